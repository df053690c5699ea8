// poseidon-bench-transport: one-way throughput and request/response latency of a Poseidon
// transport (--transport=tcp, the default, on loopback; or --transport=rdma) for message sizes
// 4 KiB ... 64 MiB, side by side in the same run with a raw-socket reference (plain blocking TCP
// moving the same bytes: a 64-byte header, then the payload), printed as a table with the ratio.
// On RDMA hardware compare with perftest's ib_write_bw / ib_read_bw between the same machines.
// poseidon-bench-transport-fake is this program linked with the test verbs provider: it proves
// the RDMA path runs end to end and measures nothing. See docs/benchmarks.md, docs/wire.md.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/opensslv.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/testing/pki.h"
#include "transport/credentials.h"
#include "transport/handshake.h"
#include "transport/rdma/rdma_context.h"
#include "transport/tcp/tcp_context.h"
#include "transport/transport_test_util.h"

ABSL_FLAG(std::string, sizes, "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB",
          "comma-separated message sizes");
ABSL_FLAG(double, seconds, 0.4, "minimum measuring time per cell");
ABSL_FLAG(int, repeats, 3, "repetitions per cell; the median is reported");
ABSL_FLAG(int, socket_buffer, 0, "SO_SNDBUF/SO_RCVBUF bytes for both sides (0: kernel autotuning)");
ABSL_FLAG(std::string, json, "", "also write the results as JSON to this file");
ABSL_FLAG(bool, quick, false, "fewer sizes and repeats (smoke test)");
ABSL_FLAG(std::string, only, "", "run only 'poseidon' or 'raw' (for profiling); ratios print as 0");
ABSL_FLAG(std::string, transport, "tcp", "the Poseidon transport measured: tcp or rdma");
ABSL_FLAG(bool, register_memory, true,
          "register the send and receive buffers with the transport (RDMA: zero-copy READs)");
ABSL_FLAG(std::string, rdma_device, "", "RDMA device (empty: the first with an active port)");
ABSL_FLAG(bool, tls, false,
          "also measure the TCP transport with TLS (data_tls) in the same run: columns 'tls' "
          "and tls/psd (the cost of encryption)");
ABSL_FLAG(std::string, tls_dir, "",
          "with --tls: a directory holding ca.pem, server.pem and server.key (empty: a throwaway "
          "CA made with openssl in a temporary directory)");

namespace poseidon::bench {
namespace {

using namespace poseidon::transport;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kJob = 1;
constexpr char kSecret[] = "bench";

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

std::string HumanSize(size_t n) {
  if (n >= (1u << 20)) return absl::StrCat(n >> 20, " MiB");
  return absl::StrCat(n >> 10, " KiB");
}

size_t ParseSize(absl::string_view s) {
  uint64_t v = 0;
  if (absl::EndsWith(s, "MiB") && absl::SimpleAtoi(s.substr(0, s.size() - 3), &v)) return v << 20;
  if (absl::EndsWith(s, "KiB") && absl::SimpleAtoi(s.substr(0, s.size() - 3), &v)) return v << 10;
  if (absl::SimpleAtoi(s, &v)) return v;
  std::fprintf(stderr, "bad size '%s'\n", std::string(s).c_str());
  std::exit(2);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// How many messages of `size` to move so a cell takes about `seconds` at ~2 GB/s, at least 8.
int MessagesFor(size_t size, double seconds) {
  const double bytes = seconds * 2e9;
  return std::max(8, static_cast<int>(bytes / static_cast<double>(size + 64)));
}

// ------------------------------ raw blocking TCP reference ------------------------------

int RawListen(uint16_t* port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 4) != 0) {
    std::perror("raw listen");
    std::exit(1);
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

void RawTune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  const int buf = absl::GetFlag(FLAGS_socket_buffer);
  if (buf > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  }
}

int RawConnect(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  RawTune(fd);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    std::perror("raw connect");
    std::exit(1);
  }
  return fd;
}

void ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = recv(fd, c, n, 0);
    if (r <= 0) {
      std::perror("raw recv");
      std::exit(1);
    }
    c += r;
    n -= static_cast<size_t>(r);
  }
}

