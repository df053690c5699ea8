// Keys of the data plane, derived from a job's secret so that one rank's key cannot speak for
// another (DESIGN.md, "Wire"; docs/wire.md, "Keys"):
//   RankKey(S, job, r)    = HMAC-SHA256(S, "poseidon/v1/rank-key" job r): rank r towards a server
//   PairKey(S, job, a, b) = HMAC-SHA256(S, "poseidon/v1/pair-key" job min(a,b) max(a,b)): the
//                           agents of ranks a and b towards each other
// A server holds the job's secret and derives the key of whichever rank says HELLO. An agent
// needs only its keyring: its own rank key and its pair keys with every other rank, which
// poseidon run writes for it (MakeKeyring) so that the agent never sees the secret. With its
// keyring, rank a can neither push to a server as rank c (no RankKey(c)) nor send factors to
// rank b as rank c (no PairKey(c, b)).
// Thread-safety: free functions are pure; a Credentials is immutable after construction.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace poseidon::transport {

inline constexpr size_t kKeyBytes = 32;

std::string RankKey(absl::string_view job_secret, uint64_t job_id, uint32_t rank);
std::string PairKey(absl::string_view job_secret, uint64_t job_id, uint32_t a, uint32_t b);

// What one rank's agent authenticates with.
class Credentials {
 public:
  // Every key derived from the job's secret (an agent started with --secret, tests, tools).
  static Credentials FromSecret(absl::string_view job_secret, uint64_t job_id, uint32_t rank,
                                uint32_t world_size);
  // A keyring (the text MakeKeyring writes), validated: its job, rank and world must be these.
  static absl::StatusOr<Credentials> FromKeyring(absl::string_view text, uint64_t job_id,
                                                 uint32_t rank, uint32_t world_size);
  // The keyring of rank `rank`: what poseidon run hands its agent instead of the secret.
  static std::string MakeKeyring(absl::string_view job_secret, uint64_t job_id, uint32_t rank,
                                 uint32_t world_size);

  uint64_t job_id() const { return job_id_; }
  uint32_t rank() const { return rank_; }
  // This rank's key towards a server.
  const std::string& server_key() const { return server_key_; }
  // The key of this rank and `peer` (another rank of the world); NotFound if it has none.
  absl::StatusOr<std::string> PeerKey(uint32_t peer) const;
  // Every other rank's pair key with this one: what this agent's peer port verifies.
  const std::map<uint32_t, std::string>& peer_keys() const { return peer_keys_; }

 private:
  uint64_t job_id_ = 0;
  uint32_t rank_ = 0;
  std::string server_key_;
  std::map<uint32_t, std::string> peer_keys_;
};

}  // namespace poseidon::transport
