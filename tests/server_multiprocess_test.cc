// poseidon-server as a real process with clients in their own processes (kv_test_client), on
// loopback: every update rule against a reference, graceful SIGTERM with a final checkpoint
// and a restart that continues exactly, kill -9 during checkpoint writes (never a torn
// snapshot), and refusal to start on bad configuration.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "server/checkpoint.h"
#include "server/update_rules.h"
#include "tests/kv_test_util.h"
#include "tests/subprocess.h"

namespace poseidon::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr char kSecret[] = "multiprocess-secret";

class ServerProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("psd-mp-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Starts the server; returns its address ("127.0.0.1:port"), or "" if it did not come up.
  std::string StartServer(std::unique_ptr<Subprocess>& server,
                          std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {POSEIDON_SERVER_BIN, "--listen=127.0.0.1:0", "--job_id=1",
                                     std::string("--job_secret=") + kSecret, "--log_level=warn"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    server = std::make_unique<Subprocess>(argv);
    if (!server->started()) return "";
    while (auto line = server->ReadLine(milliseconds(20000))) {
      const std::string marker = "listening on ";
      if (auto at = line->find(marker); at != std::string::npos) {
        return line->substr(at + marker.size());
      }
    }
    return "";
  }

  std::unique_ptr<Subprocess> StartClient(const std::string& address, uint32_t rank,
                                          uint32_t workers, const std::string& rule, int keys,
                                          uint64_t elements, uint64_t start, uint64_t clocks,
                                          const std::string& out) {
    return std::make_unique<Subprocess>(std::vector<std::string>{
        KV_TEST_CLIENT_BIN, "--server=" + address, std::string("--secret=") + kSecret,
        "--rank=" + std::to_string(rank), "--workers=" + std::to_string(workers), "--rule=" + rule,
        "--keys=" + std::to_string(keys), "--elements=" + std::to_string(elements),
        "--start_clock=" + std::to_string(start), "--clocks=" + std::to_string(clocks),
        "--out=" + out});
  }

  static std::vector<float> ReadFloats(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::vector<float> v(bytes.size() / 4);
    std::memcpy(v.data(), bytes.data(), v.size() * 4);
    return v;
  }

  // What every rank must hold after `clocks` clocks: the sum for "sum", else the parameters of
  // one optimizer stepping on the mean gradient (the P1-times larger batch).
  static std::vector<float> Expected(const std::string& rule, uint32_t workers, int keys,
                                     uint64_t elements, uint64_t clocks) {
    std::vector<float> out;
    const auto spec = KvSpec(workers, rule, keys, elements);
    for (int k = 0; k < keys; ++k) {
      if (rule == "sum") {
        std::vector<float> sum(elements, 0.0f);
        for (uint32_t r = 0; r < workers; ++r) {
          auto g = KvGrad(r, clocks, k, elements);
          for (size_t i = 0; i < elements; ++i) sum[i] += g[i];
        }
        out.insert(out.end(), sum.begin(), sum.end());
        continue;
      }
      auto hp = *server::HyperParamsFromSpec(spec.tables(0).update_rule());
      auto opt = server::MakeOptimizer(RuleFromName(rule), hp, elements);
      std::vector<float> p = KvInit(k, elements);
      for (uint64_t c = 1; c <= clocks; ++c) {
        std::vector<float> mean(elements, 0.0f);
        for (uint32_t r = 0; r < workers; ++r) {
          auto g = KvGrad(r, c, k, elements);
          for (size_t i = 0; i < elements; ++i) mean[i] += g[i];
        }
        for (auto& x : mean) x *= 1.0f / static_cast<float>(workers);
        opt->Step(p, mean);
      }
      out.insert(out.end(), p.begin(), p.end());
    }
    return out;
  }

  std::filesystem::path dir_;
};

TEST_F(ServerProcessTest, EveryUpdateRuleMatchesTheReferenceAcrossProcesses) {
  for (const std::string rule : {"sum", "sgd", "momentum", "adam"}) {
    SCOPED_TRACE(rule);
    std::unique_ptr<Subprocess> server;
    const std::string address = StartServer(server, {"--workers=2"});
    ASSERT_FALSE(address.empty());
    constexpr uint32_t kWorkers = 3;
    std::vector<std::unique_ptr<Subprocess>> clients;
    for (uint32_t r = 0; r < kWorkers; ++r) {
      clients.push_back(StartClient(address, r, kWorkers, rule, 3, 4099, 1, 6,
                                    (dir_ / (rule + std::to_string(r))).string()));
    }
    for (auto& c : clients) ASSERT_EQ(c->Wait(milliseconds(120000)), 0);
    const auto expected = Expected(rule, kWorkers, 3, 4099, 6);
    for (uint32_t r = 0; r < kWorkers; ++r) {
      const auto got = ReadFloats(dir_ / (rule + std::to_string(r)));
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], expected[i], 1e-4f * std::max(1.0f, std::abs(expected[i])))
            << "rank " << r << " element " << i;
      }
    }
    server->Signal(SIGTERM);
    EXPECT_EQ(server->Wait(milliseconds(30000)), 0);
  }
}