void WriteFrame(int fd, const void* header, const void* payload, size_t size) {
  iovec iov[2] = {{const_cast<void*>(header), 64}, {const_cast<void*>(payload), size}};
  int iovcnt = size > 0 ? 2 : 1;
  iovec* v = iov;
  while (iovcnt > 0) {
    ssize_t w = writev(fd, v, iovcnt);
    if (w < 0) {
      std::perror("raw writev");
      std::exit(1);
    }
    size_t done = static_cast<size_t>(w);
    while (iovcnt > 0 && done >= v->iov_len) {
      done -= v->iov_len;
      ++v;
      --iovcnt;
    }
    if (iovcnt > 0) {
      v->iov_base = static_cast<char*>(v->iov_base) + done;
      v->iov_len -= done;
    }
  }
}

struct RawPair {
  int client = -1;
  int server = -1;
  RawPair() {
    uint16_t port = 0;
    int lfd = RawListen(&port);
    client = RawConnect(port);
    server = accept(lfd, nullptr, nullptr);
    RawTune(server);
    close(lfd);
  }
  ~RawPair() {
    close(client);
    close(server);
  }
};

double RawThroughput(size_t size, int messages) {
  RawPair pair;
  std::vector<char> src(size, 'x'), dst(size);
  char header[64] = {};
  std::memcpy(header + 48, &size, 8);
  std::thread server([&] {
    char h[64];
    for (int i = 0; i < messages; ++i) {
      ReadAll(pair.server, h, 64);
      uint64_t len;
      std::memcpy(&len, h + 48, 8);
      ReadAll(pair.server, dst.data(), len);
    }
    char ack = 1;
    WriteFrame(pair.server, header, &ack, 0);
  });
  const auto start = Clock::now();
  for (int i = 0; i < messages; ++i) WriteFrame(pair.client, header, src.data(), size);
  char ack[64];
  ReadAll(pair.client, ack, 64);
  const double secs = Seconds(Clock::now() - start);
  server.join();
  return static_cast<double>(size) * messages / secs;
}

double RawRoundTrip(size_t size, int round_trips) {
  RawPair pair;
  std::vector<char> src(size, 'x'), dst(size), echo(size);
  char header[64] = {};
  std::memcpy(header + 48, &size, 8);
  std::thread server([&] {
    char h[64];
    for (int i = 0; i < round_trips; ++i) {
      ReadAll(pair.server, h, 64);
      ReadAll(pair.server, echo.data(), size);
      WriteFrame(pair.server, h, echo.data(), size);
    }
  });
  const auto start = Clock::now();
  char h[64];
  for (int i = 0; i < round_trips; ++i) {
    WriteFrame(pair.client, header, src.data(), size);
    ReadAll(pair.client, h, 64);
    ReadAll(pair.client, dst.data(), size);
  }
  const double secs = Seconds(Clock::now() - start);
  server.join();
  return secs / round_trips;
}

// ------------------------------ Poseidon transport ------------------------------

struct PoseidonPair {
  std::shared_ptr<Context> server_ctx, client_ctx;
  std::shared_ptr<Connection> client, server;

  std::vector<std::unique_ptr<MemoryRegion>> regions;

  // The certificates of --tls (made once).
  static const std::string& TlsDir() {
    static const std::string dir = [] {
      std::string d = absl::GetFlag(FLAGS_tls_dir);
      if (!d.empty()) return d;
      d = poseidon::testing::MakeTestPkiDir("poseidon-bench-tls");
      if (d.empty()) {
        std::fprintf(stderr, "--tls: could not make a throwaway CA with openssl\n");
        std::exit(1);
      }
      static const std::string* const made = new std::string(d);  // never destroyed
      std::atexit([] { poseidon::testing::RemoveTestPkiDir(*made); });
      return d;
    }();
    return dir;
  }

  static std::shared_ptr<Context> MakeOne(bool tls) {
    TcpOptions options;
    if (tls) {
      options.tls.enabled = true;
      options.tls.cert_file = TlsDir() + "/server.pem";
      options.tls.key_file = TlsDir() + "/server.key";
      options.tls.ca_file = TlsDir() + "/ca.pem";
    }
    options.socket_buffer_bytes = absl::GetFlag(FLAGS_socket_buffer);
    options.limits.max_payload_bytes = uint64_t{1} << 30;
    RdmaOptions rdma;
    static_cast<ContextOptions&>(rdma) = options;
    rdma.device = absl::GetFlag(FLAGS_rdma_device);
    auto ctx = MakeContext(absl::GetFlag(FLAGS_transport), options, rdma);
    if (!ctx.ok()) {
      std::fprintf(stderr, "transport: %s\n", ctx.status().ToString().c_str());
      std::exit(1);
    }
    return *ctx;
  }

