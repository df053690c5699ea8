// Bad input against a live TCP listener (issue: "Bad input"). Attackers on raw sockets send
// 10,000 random and mutated frames, truncated streams, oversized declared lengths and
// slow-loris partial headers, while a well-behaved client on the same listener keeps doing
// request/response. Asserted: every bad connection is closed by the server with a logged
// reason, no payload buffer is ever asked for beyond the limit, the good client never fails,
// and the heap does not grow.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "common/log.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "transport/checksum.h"
#include "transport/error_frame.h"
#include "transport/frame_server.h"
#include "transport/credentials.h"
#include "transport/handshake.h"
#include "transport/tcp/tcp_context.h"
#include "transport/transport_test_util.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define POSEIDON_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define POSEIDON_ASAN 1
#endif
#ifdef POSEIDON_ASAN
#include <sanitizer/allocator_interface.h>
#endif

namespace poseidon::transport {
namespace {

constexpr uint64_t kJob = 42;
constexpr char kSecret[] = "bad-input-test-secret";
constexpr uint64_t kMaxPayload = 1 << 20;

// Live heap bytes (not counting ASan's quarantine of freed blocks).
size_t LiveHeapBytes() {
#ifdef POSEIDON_ASAN
  return __sanitizer_get_current_allocated_bytes();
#else
  return mallinfo2().uordblks;
#endif
}

// Acknowledges every data frame with the CRC of its payload in `key`.
class CheckingHandler : public FrameHandler {
 public:
  absl::StatusOr<PayloadTarget> OnHeader(const std::shared_ptr<PeerSession>& peer,
                                         const FrameHeader& header) override {
    largest_request_ = std::max<uint64_t>(largest_request_, header.payload_length);
    if (header.type != FrameType::kData) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected ", FrameTypeName(header.type), " frame"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto& buffer = buffers_[peer.get()];
    buffer.resize(header.payload_length);
    return PayloadTarget::Into(buffer);
  }
  void OnFrame(const std::shared_ptr<PeerSession>& peer, const FrameHeader& header,
               MutableBuffer payload) override {
    FrameHeader ack;
    ack.type = FrameType::kData;
    ack.job_id = header.job_id;
    ack.sequence = header.sequence;
    ack.key = Crc32c(0, payload);
    peer->connection().Send(ack, {}, [](absl::Status) {});
  }
  void OnClose(const std::shared_ptr<PeerSession>& peer, const absl::Status&) override {
    std::lock_guard<std::mutex> lock(mu_);
    buffers_.erase(peer.get());
  }
  uint64_t largest_request() const { return largest_request_.load(); }

