// The handshake every connection runs before any data frame (DESIGN.md, "Wire"): the client
// names its job and rank, and both sides prove knowledge of that rank's key K with HMAC-SHA256
// over fresh nonces (mutual challenge/response; no key crosses the wire). K is derived from the
// job's secret (credentials.h): RankKey towards a server, PairKey between two agents.
//   client -> HELLO     (job, rank; payload: client nonce, 32 bytes)
//   server -> CHALLENGE (payload: server nonce, 32 bytes)      | ERROR for an unknown job
//   client -> AUTH      (payload: HMAC(K, "poseidon/v1/client" job rank cn sn))
//   server -> AUTH_OK   (payload: HMAC(K, "poseidon/v1/server" job rank sn cn)) | ERROR
// The state machines are pure (no I/O) so they can be fuzzed; the drivers run them over a
// Connection. Thread-safety: SecretStore is thread-safe; a state machine belongs to one caller.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/frame.h"
#include "transport/transport.h"

namespace poseidon::transport {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kProofBytes = 32;  // SHA-256
// No handshake frame carries more; a longer one is refused before its payload is read.
inline constexpr size_t kMaxHandshakePayload = 64;

// Who is at the other end of an authenticated connection.
struct PeerIdentity {
  uint64_t job_id = 0;
  uint32_t rank = 0;
};

// The keys a listening daemon verifies, per job (credentials.h): the job's secret, from which
// the key of whichever rank says HELLO is derived (a server: RankKey), or a table of rank -> key
// (an agent's peer port: its pair keys, Credentials::peer_keys, so it needs no secret).
class SecretStore {
 public:
  void Set(uint64_t job_id, std::string secret);
  void SetKeys(uint64_t job_id, std::map<uint32_t, std::string> keys);
  void Remove(uint64_t job_id);
  // The key rank `rank` of job `job_id` must prove: NotFound for an unknown job,
  // PermissionDenied for a rank this store holds no key of.
  absl::StatusOr<std::string> KeyFor(uint64_t job_id, uint32_t rank) const;

 private:
  struct Entry {
    std::string secret;                   // set: keys derived from it
    std::map<uint32_t, std::string> keys;  // else: these
  };
  mutable std::mutex mu_;
  std::map<uint64_t, Entry> entries_;
};

struct OutFrame {
  FrameHeader header;
  std::vector<std::byte> payload;
};

class ClientHandshake {
 public:
  // `key`: the rank's key towards this server (credentials.h: RankKey, PairKey).
  ClientHandshake(uint64_t job_id, uint32_t rank, std::string key);
  // The HELLO frame.
  OutFrame Start();
  // Feeds the server's next frame. Returns the AUTH frame after a CHALLENGE, std::nullopt once
  // AUTH_OK proved the server; an ERROR frame or anything unexpected is an error.
  absl::StatusOr<std::optional<OutFrame>> OnFrame(const FrameHeader& header,
                                                  std::span<const std::byte> payload);
  bool done() const { return state_ == State::kDone; }

 private:
  enum class State { kInit, kSentHello, kSentAuth, kDone, kFailed };
  uint64_t job_id_;
  uint32_t rank_;
  std::string secret_;
  std::array<std::byte, kNonceBytes> client_nonce_{};
  std::array<std::byte, kNonceBytes> server_nonce_{};
  State state_ = State::kInit;
};

class ServerHandshake {
 public:
  explicit ServerHandshake(const SecretStore& secrets);
  // Feeds the client's next frame and returns the answer: CHALLENGE after HELLO, AUTH_OK after
  // a correct AUTH. On error the caller sends an ERROR frame with the status and disconnects.
  absl::StatusOr<OutFrame> OnFrame(const FrameHeader& header, std::span<const std::byte> payload);
  bool done() const { return state_ == State::kDone; }
  PeerIdentity peer() const { return peer_; }

 private:
  enum class State { kWaitHello, kWaitAuth, kDone, kFailed };
  const SecretStore& secrets_;
  std::string secret_;
  PeerIdentity peer_;
  std::array<std::byte, kNonceBytes> client_nonce_{};
  std::array<std::byte, kNonceBytes> server_nonce_{};
  State state_ = State::kWaitHello;
};

using HandshakeCallback = absl::AnyInvocable<void(absl::StatusOr<PeerIdentity>)>;

// Runs the server side over `conn` within `timeout`. On failure the peer gets an ERROR frame
// and is disconnected (Connection::Abort), and `done` gets the reason.
void AcceptHandshake(std::shared_ptr<Connection> conn, std::shared_ptr<const SecretStore> secrets,
                     absl::Duration timeout, HandshakeCallback done);

// Runs the client side over `conn` within `timeout`, proving `key` (credentials.h: the rank's
// RankKey towards a server, its PairKey with the agent it connects to).
void StartClientHandshake(std::shared_ptr<Connection> conn, uint64_t job_id, uint32_t rank,
                          std::string key, absl::Duration timeout, HandshakeCallback done);

// Blocking form of StartClientHandshake; never call it from a transport callback.
absl::Status AuthenticateClient(const std::shared_ptr<Connection>& conn, uint64_t job_id,
                                uint32_t rank, std::string key, absl::Duration timeout);

// The payload (absl::Status::GetPayload) of ConnectAuthenticated's error when the peer took the
// connection but did not finish the handshake within the timeout: it is there and says nothing
// (a frozen process, for which the kernel still accepts), rather than not up yet or refusing.
inline constexpr char kPeerSilentPayload[] = "poseidon.transport/peer-silent";

// The handshake timeout of one connect attempt for a daemon with a liveness limit
// `peer_timeout` (zero: none): a live peer answers a handshake at once, so one silent for
// peer_timeout is frozen; `cap` bounds it, and is the timeout without a limit.
inline absl::Duration HandshakeTimeoutFor(absl::Duration peer_timeout, absl::Duration cap) {
  return peer_timeout > absl::ZeroDuration() ? std::min(peer_timeout, cap) : cap;
}

// Connect + AuthenticateClient; the connection is closed when authentication fails. A handshake
// that ran out of `timeout` after the peer took the connection (DeadlineExceeded) carries
// kPeerSilentPayload; a refusal or a closed connection does not, however late it comes.
absl::StatusOr<std::shared_ptr<Connection>> ConnectAuthenticated(Context& context,
                                                                 absl::string_view address,
                                                                 uint64_t job_id, uint32_t rank,
                                                                 std::string key,
                                                                 absl::Duration timeout);

}  // namespace poseidon::transport
