// The RDMA backend over the test verbs provider (fake_verbs.h): frames really travel by SEND and
// READ on queue pairs, no queue pair exists before a handshake proved the peer, and every injected
// verbs fault (lost completion, RNR retry exceeded, QP error mid-transfer, remote access error)
// becomes an error on that connection, at both ends, within a bounded time.
#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <optional>
#include <string>

#include "transport/credentials.h"
#include "transport/error_frame.h"
#include "transport/frame_server.h"
#include "transport/handshake.h"
#include "transport/rdma/fake_verbs.h"
#include "transport/rdma/rdma_context.h"
#include "transport/transport_test_util.h"

namespace poseidon::transport {
namespace {

using testing::DataHeader;
using testing::Pattern;
using testing::SyncAccept;
using testing::SyncReadFrame;
using testing::SyncReadHeader;
using testing::SyncReadPayload;
namespace fv = fake_verbs;

constexpr absl::Duration kWait = absl::Seconds(20);

// Waits at most kWait for `f`; nullopt (and a test failure naming `what`) when it did not come.
template <typename T>
std::optional<T> Await(std::future<T>& f, const std::string& what) {
  if (f.wait_for(absl::ToChronoNanoseconds(kWait)) != std::future_status::ready) {
    ADD_FAILURE() << "no result within " << kWait << " for: " << what;
    return std::nullopt;
  }
  return f.get();
}

std::future<absl::Status> SendLater(Connection& conn, const FrameHeader& h,
                                    std::vector<ConstBuffer> payload) {
  return testing::SendAsync(conn, h, std::move(payload));
}

std::future<absl::StatusOr<FrameHeader>> ReadHeaderLater(Connection& conn) {
  auto p = std::make_shared<std::promise<absl::StatusOr<FrameHeader>>>();
  auto f = p->get_future();
  conn.ReadHeader([p](absl::StatusOr<FrameHeader> h) { p->set_value(std::move(h)); });
  return f;
}

std::future<absl::Status> ReadPayloadLater(Connection& conn, MutableBuffer into) {
  auto p = std::make_shared<std::promise<absl::Status>>();
  auto f = p->get_future();
  conn.ReadPayload(into, [p](absl::Status s) { p->set_value(std::move(s)); });
  return f;
}

class RdmaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fv::Reset();
    fv::SetDeviceCount(1);
  }
  void TearDown() override {
    fv::Reset();
    if (ctx_) ctx_->Close();
  }

  void Start(RdmaOptions options) {
    auto ctx = CreateRdmaContext(options);
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    ctx_ = *ctx;
    ASSERT_TRUE(ctx_->IsViable());
    auto listener = ctx_->Listen("127.0.0.1:0");
    ASSERT_TRUE(listener.ok()) << listener.status();
    listener_ = *listener;
  }

  static RdmaOptions AtConnect() {
    RdmaOptions o;
    o.upgrade = RdmaOptions::Upgrade::kAtConnect;
    o.completion_timeout = absl::Seconds(1);
    o.payload_idle_timeout = absl::Seconds(2);
    o.read_chunk_bytes = 256 * 1024;
    return o;
  }

  std::pair<std::shared_ptr<Connection>, std::shared_ptr<Connection>> Pair() {
    auto accepted = std::async(std::launch::async, [&] { return SyncAccept(*listener_); });
    auto client = ctx_->Connect(listener_->Address(), absl::Seconds(10));
    EXPECT_TRUE(client.ok()) << client.status();
    auto server = accepted.get();
    EXPECT_TRUE(server.ok()) << server.status();
    if (!client.ok() || !server.ok()) return {};
    return {*client, *server};
  }

  // The peer learns of the failure: its pending read gets the ERROR frame naming the reason
  // (then the close), or fails; never a hang, never a data frame.
  static void ExpectPeerSeesError(std::future<absl::StatusOr<FrameHeader>>& pending,
                                  Connection& conn, const std::string& what) {
    auto h = Await(pending, what);
    ASSERT_TRUE(h.has_value());
    if (!h->ok()) return;
    ASSERT_EQ((*h)->type, FrameType::kError) << what << ": the peer read a frame, not an error";
    std::vector<std::byte> message((*h)->payload_length);
    ASSERT_TRUE(SyncReadPayload(conn, message).ok());
    EXPECT_FALSE(ParseErrorFrame(**h, message).ok());
    EXPECT_FALSE(SyncReadHeader(conn, kWait).ok()) << what << ": open after the ERROR frame";
  }

