// TelemetryReporter: what an agent tells the coordinator every --telemetry_interval
// (ReportTelemetry): per link (each KV server, each SFB peer) the bytes sent and received in the
// window and the achieved throughput, and for KV servers the round-trip latency (the minimum of
// a few pings at the end of each window: the network and server turnaround without the queueing
// behind bulk data, which the throughput already shows; SFB peer links carry no latency); the
// iteration completed; per layer the synchronisations completed in the window (count, mean and
// longest ready-to-done time) and the one still waiting, if any. The coordinator shows it in
// `poseidon status` (docs/operations.md) and may use busy windows as a lower bound of link
// bandwidth (docs/planner.md).
// Thread-safety: the Add*/Layer* hooks are lock-free (relaxed atomics) and safe from any thread
// (the data path, transport I/O threads); SetServerPing from any thread; SetLayers, Start and
// Stop from the owner's thread. Collect and PingServers are for the reporter thread and tests.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/periodic.h"
#include "coordinator/client.h"
#include "poseidon/v1/coordinator.pb.h"

namespace poseidon::agent {

// Windows whose minimum round trip the reported latency is the minimum of.
inline constexpr size_t kLatencyWindows = 10;

class TelemetryReporter {
 public:
  // `server_node_ids` in plan order (server index), `peer_node_ids` by rank (our own entry is
  // never reported). `client` (may be null: Collect only) must outlive the reporter.
  TelemetryReporter(coordinator::CoordinatorClient* client, absl::Duration interval,
                    std::vector<std::string> server_node_ids,
                    std::vector<std::string> peer_node_ids, uint32_t rank,
                    std::function<uint64_t()> iteration);
  ~TelemetryReporter();
  TelemetryReporter(const TelemetryReporter&) = delete;
  TelemetryReporter& operator=(const TelemetryReporter&) = delete;

  // Bytes moved on a link (data path; unknown indices are ignored).
  void AddServerBytes(size_t server, uint64_t sent, uint64_t received);
  void AddPeerBytes(uint32_t rank, uint64_t sent, uint64_t received);
  // A large transfer from KV server `server` that took `busy` on the link (a pull response, from
  // its header to its last byte). The window reports bytes over busy time as the capacity
  // (LinkTelemetry.capacity_bytes_per_second) of every server link that had such transfers,
  // which falls when the network slows down, unlike achieved throughput. The busy time is one
  // union over all servers' transfers: they share this agent's link, so two servers' responses
  // arriving together do not each count the whole time. (The bytes are counted by
  // AddServerBytes as well.) A window needs at least `min_bytes` (SetCapacityMinBytes) of them.
  void AddServerTransfer(size_t server, uint64_t bytes, absl::Duration busy);
  void SetCapacityMinBytes(uint64_t min_bytes);
  // A round trip measured to KV server `server` in this window. The report carries the minimum
  // over the last kLatencyWindows windows: a ping that waited behind data in a queue (a slow or
  // busy link) says nothing about the latency.
  void AddServerLatency(size_t server, absl::Duration round_trip);
  // The transport a link's connection uses, set once it is connected (after any fall-back to
  // TCP); until then the link is reported as TRANSPORT_KIND_UNSPECIFIED (not connected yet), so
  // that a status never shows a planned RDMA link that may yet fall back.
  void SetServerTransport(size_t server, poseidon::v1::TransportKind kind);
  void SetPeerTransport(uint32_t rank, poseidon::v1::TransportKind kind);

  // Measures one round trip to KV server `server`, waiting at most `timeout`.
  using ServerPing =
      std::function<absl::StatusOr<absl::Duration>(size_t server, absl::Duration timeout)>;
  // At the end of every window, before the report, the reporter thread pings each server
  // `pings` times through `ping` (never on the data path), all within min(interval / 2, 1s);
  // failures and timeouts are skipped. May be set after Start (once the servers are connected).
  void SetServerPing(ServerPing ping, int pings = 3);

  // The measured cost of one ring all-reduce step (AllreduceSyncer::Ready), in every report.
  void SetAllreduceStep(absl::Duration step);

  // The model's layers, once (before the first LayerReady).
  void SetLayers(std::vector<std::string> names);
  // A layer posted ready for `iteration`, and its synchronisation done after `took`.
  void LayerReady(uint32_t layer, uint64_t iteration, absl::Time at);
  void LayerSynced(uint32_t layer, uint64_t iteration, absl::Duration took);
  // The layer's keys fell back from a lossy wire to float32 (reported from then on).
  void LayerWireFellBack(uint32_t layer);

  // Reports every interval from a thread of its own until Stop (also called by the destructor).
  // Each call has a deadline of min(interval, 2s), so Stop returns within about that long.
  void Start();
  void Stop();

  // Pings every server as SetServerPing says (the reporter thread calls it before each Collect).
  void PingServers();

  // The report of the window since the previous Collect (or construction), ending at `now`.
  poseidon::v1::ReportTelemetryRequest Collect(absl::Time now);

 private:
  struct LinkCounters {
    std::atomic<uint64_t> sent{0};
    std::atomic<uint64_t> received{0};
    std::atomic<uint64_t> min_rtt_ns{0};  // 0: none in this window; reset by Collect
    std::atomic<bool> transfers{false};    // large transfers in this window (reset by Collect)
    std::atomic<int> transport{poseidon::v1::TRANSPORT_KIND_UNSPECIFIED};  // v1::TransportKind
    std::vector<uint64_t> recent_rtt_ns;  // the last windows' minima (Collect's)
  };
  // Capacity over all server links: bytes and busy nanoseconds of large transfers in this window
  // (reset by Collect), and where the last counted busy interval ended (Unix ns).
  std::mutex capacity_mu_;
  uint64_t capacity_bytes_ = 0;
  uint64_t busy_ns_ = 0;
  int64_t busy_until_ns_ = 0;
  std::atomic<uint64_t> capacity_min_bytes_{uint64_t{1} << 20};
  std::atomic<uint64_t> allreduce_step_ns_{0};
  struct LayerCounters {
    std::atomic<uint64_t> syncs{0};
    std::atomic<uint64_t> sync_ns{0};
    std::atomic<uint64_t> window_max_ns{0};  // reset by Collect
    std::atomic<int64_t> ready_at_ns{0};     // Unix nanoseconds of the latest ready
    std::atomic<uint64_t> ready_iteration{0};
    std::atomic<uint64_t> synced_iteration{0};
    std::atomic<bool> wire_fell_back{false};
  };
  void Tick();  // one window: ping, collect, report

  coordinator::CoordinatorClient* const client_;
  const absl::Duration interval_;
  const std::function<uint64_t()> iteration_;
  // Links: servers first, then peers by rank; node ids, counters (fixed at construction).
  const size_t servers_;
  std::vector<std::string> link_ids_;
  std::unique_ptr<LinkCounters[]> links_;

  std::mutex mu_;  // the layers' publication and the previous window (Collect)
  std::vector<std::string> layer_names_;
  std::unique_ptr<LayerCounters[]> layers_;
  std::atomic<size_t> layer_count_{0};  // set once, after layers_
  absl::Time window_start_;
  std::vector<uint64_t> prev_sent_, prev_received_, prev_syncs_, prev_sync_ns_;

  std::mutex ping_mu_;  // ping_, pings_
  ServerPing ping_;
  int pings_ = 0;

  OutageLog outage_{"telemetry to the coordinator"};  // the reporting thread's
  PeriodicThread periodic_;  // last: stopped (by the destructor) before the rest goes
};

}  // namespace poseidon::agent