 private:
  std::atomic<uint64_t> largest_request_{0};
  std::mutex mu_;
  std::map<const PeerSession*, std::vector<std::byte>> buffers_;
};

// A blocking raw-socket peer that can speak the protocol or break it at will.
class RawPeer {
 public:
  explicit RawPeer(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval tv{10, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawPeer() {
    if (fd_ >= 0) close(fd_);
  }
  bool connected() const { return connected_; }

  bool Write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = send(fd_, p, n, MSG_NOSIGNAL);
      if (w <= 0) return false;
      p += w;
      n -= static_cast<size_t>(w);
    }
    return true;
  }
  bool WriteFrame(const FrameHeader& h, std::span<const std::byte> payload) {
    const EncodedHeader bytes = EncodeHeader(h);
    return Write(bytes.data(), bytes.size()) && Write(payload.data(), payload.size());
  }
  bool ReadExact(void* data, size_t n) {
    char* p = static_cast<char*>(data);
    while (n > 0) {
      ssize_t r = recv(fd_, p, n, 0);
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }
  // Reads one frame; payloads over 64 KiB are refused (we only expect small answers).
  std::optional<std::pair<FrameHeader, std::vector<std::byte>>> ReadFrame() {
    EncodedHeader bytes;
    if (!ReadExact(bytes.data(), bytes.size())) return std::nullopt;
    auto h = DecodeHeader(bytes, FrameLimits{.max_payload_bytes = 64 << 10});
    if (!h.ok()) return std::nullopt;
    std::vector<std::byte> payload(h->payload_length);
    if (!ReadExact(payload.data(), payload.size())) return std::nullopt;
    return std::make_pair(*h, std::move(payload));
  }
  bool Authenticate(uint32_t rank) {
    ClientHandshake machine(kJob, rank, RankKey(kSecret, kJob, rank));
    OutFrame out = machine.Start();
    while (true) {
      if (!WriteFrame(out.header, out.payload)) return false;
      auto in = ReadFrame();
      if (!in) return false;
      auto next = machine.OnFrame(in->first, in->second);
      if (!next.ok()) return false;
      if (!next->has_value()) return true;
      out = std::move(**next);
    }
  }
  // Waits until the server closes the connection, skipping whatever it sends first (an ERROR
  // frame, a handshake answer). Returns the error frame's message if there was one.
  bool WaitForServerClose(std::string* error_message = nullptr) {
    char buf[4096];
    std::string received;
    while (true) {
      ssize_t r = recv(fd_, buf, sizeof(buf), 0);
      if (r == 0) break;
      if (r < 0) {
        if (errno == ECONNRESET) break;
        return false;  // timed out: the server kept the connection open
      }
      received.append(buf, static_cast<size_t>(r));
    }
    if (error_message && received.size() >= kFrameHeaderSize) {
      // Find an ERROR frame among what arrived.
      size_t off = 0;
      while (off + kFrameHeaderSize <= received.size()) {
        EncodedHeader bytes;
        std::memcpy(bytes.data(), received.data() + off, kFrameHeaderSize);
        auto h = DecodeHeader(bytes, FrameLimits{.max_payload_bytes = 64 << 10});
        if (!h.ok()) break;
        const size_t len = h->payload_length;
        if (h->type == FrameType::kError && off + kFrameHeaderSize + len <= received.size()) {
          *error_message = received.substr(off + kFrameHeaderSize, len);
        }
        off += kFrameHeaderSize + len;
      }
    }
    return true;
  }
  void CloseNow() {
    close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

FrameHeader DataHeader(uint64_t length) {
  FrameHeader h;
  h.type = FrameType::kData;
  h.job_id = kJob;
  h.payload_length = length;
  return h;
}

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    log_sink_ = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(40000);
    saved_level_ = Logger().sinks().front()->level();
    Logger().sinks().front()->set_level(spdlog::level::err);  // keep the test output readable
    Logger().sinks().push_back(log_sink_);

    TcpOptions options;
    options.limits.max_payload_bytes = kMaxPayload;
    options.header_timeout = absl::Milliseconds(300);
    options.payload_idle_timeout = absl::Seconds(1);
    auto ctx = CreateTcpContext(options);
    ASSERT_TRUE(ctx.ok());
    ctx_ = *ctx;
    auto listener = ctx_->Listen("127.0.0.1:0");
    ASSERT_TRUE(listener.ok());
    auto secrets = std::make_shared<SecretStore>();
    secrets->Set(kJob, kSecret);
    handler_ = std::make_shared<CheckingHandler>();
    FrameServerOptions server_options;
    server_options.handshake_timeout = absl::Seconds(2);
    server_ = std::make_shared<FrameServer>(*listener, secrets, handler_, server_options);
    server_->Start();
    port_ = static_cast<uint16_t>(
        std::stoi(server_->Address().substr(server_->Address().rfind(':') + 1)));
  }

  void TearDown() override {
    server_->Stop();
    ctx_->Close();
    Logger().sinks().pop_back();
    Logger().sinks().front()->set_level(saved_level_);
  }

  size_t CountLogLines(absl::string_view needle) {
    size_t n = 0;
    for (const auto& line : log_sink_->last_formatted()) {
      if (absl::string_view(line).find(needle) != absl::string_view::npos) ++n;
    }
    return n;
  }

  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> log_sink_;
  spdlog::level::level_enum saved_level_ = spdlog::level::info;
  std::shared_ptr<Context> ctx_;
  std::shared_ptr<CheckingHandler> handler_;
  std::shared_ptr<FrameServer> server_;
  uint16_t port_ = 0;
};

// A client that does authenticated request/response until told to stop.
struct GoodClient {
  std::atomic<bool> stop{false};
  std::atomic<int> completed{0};
  std::atomic<int> failures{0};
  std::string first_failure;
  std::thread thread;