  std::shared_ptr<Context> ctx_;
  std::shared_ptr<Listener> listener_;
};

TEST_F(RdmaTest, WithoutADeviceTheBackendIsNotViableAndSaysWhy) {
  fv::SetDeviceCount(0);
  EXPECT_FALSE(RdmaDeviceStatus(RdmaOptions{}).ok());
  auto ctx = CreateRdmaContext(RdmaOptions{});
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  EXPECT_FALSE((*ctx)->IsViable());
  auto listener = (*ctx)->Listen("127.0.0.1:0");
  EXPECT_EQ(listener.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(listener.status().message().find("no RDMA device"), std::string::npos)
      << listener.status();
  (*ctx)->Close();
}

TEST_F(RdmaTest, SmallFramesGoBySendAndLargeOnesByRead) {
  ASSERT_NO_FATAL_FAILURE(Start(AtConnect()));
  auto [client, server] = Pair();
  ASSERT_TRUE(client && server);
  const auto before = fv::GetCounters();
  auto small = Pattern(100, 1), large = Pattern(3 << 20, 2);
  auto s1 = SendLater(*client, DataHeader(1, small.size()), {small});
  auto s2 = SendLater(*client, DataHeader(2, large.size()), {large});
  auto f1 = SyncReadFrame(*server, kWait);
  ASSERT_TRUE(f1.ok()) << f1.status();
  EXPECT_EQ(f1->payload, small);
  auto f2 = SyncReadFrame(*server, kWait);
  ASSERT_TRUE(f2.ok()) << f2.status();
  EXPECT_TRUE(f2->payload == large);
  EXPECT_TRUE(Await(s1, "small send").value_or(absl::UnknownError("none")).ok());
  EXPECT_TRUE(Await(s2, "large send").value_or(absl::UnknownError("none")).ok());
  const auto after = fv::GetCounters();
  EXPECT_GE(after.sends - before.sends, 2u);
  EXPECT_GE(after.read_bytes - before.read_bytes, large.size()) << "the large payload was READ";
}

TEST_F(RdmaTest, RegisteredMemoryMovesByReadBetweenTheRegions) {
  ASSERT_NO_FATAL_FAILURE(Start(AtConnect()));
  auto [client, server] = Pair();
  ASSERT_TRUE(client && server);
  auto source = Pattern(2 << 20, 7);
  std::vector<std::byte> sink(source.size());
  auto src_region = ctx_->RegisterMemory(source);
  auto dst_region = ctx_->RegisterMemory(sink);
  ASSERT_TRUE(src_region.ok() && dst_region.ok());
  const auto before = fv::GetCounters();
  // Two segments of one region, gathered.
  const ConstBuffer a(source.data(), 1 << 20), b(source.data() + (1 << 20), 1 << 20);
  auto sent = SendLater(*client, DataHeader(3, source.size()), {a, b});
  auto h = SyncReadHeader(*server, kWait);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(SyncReadPayload(*server, sink).ok());
  EXPECT_TRUE(sink == source);
  EXPECT_TRUE(Await(sent, "registered send").value_or(absl::UnknownError("none")).ok());
  EXPECT_EQ(fv::GetCounters().live_mrs, before.live_mrs) << "no staging buffer was registered";
}

TEST_F(RdmaTest, NoQueuePairBeforeTheHandshakeProvedThePeer) {
  RdmaOptions options;  // production default: upgrade after the handshake
  ASSERT_NO_FATAL_FAILURE(Start(options));
  auto secrets = std::make_shared<SecretStore>();
  secrets->Set(1, "right");
  class Echo : public FrameHandler {
   public:
    absl::StatusOr<PayloadTarget> OnHeader(const std::shared_ptr<PeerSession>&,
                                           const FrameHeader& header) override {
      buffer_.resize(header.payload_length);
      return PayloadTarget::Into(buffer_);
    }
    void OnFrame(const std::shared_ptr<PeerSession>& peer, const FrameHeader& header,
                 MutableBuffer payload) override {
      auto copy = std::make_shared<std::vector<std::byte>>(payload.begin(), payload.end());
      FrameHeader reply = header;
      reply.sender_rank = 0;
      peer->connection().Send(reply, {*copy}, [copy](absl::Status) {});
    }
    std::vector<std::byte> buffer_;
  };
  auto server = std::make_shared<FrameServer>(listener_, secrets, std::make_shared<Echo>());
  server->Start();
  const uint64_t qps_before = fv::GetCounters().live_qps;

  auto impostor = ConnectAuthenticated(*ctx_, server->Address(), 1, 3, RankKey("wrong", 1, 3),
                                       absl::Seconds(10));
  EXPECT_EQ(impostor.status().code(), absl::StatusCode::kUnauthenticated) << impostor.status();
  auto silent = ctx_->Connect(server->Address(), absl::Seconds(10));
  ASSERT_TRUE(silent.ok());
  EXPECT_EQ(fv::GetCounters().live_qps, qps_before) << "an unauthenticated peer got a queue pair";

  auto good = ConnectAuthenticated(*ctx_, server->Address(), 1, 2, RankKey("right", 1, 2),
                                   absl::Seconds(10));
  ASSERT_TRUE(good.ok()) << good.status();
  const auto before = fv::GetCounters();
  auto p = Pattern(200000, 5);
  FrameHeader h = DataHeader(4, p.size());
  h.sender_rank = 2;
  auto sent = SendLater(**good, h, {p});
  auto echoed = SyncReadFrame(**good, kWait);
  ASSERT_TRUE(echoed.ok()) << echoed.status();
  EXPECT_TRUE(echoed->payload == p);
  EXPECT_TRUE(Await(sent, "send after the handshake").value_or(absl::UnknownError("none")).ok());
  const auto after = fv::GetCounters();
  EXPECT_EQ(after.live_qps, qps_before + 2) << "the authenticated pair has its queue pairs";
  EXPECT_GE(after.read_bytes - before.read_bytes, 2 * p.size()) << "both ways went by READ";
  server->Stop();
}

// Two devices that cannot reach each other (not on one fabric) set up their queue pairs fine: the
// first SEND is what fails. ConnectAuthenticated waits for the client's first SEND to be
// acknowledged (Connection::WaitEstablished), so the failure is the connect's, with the verbs
// status, and a caller holding the peer's TCP endpoint can fall back before sending anything.
TEST_F(RdmaTest, AConnectWhoseQueuePairCannotCarryAMessageFailsWithTheVerbsStatus) {
  ASSERT_NO_FATAL_FAILURE(Start(RdmaOptions{}));
  auto secrets = std::make_shared<SecretStore>();
  secrets->Set(1, "right");
  class Drop : public FrameHandler {
   public:
    absl::StatusOr<PayloadTarget> OnHeader(const std::shared_ptr<PeerSession>&,
                                           const FrameHeader&) override {
      return PayloadTarget::Discard();
    }
    void OnFrame(const std::shared_ptr<PeerSession>&, const FrameHeader&, MutableBuffer) override {}
  };
  auto server = std::make_shared<FrameServer>(listener_, secrets, std::make_shared<Drop>());
  server->Start();
  fv::InjectFault(fv::Fault::kRnrRetryExceeded, fv::WorkKind::kSend);  // the very first SEND
  auto broken = ConnectAuthenticated(*ctx_, server->Address(), 1, 2, RankKey("right", 1, 2),
                                     absl::Seconds(10));
  EXPECT_TRUE(fv::FaultFired());
  ASSERT_FALSE(broken.ok()) << "connected over a queue pair that carried nothing";
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kUnavailable) << broken.status();
  EXPECT_NE(broken.status().message().find("RNR retry counter exceeded"), std::string::npos)
      << broken.status();
  // The fault was that connection's: the next one is established and carries frames.
  auto good = ConnectAuthenticated(*ctx_, server->Address(), 1, 2, RankKey("right", 1, 2),
                                   absl::Seconds(10));
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE((*good)->WaitEstablished(absl::Seconds(1)).ok());
  auto p = Pattern(64, 3);
  auto sent = SendLater(**good, DataHeader(1, p.size()), {p});
  EXPECT_TRUE(Await(sent, "a frame on the good connection").value_or(absl::UnknownError("none")).ok());
  server->Stop();
}

