#include "transport/credentials.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace poseidon::transport {
namespace {

constexpr absl::string_view kRankLabel = "poseidon/v1/rank-key";
constexpr absl::string_view kPairLabel = "poseidon/v1/pair-key";
constexpr absl::string_view kKeyringMagic = "poseidon-keyring 1";
// A keyring holds one line per rank; this bounds what a reader takes in before it has parsed
// anything (1,024 ranks are ~90 KiB).
constexpr size_t kMaxKeyringBytes = size_t{16} << 20;

void AppendLe(std::vector<unsigned char>& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<unsigned char>(value >> (8 * i)));
}

std::string Derive(absl::string_view secret, absl::string_view label, uint64_t job,
                   std::initializer_list<uint32_t> ranks) {
  std::vector<unsigned char> message(label.begin(), label.end());
  AppendLe(message, job, 8);
  for (uint32_t r : ranks) AppendLe(message, r, 4);
  std::string out(kKeyBytes, '\0');
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), message.data(),
       message.size(), reinterpret_cast<unsigned char*>(out.data()), &len);
  return out;
}

absl::StatusOr<std::string> ParseKey(absl::string_view hex, int line) {
  if (hex.size() != 2 * kKeyBytes ||
      !std::all_of(hex.begin(), hex.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
    return absl::InvalidArgumentError(
        absl::StrCat("keyring line ", line, ": a key is ", 2 * kKeyBytes, " hex digits"));
  }
  return absl::HexStringToBytes(hex);
}

}  // namespace

std::string RankKey(absl::string_view job_secret, uint64_t job_id, uint32_t rank) {
  return Derive(job_secret, kRankLabel, job_id, {rank});
}

std::string PairKey(absl::string_view job_secret, uint64_t job_id, uint32_t a, uint32_t b) {
  return Derive(job_secret, kPairLabel, job_id, {std::min(a, b), std::max(a, b)});
}

Credentials Credentials::FromSecret(absl::string_view job_secret, uint64_t job_id, uint32_t rank,
                                    uint32_t world_size) {
  Credentials c;
  c.job_id_ = job_id;
  c.rank_ = rank;
  c.server_key_ = RankKey(job_secret, job_id, rank);
  for (uint32_t p = 0; p < world_size; ++p) {
    if (p != rank) c.peer_keys_[p] = PairKey(job_secret, job_id, rank, p);
  }
  return c;
}

std::string Credentials::MakeKeyring(absl::string_view job_secret, uint64_t job_id, uint32_t rank,
                                     uint32_t world_size) {
  const Credentials c = FromSecret(job_secret, job_id, rank, world_size);
  std::string out = absl::StrCat(kKeyringMagic, "\njob ", job_id, "\nrank ", rank, "\nworld ",
                                 world_size, "\nserver ", absl::BytesToHexString(c.server_key_),
                                 "\n");
  for (const auto& [peer, key] : c.peer_keys_) {
    absl::StrAppend(&out, "peer ", peer, " ", absl::BytesToHexString(key), "\n");
  }
  return out;
}

absl::StatusOr<Credentials> Credentials::FromKeyring(absl::string_view text, uint64_t job_id,
                                                     uint32_t rank, uint32_t world_size) {
  if (world_size == 0) return absl::InvalidArgumentError("a keyring needs a world of 1 or more");
  if (text.size() > kMaxKeyringBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a keyring of ", text.size(), " bytes (at most ", kMaxKeyringBytes, ")"));
  }
  Credentials c;
  c.job_id_ = job_id;
  c.rank_ = rank;
  const std::vector<absl::string_view> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  if (lines.empty() || lines[0] != kKeyringMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a keyring: the first line must be '", kKeyringMagic, "'"));
  }
  bool have_job = false, have_rank = false, have_world = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    const int n = static_cast<int>(i + 1);
    const std::vector<absl::string_view> f = absl::StrSplit(lines[i], ' ');
    uint64_t value = 0;
    if (f.size() == 2 && (f[0] == "job" || f[0] == "rank" || f[0] == "world")) {
      if (!absl::SimpleAtoi(f[1], &value)) {
        return absl::InvalidArgumentError(absl::StrCat("keyring line ", n, ": ", f[0],
                                                       " is not a number"));
      }
      const uint64_t want = f[0] == "job" ? job_id : f[0] == "rank" ? rank : world_size;
      if (value != want) {
        return absl::InvalidArgumentError(absl::StrCat("the keyring is for ", f[0], " ", value,
                                                       ", this agent's is ", want));
      }
      (f[0] == "job" ? have_job : f[0] == "rank" ? have_rank : have_world) = true;
    } else if (f.size() == 2 && f[0] == "server") {
      if (!c.server_key_.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("keyring line ", n, ": a second server key"));
      }
      auto key = ParseKey(f[1], n);
      if (!key.ok()) return key.status();
      c.server_key_ = *std::move(key);
    } else if (f.size() == 3 && f[0] == "peer") {
      if (!absl::SimpleAtoi(f[1], &value) || value >= world_size || value == rank) {
        return absl::InvalidArgumentError(absl::StrCat(
            "keyring line ", n, ": a peer is another rank below the world size ", world_size));
      }
      auto key = ParseKey(f[2], n);
      if (!key.ok()) return key.status();
      if (!c.peer_keys_.emplace(static_cast<uint32_t>(value), *std::move(key)).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("keyring line ", n, ": a second key for peer ", value));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "keyring line ", n, ": expected 'job|rank|world <n>', 'server <key>' or 'peer <rank> <key>'"));
    }
  }
  if (!have_job || !have_rank || !have_world || c.server_key_.empty()) {
    return absl::InvalidArgumentError("the keyring lacks its job, rank, world or server key");
  }
  if (c.peer_keys_.size() + 1 != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("the keyring has keys for ",
                                                   c.peer_keys_.size(), " peers, the world ",
                                                   world_size - 1));
  }
  return c;
}

absl::StatusOr<std::string> Credentials::PeerKey(uint32_t peer) const {
  const auto it = peer_keys_.find(peer);
  if (it == peer_keys_.end()) {
    return absl::NotFoundError(absl::StrCat("rank ", rank_, " has no key for rank ", peer));
  }
  return it->second;
}

}  // namespace poseidon::transport
