// KvService: the FrameHandler of poseidon-server. It reads requests off authenticated
// connections (register tables, push, pull, checkpoint, ping), hands pushes and pulls to the
// KvEngine, and throttles a peer that has too many pushes in flight.
// Thread-safety: called by FrameServer on transport I/O threads; safe for concurrent peers.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "server/buffer_pool.h"
#include "server/kv_engine.h"
#include "transport/frame_server.h"

namespace poseidon::server {

struct KvServiceOptions {
  // Pushes one peer may have queued in the engine before its connection stops being read.
  int max_pushes_in_flight = 16;
  // Largest REGISTER_TABLES payload accepted.
  size_t max_register_bytes = 16 << 20;
  // A rank that keeps alive (agents send an empty PING every few seconds) and has sent nothing
  // on any of its connections for this long is declared lost (KvEngine::RankLost): pulls that
  // need its push fail naming it. Zero: never.
  absl::Duration peer_timeout = absl::Seconds(15);
};

// The bytes one peer (a job's rank) has moved with this server since it first sent a frame.
struct PeerTrafficTotals {
  uint64_t job_id = 0;
  uint32_t rank = 0;
  uint64_t received = 0;  // push payloads
  uint64_t sent = 0;      // pull-response payloads
  int connections = 0;    // open now
};

class KvService : public transport::FrameHandler {
 public:
  // `checkpoint` writes a checkpoint of one job (for CHECKPOINT requests: the job and the
  // request's iteration, 0 for the next clock boundary); may be empty.
  KvService(std::shared_ptr<KvEngine> engine, std::shared_ptr<BufferPool> pool,
            KvServiceOptions options, std::function<absl::Status(uint64_t job_id, uint64_t iteration)> checkpoint = {});

  absl::StatusOr<transport::PayloadTarget> OnHeader(
      const std::shared_ptr<transport::PeerSession>& peer,
      const transport::FrameHeader& header) override;
  void OnFrame(const std::shared_ptr<transport::PeerSession>& peer,
               const transport::FrameHeader& header, transport::MutableBuffer payload) override;
  void OnClose(const std::shared_ptr<transport::PeerSession>& peer,
               const absl::Status& reason) override;

  // Every peer's totals, ordered by (job, rank). A peer without an open connection is returned
  // one last time and then forgotten (its counters start again from 0 if it comes back).
  std::vector<PeerTrafficTotals> TakeTraffic();

  // Per job, the ranks whose last connection to this server closed, or that went silent, within
  // `within` and are not back (HeartbeatRequest.ranks_gone). Forgets older ones.
  std::map<uint64_t, std::vector<uint32_t>> RanksGone(absl::Duration within);

  // Declares the ranks silent for longer than peer_timeout lost, and those whose rejoin
  // timeout ran out without a new connection (periodically, any thread).
  void CheckSilence();

 private:
  struct PeerState;
  struct TrafficEntry {
    std::shared_ptr<PeerTraffic> traffic;
    int connections = 0;       // open
    int data_connections = 0;  // of which sent a frame other than a PING (KvService::Count)
    std::string address;       // of its latest counted connection, for messages
    // Its last connection closed, or it went silent (gone_silent), and the job waits for it to
    // rejoin (KvEngine::RejoinTimeout): until this CLOCK_MONOTONIC time (0: not waiting), then
    // RankLost with gone_why.
    bool gone_silent = false;
    int64_t gone_since_ns = 0;
    int64_t gone_deadline_ns = 0;
    std::string gone_why;
  };
  std::shared_ptr<PeerState> StateOf(const std::shared_ptr<transport::PeerSession>& peer);
  void Count(const std::shared_ptr<transport::PeerSession>& peer, PeerState& state);

  std::shared_ptr<KvEngine> engine_;
  std::shared_ptr<BufferPool> pool_;
  KvServiceOptions options_;
  std::function<absl::Status(uint64_t, uint64_t)> checkpoint_;

  std::mutex traffic_mu_;  // a peer's first frame and close, TakeTraffic: never per frame
  std::map<std::pair<uint64_t, uint32_t>, TrafficEntry> traffic_;  // (job, rank)
  // Under traffic_mu_: when each rank's last connection closed or it went silent (CLOCK_MONOTONIC
  // ns), until it is back (RanksGone).
  std::map<std::pair<uint64_t, uint32_t>, int64_t> gone_;
};

}  // namespace poseidon::server