TEST_F(RdmaTest, RnrRetryExceededFailsTheConnectionAtBothEnds) {
  ASSERT_NO_FATAL_FAILURE(Start(AtConnect()));
  auto [client, server] = Pair();
  ASSERT_TRUE(client && server);
  auto server_read = ReadHeaderLater(*server);
  auto client_read = ReadHeaderLater(*client);
  fv::InjectFault(fv::Fault::kRnrRetryExceeded, fv::WorkKind::kSend);
  auto p = Pattern(64, 1);
  auto sent = SendLater(*client, DataHeader(1, p.size()), {p});
  auto s = Await(sent, "send hit by RNR retry exceeded");
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(fv::FaultFired());
  EXPECT_EQ(s->code(), absl::StatusCode::kUnavailable) << *s;
  EXPECT_NE(s->message().find("RNR retry"), std::string::npos) << *s;
  ExpectPeerSeesError(server_read, *server, "the receiver of the lost frame");
  ExpectPeerSeesError(client_read, *client, "the sender's own pending read");
}

TEST_F(RdmaTest, RemoteAccessErrorOnABadRkeyFailsTheRead) {
  ASSERT_NO_FATAL_FAILURE(Start(AtConnect()));
  auto [client, server] = Pair();
  ASSERT_TRUE(client && server);
  auto client_read = ReadHeaderLater(*client);
  auto p = Pattern(1 << 20, 3);
  auto sent = SendLater(*client, DataHeader(1, p.size()), {p});
  auto h = SyncReadHeader(*server, kWait);
  ASSERT_TRUE(h.ok()) << h.status();
  fv::InjectFault(fv::Fault::kRemoteAccessError, fv::WorkKind::kRead);
  std::vector<std::byte> into(p.size());
  auto read = ReadPayloadLater(*server, into);
  auto r = Await(read, "READ with a corrupted rkey");
  ASSERT_TRUE(r.has_value());
  EXPECT_FALSE(r->ok());
  EXPECT_NE(r->message().find("remote access error"), std::string::npos) << *r;
  // The sender is told: its frame never completes as sent, and its connection is gone.
  auto s = Await(sent, "the sender of the unreadable frame");
  ASSERT_TRUE(s.has_value());
  EXPECT_FALSE(s->ok());
  ExpectPeerSeesError(client_read, *client, "the sender's pending read");
}

