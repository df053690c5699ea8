// The RDMA transport on libibverbs (docs/wire.md, "RDMA"): reliable-connected queue pairs set up
// over a TCP side channel, frame headers (and payloads up to `eager_bytes`) by SEND/RECV into
// pre-posted receive buffers under receive credits, larger payloads pulled by the receiver with
// RDMA READ straight from the sender's registered memory into the buffer it chose. The side
// channel carries the connection's frames until its handshake has proven the peer (no
// unauthenticated peer reaches the queue pair) and stays open to report errors and closes.
// This code uses only the verbs headers; the executable links libibverbs or the test provider
// (fake_verbs.h). Thread model: one progress thread per context owns every connection's state
// and runs every callback; it sleeps on the completion channel when idle (docs/thread_model.md).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace poseidon::transport {

struct RdmaOptions : ContextOptions {
  // Device name ("mlx5_0", "rxe0"); empty: the first device whose port is active.
  std::string device;
  int port = 1;
  int gid_index = 0;
  // When a connection moves its frames onto the queue pair: once its handshake proved the peer
  // (AUTH_OK sent by the accepting side, read by the connecting side: production), or at once
  // on connect (a trusted fabric; tests of the data path without a handshake).
  enum class Upgrade { kAfterHandshake, kAtConnect };
  Upgrade upgrade = Upgrade::kAfterHandshake;
  // Receive credits: frames a sender may have in the peer's receive buffers.
  int receive_credits = 32;
  // Payloads up to this many bytes travel inside the SEND; larger ones are READ by the receiver.
  size_t eager_bytes = 4096;
  // A READ moves at most this much per work request (progress is measured per READ). A payload
  // read into memory not registered with RegisterMemory goes through a per-connection staging
  // window of (READ depth, at most 8) x this, allocated on first use.
  size_t read_chunk_bytes = size_t{256} << 10;
  // A posted work request whose completion has not arrived within this time fails the
  // connection (a lost completion is an error, not a hang).
  absl::Duration completion_timeout = absl::Seconds(30);
  // Bound on the queue-pair exchange over the side channel.
  absl::Duration setup_timeout = absl::Seconds(10);
};

// Opens the device. Without a usable device the context is returned but not viable
// (IsViable() false; Listen and Connect fail with FailedPrecondition and the reason).
// Errors: InvalidArgument for a bad option.
absl::StatusOr<std::shared_ptr<Context>> CreateRdmaContext(const RdmaOptions& options);

// OK when a device with an active port exists (what CreateRdmaContext would use), else why not.
absl::Status RdmaDeviceStatus(const RdmaOptions& options);

}  // namespace poseidon::transport
