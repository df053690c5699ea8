#include "transport/handshake.h"

#include <gtest/gtest.h>

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
  ClientHandshake client(7, 3, "job-seven-secret");
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
  ClientHandshake client(7, 3, "guess");
  ServerHandshake server(secrets);
  const absl::Status s = Converse(client, server);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_FALSE(server.done());
}

TEST(HandshakeTest, UnknownJobIsRefused) {
  SecretStore secrets;
  secrets.Set(7, "job-seven-secret");
  ClientHandshake client(8, 0, "job-seven-secret");
  ServerHandshake server(secrets);
  const absl::Status s = Converse(client, server);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("unknown job 8"), std::string::npos);
}

TEST(HandshakeTest, ServerWithWrongSecretIsDetectedByClient) {
  SecretStore secrets;
  secrets.Set(7, "server-side-secret");
  ClientHandshake client(7, 0, "client-side-secret");
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
  ClientHandshake client(1, 0, "s");
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
    ClientHandshake client(1, 0, "s");
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