TEST_F(RdmaTest, QpErrorMidTransferFailsTheReadAndTellsTheSender) {
  ASSERT_NO_FATAL_FAILURE(Start(AtConnect()));
  auto [client, server] = Pair();
  ASSERT_TRUE(client && server);
  auto client_read = ReadHeaderLater(*client);
  auto p = Pattern(4 << 20, 4);  // 16 READs of 256 KiB: the QP breaks at the third
  auto sent = SendLater(*client, DataHeader(1, p.size()), {p});
  auto h = SyncReadHeader(*server, kWait);
  ASSERT_TRUE(h.ok()) << h.status();
  fv::InjectFault(fv::Fault::kQpErrorMidTransfer, fv::WorkKind::kRead, /*skip=*/2);
  std::vector<std::byte> into(p.size());
  auto read = ReadPayloadLater(*server, into);
  auto r = Await(read, "READ when the QP breaks");
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(fv::FaultFired());
  EXPECT_EQ(r->code(), absl::StatusCode::kUnavailable) << *r;
  EXPECT_NE(r->message().find("Flushed"), std::string::npos) << *r;
  auto s = Await(sent, "the sender when the receiver's QP broke");
  ASSERT_TRUE(s.has_value());
  EXPECT_FALSE(s->ok());
  ExpectPeerSeesError(client_read, *client, "the sender's pending read");
  // And the broken connection stays broken: a later send fails at once.
  auto later = SendLater(*server, DataHeader(2, 0), {});
  auto l = Await(later, "send on the broken connection");
  ASSERT_TRUE(l.has_value());
  EXPECT_FALSE(l->ok());
}