  void Start(Context& ctx, const std::string& address) {
    thread = std::thread([this, &ctx, address] {
      auto conn = ConnectAuthenticated(ctx, address, kJob, 0, RankKey(kSecret, kJob, 0),
                                       absl::Seconds(10));
      if (!conn.ok()) {
        first_failure = conn.status().ToString();
        ++failures;
        return;
      }
      std::mt19937_64 rng(1);
      while (!stop.load()) {
        auto payload = testing::Pattern(1 + rng() % (64 << 10), rng());
        FrameHeader h = DataHeader(payload.size());
        h.sequence = static_cast<uint64_t>(completed.load());
        auto sent = testing::SyncSend(**conn, h, {payload});
        auto ack = testing::SyncReadFrame(**conn, absl::Seconds(30));
        if (!sent.ok() || !ack.ok() || ack->header.key != Crc32c(0, payload) ||
            ack->header.sequence != h.sequence) {
          if (failures++ == 0) {
            first_failure = !sent.ok() ? sent.ToString() : ack.status().ToString();
          }
          return;
        }
        ++completed;
      }
    });
  }
  void Stop() {
    stop = true;
    thread.join();
  }
};

TEST_F(BadInputTest, ListenerSurvivesGarbageAndKeepsServingTheGoodClient) {
  GoodClient good;
  good.Start(*ctx_, server_->Address());
  const size_t heap_before = LiveHeapBytes();

  // --- 10,000 random and mutated frames, before and after authentication ---
  constexpr int kFrames = 10000;
  constexpr int kThreads = 4;
  std::atomic<int> not_closed{0}, connect_failures{0}, bad_connections{0};
  std::vector<std::thread> attackers;
  for (int t = 0; t < kThreads; ++t) {
    attackers.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      for (int i = t; i < kFrames; i += kThreads) {
        RawPeer peer(port_);
        if (!peer.connected()) {
          ++connect_failures;
          continue;
        }
        const int variant = i % 5;
        if (variant >= 2 && !peer.Authenticate(static_cast<uint32_t>(i))) {
          ++connect_failures;
          continue;
        }
        std::vector<std::byte> bytes;
        if (variant == 0 || variant == 2) {
          // Random bytes.
          bytes.resize(kFrameHeaderSize + rng() % 200);
          for (auto& b : bytes) b = std::byte{static_cast<unsigned char>(rng())};
        } else {
          // A valid frame with 1 to 3 header bytes changed.
          FrameHeader h = variant == 1 ? FrameHeader{.type = FrameType::kHello,
                                                     .job_id = kJob,
                                                     .payload_length = kNonceBytes}
                                       : DataHeader(64);
          // As the rank it authenticated as: a frame claiming another is dropped at its header.
          if (variant >= 2) h.sender_rank = static_cast<uint32_t>(i);
          const EncodedHeader e = EncodeHeader(h);
          bytes.assign(e.begin(), e.end());
          const int flips = 1 + static_cast<int>(rng() % 3);
          for (int f = 0; f < flips; ++f) {
            bytes[rng() % kFrameHeaderSize] ^=
                std::byte{static_cast<unsigned char>(1 + rng() % 255)};
          }
          bytes.resize(bytes.size() + h.payload_length);
        }
        if (variant == 4) {
          // Truncated stream: a valid header, half of its payload, then hang up.
          FrameHeader truncated = DataHeader(1000);
          truncated.sender_rank = static_cast<uint32_t>(i);  // the rank it authenticated as
          const EncodedHeader e = EncodeHeader(truncated);
          bytes.assign(e.begin(), e.end());
          bytes.resize(kFrameHeaderSize + 500);
          peer.Write(bytes.data(), bytes.size());
          peer.CloseNow();
          ++bad_connections;
          continue;
        }
        peer.Write(bytes.data(), bytes.size());
        ++bad_connections;
        if (!peer.WaitForServerClose()) ++not_closed;
      }
    });
  }
  for (auto& a : attackers) a.join();
  EXPECT_EQ(connect_failures.load(), 0);
  EXPECT_EQ(not_closed.load(), 0) << "the server left connections with bad frames open";

