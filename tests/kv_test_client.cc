// kv_test_client: one rank of a training loop against poseidon-server, for the multi-process
// tests. Registers the tables, (rank 0) pushes initial values, then for each clock pushes every
// key's gradient and pulls its value; writes the last pulled values (floats, key order) to --out.
// Exit 0 on success, 1 with a message on stderr on any error.
#include <cstdio>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "server/kv_client.h"
#include "tests/kv_test_util.h"
#include "transport/credentials.h"
#include "transport/tcp/tcp_context.h"

ABSL_FLAG(std::string, server, "", "host:port");
ABSL_FLAG(uint64_t, job, 1, "job id");
ABSL_FLAG(std::string, secret, "", "job secret");
ABSL_FLAG(uint32_t, rank, 0, "rank");
ABSL_FLAG(uint32_t, workers, 1, "P1");
ABSL_FLAG(std::string, rule, "sum", "sum, sgd, momentum, adam");
ABSL_FLAG(int, keys, 2, "keys");
ABSL_FLAG(uint64_t, elements, 1000, "elements per key");
ABSL_FLAG(uint64_t, start_clock, 1, "first clock to push");
ABSL_FLAG(uint64_t, clocks, 5, "last clock to push (0: forever)");
ABSL_FLAG(std::string, out, "", "where to write the final values");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace poseidon;
  const uint32_t rank = absl::GetFlag(FLAGS_rank);
  const int keys = absl::GetFlag(FLAGS_keys);
  const uint64_t n = absl::GetFlag(FLAGS_elements);
  const std::string rule = absl::GetFlag(FLAGS_rule);
  auto fail = [&](const absl::Status& s) {
    std::fprintf(stderr, "kv_test_client rank %u: %s\n", rank, s.ToString().c_str());
    return 1;
  };
  auto ctx = transport::CreateTcpContext(transport::TcpOptions{});
  if (!ctx.ok()) return fail(ctx.status());
  auto client =
      server::KvClient::Connect(**ctx, absl::GetFlag(FLAGS_server), absl::GetFlag(FLAGS_job), rank,
                                transport::RankKey(absl::GetFlag(FLAGS_secret), absl::GetFlag(FLAGS_job), rank),
                                absl::Seconds(20));
  if (!client.ok()) return fail(client.status());
  auto& c = **client;
  const absl::Duration wait = absl::Seconds(60);
  if (auto s = c.RegisterTables(testing::KvSpec(absl::GetFlag(FLAGS_workers), rule, keys, n), wait);
      !s.ok()) {
    return fail(s);
  }
  const uint64_t start = absl::GetFlag(FLAGS_start_clock);
  std::vector<std::vector<float>> values(keys, std::vector<float>(n));
  if (rule != "sum" && start == 1 && rank == 0) {
    std::vector<std::vector<float>> init;
    for (int k = 0; k < keys; ++k) init.push_back(testing::KvInit(k, n));
    for (int k = 0; k < keys; ++k) {
      if (auto s = c.Wait(c.Push(k, 0, init[k], /*init=*/true), wait); !s.ok()) return fail(s);
    }
  }
  const uint64_t last = absl::GetFlag(FLAGS_clocks);
  for (uint64_t clock = start; last == 0 || clock <= last; ++clock) {
    std::vector<std::vector<float>> grads;
    std::vector<server::Ticket> tickets;
    for (int k = 0; k < keys; ++k) grads.push_back(testing::KvGrad(rank, clock, k, n));
    for (int k = 0; k < keys; ++k) tickets.push_back(c.Push(k, clock, grads[k]));
    for (int k = 0; k < keys; ++k) tickets.push_back(c.Pull(k, clock, values[k]));
    for (auto t : tickets) {
      if (auto s = c.Wait(t, wait); !s.ok()) return fail(s);
    }
  }
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    std::ofstream f(out, std::ios::binary);
    for (const auto& v : values) {
      f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
    }
  }
  return 0;
}
