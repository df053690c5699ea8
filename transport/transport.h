// The transport interface every data-plane backend implements (tcp/, inproc/, later rdma/):
// a Context that listens and connects, Listeners that accept, Connections that move frames
// (DESIGN.md "Wire"). Payloads are sent by gather from caller memory and received into caller
// memory: the transport never copies tensor bytes into a buffer of its own.
// Thread model (docs/thread_model.md): every method is thread-safe; completion callbacks run on
// the context's I/O threads, must not block, and may call back into the transport.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/frame.h"

namespace poseidon::transport {

using ConstBuffer = std::span<const std::byte>;
using MutableBuffer = std::span<std::byte>;

using DoneCallback = absl::AnyInvocable<void(absl::Status)>;
using HeaderCallback = absl::AnyInvocable<void(absl::StatusOr<FrameHeader>)>;

// Counters kept by every connection (monotonic; read with relaxed ordering).
struct ConnectionStats {
  uint64_t frames_sent = 0;
  uint64_t frames_received = 0;
  uint64_t bytes_sent = 0;  // headers included
  uint64_t bytes_received = 0;
};

// One ordered, reliable, bidirectional frame stream to one peer.
//
// Reading is two-phase so the receiver chooses where a payload lands after seeing its validated
// header: ReadHeader, then (if payload_length > 0) exactly one of ReadPayload / DiscardPayload.
// One read may be outstanding at a time; sends may be queued from any thread at any time.
class Connection {
 public:
  virtual ~Connection() = default;

  // Queues one frame: `header` then the bytes of `payload` in order. The sum of the buffer
  // sizes must equal header.payload_length. The buffers must stay valid and unchanged until
  // `done` runs. Frames go out in the order Send was called. `done` gets OK once the frame is
  // handed to the network, or the reason it never will be. `done` may wait until the peer reads
  // (in-process, or a full socket buffer): never wait for it before reading what the peer sends.
  // It may also run before Send returns, on the calling thread (TCP writes a small frame on an
  // idle connection at once): a caller that sends again from `done` must not recurse unbounded.
  virtual void Send(const FrameHeader& header, std::vector<ConstBuffer> payload,
                    DoneCallback done) = 0;

  // Reads the next frame header, validated against the context's FrameLimits. `timeout` bounds
  // the wait for the whole header (use it while waiting for an answer the peer owes us); a header
  // that has started arriving must always complete within the context's header timeout.
  virtual void ReadHeader(HeaderCallback done,
                          absl::Duration timeout = absl::InfiniteDuration()) = 0;

  // Reads the payload of the header just read into `into`, whose size must equal its
  // payload_length. A payload whose checksum flag is set is verified (DataLoss on mismatch).
  virtual void ReadPayload(MutableBuffer into, DoneCallback done) = 0;

  // Reads and drops the payload of the header just read.
  virtual void DiscardPayload(DoneCallback done) = 0;

  // Closes the connection; idempotent. Queued sends and an outstanding read complete with an
  // error. The peer's reads fail with Unavailable.
  virtual void Close() = 0;

  // Tells the peer why (an ERROR frame carrying `reason`, best effort, at most ~1 s), logs the
  // reason and closes. For peers that broke the protocol or failed authentication.
  virtual void Abort(const absl::Status& reason) = 0;

  // Waits at most `timeout` until the connection's own path has carried a message to the peer,
  // and says why not if it cannot: for RDMA, the queue pair set up after the handshake (two
  // devices that cannot reach each other fail here, so that a caller holding the peer's TCP
  // endpoint too can fall back to it before sending anything). TCP and in-process connections
  // are established when connected: OK at once. ConnectAuthenticated calls it.
  virtual absl::Status WaitEstablished(absl::Duration /*timeout*/) { return absl::OkStatus(); }

  // "host:port" (TCP) or the listener name (in-process).
  virtual std::string PeerAddress() const = 0;
  virtual ConnectionStats Stats() const = 0;
};

using AcceptCallback = absl::AnyInvocable<void(absl::StatusOr<std::shared_ptr<Connection>>)>;

class Listener {
 public:
  virtual ~Listener() = default;
  // The address peers connect to ("127.0.0.1:40123"; the real port when 0 was asked for).
  virtual std::string Address() const = 0;
  // Accepts the next connection; call again from the callback to keep accepting.
  virtual void Accept(AcceptCallback done) = 0;
  // Stops accepting; an outstanding Accept completes with Cancelled. Idempotent.
  virtual void Close() = 0;
};

// A registered region of memory. TCP needs none; RDMA pins and registers the pages so that a
// peer may read or write them one-sidedly. Kept alive as long as the region is in use.
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  virtual MutableBuffer Buffer() const = 0;
};