  // Registers `buffer` with the context of one side (a no-op view for TCP), for the pair's life.
  void Register(Context& ctx, std::span<std::byte> buffer) {
    if (!absl::GetFlag(FLAGS_register_memory) || buffer.empty()) return;
    auto region = ctx.RegisterMemory(buffer);
    if (!region.ok()) {
      std::fprintf(stderr, "register memory: %s\n", region.status().ToString().c_str());
      std::exit(1);
    }
    regions.push_back(std::move(*region));
  }

  explicit PoseidonPair(bool tls = false) {
    server_ctx = MakeOne(tls);
    client_ctx = MakeOne(tls);
    auto listener = *server_ctx->Listen("127.0.0.1:0");
    auto secrets = std::make_shared<SecretStore>();
    secrets->Set(kJob, kSecret);
    std::promise<std::shared_ptr<Connection>> accepted;
    listener->Accept([&](absl::StatusOr<std::shared_ptr<Connection>> c) {
      auto conn = *c;
      AcceptHandshake(conn, secrets, absl::Seconds(10),
                      [&accepted, conn](absl::StatusOr<PeerIdentity> id) {
                        if (!id.ok()) {
                          std::fprintf(stderr, "handshake: %s\n", id.status().ToString().c_str());
                          std::exit(1);
                        }
                        accepted.set_value(conn);
                      });
    });
    auto c =
        ConnectAuthenticated(*client_ctx, listener->Address(), kJob, 1, RankKey(kSecret, kJob, 1),
                             absl::Seconds(10));
    if (!c.ok()) {
      std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
      std::exit(1);
    }
    client = *c;
    server = accepted.get_future().get();
    listener->Close();
  }
  ~PoseidonPair() {
    regions.clear();
    client_ctx->Close();
    server_ctx->Close();
  }
};

FrameHeader DataHeader(size_t size, uint64_t seq) {
  FrameHeader h;
  h.type = FrameType::kData;
  h.job_id = kJob;
  h.sequence = seq;
  h.payload_length = size;
  return h;
}

// The server side runs entirely in I/O callbacks: read header, payload into a fixed buffer,
// repeat; after `messages` frames, acknowledge.
struct SinkServer : std::enable_shared_from_this<SinkServer> {
  std::shared_ptr<Connection> conn;
  std::vector<std::byte> buffer;
  int remaining = 0;
  bool echo = false;

  void Next() {
    conn->ReadHeader([self = shared_from_this()](absl::StatusOr<FrameHeader> h) {
      if (!h.ok()) return;
      self->conn->ReadPayload(
          std::span(self->buffer).first(h->payload_length), [self, h = *h](absl::Status s) {
            if (!s.ok()) return;
            if (self->echo) {
              self->conn->Send(h, {std::span(self->buffer).first(h.payload_length)},
                               [](absl::Status) {});
            } else if (--self->remaining == 0) {
              self->conn->Send(DataHeader(0, 0), {}, [](absl::Status) {});
            }
            if (self->echo || self->remaining > 0) self->Next();
          });
    });
  }
};

constexpr int kWindow = 4;  // frames queued ahead of the socket

double PoseidonThroughput(size_t size, int messages, bool tls = false) {
  PoseidonPair pair(tls);
  auto sink = std::make_shared<SinkServer>();
  sink->conn = pair.server;
  sink->buffer.resize(size);
  sink->remaining = messages;
  pair.Register(*pair.server_ctx, sink->buffer);
  sink->Next();
  std::vector<std::byte> src(size, std::byte{'x'});
  pair.Register(*pair.client_ctx, src);
  // Keep a bounded window of frames queued, refilled from the send callbacks. A callback may
  // run inside Send, on this thread (a small frame written at once): the refill is then queued
  // for the Send below it on the stack rather than recursing (one frame deeper per message).
  struct Sender {
    Connection* conn;
    std::span<const std::byte> src;
    int to_send;
    std::atomic<int> sent{0};
    void Send(uint64_t seq) {
      thread_local std::deque<uint64_t>* refills = nullptr;
      if (refills != nullptr) {
        refills->push_back(seq);
        return;
      }
      std::deque<uint64_t> mine{seq};
      refills = &mine;
      while (!mine.empty()) {
        const uint64_t next_seq = mine.front();
        mine.pop_front();
        conn->Send(DataHeader(src.size(), next_seq), {src}, [this, next_seq](absl::Status s) {
          if (!s.ok()) return;
          const int next = sent.fetch_add(1) + kWindow;
          if (next < to_send) Send(next_seq + kWindow);
        });
      }
      refills = nullptr;
    }
  } sender{pair.client.get(), src, messages};
  const auto start = Clock::now();
  for (int i = 0; i < std::min(messages, kWindow); ++i) sender.Send(i);
  auto ack = poseidon::transport::testing::SyncReadHeader(*pair.client, absl::Seconds(120));
  const double secs = Seconds(Clock::now() - start);
  while (sender.sent.load() < messages && ack.ok()) std::this_thread::yield();
  if (!ack.ok()) {
    std::fprintf(stderr, "throughput run failed: %s\n", ack.status().ToString().c_str());
    std::exit(1);
  }
  return static_cast<double>(size) * messages / secs;
}

