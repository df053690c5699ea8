// poseidon-bench-server: (1) aggregation throughput of the engine's summation loop against
// memcpy of the same bytes, measured in the same run; (2) push+pull throughput of a real
// poseidon-server engine behind the transport (--transport=tcp on loopback, the default, or
// --transport=rdma) with 1, 2, 4 and 8 clients (each a rank of one job, sum rule, BSP). On RDMA
// hardware compare with perftest's ib_write_bw on the same machines; poseidon-bench-server-fake
// (transport/CMakeLists.txt) runs --transport=rdma over the test verbs provider: proof that the
// path works, no speed figures.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "server/kv_client.h"
#include "server/kv_engine.h"
#include "server/kv_service.h"
#include "server/update_rules.h"
#include "transport/credentials.h"
#include "transport/rdma/rdma_context.h"
#include "transport/tcp/tcp_context.h"
#include "transport/transport.h"

ABSL_FLAG(bool, quick, false, "small sizes, one client count (smoke test)");
ABSL_FLAG(int, engine_workers, 2, "engine threads of the server");
ABSL_FLAG(uint64_t, key_bytes, 4 << 20, "bytes per key (chunk) for push+pull");
ABSL_FLAG(int, keys, 8, "keys in the push+pull table");
ABSL_FLAG(int, connections, 1, "connections per client to the server (keys spread over them)");
ABSL_FLAG(std::string, transport, "tcp", "the transport the server and its clients use: tcp or rdma");
ABSL_FLAG(std::string, rdma_device, "", "RDMA device (empty: the first with an active port)");

namespace poseidon::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

void Aggregation(bool quick) {
  std::printf("Aggregation: dst += src (float32) against memcpy of the same bytes, one thread\n");
  std::printf("%-10s | %12s %12s %6s\n", "buffer", "sum GB/s", "memcpy GB/s", "ratio");
  std::printf("%s\n", std::string(48, '-').c_str());
  const std::vector<size_t> sizes = quick
                                        ? std::vector<size_t>{1 << 20}
                                        : std::vector<size_t>{64 << 10, 1 << 20, 4 << 20, 64 << 20};
  for (size_t bytes : sizes) {
    const size_t n = bytes / sizeof(float);
    std::vector<float> dst(n, 1.0f), src(n, 2.0f);
    std::vector<float> copy(n);
    const double target = quick ? 0.05 : 0.3;
    auto measure = [&](auto&& fn) {
      std::vector<double> rates;
      for (int rep = 0; rep < 5; ++rep) {
        size_t iters = 0;
        const auto start = Clock::now();
        do {
          fn();
          ++iters;
        } while (Seconds(Clock::now() - start) < target / 5);
        rates.push_back(static_cast<double>(bytes) * iters / Seconds(Clock::now() - start));
      }
      std::sort(rates.begin(), rates.end());
      return rates[rates.size() / 2];
    };
    const double sum = measure([&] { server::AddInto(dst, src); });
    const double memcpy_rate = measure([&] { std::memcpy(copy.data(), src.data(), bytes); });
    std::printf("%-10s | %12.2f %12.2f %6.2f\n",
                bytes >= (1 << 20) ? absl::StrCat(bytes >> 20, " MiB").c_str()
                                   : absl::StrCat(bytes >> 10, " KiB").c_str(),
                sum / 1e9, memcpy_rate / 1e9, sum / memcpy_rate);
  }
  std::printf("(GB/s of input summed; target >= 0.5 of memcpy)\n\n");
}

std::shared_ptr<transport::Context> MakeTransport() {
  transport::TcpOptions tcp;
  transport::RdmaOptions rdma;
  rdma.device = absl::GetFlag(FLAGS_rdma_device);
  auto ctx = transport::MakeContext(absl::GetFlag(FLAGS_transport), tcp, rdma);
  if (!ctx.ok()) {
    std::fprintf(stderr, "transport: %s\n", ctx.status().ToString().c_str());
    std::exit(2);
  }
  return *ctx;
}