struct ContextOptions {
  FrameLimits limits;
  // A header that has begun to arrive must complete within this time (defeats slow-loris peers).
  absl::Duration header_timeout = absl::Seconds(10);
  // While a payload is arriving, at most this long without progress.
  absl::Duration payload_idle_timeout = absl::Seconds(60);
  // Fill and verify payload checksums on every frame (costs a CRC-32C pass over each payload).
  bool payload_checksums = false;
};

class Context {
 public:
  virtual ~Context() = default;
  virtual absl::string_view Name() const = 0;
  // Whether this backend can work on this machine (an RDMA context without a device cannot).
  virtual bool IsViable() const = 0;
  virtual const ContextOptions& Options() const = 0;

  // Starts listening on `address` ("host:port", port 0 for any; a name for in-process).
  virtual absl::StatusOr<std::shared_ptr<Listener>> Listen(absl::string_view address) = 0;

  // Connects to `address` within `timeout`. Blocks the calling thread: never call it from a
  // transport callback.
  virtual absl::StatusOr<std::shared_ptr<Connection>> Connect(absl::string_view address,
                                                              absl::Duration timeout) = 0;

  // Registers memory for zero-copy I/O. The default is a plain view (what TCP needs).
  virtual absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(MutableBuffer buffer);

  // Closes every listener and connection and stops the I/O threads. Idempotent; the destructor
  // calls it.
  virtual void Close() = 0;
};

struct TcpOptions;   // tcp/tcp_context.h
struct RdmaOptions;  // rdma/rdma_context.h

// The context of one transport kind, what a daemon's --transport=auto|tcp|rdma names:
//   "tcp"    the TCP backend (`tcp`'s options)
//   "rdma"   the RDMA backend (`rdma`'s options); FailedPrecondition with the reason when this
//            machine has no usable device, Unimplemented in a build without libibverbs
//   "auto"   RDMA when a device is usable here, else TCP; the choice and its reason are logged
//   "inproc" the in-process backend (tests, single-process runs)
// InvalidArgument for any other kind. A listener speaks its context's kind only: an RDMA
// listener's peers must use RDMA contexts too (advertise it as TRANSPORT_KIND_RDMA).
absl::StatusOr<std::shared_ptr<Context>> MakeContext(absl::string_view kind, const TcpOptions& tcp,
                                                     const RdmaOptions& rdma);
// The same with every backend's defaults around `options`.
absl::StatusOr<std::shared_ptr<Context>> MakeContext(absl::string_view kind,
                                                     const ContextOptions& options);

// What a daemon's --transport=auto|tcp|rdma gives it: every context it listens and connects with.
// An RDMA listener serves RDMA clients only, so a daemon with a usable device keeps a TCP context
// too, listens on both and advertises both (docs/wire.md, "RDMA backend").
//   "tcp"   tcp only
//   "rdma"  rdma only; FailedPrecondition with the reason when no device is usable here,
//           Unimplemented in a build without libibverbs
//   "auto"  rdma and tcp when a device is usable here, else tcp only
// InvalidArgument for any other kind. Nothing is logged: `choice` is the line to log, once.
struct TransportSet {
  std::shared_ptr<Context> tcp;   // null with "rdma"
  std::shared_ptr<Context> rdma;  // a viable RDMA context, or null
  std::string choice;             // "rdma and tcp (--transport=auto: ...)"
  // The context to connect with for a chosen endpoint kind (rdma: true), or null.
  Context* For(bool rdma_kind) const { return rdma_kind ? rdma.get() : tcp.get(); }
  // The one context of a set that holds one kind (tcp preferred when both).
  Context& Primary() const { return tcp ? *tcp : *rdma; }
  void Close() const;
};
absl::StatusOr<TransportSet> MakeTransportSet(absl::string_view kind, const TcpOptions& tcp,
                                              const RdmaOptions& rdma);

// Total bytes of a gather list.
size_t TotalSize(std::span<const ConstBuffer> buffers);

// What every backend checks before sending: the buffers hold exactly header.payload_length
// bytes, within the limit; with payload checksums on, fills the flag and the CRC.
absl::Status PrepareSend(FrameHeader& header, std::span<const ConstBuffer> payload,
                         const ContextOptions& options);

// The counters behind Connection::Stats(), for backends.
struct ConnectionCounters {
  std::atomic<uint64_t> frames_sent{0}, frames_received{0}, bytes_sent{0}, bytes_received{0};
  ConnectionStats Snapshot() const;
};

}  // namespace poseidon::transport
