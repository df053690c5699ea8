// KvService: the FrameHandler of poseidon-server. It reads requests off authenticated
// connections (register tables, push, pull, checkpoint, ping), hands pushes and pulls to the
// KvEngine, and throttles a peer that has too many pushes in flight.
// Thread-safety: called by FrameServer on transport I/O threads; safe for concurrent peers.
#pragma once

#include <functional>
#include <memory>

#include "server/buffer_pool.h"
#include "server/kv_engine.h"
#include "transport/frame_server.h"

namespace poseidon::server {

struct KvServiceOptions {
  // Pushes one peer may have queued in the engine before its connection stops being read.
  int max_pushes_in_flight = 16;
  // Largest REGISTER_TABLES payload accepted.
  size_t max_register_bytes = 16 << 20;
};

class KvService : public transport::FrameHandler {
 public:
  // `checkpoint` writes a checkpoint of one job now (for CHECKPOINT requests); may be empty.
  KvService(std::shared_ptr<KvEngine> engine, std::shared_ptr<BufferPool> pool,
            KvServiceOptions options, std::function<absl::Status(uint64_t job_id)> checkpoint = {});

  absl::StatusOr<transport::PayloadTarget> OnHeader(
      const std::shared_ptr<transport::PeerSession>& peer,
      const transport::FrameHeader& header) override;
  void OnFrame(const std::shared_ptr<transport::PeerSession>& peer,
               const transport::FrameHeader& header, transport::MutableBuffer payload) override;

 private:
  struct PeerState;
  std::shared_ptr<PeerState> StateOf(const std::shared_ptr<transport::PeerSession>& peer);

  std::shared_ptr<KvEngine> engine_;
  std::shared_ptr<BufferPool> pool_;
  KvServiceOptions options_;
  std::function<absl::Status(uint64_t)> checkpoint_;
};

}  // namespace poseidon::server
