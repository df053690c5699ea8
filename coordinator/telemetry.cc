#include "coordinator/telemetry.h"

#include <algorithm>
#include <cmath>

namespace poseidon::coordinator {

void LinkTable::Record(const std::string& from, const std::string& to, const LinkSample& sample) {
  out_[from][to] = sample;
}

void LinkTable::EraseNode(const std::string& node) {
  out_.erase(node);
  for (auto it = out_.begin(); it != out_.end();) {
    it->second.erase(node);
    it = it->second.empty() ? out_.erase(it) : std::next(it);
  }
}

std::optional<double> SampleBandwidth(const LinkSample& sample, uint64_t min_bytes) {
  if (sample.capacity_bytes_per_second > 0) return sample.capacity_bytes_per_second;
  if (!(sample.bytes_per_second > 0)) return std::nullopt;
  if (sample.window_ns != 0 && sample.bytes < min_bytes) return std::nullopt;
  return sample.bytes_per_second;
}

bool IsLowerBound(const LinkSample& sample) {
  return !(sample.capacity_bytes_per_second > 0) && sample.window_ns != 0;
}

NetworkEstimate LinkTable::Estimate(const absl::flat_hash_set<std::string>& members, absl::Time now,
                                    absl::Duration max_age, const ThroughputRule& rule) const {
  std::vector<double> capacities, lower_bounds;
  std::vector<double> latencies;
  NetworkEstimate estimate;
  for (const std::string& from : members) {
    const auto links = out_.find(from);
    if (links == out_.end()) continue;
    for (const auto& [to, sample] : links->second) {
      if (!members.contains(to) || now - sample.at > max_age) continue;
      ++estimate.links;
      if (const std::optional<double> bandwidth = SampleBandwidth(sample, rule.min_bytes)) {
        // Achieved throughput is only a lower bound: it never drags the estimate below `floor`.
        // A capacity sample (a measurement, or an estimate from busy time) is taken as is.
        if (IsLowerBound(sample)) {
          lower_bounds.push_back(std::max(*bandwidth, rule.floor));
        } else {
          capacities.push_back(*bandwidth);
        }
      }
      if (sample.latency_ns > 0) latencies.push_back(static_cast<double>(sample.latency_ns) / 2e9);
    }
  }
  // Where links were measured, the measurements decide: a floored lower bound (e.g. a server's
  // achieved throughput towards the agents) would hold the median at the plan's bandwidth after
  // the network slowed down. Lower bounds count only where nothing measured the capacity.
  std::vector<double>& bandwidths = capacities.empty() ? lower_bounds : capacities;
  if (!bandwidths.empty()) estimate.bandwidth_bytes_per_second = Median(std::move(bandwidths));
  if (!latencies.empty()) estimate.latency_seconds = Median(std::move(latencies));
  return estimate;
}

double LinkTable::MeanOutgoing(const std::string& node, absl::Time now,
                               absl::Duration max_age) const {
  const auto links = out_.find(node);
  if (links == out_.end()) return 0;
  double sum = 0;
  int count = 0;
  for (const auto& [to, sample] : links->second) {
    if (now - sample.at > max_age || !(sample.bytes_per_second > 0)) continue;
    sum += sample.bytes_per_second;
    ++count;
  }
  return count == 0 ? 0 : sum / count;
}

const LinkSample* LinkTable::Find(const std::string& from, const std::string& to) const {
  const auto links = out_.find(from);
  if (links == out_.end()) return nullptr;
  const auto sample = links->second.find(to);
  return sample == links->second.end() ? nullptr : &sample->second;
}

size_t LinkTable::size() const {
  size_t n = 0;
  for (const auto& [from, links] : out_) n += links.size();
  return n;
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  const double upper = values[mid];
  if (values.size() % 2 == 1) return upper;
  const double lower =
      *std::max_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid));
  return (lower + upper) / 2;
}

bool MovedBeyond(double reference, double measured, double fraction) {
  return std::fabs(measured - reference) > fraction * std::fabs(reference);
}

}  // namespace poseidon::coordinator
