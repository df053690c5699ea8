// ServerTelemetry: what poseidon-server tells the coordinator every --telemetry_interval
// (ReportTelemetry): per data-plane peer (a job's rank, over all its connections) the bytes
// received (pushes) and sent (pull responses) in the window, and the achieved throughput (the
// busier direction). A server knows its peers only from the handshake, so links name them by job
// and rank (LinkTelemetry.peer_job_id, peer_rank; the job id is the data-plane job id in decimal,
// as agents register it) and the coordinator resolves them to the agents' node ids. Latency is
// not measured here (agents ping servers and report it on their side of the link). With
// replication, each replicated job's primary and backup keys, degraded keys and backup lag
// (ReplicationTelemetry; `poseidon status` shows them).
// Thread-safety: Start and Stop from the owner's thread; Collect is for the reporter thread and
// tests.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/periodic.h"
#include "poseidon/v1/coordinator.pb.h"
#include "server/kv_engine.h"
#include "server/kv_service.h"

namespace poseidon::server {

class ServerTelemetry {
 public:
  // Every peer's byte totals (KvService::TakeTraffic).
  using Source = std::function<std::vector<PeerTrafficTotals>()>;
  // Sends one report within `timeout` (CoordinatorClient::ReportTelemetry).
  using Send =
      std::function<absl::Status(const poseidon::v1::ReportTelemetryRequest&, absl::Duration)>;

  // Links reported at most per window (the coordinator's limit); the busiest peers first beyond.
  static constexpr size_t kMaxLinks = 4096;

  // The transport a peer's connections use (the listener it came in by); TCP when not set.
  using TransportOf = std::function<poseidon::v1::TransportKind(uint64_t job_id, uint32_t rank)>;

  // The replication of the jobs' keys on this server (KvEngine::ReplicationStatus).
  using ReplicationOf = std::function<std::vector<ReplicationCounts>()>;

  ServerTelemetry(Source source, absl::Duration interval, Send send = {},
                  TransportOf transport_of = {}, ReplicationOf replication_of = {});
  ~ServerTelemetry();
  ServerTelemetry(const ServerTelemetry&) = delete;
  ServerTelemetry& operator=(const ServerTelemetry&) = delete;

  // Reports every interval from a thread of its own until Stop (also called by the destructor);
  // nothing without `send` or with a zero interval. Each report has a deadline of
  // min(interval, 2s), so Stop returns within about that long.
  void Start();
  void Stop();

  // The report of the window since the previous Collect (or construction), ending at `now`: a
  // link per peer that is connected or moved bytes in the window.
  poseidon::v1::ReportTelemetryRequest Collect(absl::Time now);

 private:
  const Source source_;
  const absl::Duration interval_;
  const Send send_;
  const TransportOf transport_of_;  // called by Collect under mu_
  const ReplicationOf replication_of_;  // likewise

  std::mutex mu_;  // Collect
  absl::Time window_start_;
  std::map<std::pair<uint64_t, uint32_t>, std::pair<uint64_t, uint64_t>> prev_;  // received, sent

  OutageLog outage_{"telemetry to the coordinator"};  // the reporting thread's
  PeriodicThread periodic_;  // last: stopped (by the destructor) before the rest goes
};

}  // namespace poseidon::server