void PushPull(bool quick) {
  const int keys = quick ? 2 : absl::GetFlag(FLAGS_keys);
  const uint64_t key_bytes = quick ? 256 << 10 : absl::GetFlag(FLAGS_key_bytes);
  const uint64_t elements = key_bytes / sizeof(float);
  const std::vector<uint32_t> counts =
      quick ? std::vector<uint32_t>{2} : std::vector<uint32_t>{1, 2, 4, 8};
  const std::string kind = absl::GetFlag(FLAGS_transport);
  std::printf(
      "Push+pull over %s on loopback: one job, sum rule, BSP; %d keys of %s; %d engine threads; "
      "%d connection(s) per client\n",
      kind.c_str(), keys, absl::StrCat(key_bytes >> 10, " KiB").c_str(),
      absl::GetFlag(FLAGS_engine_workers), absl::GetFlag(FLAGS_connections));
  if (kind == "rdma") {
#ifdef POSEIDON_BENCH_FAKE_VERBS
    std::printf(
        "WARNING: linked with the test verbs provider (memcpy under one lock): this run proves "
        "the server's RDMA path works; its numbers mean nothing\n");
#else
    std::printf("reference on RDMA hardware: perftest ib_write_bw, same machines\n");
#endif
  }
  std::printf("%-8s | %10s %14s %14s %12s\n", "clients", "clocks/s", "push GB/s", "push+pull GB/s",
              "per client");
  std::printf("%s\n", std::string(68, '-').c_str());
  for (uint32_t clients : counts) {
    auto ctx = MakeTransport();
    server::EngineOptions eo;
    eo.workers = absl::GetFlag(FLAGS_engine_workers);
    auto engine = std::make_shared<server::KvEngine>(eo);
    auto secrets = std::make_shared<transport::SecretStore>();
    secrets->Set(1, "bench");
    auto fs = std::make_shared<transport::FrameServer>(
        *ctx->Listen("127.0.0.1:0"), secrets,
        std::make_shared<server::KvService>(engine, server::BufferPool::Create(1u << 30),
                                            server::KvServiceOptions{}));
    fs->Start();
    v1::RegisterTablesRequest spec;
    spec.set_num_workers(clients);
    auto* t = spec.add_tables();
    t->set_name("bench");
    t->mutable_update_rule()->set_rule(v1::UPDATE_RULE_SUM);
    for (int k = 0; k < keys; ++k) {
      auto* key = t->add_keys();
      key->set_key(k);
      key->set_elements(elements);
    }
    const int clocks = quick ? 3 : std::max(4, static_cast<int>(64 / clients));
    std::vector<std::thread> ranks;
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    Clock::time_point start, end;
    std::vector<std::shared_ptr<transport::Context>> client_ctx;
    for (uint32_t r = 0; r < clients; ++r) client_ctx.push_back(MakeTransport());
    for (uint32_t r = 0; r < clients; ++r) {
      ranks.emplace_back([&, r] {
        auto connected = server::KvClient::Connect(*client_ctx[r], fs->Address(), 1, r,
                                                   transport::RankKey("bench", 1, r),
                                                   absl::Seconds(10),
                                                   absl::GetFlag(FLAGS_connections));
        if (!connected.ok()) {
          std::fprintf(stderr, "rank %u: %s\n", r, connected.status().ToString().c_str());
          std::exit(1);
        }
        auto c = *connected;
        (void)c->RegisterTables(spec, absl::Seconds(30));
        std::vector<std::vector<float>> grads(keys, std::vector<float>(elements, 1.0f));
        std::vector<std::vector<float>> out(keys, std::vector<float>(elements));
        ++ready;
        while (!go.load()) std::this_thread::yield();
        for (int clock = 1; clock <= clocks; ++clock) {
          std::vector<server::Ticket> tickets;
          for (int k = 0; k < keys; ++k) tickets.push_back(c->Push(k, clock, grads[k]));
          for (int k = 0; k < keys; ++k) tickets.push_back(c->Pull(k, clock, out[k]));
          for (auto tk : tickets) {
            if (auto s = c->Wait(tk, absl::Seconds(120)); !s.ok()) {
              std::fprintf(stderr, "rank %u: %s\n", r, s.ToString().c_str());
              std::exit(1);
            }
          }
        }
      });
    }
    while (ready.load() < static_cast<int>(clients)) std::this_thread::yield();
    start = Clock::now();
    go = true;
    for (auto& th : ranks) th.join();
    end = Clock::now();
    const double secs = Seconds(end - start);
    const double pushed = static_cast<double>(clients) * clocks * keys * key_bytes;
    std::printf("%-8u | %10.1f %14.2f %14.2f %12.2f\n", clients, clocks / secs, pushed / secs / 1e9,
                2 * pushed / secs / 1e9, 2 * pushed / secs / 1e9 / clients);
    fs->Stop();
    for (auto& c : client_ctx) c->Close();
    ctx->Close();
  }
  std::printf(
      "(push GB/s: gradient bytes aggregated per second over all clients; push+pull adds "
      "the responses)\n");
}

}  // namespace
}  // namespace poseidon::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  poseidon::InitLogging("poseidon-bench-server", spdlog::level::warn);
  const unsigned cores = std::thread::hardware_concurrency();
  std::printf("Poseidon server benchmark, %u hardware threads\n\n", cores);
  poseidon::bench::Aggregation(absl::GetFlag(FLAGS_quick));
  poseidon::bench::PushPull(absl::GetFlag(FLAGS_quick));
  return 0;
}