// The client also runs in callbacks: on each echo, send the next request.
double PoseidonRoundTrip(size_t size, int round_trips, bool tls = false) {
  PoseidonPair pair(tls);
  auto echo = std::make_shared<SinkServer>();
  echo->conn = pair.server;
  echo->buffer.resize(size);
  echo->echo = true;
  pair.Register(*pair.server_ctx, echo->buffer);
  echo->Next();
  struct Client : std::enable_shared_from_this<Client> {
    std::shared_ptr<Connection> conn;
    std::vector<std::byte> src, dst;
    int remaining;
    std::promise<void> finished;
    void Round() {
      conn->Send(DataHeader(src.size(), remaining), {src}, [](absl::Status) {});
      conn->ReadHeader([self = shared_from_this()](absl::StatusOr<FrameHeader> h) {
        if (!h.ok()) return;
        self->conn->ReadPayload(self->dst, [self](absl::Status s) {
          if (!s.ok()) return;
          if (--self->remaining == 0) {
            self->finished.set_value();
          } else {
            self->Round();
          }
        });
      });
    }
  };
  auto client = std::make_shared<Client>();
  client->conn = pair.client;
  client->src.assign(size, std::byte{'y'});
  client->dst.resize(size);
  client->remaining = round_trips;
  pair.Register(*pair.client_ctx, client->src);
  pair.Register(*pair.client_ctx, client->dst);
  auto done = client->finished.get_future();
  const auto start = Clock::now();
  client->Round();
  if (done.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
    std::fprintf(stderr, "round-trip run did not finish\n");
    std::exit(1);
  }
  const double secs = Seconds(Clock::now() - start);
  pair.client->Close();
  return secs / round_trips;
}

struct Row {
  size_t size;
  double psd_bps, raw_bps, psd_rtt, raw_rtt;
  double tls_bps = 0, tls_rtt = 0;  // with --tls
};