TEST_F(RdmaTest, ALostSendCompletionIsAnErrorNotAHang) {
  ASSERT_NO_FATAL_FAILURE(Start(AtConnect()));  // completion_timeout 1 s
  auto [client, server] = Pair();
  ASSERT_TRUE(client && server);
  fv::InjectFault(fv::Fault::kDropCompletion, fv::WorkKind::kSend);
  auto p = Pattern(64, 1);
  auto sent = SendLater(*client, DataHeader(1, p.size()), {p});
  auto s = Await(sent, "send whose completion was dropped");
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(fv::FaultFired());
  EXPECT_EQ(s->code(), absl::StatusCode::kUnavailable) << *s;
  EXPECT_NE(s->message().find("did not complete within"), std::string::npos) << *s;
  // The receiver got the bytes (the transfer happened) and then learns the connection is gone.
  auto f = SyncReadFrame(*server, kWait);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->payload, p);
  auto next = ReadHeaderLater(*server);
  ExpectPeerSeesError(next, *server, "the receiver after the lost completion");
}

TEST_F(RdmaTest, ALostReadCompletionFailsThePayloadRead) {
  ASSERT_NO_FATAL_FAILURE(Start(AtConnect()));
  auto [client, server] = Pair();
  ASSERT_TRUE(client && server);
  auto client_read = ReadHeaderLater(*client);
  auto p = Pattern(1 << 20, 9);
  auto sent = SendLater(*client, DataHeader(1, p.size()), {p});
  auto h = SyncReadHeader(*server, kWait);
  ASSERT_TRUE(h.ok()) << h.status();
  fv::InjectFault(fv::Fault::kDropCompletion, fv::WorkKind::kRead);
  std::vector<std::byte> into(p.size());
  auto read = ReadPayloadLater(*server, into);
  auto r = Await(read, "READ whose completion was dropped");
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code(), absl::StatusCode::kDeadlineExceeded) << *r;
  EXPECT_NE(r->message().find("did not complete within"), std::string::npos) << *r;
  ExpectPeerSeesError(client_read, *client, "the sender's pending read");
  auto s = Await(sent, "the sender of the frame");
  ASSERT_TRUE(s.has_value());
  EXPECT_FALSE(s->ok());
}

TEST_F(RdmaTest, AnIdleConnectionSleepsOnTheCompletionChannel) {
  ASSERT_NO_FATAL_FAILURE(Start(AtConnect()));
  auto [client, server] = Pair();
  ASSERT_TRUE(client && server);
  auto p = Pattern(10, 1);
  auto sent = SendLater(*client, DataHeader(1, p.size()), {p});
  ASSERT_TRUE(SyncReadFrame(*server, kWait).ok());
  ASSERT_TRUE(Await(sent, "send").value_or(absl::UnknownError("none")).ok());
  // Completions were found through channel events (the progress thread sleeps in poll(2) on the
  // channel; it has no busy-poll loop to fall back on).
  EXPECT_GT(fv::GetCounters().events, 0u);
}

TEST(MakeContextRdma, AutoTakesRdmaWhereADeviceIsUsableAndTcpElsewhere) {
  fv::Reset();
  fv::SetDeviceCount(1);
  for (const char* kind : {"rdma", "auto"}) {
    auto ctx = MakeContext(kind, ContextOptions{});
    ASSERT_TRUE(ctx.ok()) << kind << ": " << ctx.status();
    EXPECT_EQ((*ctx)->Name(), "rdma") << kind;
    (*ctx)->Close();
  }
  fv::SetDeviceCount(0);
  auto fallback = MakeContext("auto", ContextOptions{});
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_EQ((*fallback)->Name(), "tcp");
  (*fallback)->Close();
  auto forced = MakeContext("rdma", ContextOptions{});
  EXPECT_EQ(forced.status().code(), absl::StatusCode::kFailedPrecondition) << forced.status();
  EXPECT_NE(forced.status().message().find("no RDMA device"), std::string::npos)
      << forced.status();
  fv::SetDeviceCount(1);
}

}  // namespace
}  // namespace poseidon::transport
