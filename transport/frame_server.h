// FrameServer: the accept loop every data-plane daemon runs. It accepts connections on a
// Listener, authenticates each peer (handshake.h), then reads frames forever and lets a
// FrameHandler decide where each payload lands. A peer that breaks the protocol is told why
// (ERROR frame), logged and disconnected; everyone else keeps being served.
// Thread-safety: Start/Stop from any thread; handler methods run on transport I/O threads
// (one connection's frames are delivered in order, never concurrently).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "transport/handshake.h"
#include "transport/transport.h"

namespace poseidon::transport {

class FrameServer;

// One authenticated peer.
class PeerSession : public std::enable_shared_from_this<PeerSession> {
 public:
  PeerSession(std::shared_ptr<Connection> connection, PeerIdentity identity,
              std::weak_ptr<FrameServer> server = {})
      : connection_(std::move(connection)), identity_(identity), server_(std::move(server)) {}
  const PeerIdentity& identity() const { return identity_; }
  Connection& connection() const { return *connection_; }
  const std::shared_ptr<Connection>& shared_connection() const { return connection_; }
  std::string address() const { return connection_->PeerAddress(); }

  // Back-pressure. PauseReading (from any thread, typically inside OnFrame) stops the server from
  // reading this peer's next frame once the current OnFrame returns; ResumeReading (any thread)
  // starts it again. The peer's frames then wait in its socket, throttling the peer.
  void PauseReading();
  void ResumeReading();

  // One slot of handler-owned state per peer (set and read by the handler; its own locking).
  void set_handler_state(std::shared_ptr<void> state) { handler_state_ = std::move(state); }
  bool has_handler_state() const { return handler_state_ != nullptr; }  // no copy, per frame
  template <typename T>
  std::shared_ptr<T> handler_state() const {
    return std::static_pointer_cast<T>(handler_state_);
  }

 private:
  friend class FrameServer;
  // Called by the server after OnFrame: true when reading must wait for ResumeReading.
  bool ParkIfPaused();

  std::shared_ptr<Connection> connection_;
  PeerIdentity identity_;
  std::weak_ptr<FrameServer> server_;
  std::shared_ptr<void> handler_state_;
  std::mutex pause_mu_;
  bool pause_requested_ = false;
  bool parked_ = false;
};

// Where a frame's payload goes.
struct PayloadTarget {
  MutableBuffer buffer;
  bool discard = false;
  static PayloadTarget Into(MutableBuffer b) { return PayloadTarget{b, false}; }
  static PayloadTarget Discard() { return PayloadTarget{{}, true}; }
};

class FrameHandler {
 public:
  virtual ~FrameHandler() = default;
  // A validated header from an authenticated peer of the same job. Return a buffer of exactly
  // payload_length bytes, valid until OnFrame returns, or Discard; an error disconnects the
  // peer with that error.
  virtual absl::StatusOr<PayloadTarget> OnHeader(const std::shared_ptr<PeerSession>& peer,
                                                 const FrameHeader& header) = 0;
  // The whole frame has arrived (payload is empty when discarded or zero-length).
  virtual void OnFrame(const std::shared_ptr<PeerSession>& peer, const FrameHeader& header,
                       MutableBuffer payload) = 0;
  // The peer is gone (closed, failed, or disconnected for a protocol error).
  virtual void OnClose(const std::shared_ptr<PeerSession>& /*peer*/,
                       const absl::Status& /*reason*/) {}
};

struct FrameServerOptions {
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Authenticated connections.
  size_t max_connections = 4096;
  // Connections still in their handshake have slots of their own, fewer, and at most
  // max_handshakes_per_address from one address (its host part), so that idle unauthenticated
  // connections can neither take the authenticated peers' slots nor all the handshake slots
  // from one host. A connection beyond a limit is refused at once, naming the limit.
  size_t max_handshakes = 512;
  size_t max_handshakes_per_address = 256;  // poseidon run starts up to 256 agents on one host
};

struct FrameServerStats {
  uint64_t accepted = 0;
  uint64_t authenticated = 0;
  uint64_t handshake_failures = 0;
  uint64_t protocol_errors = 0;  // disconnected for a bad frame or a handler error
  uint64_t frames = 0;
  uint64_t active = 0;       // every open connection, authenticated or in its handshake
  uint64_t handshaking = 0;  // of which still in their handshake
  uint64_t refused = 0;      // refused at accept for a limit
};

class FrameServer : public std::enable_shared_from_this<FrameServer> {
 public:
  FrameServer(std::shared_ptr<Listener> listener, std::shared_ptr<const SecretStore> secrets,
              std::shared_ptr<FrameHandler> handler, FrameServerOptions options = {});
  ~FrameServer();

  void Start();
  // Stops accepting and closes every connection. Idempotent.
  void Stop();
  std::string Address() const { return listener_->Address(); }
  FrameServerStats Stats() const;
  // Whether an authenticated connection of this peer (job, rank) is open on this server (a daemon
  // listening once per transport kind tells by it which kind a peer uses).
  bool HasPeer(uint64_t job_id, uint32_t rank);
  // Serves the frames that arrive on a connection this process opened and authenticated as
  // `identity` (the peer at its other end sends on it too) as on an accepted one: the same
  // checks, the same handler, closed by Stop. A stopped server closes it at once.
  void Serve(std::shared_ptr<Connection> conn, PeerIdentity identity);

 private:
  friend class PeerSession;
  void AcceptNext();
  void OnAccepted(std::shared_ptr<Connection> conn);
  void ReadNext(const std::shared_ptr<PeerSession>& peer);
  void Drop(const std::shared_ptr<PeerSession>& peer, const std::shared_ptr<Connection>& conn,
            const absl::Status& reason, bool protocol_error);

  std::shared_ptr<Listener> listener_;
  std::shared_ptr<const SecretStore> secrets_;
  std::shared_ptr<FrameHandler> handler_;
  FrameServerOptions options_;

  // Frees a connection's handshake slot (once its handshake ended either way). Under mu_.
  void EndHandshakeLocked(const std::string& host);

  std::mutex mu_;
  bool stopped_ = false;
  std::set<std::shared_ptr<Connection>> connections_;
  size_t handshaking_ = 0;                      // connections in their handshake
  std::map<std::string, size_t> handshaking_by_host_;
  std::map<std::pair<uint64_t, uint32_t>, size_t> peers_;  // authenticated, by (job, rank)

  std::atomic<uint64_t> accepted_{0}, authenticated_{0}, handshake_failures_{0},
      protocol_errors_{0}, frames_{0}, refused_{0};
};

}  // namespace poseidon::transport