int Run() {
  std::vector<size_t> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',')) {
    sizes.push_back(ParseSize(s));
  }
  int repeats = absl::GetFlag(FLAGS_repeats);
  double seconds = absl::GetFlag(FLAGS_seconds);
  if (absl::GetFlag(FLAGS_quick)) {
    sizes = {4 << 10, 1 << 20, 16 << 20};
    repeats = 1;
    seconds = 0.1;
  }
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const std::string transport = absl::GetFlag(FLAGS_transport);
  std::printf("Poseidon transport benchmark: %s on %s, %u hardware threads\n",
              transport == "tcp" ? "loopback TCP" : "RDMA (loopback addresses)", host,
              std::thread::hardware_concurrency());
  if (transport == "tcp") {
    std::printf(
        "poseidon: Boost.Asio transport, 1 I/O thread per side, authenticated connection, "
        "gather send, receive into caller buffer\n");
  } else {
    std::printf(
        "poseidon: RDMA transport, RC queue pairs, 1 progress thread per side, authenticated "
        "connection, payloads READ %s\n",
        absl::GetFlag(FLAGS_register_memory) ? "between registered buffers (zero copy)"
                                             : "through staging buffers");
#ifdef POSEIDON_BENCH_FAKE_VERBS
    std::printf(
        "WARNING: linked with the test verbs provider (memcpy under one lock): this run proves "
        "the RDMA path works; its numbers mean nothing\n");
#else
    std::printf("reference on RDMA hardware: perftest ib_read_bw / ib_write_bw, same machines\n");
#endif
  }
  std::printf("raw: blocking sockets, writev(64-byte header, payload) / recv; same bytes\n");
  std::printf("socket buffers: %s; median of %d runs; ~%.1f s per cell\n\n",
              absl::GetFlag(FLAGS_socket_buffer) > 0
                  ? absl::StrCat(absl::GetFlag(FLAGS_socket_buffer), " bytes").c_str()
                  : "kernel autotuning",
              repeats, seconds);
  const bool tls = absl::GetFlag(FLAGS_tls);
  if (tls && transport != "tcp") {
    std::fprintf(stderr, "--tls measures the TCP transport: use it with --transport=tcp\n");
    return 2;
  }
  if (tls) {
    std::printf(
        "tls: the same transport with TLS on both ends (data_tls; OpenSSL %s, P-256 "
        "certificates), measured in this run next to plaintext\n",
        OPENSSL_VERSION_TEXT);
  }
  std::printf("%-8s | %12s %12s %6s | %14s %14s %6s", "size", "psd GB/s", "raw GB/s", "ratio",
              "psd RTT us", "raw RTT us", "ratio");
  if (tls) std::printf(" | %8s %7s %10s %7s", "tls GB/s", "tls/psd", "tls RTT us", "tls/psd");
  std::printf("\n%s\n", std::string(tls ? 122 : 84, '-').c_str());
  std::vector<Row> rows;
  for (size_t size : sizes) {
    const int messages = MessagesFor(size, seconds);
    const int round_trips = std::max(4, std::min(20000, MessagesFor(size, seconds) / 2));
    std::vector<double> pb, rb, pr, rr, tb, tr;
    const std::string only = absl::GetFlag(FLAGS_only);
    for (int r = 0; r < repeats; ++r) {
      rb.push_back(only == "poseidon" ? 1 : RawThroughput(size, messages));
      pb.push_back(only == "raw" ? 1 : PoseidonThroughput(size, messages));
      rr.push_back(only == "poseidon" ? 1 : RawRoundTrip(size, round_trips));
      pr.push_back(only == "raw" ? 1 : PoseidonRoundTrip(size, round_trips));
      if (tls) {
        tb.push_back(PoseidonThroughput(size, messages, /*tls=*/true));
        tr.push_back(PoseidonRoundTrip(size, round_trips, /*tls=*/true));
      }
    }
    Row row{size, Median(pb), Median(rb), Median(pr), Median(rr)};
    if (tls) {
      row.tls_bps = Median(tb);
      row.tls_rtt = Median(tr);
    }
    rows.push_back(row);
    std::printf("%-8s | %12.2f %12.2f %6.2f | %14.1f %14.1f %6.2f", HumanSize(size).c_str(),
                row.psd_bps / 1e9, row.raw_bps / 1e9, row.psd_bps / row.raw_bps, row.psd_rtt * 1e6,
                row.raw_rtt * 1e6, row.psd_rtt / row.raw_rtt);
    if (tls) {
      std::printf(" | %8.2f %7.2f %10.1f %7.2f", row.tls_bps / 1e9, row.tls_bps / row.psd_bps,
                  row.tls_rtt * 1e6, row.tls_rtt / row.psd_rtt);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  std::printf(
      "\nthroughput ratio = poseidon / raw (higher is better; target >= 0.95 at >= 1 MiB)\n");
  std::printf("RTT ratio = poseidon / raw (lower is better; target <= 1.5 for small messages)\n");
  if (tls) std::printf("tls/psd = with TLS / plaintext, same transport (the cost of TLS)\n");
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream out(path);
    out << "{\"host\": \"" << host << "\", \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      out << (i ? ", " : "") << "{\"size\": " << r.size
          << ", \"poseidon_bytes_per_s\": " << r.psd_bps << ", \"raw_bytes_per_s\": " << r.raw_bps
          << ", \"poseidon_rtt_s\": " << r.psd_rtt << ", \"raw_rtt_s\": " << r.raw_rtt;
      if (tls) out << ", \"tls_bytes_per_s\": " << r.tls_bps << ", \"tls_rtt_s\": " << r.tls_rtt;
      out << "}";
    }
    out << "]}\n";
  }
  return 0;
}

}  // namespace
}  // namespace poseidon::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Transport throughput and latency against raw TCP on loopback");
  absl::ParseCommandLine(argc, argv);
  poseidon::InitLogging("poseidon-bench-transport", spdlog::level::warn);
  return poseidon::bench::Run();
}