TEST_F(ServerProcessTest, SigtermFlushesACheckpointAndARestartContinuesExactly) {
  const std::string ckpt = (dir_ / "ckpt").string();
  constexpr uint32_t kWorkers = 2;
  {
    std::unique_ptr<Subprocess> server;
    const std::string address = StartServer(server, {"--checkpoint_dir=" + ckpt});
    ASSERT_FALSE(address.empty());
    std::vector<std::unique_ptr<Subprocess>> clients;
    for (uint32_t r = 0; r < kWorkers; ++r) {
      clients.push_back(StartClient(address, r, kWorkers, "momentum", 2, 1000, 1, 3,
                                    (dir_ / ("a" + std::to_string(r))).string()));
    }
    for (auto& c : clients) ASSERT_EQ(c->Wait(milliseconds(60000)), 0);
    server->Signal(SIGTERM);
    ASSERT_EQ(server->Wait(milliseconds(30000)), 0) << "graceful shutdown exits 0";
  }
  auto saved = server::LoadCheckpoints(ckpt);
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_EQ(saved->size(), 1u);
  EXPECT_EQ((*saved)[0].clock, 3u);
  {
    std::unique_ptr<Subprocess> server;
    const std::string address = StartServer(server, {"--checkpoint_dir=" + ckpt});
    ASSERT_FALSE(address.empty());
    std::vector<std::unique_ptr<Subprocess>> clients;
    for (uint32_t r = 0; r < kWorkers; ++r) {
      clients.push_back(StartClient(address, r, kWorkers, "momentum", 2, 1000, 4, 6,
                                    (dir_ / ("b" + std::to_string(r))).string()));
    }
    for (auto& c : clients) ASSERT_EQ(c->Wait(milliseconds(60000)), 0);
    server->Signal(SIGTERM);
    EXPECT_EQ(server->Wait(milliseconds(30000)), 0);
  }
  // Three clocks, a restart, three more: the same as six without a restart.
  const auto expected = Expected("momentum", kWorkers, 2, 1000, 6);
  for (uint32_t r = 0; r < kWorkers; ++r) {
    const auto got = ReadFloats(dir_ / ("b" + std::to_string(r)));
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], expected[i], 1e-5f) << i;
  }
}