  // --- oversized declared lengths, after and before authentication ---
  for (uint64_t length : {uint64_t{1} << 31, uint64_t{1} << 63, kMaxPayload + 1}) {
    RawPeer peer(port_);
    ASSERT_TRUE(peer.Authenticate(1));
    ASSERT_TRUE(peer.WriteFrame(DataHeader(length), {}));
    std::string why;
    ASSERT_TRUE(peer.WaitForServerClose(&why));
    EXPECT_NE(why.find("exceeds the maximum"), std::string::npos) << why;
  }
  // Before authentication: the transport limit, then the handshake's own 64-byte limit.
  for (uint64_t length : {uint64_t{1} << 31, uint64_t{1000}}) {
    RawPeer peer(port_);
    FrameHeader hello{.type = FrameType::kHello, .job_id = kJob, .payload_length = length};
    ASSERT_TRUE(peer.WriteFrame(hello, {}));
    std::string why;
    ASSERT_TRUE(peer.WaitForServerClose(&why));
    EXPECT_NE(why.find(length > kMaxPayload ? "exceeds the maximum" : "payload bytes (max 64)"),
              std::string::npos)
        << why;
  }

  // --- slow loris: partial headers that never complete ---
  {
    std::vector<std::unique_ptr<RawPeer>> lorises;
    for (int i = 0; i < 50; ++i) {
      lorises.push_back(std::make_unique<RawPeer>(port_));
      ASSERT_TRUE(lorises.back()->connected());
      const EncodedHeader e = EncodeHeader(DataHeader(10));
      lorises.back()->Write(e.data(), 1 + i % 60);
    }
    for (auto& l : lorises) EXPECT_TRUE(l->WaitForServerClose()) << "slow-loris peer kept open";
  }

  // The good client worked throughout.
  const int before_stop = good.completed.load();
  good.Stop();
  EXPECT_EQ(good.failures.load(), 0) << good.first_failure;
  EXPECT_GT(before_stop, 0);

  // No payload buffer beyond the limit was ever requested from the handler.
  EXPECT_LE(handler_->largest_request(), kMaxPayload);

  // Memory stays bounded: once the attackers are gone, the live heap is back where it was
  // (within the good client's buffers and the transport's small per-connection state).
  absl::SleepFor(absl::Milliseconds(500));
  const size_t heap_after = LiveHeapBytes();
  EXPECT_LT(heap_after, heap_before + (8u << 20))
      << "live heap grew from " << heap_before << " to " << heap_after << " bytes";

  // Every bad connection was closed with a logged reason.
  const size_t logged =
      CountLogLines("closing connection from") + CountLogLines("rejected connection from");
  EXPECT_GE(logged, static_cast<size_t>(bad_connections.load()));
  EXPECT_GT(CountLogLines("stalled"), 0u);
  EXPECT_GT(CountLogLines("exceeds the maximum"), 0u);
  EXPECT_GT(CountLogLines("bad frame magic"), 0u);
  EXPECT_GT(CountLogLines("in the middle of a frame payload"), 0u);
  const auto stats = server_->Stats();
  EXPECT_EQ(stats.active, 0u);
  std::printf(
      "bad connections: %d, log lines: %zu, good requests: %d, "
      "handshake failures: %llu, protocol errors: %llu\n",
      bad_connections.load(), logged, before_stop,
      static_cast<unsigned long long>(stats.handshake_failures),
      static_cast<unsigned long long>(stats.protocol_errors));
}

}  // namespace
}  // namespace poseidon::transport
