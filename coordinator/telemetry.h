// Link telemetry: the latest bandwidth and latency each node measured to each peer, the estimate
// the planner uses for a set of nodes (median over fresh links), and the hysteresis test.
// Thread-safety: LinkTable is not thread-safe (the registry's lock guards it); functions are pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/time/time.h"

namespace poseidon::coordinator {

// One measurement of a directed link.
struct LinkSample {
  double bytes_per_second = 0;  // 0: not measured
  uint64_t latency_ns = 0;      // round trip; 0: not measured
  absl::Time at;
  // 0: bytes_per_second measures the link's capacity. Otherwise it is the throughput achieved over
  // a window this long, which moved `bytes` in its busier direction: a lower bound of the
  // capacity, since an idle or compute-bound link moves less than it could.
  uint64_t window_ns = 0;
  uint64_t bytes = 0;
  // > 0: the reporter's capacity estimate of the link (bytes over the busy time of its large
  // transfers, LinkTelemetry.capacity_bytes_per_second). It is preferred to bytes_per_second and
  // taken as is: it can lower the estimate as well as raise it.
  double capacity_bytes_per_second = 0;
};

// How achieved-throughput samples feed the planner (docs/planner.md, "Measured bandwidth").
struct ThroughputRule {
  // A window that moved fewer bytes (busier direction) does not count at all.
  uint64_t min_bytes = 0;
  // A counted window stands for max(achieved, floor): it can raise the estimate above the
  // bandwidth the plan assumes (the link carried that much), never lower it.
  double floor = 0;
};

// The bandwidth a sample tells about the link's capacity: its capacity estimate
// (capacity_bytes_per_second) when it has one; else a capacity measurement (window_ns == 0) as
// is; else the achieved throughput of a window with at least min_bytes (a lower bound); nullopt
// otherwise.
std::optional<double> SampleBandwidth(const LinkSample& sample, uint64_t min_bytes);

// Whether SampleBandwidth of the sample is only a lower bound of the capacity: achieved
// throughput over a window, without a capacity estimate.
bool IsLowerBound(const LinkSample& sample);

// What the planner should assume for a set of nodes.
struct NetworkEstimate {
  // Median of the fresh links' bytes/s (links that measured 0 are skipped); nullopt without any.
  std::optional<double> bandwidth_bytes_per_second;
  // Median of the fresh links' one-way latency (round trip / 2); nullopt without any.
  std::optional<double> latency_seconds;
  size_t links = 0;  // fresh links considered
};

class LinkTable {
 public:
  // Replaces the sample of link from -> to.
  void Record(const std::string& from, const std::string& to, const LinkSample& sample);
  // Forgets every link from or to `node`.
  void EraseNode(const std::string& node);
  // Over the links whose both ends are in `members` and whose sample is at most `max_age` old;
  // achieved-throughput samples (IsLowerBound) count as `rule` says, capacity samples as they are.
  NetworkEstimate Estimate(const absl::flat_hash_set<std::string>& members, absl::Time now,
                           absl::Duration max_age, const ThroughputRule& rule = {}) const;
  // Mean bytes/s of `node`'s fresh outgoing links; 0 without any.
  double MeanOutgoing(const std::string& node, absl::Time now, absl::Duration max_age) const;
  size_t size() const;
  // The sample of link from -> to, or null.
  const LinkSample* Find(const std::string& from, const std::string& to) const;

 private:
  std::map<std::string, std::map<std::string, LinkSample>> out_;  // from -> to -> sample
};

// The median (the mean of the two middle values for an even count); 0 for no values.
double Median(std::vector<double> values);

// Whether `measured` differs from `reference` by more than `fraction` of `reference`.
bool MovedBeyond(double reference, double measured, double fraction);

}  // namespace poseidon::coordinator