TEST_F(ServerProcessTest, KillDuringCheckpointingNeverLeavesATornSnapshot) {
  const std::string ckpt = (dir_ / "ckpt").string();
  std::mt19937 rng(11);
  constexpr int kTrials = 20;
  constexpr uint64_t kElements = 1 << 20;  // 4 MiB per key: writes take a while
  int with_snapshot = 0, with_leftover = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    std::unique_ptr<Subprocess> server;
    const std::string address =
        StartServer(server, {"--checkpoint_dir=" + ckpt, "--checkpoint_every=1"});
    ASSERT_FALSE(address.empty());
    // One worker training forever; the server checkpoints after every clock. The kill comes a
    // random moment after the first checkpoint write began (even trials: during or after the
    // first snapshot, with nothing older on disk) or after a first snapshot completed (odd
    // trials: during a later one, an older one on disk), not at a fixed time from the start: a
    // loaded machine (CI, ThreadSanitizer) can take longer than any fixed delay to get there.
    auto client = StartClient(address, 0, 1, "sum", 2, kElements, 1, 0, "");
    const bool after_a_snapshot = trial % 2 == 1;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    bool reached = false;
    while (!reached && std::chrono::steady_clock::now() < deadline) {
      std::error_code ec;
      for (const auto& e : std::filesystem::directory_iterator(ckpt, ec)) {
        const bool tmp = e.path().string().find(".tmp.") != std::string::npos;
        if (!after_a_snapshot || !tmp) reached = true;
      }
      if (!reached) std::this_thread::sleep_for(milliseconds(2));
    }
    ASSERT_TRUE(reached) << "trial " << trial << ": no checkpoint "
                         << (after_a_snapshot ? "completed" : "begun") << " in " << ckpt
                         << " within 60 s";
    std::this_thread::sleep_for(milliseconds(rng() % 300));
    server->Signal(SIGKILL);
    ASSERT_TRUE(server->Wait(milliseconds(10000)).has_value());
    client->Signal(SIGKILL);
    client->Wait(milliseconds(10000));
    for (const auto& e : std::filesystem::directory_iterator(ckpt)) {
      if (e.path().string().find(".tmp.") != std::string::npos) {
        ++with_leftover;
        std::filesystem::remove(e.path());  // the next server would ignore it too
      }
    }
    // Whatever is there is a whole snapshot of some clock: old or new, never torn.
    auto loaded = server::LoadCheckpoints(ckpt);
    ASSERT_TRUE(loaded.ok()) << "trial " << trial << ": " << loaded.status();
    if (loaded->empty()) continue;
    ++with_snapshot;
    const auto& snap = (*loaded)[0];
    ASSERT_GE(snap.clock, 1u);
    for (const auto& key : snap.keys) {
      const auto g = KvGrad(0, snap.clock, key.key, kElements);
      ASSERT_EQ(key.result, g) << "trial " << trial << " clock " << snap.clock;
    }
    std::filesystem::remove_all(ckpt);
  }
  std::printf("kill -9 trials: %d, with a snapshot on disk: %d, interrupted writes seen: %d\n",
              kTrials, with_snapshot, with_leftover);
  EXPECT_GT(with_snapshot, 0);
}

TEST_F(ServerProcessTest, BadConfigurationIsRefusedWithAClearMessage) {
  {
    Subprocess p({POSEIDON_SERVER_BIN, "--workers=0", "--job_id=1", "--job_secret=x"});
    EXPECT_EQ(p.Wait(milliseconds(20000)), 2);
  }
  {
    Subprocess p({POSEIDON_SERVER_BIN, "--listen=127.0.0.1:0"});  // no job to serve
    EXPECT_EQ(p.Wait(milliseconds(20000)), 2);
  }
  {
    std::filesystem::create_directories(dir_ / "bad");
    std::ofstream(dir_ / "bad" / "job-1.ckpt") << "not a checkpoint";
    Subprocess p({POSEIDON_SERVER_BIN, "--listen=127.0.0.1:0", "--job_id=1", "--job_secret=x",
                  "--checkpoint_dir=" + (dir_ / "bad").string()});
    EXPECT_EQ(p.Wait(milliseconds(20000)), 2) << "a corrupt checkpoint must stop the start";
  }
  for (const char* interval :
       {"--telemetry_interval=5ms", "--telemetry_interval=2h", "--telemetry_interval=-1s"}) {
    Subprocess p(
        {POSEIDON_SERVER_BIN, "--listen=127.0.0.1:0", "--job_id=1", "--job_secret=x", interval});
    EXPECT_EQ(p.Wait(milliseconds(20000)), 2) << interval << " must be refused";
  }
}

TEST_F(ServerProcessTest, AFailedRegistrationWithTheCoordinatorIsOneLineAndExitCode2) {
  // Nothing listens on port 1: the registration fails at once. It used to abort (exit 134,
  // "terminate called without an active exception": the metrics thread was never joined).
  Subprocess p({POSEIDON_SERVER_BIN, "--listen=127.0.0.1:0", "--job_id=1", "--job_secret=x",
                "--coordinator=127.0.0.1:1", "--coordinator_token=t", "--log_level=warn"},
               /*merge_stderr=*/true);
  const std::string out = p.ReadAll(milliseconds(30000));
  EXPECT_EQ(p.Wait(milliseconds(20000)), 2) << out;
  EXPECT_NE(out.find("refusing to start: registering with the coordinator 127.0.0.1:1"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("terminate called"), std::string::npos) << out;
}

}  // namespace
}  // namespace poseidon::testing
