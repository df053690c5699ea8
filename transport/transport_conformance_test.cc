// One conformance suite, instantiated for every transport backend (STYLE.md; in the manner of
// tensorpipe's transport_test.h). A backend that is not viable here (RDMA without a device)
// skips with the reason.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "common/testing/pki.h"
#include "transport/error_frame.h"
#include "transport/frame_server.h"
#include "transport/credentials.h"
#include "transport/handshake.h"
#include "transport/inproc/inproc_context.h"
#ifdef POSEIDON_HAVE_RDMA
#include "transport/rdma/rdma_context.h"
#endif
#include "transport/tcp/tcp_context.h"
#include "transport/transport_test_util.h"

namespace poseidon::transport {
namespace {

using testing::Pattern;
using testing::ReceivedFrame;
using testing::SyncAccept;
using testing::SyncDiscardPayload;
using testing::SyncReadFrame;
using testing::SyncReadHeader;
using testing::SyncReadPayload;
using testing::SyncSend;

struct Backend {
  std::string name;
  std::function<absl::StatusOr<std::shared_ptr<Context>>(const ContextOptions&)> create;
  std::string listen_address;
};

// Test names and failure messages show the backend's name, not its bytes.
void PrintTo(const Backend& backend, std::ostream* os) {
  *os << backend.name;
}

// The certificates of the TLS instances, made once per process (removed at exit).
const std::string& PkiDir() {
  // Never destroyed: the exit handler below still reads it.
  static const std::string* const dir = [] {
    auto* d = new std::string(poseidon::testing::MakeTestPkiDir("poseidon-conformance-tls"));
    if (d->empty()) ADD_FAILURE() << "could not make the TLS test certificates (openssl)";
    std::atexit([] { poseidon::testing::RemoveTestPkiDir(PkiDir()); });
    return d;
  }();
  return *dir;
}

TcpOptions TlsOptionsFor(const ContextOptions& o, bool mutual) {
  TcpOptions t;
  static_cast<ContextOptions&>(t) = o;
  t.tls.enabled = true;
  // One certificate for both ends: it names 127.0.0.1 and may serve as a client's.
  t.tls.cert_file = PkiDir() + "/server.pem";
  t.tls.key_file = PkiDir() + "/server.key";
  t.tls.ca_file = PkiDir() + "/ca.pem";
  t.tls.verify_clients = mutual;
  return t;
}

std::vector<Backend> Backends() {
  return {
      {"tcp",
       [](const ContextOptions& o) {
         TcpOptions t;
         static_cast<ContextOptions&>(t) = o;
         return CreateTcpContext(t);
       },
       "127.0.0.1:0"},
      {"tcp_two_threads_checksummed",
       [](const ContextOptions& o) {
         TcpOptions t;
         static_cast<ContextOptions&>(t) = o;
         t.io_threads = 2;
         t.payload_checksums = true;
         t.socket_buffer_bytes = 4 << 20;
         return CreateTcpContext(t);
       },
       "127.0.0.1:0"},
      // TLS on every connection; then mutual TLS with two I/O threads and payload checksums.
      {"tcp_tls", [](const ContextOptions& o) { return CreateTcpContext(TlsOptionsFor(o, false)); },
       "127.0.0.1:0"},
      {"tcp_mutual_tls_two_threads_checksummed",
       [](const ContextOptions& o) {
         TcpOptions t = TlsOptionsFor(o, true);
         t.io_threads = 2;
         t.payload_checksums = true;
         return CreateTcpContext(t);
       },
       "127.0.0.1:0"},
      {"inproc", [](const ContextOptions& o) { return CreateInprocContext(o); }, ""},
#ifdef POSEIDON_HAVE_RDMA
      // The RDMA backend, here over the test verbs provider (the test links it instead of
      // libibverbs; linked against libibverbs on a machine without a device, it skips).
      // Frames on queue pairs from the first one (no handshake needed to reach the data path).
      {"rdma_at_connect",
       [](const ContextOptions& o) {
         RdmaOptions r;
         static_cast<ContextOptions&>(r) = o;
         r.upgrade = RdmaOptions::Upgrade::kAtConnect;
         return CreateRdmaContext(r);
       },
       "127.0.0.1:0"},
      // Few credits, a small eager limit and small READs, with payload checksums: credit
      // exhaustion, the READ path for most frames and chunked READs on every test.
      {"rdma_at_connect_few_credits_checksummed",
       [](const ContextOptions& o) {
         RdmaOptions r;
         static_cast<ContextOptions&>(r) = o;
         r.upgrade = RdmaOptions::Upgrade::kAtConnect;
         r.payload_checksums = true;
         r.receive_credits = 4;
         r.eager_bytes = 256;
         r.read_chunk_bytes = 64 * 1024;
         return CreateRdmaContext(r);
       },
       "127.0.0.1:0"},
      // The production default: frames on the side channel until the handshake proved the peer.
      {"rdma_after_handshake",
       [](const ContextOptions& o) {
         RdmaOptions r;
         static_cast<ContextOptions&>(r) = o;
         return CreateRdmaContext(r);
       },
       "127.0.0.1:0"},
#endif
  };
}

// Answers every data frame with the same frame (the frame server tests).
class EchoHandler : public FrameHandler {
 public:
  absl::StatusOr<PayloadTarget> OnHeader(const std::shared_ptr<PeerSession>&,
                                         const FrameHeader& header) override {
    if (header.type != FrameType::kData) {
      return absl::InvalidArgumentError("echo handler only takes data frames");
    }
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

 private:
  std::vector<std::byte> buffer_;  // frames of one connection arrive one at a time
};

// Polls `done` until it holds, at most 10 s; whether it did.
template <typename Done>
bool Eventually(Done done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

class TransportConformance : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override { Reset(ContextOptions{}); }

  void Reset(const ContextOptions& options) {
    if (ctx_) ctx_->Close();
    auto ctx = GetParam().create(options);
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    ctx_ = *ctx;
    if (!ctx_->IsViable()) GTEST_SKIP() << ctx_->Name() << " is not viable on this machine";
    auto listener = ctx_->Listen(GetParam().listen_address);
    ASSERT_TRUE(listener.ok()) << listener.status();
    listener_ = *listener;
  }

  void TearDown() override {
    if (ctx_) ctx_->Close();
  }

  // An echo FrameServer on listener_ for job 1 with secret "right".
  std::shared_ptr<FrameServer> StartEchoServer(FrameServerOptions options = {}) {
    auto secrets = std::make_shared<SecretStore>();
    secrets->Set(1, "right");
    auto server =
        std::make_shared<FrameServer>(listener_, secrets, std::make_shared<EchoHandler>(), options);
    server->Start();
    return server;
  }

  // `n` connections that never say a word, once the server counts them in their handshake.
  std::vector<std::shared_ptr<Connection>> OpenSilent(FrameServer& server, int n) {
    std::vector<std::shared_ptr<Connection>> silent;
    for (int i = 0; i < n; ++i) {
      auto c = ctx_->Connect(server.Address(), absl::Seconds(10));
      EXPECT_TRUE(c.ok()) << c.status();
      if (c.ok()) silent.push_back(*c);
    }
    EXPECT_TRUE(Eventually([&] { return server.Stats().handshaking == static_cast<uint64_t>(n); }));
    return silent;
  }

  // A connected pair: (client end, server end).
  std::pair<std::shared_ptr<Connection>, std::shared_ptr<Connection>> Pair() {
    auto accepted = std::async(std::launch::async, [&] { return SyncAccept(*listener_); });
    auto client = ctx_->Connect(listener_->Address(), absl::Seconds(10));
    EXPECT_TRUE(client.ok()) << client.status();
    auto server = accepted.get();
    EXPECT_TRUE(server.ok()) << server.status();
    if (!client.ok() || !server.ok()) return {};
    return {*client, *server};
  }

  std::shared_ptr<Context> ctx_;
  std::shared_ptr<Listener> listener_;
};

// An ERROR frame's reason.
std::string ErrorText(const ReceivedFrame& frame) {
  return std::string(reinterpret_cast<const char*>(frame.payload.data()), frame.payload.size());
}

FrameHeader DataHeader(uint64_t key, uint64_t length) {
  FrameHeader h;
  h.type = FrameType::kData;
  h.job_id = 1;
  h.key = key;
  h.clock = key * 10;
  h.sequence = key;
  h.payload_length = length;
  return h;
}

TEST_P(TransportConformance, FramesArriveInOrderWithHeadersAndPayloadsIntact) {
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  std::vector<std::vector<std::byte>> payloads;
  for (uint64_t k = 0; k < 50; ++k) payloads.push_back(Pattern(k * 37 + (k % 3 == 0 ? 0 : 1), k));
  for (uint64_t k = 0; k < payloads.size(); ++k) {
    client->Send(DataHeader(k, payloads[k].size()), {payloads[k]},
                 [](absl::Status s) { EXPECT_TRUE(s.ok()) << s; });
  }
  for (uint64_t k = 0; k < payloads.size(); ++k) {
    auto frame = SyncReadFrame(*server);
    ASSERT_TRUE(frame.ok()) << frame.status();
    EXPECT_EQ(frame->header.key, k);
    EXPECT_EQ(frame->header.clock, k * 10);
    EXPECT_EQ(frame->payload, payloads[k]);
  }
  // Both directions work.
  auto reply = Pattern(1000, 99);
  auto sent = testing::SendAsync(*server, DataHeader(7, reply.size()), {reply});
  auto frame = SyncReadFrame(*client);
  ASSERT_TRUE(frame.ok());
  EXPECT_EQ(frame->payload, reply);
  EXPECT_TRUE(sent.get().ok());
  EXPECT_GE(client->Stats().frames_sent, 50u);
}

TEST_P(TransportConformance, GatherSendDeliversTheConcatenation) {
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  auto a = Pattern(3, 1), b = Pattern(0, 2), c = Pattern(70000, 3), d = Pattern(1, 4);
  auto sent = testing::SendAsync(*client, DataHeader(1, a.size() + b.size() + c.size() + d.size()),
                                 {a, b, c, d});
  auto frame = SyncReadFrame(*server);
  EXPECT_TRUE(sent.get().ok());
  ASSERT_TRUE(frame.ok()) << frame.status();
  std::vector<std::byte> expected;
  for (auto* v : {&a, &b, &c, &d}) expected.insert(expected.end(), v->begin(), v->end());
  EXPECT_EQ(frame->payload, expected);
}

TEST_P(TransportConformance, LargePayloadIsReceivedIntoTheCallersBuffer) {
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  const auto big = Pattern(64u << 20, 5);
  std::promise<absl::Status> sent;
  client->Send(DataHeader(3, big.size()), {big}, [&](absl::Status s) { sent.set_value(s); });
  auto header = SyncReadHeader(*server);
  ASSERT_TRUE(header.ok()) << header.status();
  ASSERT_EQ(header->payload_length, big.size());
  std::vector<std::byte> into(big.size());
  ASSERT_TRUE(SyncReadPayload(*server, into).ok());
  EXPECT_TRUE(sent.get_future().get().ok());
  EXPECT_TRUE(into == big);
}

TEST_P(TransportConformance, ConcurrentSendersNeverInterleaveFrames) {
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  constexpr int kThreads = 4, kFrames = 100;
  std::vector<std::thread> threads;
  std::vector<std::vector<std::vector<std::byte>>> data(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kFrames; ++i) data[t].push_back(Pattern(100 + 13 * i, t * 1000 + i));
  }
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kFrames; ++i) {
        FrameHeader h = DataHeader(t * 1000 + i, data[t][i].size());
        h.sender_rank = t;
        if (!SyncSend(*client, h, {data[t][i]}).ok()) ++failures;
      }
    });
  }
  std::vector<int> next(kThreads, 0);
  for (int n = 0; n < kThreads * kFrames; ++n) {
    auto frame = SyncReadFrame(*server);
    ASSERT_TRUE(frame.ok()) << frame.status();
    const int t = static_cast<int>(frame->header.sender_rank);
    ASSERT_LT(t, kThreads);
    const int i = next[t]++;
    EXPECT_EQ(frame->header.key, static_cast<uint64_t>(t * 1000 + i)) << "order of thread " << t;
    EXPECT_EQ(frame->payload, data[t][i]);
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

// Small and large frames from four threads into a peer that reads only once everything is sent:
// the socket buffers fill up, so small frames are cut by partial writes and large ones queue
// behind them (TCP: the direct write of small frames and its hand-over to the I/O thread).
TEST_P(TransportConformance, FramesIntoAPeerThatIsNotReadingArriveIntactAndInOrder) {
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  constexpr int kThreads = 4, kFrames = 150;  // ~20 MB: more than the socket buffers hold
  std::vector<std::vector<std::vector<std::byte>>> data(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kFrames; ++i) {
      const size_t size = i > kFrames / 2 && i % 10 == 9 ? 200000 : 1000 + (i * 7919) % 64000;
      data[t].push_back(Pattern(size, t * 1000 + i));
    }
  }
  std::atomic<int> failures{0}, completed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kFrames; ++i) {
        FrameHeader h = DataHeader(t * 1000 + i, data[t][i].size());
        h.sender_rank = t;
        client->Send(h, {data[t][i]}, [&](absl::Status s) {
          if (!s.ok()) ++failures;
          ++completed;
        });
      }
    });
  }
  for (auto& th : threads) th.join();
  std::vector<int> next(kThreads, 0);
  for (int n = 0; n < kThreads * kFrames; ++n) {
    auto frame = SyncReadFrame(*server);
    ASSERT_TRUE(frame.ok()) << frame.status();
    const int t = static_cast<int>(frame->header.sender_rank);
    ASSERT_LT(t, kThreads);
    const int i = next[t]++;
    ASSERT_EQ(frame->header.key, static_cast<uint64_t>(t * 1000 + i)) << "order of thread " << t;
    ASSERT_EQ(frame->payload, data[t][i]) << "frame " << i << " of thread " << t;
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (completed.load() < kThreads * kFrames && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(completed.load(), kThreads * kFrames);
  EXPECT_EQ(failures.load(), 0);
}

TEST_P(TransportConformance, SendRejectsALengthThatDoesNotMatchTheBuffers) {
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  auto p = Pattern(10, 1);
  EXPECT_EQ(SyncSend(*client, DataHeader(1, 11), {p}).code(), absl::StatusCode::kInvalidArgument);
  // The connection is still usable.
  auto sent = testing::SendAsync(*client, DataHeader(2, p.size()), {p});
  auto frame = SyncReadFrame(*server);
  ASSERT_TRUE(frame.ok());
  EXPECT_EQ(frame->header.key, 2u);
  EXPECT_TRUE(sent.get().ok());
}

TEST_P(TransportConformance, PayloadAboveTheLimitIsRefusedBeforeSending) {
  ContextOptions options;
  options.limits.max_payload_bytes = 1024;
  Reset(options);
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  auto p = Pattern(1025, 1);
  EXPECT_EQ(SyncSend(*client, DataHeader(1, p.size()), {p}).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_P(TransportConformance, WrongSizedPayloadReadFailsAndTheRightOneStillWorks) {
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  auto p = Pattern(100, 1);
  auto sent = testing::SendAsync(*client, DataHeader(1, p.size()), {p});
  ASSERT_TRUE(SyncReadHeader(*server).ok());
  std::vector<std::byte> small(99);
  EXPECT_EQ(SyncReadPayload(*server, small).code(), absl::StatusCode::kInvalidArgument);
  // A second header read before the payload is consumed is a caller error too.
  EXPECT_EQ(SyncReadHeader(*server).status().code(), absl::StatusCode::kFailedPrecondition);
  std::vector<std::byte> right(100);
  ASSERT_TRUE(SyncReadPayload(*server, right).ok());
  EXPECT_EQ(right, p);
  EXPECT_TRUE(sent.get().ok());
}

TEST_P(TransportConformance, DiscardSkipsToTheNextFrame) {
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  auto big = Pattern(300000, 1), small = Pattern(5, 2);
  client->Send(DataHeader(1, big.size()), {big}, [](absl::Status) {});
  client->Send(DataHeader(2, small.size()), {small}, [](absl::Status) {});
  auto h = SyncReadHeader(*server);
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(SyncDiscardPayload(*server).ok());
  auto frame = SyncReadFrame(*server);
  ASSERT_TRUE(frame.ok());
  EXPECT_EQ(frame->header.key, 2u);
  EXPECT_EQ(frame->payload, small);
}

TEST_P(TransportConformance, PeerCloseFailsThePendingReadWithUnavailable) {
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  std::promise<absl::StatusOr<FrameHeader>> result;
  server->ReadHeader([&](absl::StatusOr<FrameHeader> h) { result.set_value(std::move(h)); });
  client->Close();
  auto h = result.get_future().get();
  EXPECT_EQ(h.status().code(), absl::StatusCode::kUnavailable) << h.status();
  // And sending on the closed side fails instead of vanishing.
  auto p = Pattern(8, 1);
  EXPECT_FALSE(SyncSend(*client, DataHeader(1, p.size()), {p}).ok());
}

TEST_P(TransportConformance, HeaderWaitTimesOutNamingThePeer) {
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  auto h = SyncReadHeader(*server, absl::Milliseconds(200));
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDeadlineExceeded) << h.status();
  EXPECT_NE(h.status().message().find("no frame from"), std::string::npos);
}

TEST_P(TransportConformance, AbortTellsThePeerWhy) {
  auto conns = Pair();
  auto client = conns.first;
  auto server = conns.second;
  ASSERT_TRUE(client && server);
  server->Abort(absl::PermissionDeniedError("go away"));
  auto frame = SyncReadFrame(*client, absl::Seconds(10));
  ASSERT_TRUE(frame.ok()) << frame.status();
  ASSERT_EQ(frame->header.type, FrameType::kError);
  const absl::Status why = ParseErrorFrame(frame->header, frame->payload);
  EXPECT_EQ(why.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(why.message().find("go away"), std::string::npos);
  EXPECT_FALSE(SyncReadHeader(*client, absl::Seconds(10)).ok());
}

TEST_P(TransportConformance, ConnectingToNothingFails) {
  const std::string nowhere =
      GetParam().listen_address.empty() ? "no-such-listener" : "127.0.0.1:1";
  auto conn = ctx_->Connect(nowhere, absl::Seconds(5));
  EXPECT_FALSE(conn.ok());
}

TEST_P(TransportConformance, ClosingTheListenerCancelsAccept) {
  std::promise<absl::Status> result;
  listener_->Accept(
      [&](absl::StatusOr<std::shared_ptr<Connection>> c) { result.set_value(c.status()); });
  listener_->Close();
  EXPECT_EQ(result.get_future().get().code(), absl::StatusCode::kCancelled);
}

// ---- the handshake and the frame server over each backend ----

// A peer that takes the connection and never answers the handshake (a frozen server, for which
// the kernel still accepts) fails ConnectAuthenticated once its timeout runs out, marked
// kPeerSilentPayload: the agents give such a server up at once rather than trying again until
// their connect timeout. A refusal is not so marked (below).
TEST_P(TransportConformance, APeerThatTakesTheConnectionAndSaysNothingIsMarkedSilent) {
  std::mutex mu;
  std::shared_ptr<Connection> held;  // accepted, never read
  listener_->Accept([&](absl::StatusOr<std::shared_ptr<Connection>> c) {
    std::lock_guard<std::mutex> lock(mu);
    if (c.ok()) held = *c;
  });
  auto silent = ConnectAuthenticated(*ctx_, listener_->Address(), 1, 2, RankKey("right", 1, 2),
                                     absl::Milliseconds(500));
  ASSERT_FALSE(silent.ok());
  EXPECT_TRUE(silent.status().GetPayload(kPeerSilentPayload).has_value()) << silent.status();
  EXPECT_NE(silent.status().message().find("it took the connection and said nothing"),
            std::string::npos)
      << silent.status();
  std::lock_guard<std::mutex> lock(mu);
  if (held) held->Close();
}

// A peer that takes the connection and closes it during the handshake (a daemon stopping, one
// that refuses) is not silent, late in the timeout as it comes: what marks silence is the
// handshake's read running out (DeadlineExceeded), not the time the failure came at.
TEST_P(TransportConformance, APeerThatClosesTheConnectionDuringTheHandshakeIsNotMarkedSilent) {
  std::promise<std::shared_ptr<Connection>> accepted;
  listener_->Accept([&](absl::StatusOr<std::shared_ptr<Connection>> c) {
    accepted.set_value(c.ok() ? *c : nullptr);
  });
  std::thread closer([taken = accepted.get_future()]() mutable {
    if (taken.wait_for(std::chrono::seconds(10)) != std::future_status::ready) return;
    std::shared_ptr<Connection> conn = taken.get();
    absl::SleepFor(absl::Milliseconds(400));
    if (conn) conn->Close();
  });
  auto closed = ConnectAuthenticated(*ctx_, listener_->Address(), 1, 2, RankKey("right", 1, 2),
                                     absl::Seconds(10));
  ASSERT_FALSE(closed.ok());
  EXPECT_FALSE(absl::IsDeadlineExceeded(closed.status())) << closed.status();
  EXPECT_FALSE(closed.status().GetPayload(kPeerSilentPayload).has_value()) << closed.status();
  closer.join();
}

TEST_P(TransportConformance, AuthenticatedPeersAreServedAndImpostorsRefused) {
  auto secrets = std::make_shared<SecretStore>();
  secrets->Set(1, "right");
  auto server = std::make_shared<FrameServer>(listener_, secrets, std::make_shared<EchoHandler>());
  server->Start();

  // Frames carry the rank their connection authenticated as (2 here).
  auto as_rank_2 = [](FrameHeader h) {
    h.sender_rank = 2;
    return h;
  };
  auto good = ConnectAuthenticated(*ctx_, server->Address(), 1, 2, RankKey("right", 1, 2), absl::Seconds(10));
  ASSERT_TRUE(good.ok()) << good.status();
  auto p = Pattern(5000, 9);
  ASSERT_TRUE(SyncSend(**good, as_rank_2(DataHeader(4, p.size())), {p}).ok());
  auto echoed = SyncReadFrame(**good, absl::Seconds(10));
  ASSERT_TRUE(echoed.ok()) << echoed.status();
  EXPECT_EQ(echoed->payload, p);

  auto wrong_secret =
      ConnectAuthenticated(*ctx_, server->Address(), 1, 3, RankKey("wrong", 1, 3), absl::Seconds(10));
  EXPECT_EQ(wrong_secret.status().code(), absl::StatusCode::kUnauthenticated)
      << wrong_secret.status();
  EXPECT_FALSE(wrong_secret.status().GetPayload(kPeerSilentPayload).has_value());
  auto wrong_job = ConnectAuthenticated(*ctx_, server->Address(), 2, 3, RankKey("right", 2, 3), absl::Seconds(10));
  EXPECT_EQ(wrong_job.status().code(), absl::StatusCode::kPermissionDenied) << wrong_job.status();
  EXPECT_NE(wrong_job.status().message().find("unknown job"), std::string::npos);

  // A data frame for another job on an authenticated connection disconnects that peer only.
  FrameHeader other = as_rank_2(DataHeader(5, 0));
  other.job_id = 99;
  ASSERT_TRUE(SyncSend(**good, other, {}).ok());
  auto error = SyncReadFrame(**good, absl::Seconds(10));
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_EQ(error->header.type, FrameType::kError);

  auto again = ConnectAuthenticated(*ctx_, server->Address(), 1, 2, RankKey("right", 1, 2), absl::Seconds(10));
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(SyncSend(**again, as_rank_2(DataHeader(6, p.size())), {p}).ok());
  EXPECT_TRUE(SyncReadFrame(**again, absl::Seconds(10)).ok());

  // A frame claiming another rank than the one the handshake proved (a forged sender, which
  // would make the real rank's push a "duplicate") disconnects that peer, naming both ranks.
  auto forger = ConnectAuthenticated(*ctx_, server->Address(), 1, 2, RankKey("right", 1, 2), absl::Seconds(10));
  ASSERT_TRUE(forger.ok()) << forger.status();
  FrameHeader forged = DataHeader(7, 0);
  forged.sender_rank = 0;
  ASSERT_TRUE(SyncSend(**forger, forged, {}).ok());
  auto refused = SyncReadFrame(**forger, absl::Seconds(10));
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->header.type, FrameType::kError);
  const std::string why = ErrorText(*refused);
  EXPECT_NE(why.find("frame from rank 0 on a connection authenticated as rank 2"),
            std::string::npos)
      << why;
  // Dropped: only `again` is left (`good` went for its job-99 frame).
  EXPECT_TRUE(Eventually([&] { return server->Stats().active == 1; }))
      << "the forger stays connected";
  ASSERT_TRUE(SyncSend(**again, as_rank_2(DataHeader(8, p.size())), {p}).ok());
  EXPECT_TRUE(SyncReadFrame(**again, absl::Seconds(10)).ok()) << "the others are served on";
  EXPECT_EQ(server->Stats().handshake_failures, 2u);
  server->Stop();
}

// Keeps what arrives (FrameServer::Serve's test).
class KeepingHandler : public FrameHandler {
 public:
  absl::StatusOr<PayloadTarget> OnHeader(const std::shared_ptr<PeerSession>&,
                                         const FrameHeader& header) override {
    buffer_.resize(header.payload_length);
    return PayloadTarget::Into(buffer_);
  }
  void OnFrame(const std::shared_ptr<PeerSession>& peer, const FrameHeader& header,
               MutableBuffer payload) override {
    std::lock_guard<std::mutex> lock(mu_);
    frames_.push_back({peer->identity().rank, header.key,
                       std::vector<std::byte>(payload.begin(), payload.end())});
  }
  void OnClose(const std::shared_ptr<PeerSession>&, const absl::Status&) override {
    closed_.store(true);
  }
  struct Kept {
    uint32_t rank;
    uint64_t key;
    std::vector<std::byte> payload;
  };
  std::vector<Kept> frames() {
    std::lock_guard<std::mutex> lock(mu_);
    return frames_;
  }
  bool closed() const { return closed_.load(); }

 private:
  std::vector<std::byte> buffer_;
  std::mutex mu_;
  std::vector<Kept> frames_;
  std::atomic<bool> closed_{false};
};

// A connection this side opened is served like an accepted one (an agent taking up a running job
// reads the others' frames on its own connections): frames reach the handler as the rank the
// connection authenticated, one claiming another rank disconnects it, and Stop closes it.
TEST_P(TransportConformance, AConnectionThisSideOpenedIsServedLikeAnAcceptedOne) {
  auto echo = StartEchoServer();  // answers as rank 0
  auto own_listener = ctx_->Listen(GetParam().listen_address);
  ASSERT_TRUE(own_listener.ok()) << own_listener.status();
  auto keeping = std::make_shared<KeepingHandler>();
  auto own = std::make_shared<FrameServer>(*own_listener, std::make_shared<SecretStore>(), keeping);
  own->Start();
  auto as_rank_2 = [](FrameHeader h) {
    h.sender_rank = 2;
    return h;
  };
  auto conn = ConnectAuthenticated(*ctx_, echo->Address(), 1, 2, RankKey("right", 1, 2),
                                   absl::Seconds(10));
  ASSERT_TRUE(conn.ok()) << conn.status();
  own->Serve(*conn, PeerIdentity{1, 0});
  auto p = Pattern(3000, 4);
  ASSERT_TRUE(SyncSend(**conn, as_rank_2(DataHeader(4, p.size())), {p}).ok());
  ASSERT_TRUE(Eventually([&] { return keeping->frames().size() == 1; }));
  EXPECT_EQ(keeping->frames()[0].rank, 0u);
  EXPECT_EQ(keeping->frames()[0].key, 4u);
  EXPECT_EQ(keeping->frames()[0].payload, p);
  EXPECT_EQ(own->Stats().active, 1u);
  EXPECT_TRUE(own->HasPeer(1, 0));
  own->Stop();
  EXPECT_TRUE(Eventually([&] { return keeping->closed(); })) << "Stop closes it";
  EXPECT_FALSE(SyncSend(**conn, as_rank_2(DataHeader(5, p.size())), {p}).ok());

  // The peer at the other end is who the handshake proved: an answer as another rank is refused.
  auto listener2 = ctx_->Listen(GetParam().listen_address);
  ASSERT_TRUE(listener2.ok()) << listener2.status();
  auto own2 = std::make_shared<FrameServer>(*listener2, std::make_shared<SecretStore>(), keeping);
  auto conn2 = ConnectAuthenticated(*ctx_, echo->Address(), 1, 2, RankKey("right", 1, 2),
                                    absl::Seconds(10));
  ASSERT_TRUE(conn2.ok()) << conn2.status();
  own2->Serve(*conn2, PeerIdentity{1, 3});  // the echo answers as rank 0
  ASSERT_TRUE(SyncSend(**conn2, as_rank_2(DataHeader(6, p.size())), {p}).ok());
  EXPECT_TRUE(Eventually([&] { return own2->Stats().protocol_errors == 1; }));
  EXPECT_EQ(keeping->frames().size(), 1u);
  own2->Stop();
  echo->Stop();
}

TEST_P(TransportConformance, SilentClientIsDroppedAfterTheHandshakeTimeout) {
  auto secrets = std::make_shared<SecretStore>();
  secrets->Set(1, "right");
  FrameServerOptions options;
  options.handshake_timeout = absl::Milliseconds(200);
  auto server =
      std::make_shared<FrameServer>(listener_, secrets, std::make_shared<EchoHandler>(), options);
  server->Start();
  auto conn = ctx_->Connect(server->Address(), absl::Seconds(10));
  ASSERT_TRUE(conn.ok());
  // Say nothing: the server must hang up (a read on our side ends in an error, not a hang).
  auto h = SyncReadHeader(**conn, absl::Seconds(30));
  EXPECT_FALSE(h.ok());
  EXPECT_NE(h.status().code(), absl::StatusCode::kDeadlineExceeded) << h.status();
  server->Stop();
}

TEST_P(TransportConformance, IdleUnauthenticatedConnectionsCannotLockPeersOut) {
  // Handshake slots are separate from authenticated ones and fewer: idle connections that never
  // authenticate fill them and are refused beyond, while authenticated peers are served on and
  // a slot frees when its silent holder times out.
  FrameServerOptions options;
  options.handshake_timeout = absl::Seconds(2);
  options.max_handshakes = 3;
  options.max_connections = 8;
  auto server = StartEchoServer(options);
  auto member = ConnectAuthenticated(*ctx_, server->Address(), 1, 0, RankKey("right", 1, 0), absl::Seconds(10));
  ASSERT_TRUE(member.ok()) << member.status();
  // Its handshake slot frees once the server checked its final proof, which may be just after
  // our side returned (a loaded machine): until then a third silent one would be the fourth.
  ASSERT_TRUE(Eventually([&] { return server->Stats().handshaking == 0; }));
  auto silent = OpenSilent(*server, 3);
  ASSERT_EQ(silent.size(), 3u);
  // A fourth is refused and told why (an error frame naming the limit; the handshake timeout
  // would only close the connection).
  auto fourth = ctx_->Connect(server->Address(), absl::Seconds(10));
  ASSERT_TRUE(fourth.ok()) << fourth.status();
  auto refusal = SyncReadFrame(**fourth, absl::Seconds(30));
  ASSERT_TRUE(refusal.ok()) << refusal.status();
  EXPECT_EQ(refusal->header.type, FrameType::kError);
  const std::string why = ErrorText(*refusal);
  EXPECT_NE(why.find("connections in their handshake"), std::string::npos) << why;
  EXPECT_GE(server->Stats().refused, 1u);

  // The authenticated member is served all along.
  auto p = Pattern(100, 3);
  ASSERT_TRUE(SyncSend(**member, DataHeader(1, p.size()), {p}).ok());
  auto echoed = SyncReadFrame(**member, absl::Seconds(10));
  ASSERT_TRUE(echoed.ok()) << echoed.status();
  EXPECT_EQ(echoed->payload, p);

  // The silent ones time out (2 s); then a new peer authenticates.
  for (auto& c : silent) EXPECT_FALSE(SyncReadHeader(*c, absl::Seconds(30)).ok());
  auto later = ConnectAuthenticated(*ctx_, server->Address(), 1, 1, RankKey("right", 1, 1), absl::Seconds(10));
  EXPECT_TRUE(later.ok()) << later.status();
  // The server counts the last handshake done once it checked the peer's final proof, which may
  // be just after the peer's side returned (a loaded machine, TLS).
  EXPECT_TRUE(Eventually([&] { return server->Stats().handshaking == 0; }));
  server->Stop();
}

TEST_P(TransportConformance, OneAddressCannotTakeEveryHandshakeSlot) {
  if (GetParam().name == "inproc") GTEST_SKIP() << "in-process peers have no shared address";
  FrameServerOptions options;
  options.max_handshakes_per_address = 2;
  auto server = StartEchoServer(options);
  auto silent = OpenSilent(*server, 2);
  ASSERT_EQ(silent.size(), 2u);
  auto third = ctx_->Connect(server->Address(), absl::Seconds(10));
  ASSERT_TRUE(third.ok()) << third.status();
  auto refusal = SyncReadFrame(**third, absl::Seconds(30));
  ASSERT_TRUE(refusal.ok()) << refusal.status();
  const std::string why = ErrorText(*refusal);
  EXPECT_NE(why.find("connections from 127.0.0.1 in their handshake"), std::string::npos) << why;
  silent.clear();  // their holders leave: the address may handshake again
  EXPECT_TRUE(Eventually([&] { return server->Stats().handshaking == 0; }));
  EXPECT_TRUE(
      ConnectAuthenticated(*ctx_, server->Address(), 1, 0, RankKey("right", 1, 0), absl::Seconds(10)).ok());
  server->Stop();
}

// ---- the factory daemons take --transport from ----

TEST(MakeContext, NamesEachBackendAndRefusesAnUnknownKind) {
  for (const char* kind : {"tcp", "inproc"}) {
    auto ctx = MakeContext(kind, ContextOptions{});
    ASSERT_TRUE(ctx.ok()) << kind << ": " << ctx.status();
    EXPECT_EQ((*ctx)->Name(), kind);
    (*ctx)->Close();
  }
  auto bogus = MakeContext("carrier-pigeon", ContextOptions{});
  EXPECT_EQ(bogus.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bogus.status().message().find("carrier-pigeon"), std::string::npos);
  // auto always yields a working context: RDMA where a device is usable, TCP otherwise.
  auto any = MakeContext("auto", ContextOptions{});
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_TRUE((*any)->IsViable());
  EXPECT_TRUE((*any)->Name() == "rdma" || (*any)->Name() == "tcp") << (*any)->Name();
  (*any)->Close();
}

INSTANTIATE_TEST_SUITE_P(AllBackends, TransportConformance, ::testing::ValuesIn(Backends()),
                         [](const auto& test_info) { return test_info.param.name; });

}  // namespace
}  // namespace poseidon::transport
