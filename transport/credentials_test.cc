#include "transport/credentials.h"

#include <gtest/gtest.h>

#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_replace.h"

namespace poseidon::transport {
namespace {

TEST(CredentialsTest, KeysDependOnSecretJobAndRanksAndPairKeysAreSymmetric) {
  std::set<std::string> keys = {RankKey("s", 1, 0), RankKey("s", 1, 1), RankKey("s", 2, 0),
                                RankKey("t", 1, 0), PairKey("s", 1, 0, 1), PairKey("s", 1, 0, 2),
                                PairKey("s", 2, 0, 1)};
  EXPECT_EQ(keys.size(), 7u) << "every key distinct";
  EXPECT_EQ(PairKey("s", 1, 3, 5), PairKey("s", 1, 5, 3));
  EXPECT_EQ(RankKey("s", 1, 0).size(), kKeyBytes);
}

TEST(CredentialsTest, KeysEqualAnIndependentHmacSha256) {
  // Computed with Python's hmac module (the launcher's poseidon/keys.py derives keyrings with it):
  // hmac.new(b"s", b"poseidon/v1/rank-key" + (1).to_bytes(8, "little") + (0).to_bytes(4, "little"),
  //          hashlib.sha256).hexdigest(), and the pair key of ranks 3 and 5 of job 7.
  EXPECT_EQ(absl::BytesToHexString(RankKey("s", 1, 0)),
            "67634587b615c87ec78ea83ac782dedfba51ee5ec87cb8153ac86e0f640f44bf");
  EXPECT_EQ(absl::BytesToHexString(PairKey("s", 7, 5, 3)),
            "5a914113675d116ac2883274836aef57c57aac66251f1243c7bf0b9edc02b819");
}

TEST(CredentialsTest, AKeyringHoldsWhatTheSecretDerivesForThatRankAndNoMore) {
  const std::string ring = Credentials::MakeKeyring("secret", 4, 1, 3);
  EXPECT_EQ(ring.find("secret"), std::string::npos) << ring;
  auto c = Credentials::FromKeyring(ring, 4, 1, 3);
  ASSERT_TRUE(c.ok()) << c.status();
  const Credentials d = Credentials::FromSecret("secret", 4, 1, 3);
  EXPECT_EQ(c->server_key(), d.server_key());
  EXPECT_EQ(c->peer_keys(), d.peer_keys());
  EXPECT_EQ(*c->PeerKey(0), PairKey("secret", 4, 0, 1));
  EXPECT_EQ(*c->PeerKey(2), PairKey("secret", 4, 1, 2));
  EXPECT_EQ(c->PeerKey(1).status().code(), absl::StatusCode::kNotFound) << "no key with itself";
  EXPECT_EQ(c->server_key(), RankKey("secret", 4, 1));
}

TEST(CredentialsTest, BadKeyringsAreRefusedNamingWhy) {
  const std::string ring = Credentials::MakeKeyring("secret", 4, 1, 3);
  struct Case {
    std::string text;
    uint64_t job;
    uint32_t rank, world;
    std::string why;
  };
  const std::string first_peer = ring.substr(ring.find("peer 0 "), ring.find('\n', ring.find("peer 0 ")) - ring.find("peer 0 ") + 1);
  const Case cases[] = {
      {ring, 4, 2, 3, "the keyring is for rank 1, this agent's is 2"},
      {ring, 5, 1, 3, "the keyring is for job 4"},
      {ring, 4, 1, 4, "the keyring is for world 3"},
      {"something else\n", 4, 1, 3, "not a keyring"},
      {absl::StrReplaceAll(ring, {{first_peer, ""}}), 4, 1, 3, "keys for 1 peers"},
      {ring + first_peer, 4, 1, 3, "a second key for peer 0"},
      {ring + "peer 1 " + std::string(64, 'a') + "\n", 4, 1, 3, "another rank"},
      {ring + "peer 7 " + std::string(64, 'a') + "\n", 4, 1, 3, "below the world size"},
      {absl::StrReplaceAll(ring, {{"server ", "server zz"}}), 4, 1, 3, "hex digits"},
      {ring + "server " + std::string(64, 'a') + "\n", 4, 1, 3, "a second server key"},
      {ring + "color blue\n", 4, 1, 3, "expected"},
      {ring, 4, 1, 0, "a world of 1 or more"},
  };
  for (const Case& c : cases) {
    auto parsed = Credentials::FromKeyring(c.text, c.job, c.rank, c.world);
    ASSERT_FALSE(parsed.ok()) << c.why;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << c.why;
    EXPECT_NE(parsed.status().message().find(c.why), std::string::npos)
        << parsed.status() << " should say " << c.why;
  }
}

}  // namespace
}  // namespace poseidon::transport
