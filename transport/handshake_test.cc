#include "transport/handshake.h"

#include <gtest/gtest.h>

#include "transport/credentials.h"

namespace poseidon::transport {
namespace {

// Runs the two pure state machines against each other; returns the first error.
absl::Status Converse(ClientHandshake& client, ServerHandshake& server) {
  OutFrame to_server = client.Start();
  for (int round = 0; round < 4; ++round) {
    auto answer = server.OnFrame(to_server.header, to_server.payload);
    if (!answer.ok()) return answer.status();
    auto next = client.OnFrame(answer->header, answer->payload);
    if (!next.ok()) return next.status();
    if (!next->has_value()) return absl::OkStatus();
    to_server = std::move(**next);
  }
  return absl::InternalError("handshake did not finish");
}

TEST(HandshakeTest, RightSecretAuthenticatesBothWays) {
  SecretStore secrets;
  secrets.Set(7, "job-seven-secret");
  ClientHandshake client(7, 3, RankKey("job-seven-secret", 7, 3));
  ServerHandshake server(secrets);
  ASSERT_TRUE(Converse(client, server).ok());
  EXPECT_TRUE(client.done());
  EXPECT_TRUE(server.done());
  EXPECT_EQ(server.peer().job_id, 7u);
  EXPECT_EQ(server.peer().rank, 3u);
}

TEST(HandshakeTest, WrongSecretIsRefused) {
  SecretStore secrets;
  secrets.Set(7, "job-seven-secret");
  ClientHandshake client(7, 3, RankKey("guess", 7, 3));
  ServerHandshake server(secrets);
  const absl::Status s = Converse(client, server);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_FALSE(server.done());
}

TEST(HandshakeTest, UnknownJobIsRefused) {
  SecretStore secrets;
  secrets.Set(7, "job-seven-secret");
  ClientHandshake client(8, 0, RankKey("job-seven-secret", 8, 0));
  ServerHandshake server(secrets);
  const absl::Status s = Converse(client, server);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("unknown job 8"), std::string::npos);
}

TEST(HandshakeTest, ServerWithWrongSecretIsDetectedByClient) {
  SecretStore secrets;
  secrets.Set(7, "server-side-secret");
  ClientHandshake client(7, 0, RankKey("client-side-secret", 7, 0));
  // A server that skips verification would still have to produce AUTH_OK with the secret:
  // emulate it by answering the client's AUTH with a proof made from the server's secret.
  ServerHandshake server(secrets);
  OutFrame hello = client.Start();
  auto challenge = server.OnFrame(hello.header, hello.payload);
  ASSERT_TRUE(challenge.ok());
  auto auth = client.OnFrame(challenge->header, challenge->payload);
  ASSERT_TRUE(auth.ok());
  OutFrame forged;
  forged.header.type = FrameType::kAuthOk;
  forged.header.job_id = 7;
  forged.payload.assign(kProofBytes, std::byte{0x5A});
  forged.header.payload_length = forged.payload.size();
  auto result = client.OnFrame(forged.header, forged.payload);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(HandshakeTest, ReplayedAuthFromAnotherSessionIsRefused) {
  SecretStore secrets;
  secrets.Set(1, "s");
  ClientHandshake client(1, 0, RankKey("s", 1, 0));
  ServerHandshake first(secrets);
  OutFrame hello = client.Start();
  auto challenge = first.OnFrame(hello.header, hello.payload);
  ASSERT_TRUE(challenge.ok());
  auto auth = client.OnFrame(challenge->header, challenge->payload);
  ASSERT_TRUE(auth.ok() && auth->has_value());
  // An eavesdropper replays HELLO and AUTH to a new server session: fresh nonce, so it fails.
  ServerHandshake second(secrets);
  ASSERT_TRUE(second.OnFrame(hello.header, hello.payload).ok());
  auto replay = second.OnFrame((*auth)->header, (*auth)->payload);
  EXPECT_EQ(replay.status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(HandshakeTest, OneRanksKeyCannotSpeakForAnother) {
  SecretStore secrets;
  secrets.Set(7, "job-seven-secret");
  // Rank 1 holds only its own key (its keyring): claiming rank 2 with it is refused.
  ClientHandshake forger(7, 2, RankKey("job-seven-secret", 7, 1));
  ServerHandshake server(secrets);
  const absl::Status s = Converse(forger, server);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  // The job secret itself is not a rank's key either.
  ClientHandshake raw(7, 2, "job-seven-secret");
  ServerHandshake again(secrets);
  EXPECT_EQ(Converse(raw, again).code(), absl::StatusCode::kUnauthenticated);
}

TEST(HandshakeTest, AnAgentsPeerPortVerifiesPairKeysWithoutTheSecret) {
  // Rank 0's peer port holds its keyring's pair keys, not the secret.
  const Credentials rank0 = Credentials::FromSecret("s3", 9, 0, 3);
  SecretStore peers;
  peers.SetKeys(9, rank0.peer_keys());
  const Credentials rank1 = Credentials::FromSecret("s3", 9, 1, 3);
  const Credentials rank2 = Credentials::FromSecret("s3", 9, 2, 3);
  {
    ClientHandshake client(9, 1, *rank1.PeerKey(0));
    ServerHandshake server(peers);
    ASSERT_TRUE(Converse(client, server).ok());
    EXPECT_EQ(server.peer().rank, 1u);
  }
  {
    // Rank 2 claiming rank 1 with what it holds: its pair key with rank 0, or its server key.
    for (const std::string& key : {*rank2.PeerKey(0), rank2.server_key()}) {
      ClientHandshake forger(9, 1, key);
      ServerHandshake server(peers);
      EXPECT_EQ(Converse(forger, server).code(), absl::StatusCode::kUnauthenticated);
    }
  }
  {
    // A rank the table has no key of (outside the world) is refused at HELLO.
    ClientHandshake client(9, 5, RankKey("s3", 9, 5));
    ServerHandshake server(peers);
    const absl::Status s = Converse(client, server);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_NE(s.message().find("rank 5 of job 9 has no key"), std::string::npos) << s;
  }
}

TEST(HandshakeTest, OutOfOrderAndMisSizedFramesAreRefused) {
  SecretStore secrets;
  secrets.Set(1, "s");
  {
    ServerHandshake server(secrets);
    FrameHeader h;
    h.type = FrameType::kAuth;
    h.job_id = 1;
    std::vector<std::byte> p(kProofBytes);
    h.payload_length = p.size();
    EXPECT_FALSE(server.OnFrame(h, p).ok());
    // A failed machine stays failed.
    ClientHandshake client(1, 0, RankKey("s", 1, 0));
    OutFrame hello = client.Start();
    EXPECT_FALSE(server.OnFrame(hello.header, hello.payload).ok());
  }
  {
    ServerHandshake server(secrets);
    FrameHeader h;
    h.type = FrameType::kHello;
    h.job_id = 1;
    std::vector<std::byte> p(kNonceBytes - 1);
    h.payload_length = p.size();
    EXPECT_FALSE(server.OnFrame(h, p).ok());
  }
  {
    ServerHandshake server(secrets);
    FrameHeader h;
    h.type = FrameType::kData;
    h.job_id = 1;
    EXPECT_FALSE(server.OnFrame(h, {}).ok());
  }
}

}  // namespace
}  // namespace poseidon::transport
