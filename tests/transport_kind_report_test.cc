// The transport kind a daemon reports per link (issue 16): a FrameServer knows which peers
// (job, rank) it serves, so a server listening once per kind tells a peer's kind by the listener
// its connections came in by; ServerTelemetry reports that kind on the peer's link.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "server/server_telemetry.h"
#include "transport/credentials.h"
#include "transport/frame_server.h"
#include "transport/handshake.h"
#include "transport/tcp/tcp_context.h"

namespace poseidon::testing {
namespace {

namespace v1 = ::poseidon::v1;

class NullHandler : public transport::FrameHandler {
 public:
  absl::StatusOr<transport::PayloadTarget> OnHeader(const std::shared_ptr<transport::PeerSession>&,
                                                    const transport::FrameHeader&) override {
    return transport::PayloadTarget::Discard();
  }
  void OnFrame(const std::shared_ptr<transport::PeerSession>&, const transport::FrameHeader&,
               transport::MutableBuffer) override {}
};

TEST(TransportKindReport, AFrameServerKnowsWhichPeersItServes) {
  auto ctx = transport::CreateTcpContext(transport::TcpOptions{});
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  auto listener = (*ctx)->Listen("127.0.0.1:0");
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto secrets = std::make_shared<transport::SecretStore>();
  secrets->Set(7, "report-secret");
  auto server =
      std::make_shared<transport::FrameServer>(*listener, secrets, std::make_shared<NullHandler>());
  server->Start();
  EXPECT_FALSE(server->HasPeer(7, 3));
  const auto creds = transport::Credentials::FromSecret("report-secret", 7, 3, 4);
  auto conn = transport::ConnectAuthenticated(**ctx, server->Address(), 7, 3, creds.server_key(),
                                              absl::Seconds(10));
  ASSERT_TRUE(conn.ok()) << conn.status();
  // The server's handshake completes on its own I/O thread, about when the client reads
  // AUTH_OK: wait for it, bounded.
  auto wait_for = [&](bool present) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (server->HasPeer(7, 3) != present && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return server->HasPeer(7, 3) == present;
  };
  EXPECT_TRUE(wait_for(true));
  EXPECT_FALSE(server->HasPeer(7, 2));
  EXPECT_FALSE(server->HasPeer(8, 3));
  (*conn)->Close();
  // The server sees the close asynchronously too.
  EXPECT_TRUE(wait_for(false));
  server->Stop();
  (*ctx)->Close();
}

TEST(TransportKindReport, ServerTelemetryReportsEachPeersTransport) {
  std::vector<server::PeerTrafficTotals> traffic(2);
  traffic[0].job_id = 1;
  traffic[0].rank = 0;
  traffic[0].received = 100;
  traffic[0].connections = 1;
  traffic[1].job_id = 1;
  traffic[1].rank = 1;
  traffic[1].received = 200;
  traffic[1].connections = 1;
  server::ServerTelemetry telemetry([&] { return traffic; }, absl::Seconds(5), {},
                                    [](uint64_t, uint32_t rank) {
                                      return rank == 1 ? v1::TRANSPORT_KIND_RDMA
                                                       : v1::TRANSPORT_KIND_TCP;
                                    });
  const v1::ReportTelemetryRequest report = telemetry.Collect(absl::Now());
  ASSERT_EQ(report.links_size(), 2);
  for (const v1::LinkTelemetry& link : report.links()) {
    EXPECT_EQ(link.transport(),
              link.peer_rank() == 1 ? v1::TRANSPORT_KIND_RDMA : v1::TRANSPORT_KIND_TCP)
        << link.peer_rank();
  }
  // Without a resolver every link is TCP (a server with one TCP listener).
  server::ServerTelemetry plain([&] { return traffic; }, absl::Seconds(5));
  const v1::ReportTelemetryRequest plain_report = plain.Collect(absl::Now());
  ASSERT_EQ(plain_report.links_size(), 2);
  for (const v1::LinkTelemetry& link : plain_report.links()) {
    EXPECT_EQ(link.transport(), v1::TRANSPORT_KIND_TCP);
  }
}

}  // namespace
}  // namespace poseidon::testing
