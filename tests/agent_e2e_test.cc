// End to end on loopback with real processes: KV servers, one poseidon-agent per worker and one
// poseidon-synth per worker (an emulated training process on the C ABI), with every synchronised
// result verified against the exact sum over all ranks; for PS-only, SFB-only and the planner's
// mixed plan. Then the faults: a dead agent, a dead training process, a dead server, a hostile
// writer on the shared memory, and misuse of the C ABI.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include <cstring>
#include <fstream>
#include <filesystem>
#include <random>
#include <regex>

#include "common/shm_layout.h"
#ifdef POSEIDON_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#include "poseidon/poseidon.h"
#include "tests/subprocess.h"

namespace poseidon::testing {
namespace {

using std::chrono::milliseconds;

constexpr char kSecret[] = "e2e-secret";

int FreePort() { return FreeLoopbackPort(); }

std::string Join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

class Cluster {
 public:
  // Starts `servers` KV servers and `workers` agents.
  // `one_server_extra`: more arguments for some servers only, by index; their stderr (warnings
  // only: little) is captured with their stdout.
  Cluster(int servers, int workers, const std::string& scheme,
          std::vector<std::string> agent_extra = {}, std::vector<std::string> server_extra = {},
          std::map<int, std::vector<std::string>> one_server_extra = {}) {
    for (int s = 0; s < servers; ++s) {
      std::vector<std::string> args{POSEIDON_SERVER_BIN, "--listen=127.0.0.1:0", "--job_id=1",
                                    std::string("--job_secret=") + kSecret, "--log_level=warn"};
      args.insert(args.end(), server_extra.begin(), server_extra.end());
      const auto own = one_server_extra.find(s);
      if (own != one_server_extra.end()) {
        args.insert(args.end(), own->second.begin(), own->second.end());
      }
      servers_.push_back(std::make_unique<Subprocess>(args, own != one_server_extra.end()));
      server_early_.emplace_back();
      while (auto line = servers_.back()->ReadLine(milliseconds(20000))) {
        server_early_.back() += *line + "\n";
        if (auto at = line->find("listening on "); at != std::string::npos) {
          addresses_.push_back(line->substr(at + 13));
          break;
        }
      }
    }
    // An agent that cannot bind its port (taken since we chose it) exits at once: start the
    // agents again on new ports.
    for (int attempt = 0; attempt < 5; ++attempt) {
      if (StartAgents(workers, scheme, agent_extra)) break;
      agents_.clear();
      agent_argv_.clear();
      for (const auto& segment : segments_) {
        shm_unlink(segment.c_str());
        shm_unlink((segment + ".data").c_str());
      }
      peers_.clear();
      segments_.clear();
      early_.clear();
    }
  }

  // Whether every agent came up.
  bool StartAgents(int workers, const std::string& scheme,
                   const std::vector<std::string>& agent_extra) {
    for (int r = 0; r < workers; ++r) peers_.push_back("127.0.0.1:" + std::to_string(FreePort()));
    // Unique per cluster: a killed agent leaves its segment behind.
    static int clusters = 0;
    const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(clusters++);
    for (int r = 0; r < workers; ++r) {
      segments_.push_back("/psd-e2e-" + tag + "-" + std::to_string(r));
      std::vector<std::string> argv = {POSEIDON_AGENT_BIN,
                                       std::string("--secret=") + kSecret,
                                       "--rank=" + std::to_string(r),
                                       "--world_size=" + std::to_string(workers),
                                       "--servers=" + Join(addresses_),
                                       "--peers=" + Join(peers_),
                                       "--scheme=" + scheme,
                                       "--segment=" + segments_.back(),
                                       "--log_level=warn",
                                       "--attach_timeout=60s"};
      argv.insert(argv.end(), agent_extra.begin(), agent_extra.end());
      agent_argv_.push_back(argv);
      agents_.push_back(std::make_unique<Subprocess>(argv, /*merge_stderr=*/true));
    }
    // Training processes start once their agent has created its segment.
    bool all_ready = true;
    for (auto& agent : agents_) {
      early_.emplace_back();
      bool ready = false;
      while (auto line = agent->ReadLine(milliseconds(20000))) {
        early_.back() += *line + "\n";
        if (line->find("poseidon-agent ready") != std::string::npos) {
          ready = true;
          break;
        }
      }
      if (!ready && early_.back().find("Address already in use") != std::string::npos) {
        all_ready = false;
      }
    }
    return all_ready;
  }

  std::unique_ptr<Subprocess> Synth(int rank, const std::string& model, int iterations,
                                    std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {POSEIDON_SYNTH_BIN,
                                     "--segment=" + segments_[rank],
                                     "--model=" + model,
                                     "--batch=8",
                                     "--iterations=" + std::to_string(iterations),
                                     "--verify"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<Subprocess>(argv, /*merge_stderr=*/true);
  }

  // Elastic workers: rank r's agent is SIGKILLed (if it still runs) and a new one started with
  // --rejoin on a new segment (Synth(r, ...) then attaches to it). Whether it came up.
  // `flag`: started with --rejoin (false: as before, which --rejoin_if_restarted must turn
  // into a rejoin).
  bool RejoinAgent(int r, bool flag = true) {
    agents_[r]->Signal(SIGKILL);
    agents_[r]->Wait(milliseconds(10000));
    std::vector<std::string> argv = agent_argv_[r];
    segments_.push_back(segments_[r] + "-rejoined");
    segments_[r].swap(segments_.back());  // the old one is still unlinked at the end
    for (auto& a : argv) {
      if (a.rfind("--segment=", 0) == 0) a = "--segment=" + segments_[r];
    }
    if (flag) argv.push_back("--rejoin");
    agents_[r] = std::make_unique<Subprocess>(argv, /*merge_stderr=*/true);
    early_[r].clear();
    while (auto line = agents_[r]->ReadLine(milliseconds(20000))) {
      early_[r] += *line + "\n";
      if (line->find("poseidon-agent ready") != std::string::npos) return true;
    }
    return false;
  }

  // Agents end first (a SIGKILLed one cannot unlink its segments: do it for it), then servers.
  ~Cluster() {
    agents_.clear();
    for (const auto& segment : segments_) {
      shm_unlink(segment.c_str());
      shm_unlink((segment + ".data").c_str());
    }
  }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  bool ok() const { return !addresses_.empty() || servers_.empty(); }
  Subprocess& agent(int r) { return *agents_[r]; }
  Subprocess& server(int s) { return *servers_[s]; }
  const std::string& segment(int r) const { return segments_[r]; }
  // Attaches this process to rank r's agent (nullptr, with a test failure, if it cannot).
  psd_context* Attach(int r) const {
    psd_config config;
    psd_config_init(&config);
    config.segment = segments_[r].c_str();
    psd_context* ctx = nullptr;
    EXPECT_EQ(psd_attach(&config, &ctx), PSD_OK) << psd_last_error();
    return ctx;
  }
  // What an agent printed before it was ready; a server before it listened.
  const std::string& early_output(int r) const { return early_[r]; }
  const std::string& server_early_output(int s) const { return server_early_[s]; }

 private:
  std::vector<std::unique_ptr<Subprocess>> servers_, agents_;
  std::vector<std::string> addresses_, peers_, segments_, early_, server_early_;
  std::vector<std::vector<std::string>> agent_argv_;
};

const std::string kTiny = POSEIDON_TEST_MODELS "/tiny.json";
const std::string kFcOnly = POSEIDON_TEST_MODELS "/fc_only.json";  // all SFB: no server

class EndToEnd : public ::testing::TestWithParam<std::string> {};

TEST_P(EndToEnd, FourWorkersTwoServersTwentyIterationsVerified) {
  Cluster cluster(2, 4, GetParam());
  ASSERT_TRUE(cluster.ok());
  std::vector<std::unique_ptr<Subprocess>> synths;
  for (int r = 0; r < 4; ++r) synths.push_back(cluster.Synth(r, kTiny, 20));
  // On a failure, what every training process and agent said (the agents' stall reports name
  // what a layer waits for).
  auto agents_said = [&] {
    std::string all;
    for (int r = 0; r < 4; ++r) {
      synths[r]->Signal(SIGTERM);
      all += "--- training process " + std::to_string(r) + ":\n" +
             synths[r]->ReadAll(milliseconds(5000));
    }
    for (int r = 0; r < 4; ++r) {
      cluster.agent(r).Signal(SIGTERM);
      all += "--- agent " + std::to_string(r) + ":\n" + cluster.early_output(r) +
             cluster.agent(r).ReadAll(milliseconds(10000));
    }
    return all;
  };
  for (int r = 0; r < 4; ++r) {
    const std::string out = synths[r]->ReadAll(milliseconds(120000));
    ASSERT_EQ(synths[r]->Wait(milliseconds(10000)), 0) << out << agents_said();
    EXPECT_NE(out.find("verified 160 results, 0 mismatches"), std::string::npos) << out;
    // auto: with P1 = 4, P2 = 2 and K = 8, fc1 and fc2 are cheaper by SFB, fc3 (10 x 128) by PS.
    const int sfb_layers = GetParam() == "ps" ? 0 : GetParam() == "sfb" ? 3 : 2;
    EXPECT_NE(out.find(std::to_string(sfb_layers) + " on SFB"), std::string::npos) << out;
  }
  for (int r = 0; r < 4; ++r) EXPECT_EQ(cluster.agent(r).Wait(milliseconds(20000)), 0);
}

INSTANTIATE_TEST_SUITE_P(Schemes, EndToEnd, ::testing::Values("ps", "sfb", "auto"));

// Small PS layers fused into buckets (as the plan says, the default, or by size) and not fused
// give the same exact sums; the agent says what it fused.
TEST(Buckets, FusedAndUnfusedSmallLayersGiveTheExactSums) {
  for (const char* bucket : {"--fusion=off", "--fusion=bytes", "--fusion=plan"}) {
    Cluster cluster(1, 2, "ps", {bucket, "--bucket_bytes=512KiB", "--log_level=info"});
    ASSERT_TRUE(cluster.ok());
    std::vector<std::unique_ptr<Subprocess>> synths;
    for (int r = 0; r < 2; ++r) synths.push_back(cluster.Synth(r, kTiny, 10));
    for (int r = 0; r < 2; ++r) {
      const std::string out = synths[r]->ReadAll(milliseconds(120000));
      ASSERT_EQ(synths[r]->Wait(milliseconds(10000)), 0) << bucket << ": " << out;
      EXPECT_NE(out.find("verified 80 results, 0 mismatches"), std::string::npos) << out;
    }
    const std::string log = cluster.agent(0).ReadAll(milliseconds(20000));
    // tiny, all PS: conv1.weight + conv1.bias, then fc1.bias .. fc3.bias (fc1.weight is 1 MiB).
    if (std::string(bucket) == "--fusion=off") {
      EXPECT_EQ(log.find("fused"), std::string::npos) << log;
    } else if (std::string(bucket) == "--fusion=bytes") {
      EXPECT_NE(log.find("7 small layers fused into 2 buckets"), std::string::npos) << log;
      EXPECT_NE(log.find("--bucket_bytes=524288"), std::string::npos) << log;
    } else {
      // The planner's target at 10 Gbit/s and 50 us (B* ~ 0.4 MB) takes the same two runs.
      EXPECT_NE(log.find("7 small layers fused into 2 buckets"), std::string::npos) << log;
      EXPECT_NE(log.find("the plan's"), std::string::npos) << log;
    }
  }
}

// The GPU path: two training processes share one GPU; each keeps its layers in a CUDA arena its
// agent reaches by CUDA IPC (device->host staging, pinned buffers, results back by event, SFB
// rebuilt with cuBLAS). Every result must equal the exact sum, as on the CPU path.
class GpuEndToEnd : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
#ifdef POSEIDON_HAVE_CUDA
    int devices = 0;
    const cudaError_t e = cudaGetDeviceCount(&devices);
    if (e != cudaSuccess || devices == 0) {
      GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount returned " << static_cast<int>(e)
                   << " (" << cudaGetErrorName(e) << ")";
    }
#else
    GTEST_SKIP() << "built without CUDA";
#endif
  }
};

TEST_P(GpuEndToEnd, TwoProcessesOnOneGpuMatchTheExactSums) {
  Cluster cluster(1, 2, GetParam());
  ASSERT_TRUE(cluster.ok());
  std::vector<std::unique_ptr<Subprocess>> synths;
  for (int r = 0; r < 2; ++r) synths.push_back(cluster.Synth(r, kTiny, 20, {"--cuda"}));
  for (int r = 0; r < 2; ++r) {
    const std::string out = synths[r]->ReadAll(milliseconds(120000));
    ASSERT_EQ(synths[r]->Wait(milliseconds(10000)), 0) << out;
    EXPECT_NE(out.find("verified 160 results, 0 mismatches"), std::string::npos) << out;
    const int sfb_layers = GetParam() == "ps" ? 0 : 3;
    EXPECT_NE(out.find(std::to_string(sfb_layers) + " on SFB"), std::string::npos) << out;
  }
  for (int r = 0; r < 2; ++r) EXPECT_EQ(cluster.agent(r).Wait(milliseconds(20000)), 0);
}

INSTANTIATE_TEST_SUITE_P(Schemes, GpuEndToEnd, ::testing::Values("ps", "sfb"));

// A lossy wire: every PS result is the sum within the type's rounding of the inputs (values up
// to 11 in magnitude, whose rounding unit is 2^-4 in bfloat16 and 2^-7 in fp16; each rank's and
// the server's error feedback may release up to one unit in a clock), and not exactly the sum:
// the pushes carry values neither type can hold (x + 2^-10, x >= 2). The wire is forced
// (--wire=bf16|fp16) or the plan's: without a coordinator the agent's own plan, which the job
// allows bfloat16 (--plan_lossy_wire) and which takes it at 1 Gbit/s (half the bytes save more
// than the casts cost; at 10 Gbit/s, colocated with 2 workers and a server, they do not:
// coordinator/planner/planner_test.cc).
class LossyWire : public ::testing::TestWithParam<std::vector<std::string>> {};

TEST_P(LossyWire, ResultsAreTheSumsWithinRoundingAndNotExactly) {
  Cluster cluster(1, 2, "ps", GetParam());
  ASSERT_TRUE(cluster.ok());
  std::vector<std::unique_ptr<Subprocess>> synths;
  for (int r = 0; r < 2; ++r) {
    synths.push_back(cluster.Synth(r, kTiny, 10,
                                   {"--verify", "--tolerance=0.2", "--grad_fraction=0.0009765625"}));
  }
  for (int r = 0; r < 2; ++r) {
    const std::string out = synths[r]->ReadAll(milliseconds(60000));
    ASSERT_EQ(synths[r]->Wait(milliseconds(10000)), 0) << out;
    EXPECT_NE(out.find("verified 80 results, 0 mismatches"), std::string::npos) << out;
  }
  for (int r = 0; r < 2; ++r) EXPECT_EQ(cluster.agent(r).Wait(milliseconds(20000)), 0);
  // The same job checked exactly: the rounding shows.
  Cluster exact(1, 2, "ps", GetParam());
  ASSERT_TRUE(exact.ok());
  std::vector<std::unique_ptr<Subprocess>> strict;
  for (int r = 0; r < 2; ++r) {
    strict.push_back(exact.Synth(r, kTiny, 3, {"--verify", "--grad_fraction=0.0009765625"}));
  }
  const std::string out = strict[0]->ReadAll(milliseconds(60000));
  strict[1]->ReadAll(milliseconds(60000));
  EXPECT_EQ(out.find(" 0 mismatches"), std::string::npos) << "a lossy wire: " << out;
}

INSTANTIATE_TEST_SUITE_P(
    Wire, LossyWire,
    ::testing::Values(std::vector<std::string>{"--wire=bf16"},
                      std::vector<std::string>{"--wire=fp16"},
                      std::vector<std::string>{"--plan_lossy_wire=bf16", "--bandwidth=1Gbit"}),
    [](const auto& flags) {  // (not `info`: the macro's own parameter is called that)
      return std::string(flags.param[0] == "--wire=bf16"   ? "ForcedBf16"
                         : flags.param[0] == "--wire=fp16" ? "ForcedFp16"
                                                           : "PlannedBf16");
    });

// The divergence guard (agent/wire_guard.h): gradients beyond fp16's range (±65504) saturate on
// an fp16 wire. With the guard a rank that sees it on a key falls the key back to float32 at
// clock 1 (the server switches every rank); the other ranks' last roundings go out with their
// clock-2 pushes (error feedback), so from clock 3 on every result is the exact sum; without the
// guard (--wire_check_every=0) the saturated results stay wrong.
TEST(Wire, TheDivergenceGuardFallsBackToAnExactWire) {
  const std::vector<std::string> scale = {"--verify", "--verify_from=3", "--grad_scale=8192"};
  for (const bool guard : {true, false}) {
    Cluster cluster(1, 2, "ps",
                    {"--wire=fp16", guard ? "--wire_check_every=100" : "--wire_check_every=0",
                     "--log_level=warn"});
    ASSERT_TRUE(cluster.ok());
    std::vector<std::unique_ptr<Subprocess>> synths;
    for (int r = 0; r < 2; ++r) synths.push_back(cluster.Synth(r, kTiny, 6, scale));
    for (int r = 0; r < 2; ++r) {
      const std::string out = synths[r]->ReadAll(milliseconds(60000));
      if (guard) {
        ASSERT_EQ(synths[r]->Wait(milliseconds(10000)), 0) << out;
        EXPECT_NE(out.find("verified 32 results, 0 mismatches"), std::string::npos) << out;
      } else {
        EXPECT_EQ(out.find(" 0 mismatches"), std::string::npos) << "saturated: " << out;
      }
    }
    for (int r = 0; r < 2; ++r) {
      const std::string log = cluster.agent(r).ReadAll(milliseconds(20000));
      const std::optional<int> code = cluster.agent(r).Wait(milliseconds(10000));
      if (!guard) continue;
      EXPECT_EQ(code, 0) << log;
      EXPECT_NE(log.find("falling back to float32 (exact)"), std::string::npos) << log;
    }
  }
}

// The job allows bfloat16, but at 100 Gbit/s the casts cost more than the bytes they save: the
// plan keeps every layer exact, and every result is the exact sum.
TEST(Wire, AnAllowedLossyWireThatDoesNotPayIsNotUsed) {
  Cluster cluster(1, 2, "ps", {"--plan_lossy_wire=bf16", "--bandwidth=100Gbit"});
  ASSERT_TRUE(cluster.ok());
  std::vector<std::unique_ptr<Subprocess>> synths;
  for (int r = 0; r < 2; ++r) {
    synths.push_back(cluster.Synth(r, kTiny, 5, {"--verify", "--grad_fraction=0.0009765625"}));
  }
  for (int r = 0; r < 2; ++r) {
    const std::string out = synths[r]->ReadAll(milliseconds(60000));
    ASSERT_EQ(synths[r]->Wait(milliseconds(10000)), 0) << out;
    EXPECT_NE(out.find("verified 40 results, 0 mismatches"), std::string::npos) << out;
  }
  for (int r = 0; r < 2; ++r) EXPECT_EQ(cluster.agent(r).Wait(milliseconds(20000)), 0);
}

// A single rank's agent gets `signal` 1.5 s into the training (a 30 s wait timeout, the
// training process's agent timeout `agent_timeout_ms`): the training process must fail naming
// its agent lost. Returns its output.
std::string TrainingProcessOutputOnceItsAgentGets(int signal, int agent_timeout_ms) {
  Cluster cluster(1, 1, "ps");
  auto synth = cluster.Synth(0, kTiny, 100000,
                             {"--compute_scale=2000", "--timeout_ms=30000",
                              "--agent_timeout_ms=" + std::to_string(agent_timeout_ms)});
  std::this_thread::sleep_for(milliseconds(1500));
  cluster.agent(0).Signal(signal);
  const std::string out = synth->ReadAll(milliseconds(60000));
  EXPECT_EQ(synth->Wait(milliseconds(10000)), 1) << out;
  EXPECT_NE(out.find("agent lost (rank 0, segment "), std::string::npos) << out;
  if (signal == SIGSTOP) cluster.agent(0).Signal(SIGKILL);
  return out;
}

TEST(Faults, AKilledAgentIsReportedAsAgentLostWithinTheWaitTimeout) {
  TrainingProcessOutputOnceItsAgentGets(SIGKILL, 5000);
}

// A frozen agent (SIGSTOP: its process and segment stay) stops beating: its training process
// names it lost after its agent timeout, saying for how long it has been silent, not after the
// 30 s wait timeout.
TEST(Faults, AFrozenAgentIsReportedAsAgentLostAfterTheAgentTimeout) {
  const std::string out = TrainingProcessOutputOnceItsAgentGets(SIGSTOP, 1500);
  EXPECT_NE(out.find("no heartbeat for "), std::string::npos) << out;
}

TEST(Faults, AKilledTrainingProcessMakesTheAgentExitClearly) {
  Cluster cluster(1, 1, "ps");
  auto synth = cluster.Synth(0, kTiny, 100000, {"--compute_scale=2000"});
  std::this_thread::sleep_for(milliseconds(1500));
  synth->Signal(SIGKILL);
  synth->Wait(milliseconds(10000));
  const std::string out = cluster.agent(0).ReadAll(milliseconds(30000));
  EXPECT_EQ(cluster.agent(0).Wait(milliseconds(10000)), 3) << out;
  EXPECT_NE(out.find("died"), std::string::npos) << out;
}

TEST(Faults, AZombieTrainingProcessMakesTheAgentExitClearly) {
  // The training process ends but its parent (this test) does not reap it: the process is a
  // zombie, which kill(pid, 0) still finds. The agent must see the exit anyway.
  Cluster cluster(1, 1, "ps");
  auto synth = cluster.Synth(0, kTiny, 100000, {"--compute_scale=2000"});
  std::this_thread::sleep_for(milliseconds(1500));
  kill(synth->pid(), SIGKILL);  // not Signal/Wait: those reap it
  const std::string out = cluster.agent(0).ReadAll(milliseconds(30000));
  EXPECT_EQ(cluster.agent(0).Wait(milliseconds(10000)), 3) << out;
  EXPECT_NE(out.find("the training process (pid " + std::to_string(synth->pid()) + ") died"),
            std::string::npos)
      << out;
  synth->Wait(milliseconds(10000));
}

TEST(Faults, AnOverwrittenFrameworkPidDoesNotChangeWhichProcessTheAgentWatches) {
  Cluster cluster(1, 1, "ps");
  auto synth = cluster.Synth(0, kTiny, 100000, {"--compute_scale=2000"});
  std::this_thread::sleep_for(milliseconds(1500));
  const int fd = shm_open(cluster.segment(0).c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  auto* header = static_cast<psd_shm_header*>(
      mmap(nullptr, sizeof(psd_shm_header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  ASSERT_NE(static_cast<void*>(header), MAP_FAILED);
  // A pid that is no process (above any pid_max), then this test's own (alive) pid.
  __atomic_store_n(&header->framework_pid, 10965685u, __ATOMIC_RELEASE);
  std::this_thread::sleep_for(milliseconds(500));
  EXPECT_FALSE(cluster.agent(0).Wait(milliseconds(0)).has_value()) << "the agent exited";
  __atomic_store_n(&header->framework_pid, static_cast<uint32_t>(getpid()), __ATOMIC_RELEASE);
  munmap(header, sizeof(psd_shm_header));
  synth->Signal(SIGKILL);
  synth->Wait(milliseconds(10000));
  const std::string out = cluster.agent(0).ReadAll(milliseconds(30000));
  EXPECT_EQ(cluster.agent(0).Wait(milliseconds(10000)), 3) << out;
  EXPECT_NE(out.find("the training process (pid " + std::to_string(synth->pid()) + ") died"),
            std::string::npos)
      << out;
}

TEST(Faults, AKilledServerFailsTheLayerNamingServerLayerAndClock) {
  Cluster cluster(1, 2, "ps", {"--sync_timeout=3s", "--connect_timeout=5s"});
  auto s0 = cluster.Synth(0, kTiny, 100000, {"--compute_scale=500"});
  auto s1 = cluster.Synth(1, kTiny, 100000, {"--compute_scale=500"});
  std::this_thread::sleep_for(milliseconds(1500));
  cluster.server(0).Signal(SIGKILL);
  const std::string out = s0->ReadAll(milliseconds(60000));
  EXPECT_EQ(s0->Wait(milliseconds(10000)), 1) << out;
  EXPECT_NE(out.find("synchronisation failed"), std::string::npos) << out;
  EXPECT_NE(out.find("clock"), std::string::npos) << out;
  EXPECT_NE(out.find("127.0.0.1:"), std::string::npos) << "names the server: " << out;
}

// The failover tests' job: 4 servers, 4 agents (--replicas=1; small blocks and no fusion, so
// that every server is some keys' primary) and 4 poseidon-synth --verify ranks of the tiny
// model, rank 0 printing its iterations.
struct FailoverJob {
  explicit FailoverJob(int iterations_, std::map<int, std::vector<std::string>> one_server = {})
      : iterations(iterations_),
        cluster(4, 4, "ps",
                {"--replicas=1", "--peer_timeout=2s", "--fusion=off", "--block_bytes=65536",
                 "--sync_timeout=60s"},
                {"--peer_timeout=2s"}, std::move(one_server)) {
    if (!cluster.ok()) return;
    for (int r = 0; r < 4; ++r) {
      std::vector<std::string> extra = {"--compute_scale=20"};
      if (r == 0) extra.push_back("--print_iterations");
      synths.push_back(cluster.Synth(r, kTiny, iterations, extra));
    }
  }
  // Every rank ran every iteration with every result exact, and every agent exited cleanly
  // (`early`: what rank 0 printed before, already read).
  void ExpectEveryRankExact(const std::string& early) {
    for (int r = 0; r < 4; ++r) {
      const std::string out = (r == 0 ? early : "") + synths[r]->ReadAll(milliseconds(120000));
      EXPECT_EQ(synths[r]->Wait(milliseconds(10000)), 0) << "rank " << r << ": " << out;
      EXPECT_NE(out.find(std::to_string(iterations) + " iterations"), std::string::npos) << out;
      EXPECT_NE(out.find(", 0 mismatches"), std::string::npos) << out;
    }
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(cluster.agent(r).Wait(milliseconds(30000)), 0)
          << "agent " << r << ": " << cluster.agent(r).ReadAll(milliseconds(1000));
    }
  }
  // SIGKILLs server `first` once rank 0 ended iteration `first_after`, then server `second`
  // once it ended `second_after`; true once both were killed. `early` gets what rank 0 printed.
  bool KillInTurn(int first, int first_after, int second, int second_after, std::string& early) {
    const std::string first_at = "iteration " + std::to_string(first_after) + " ends";
    const std::string second_at = "iteration " + std::to_string(second_after) + " ends";
    bool killed_first = false;
    while (auto line = synths[0]->ReadLine(milliseconds(60000))) {
      early += *line + "\n";
      if (!killed_first && line->find(first_at) != std::string::npos) {
        cluster.server(first).Signal(SIGKILL);
        killed_first = true;
      }
      if (line->find(second_at) != std::string::npos) {
        cluster.server(second).Signal(SIGKILL);
        return killed_first;
      }
    }
    return false;
  }
  int iterations;
  Cluster cluster;
  std::vector<std::unique_ptr<Subprocess>> synths;
};

// Replication (DESIGN.md "Faults"): four servers, each the backup of the previous one's keys
// (--replicas=1; small blocks and no fusion, so that every server is some keys' primary). One
// server killed (or frozen) at a random moment of a 60-clock run (once training is under way),
// so before, during or after
// some clock's aggregation, costs the job nothing: every rank runs every iteration with every
// result exactly the sum over the ranks (synth --verify: integer-valued gradients, so the sums
// are exact whatever the order), and every agent exits cleanly once its rank is done.
// A frozen server is resumed (SIGCONT) once the agents have given it up: the old primary, fenced
// by its backup, must answer nothing that could mix into the run.
void ExpectEveryTrialToSurviveALostServer(int signal, int trials) {
  const int iterations = signal == SIGSTOP ? 150 : 60;
  if (const char* n = std::getenv("POSEIDON_FAILOVER_TRIALS")) trials = std::atoi(n);
  const auto seed = static_cast<unsigned>(std::random_device{}());
  std::mt19937 rng(seed);
  for (int trial = 0; trial < trials; ++trial) {
    const int victim = static_cast<int>(rng() % 4);
    const int delay_ms = static_cast<int>(rng() % 800);
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " trial " << trial << ": server "
                                      << victim << " signalled " << delay_ms
                                      << " ms after iteration 2");
    FailoverJob job(iterations);
    ASSERT_TRUE(job.cluster.ok());
    // The moment is counted from rank 0's second iteration: training is under way (a server
    // lost during start-up, before the agents connected to it, is a start-up failure).
    std::string early;
    while (auto line = job.synths[0]->ReadLine(milliseconds(60000))) {
      early += *line + "\n";
      if (line->find("iteration 2 ends") != std::string::npos) break;
    }
    std::this_thread::sleep_for(milliseconds(delay_ms));
    job.cluster.server(victim).Signal(signal);
    if (signal == SIGSTOP) {
      std::this_thread::sleep_for(milliseconds(3000));  // past the agents' 2 s peer_timeout
      job.cluster.server(victim).Signal(SIGCONT);
    }
    job.ExpectEveryRankExact(early);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(Failover, AKilledServerIsReplacedByItsBackupAndEveryResultStaysExact) {
  ExpectEveryTrialToSurviveALostServer(SIGKILL, 20);
}

// The replication factor is restored among the servers left (docs/server.md "Replication and
// failover"): after one server is killed, its keys' new primary and the primary whose backup it
// was each copy those keys to the next server of their chains, so a second server of the same
// chain killed later — the new primary (victim + 1) or the primary that lost its backup
// (victim - 1), in turn — costs the job nothing either: every result exact, every agent exits 0.
TEST(Failover, TwoServersOfOneChainKilledInTurnCostNothing) {
  int trials = 4;
  if (const char* n = std::getenv("POSEIDON_FAILOVER_TRIALS")) trials = std::atoi(n);
  const auto seed = static_cast<unsigned>(std::random_device{}());
  std::mt19937 rng(seed);
  constexpr int kIterations = 80;
  for (int trial = 0; trial < trials; ++trial) {
    const int first = static_cast<int>(rng() % 4);
    const int second = (first + (trial % 2 == 0 ? 1 : 3)) % 4;
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " trial " << trial << ": server "
                                      << first << " killed after iteration 2, server " << second
                                      << " after iteration 30");
    FailoverJob job(kIterations);
    ASSERT_TRUE(job.cluster.ok());
    std::string early;
    ASSERT_TRUE(job.KillInTurn(first, 2, second, 30, early)) << early;
    job.ExpectEveryRankExact(early);
    if (::testing::Test::HasFailure()) return;
  }
}

// Adoption is bounded by --max_memory: server 2 has room for its own keys and those it backs up
// from the start (about 1.2 MB of the tiny model's tables) but not for a third share. Server 1
// killed: server 0's keys, which it backed up, are refused by server 2 and copied to server 3.
// Server 0 killed later: the agents walk its keys' chain past the dead server 1 and past server
// 2, which holds no copy, to server 3. Every result exact, every agent exits 0.
TEST(Failover, AServerWithNoRoomToAdoptIsPassedOverAndTheNextOneTakesTheKeys) {
  constexpr int kIterations = 60;
  FailoverJob job(kIterations, {{2, {"--max_memory=1500000"}}});
  ASSERT_TRUE(job.cluster.ok());
  std::string early;
  ASSERT_TRUE(job.KillInTurn(1, 2, 0, 20, early)) << early;
  job.ExpectEveryRankExact(early);
  const std::string full = job.cluster.server(2).ReadAll(milliseconds(500));
  EXPECT_NE(full.find("has no room to adopt the keys of job 1 first held by server 0"),
            std::string::npos)
      << full;
}

// A frozen server (SIGSTOP: its sockets stay open) answers no ping: the agents give it up after
// their peer_timeout and go on at its keys' backup; its own primary gives it up as a backup. It
// is resumed 3 s later, while the run goes on.
TEST(Failover, AFrozenServerIsReplacedByItsBackupAndEveryResultStaysExact) {
  ExpectEveryTrialToSurviveALostServer(SIGSTOP, 3);
}

// Elastic workers (issue 18, docs/operations.md "A rank rejoins the running job"): rank 1's
// training process and agent are SIGKILLed mid-run; a new agent started with --rejoin takes up
// the running job at the servers' clock and a new training process follows it
// (psd_start_iteration). The others only wait: every rank finishes every iteration and every
// result is the exact sum over the three ranks, as in the fault-free run.
// Rank 1 (one of 3, two servers) is killed once it has done 10 iterations and its agent
// restarted — with --rejoin, or (`by_marker`) exactly as before, its --rejoin_if_restarted
// marker telling it it is a restart (a Kubernetes container restarted in its pod): it takes up
// the running job and every rank verifies every result. With `scheme` sfb the three FC layers go
// by SFB: the others send the restarted rank again their factors of the iteration it takes up
// and take its factors of an iteration they had as a retransmission.
void KilledRankTakesUpTheRunningJob(bool by_marker, const std::string& scheme = "ps") {
  const std::string markers =
      ::testing::TempDir() + "psd-e2e-markers-" + std::to_string(::getpid());
  std::filesystem::remove_all(markers);
  std::filesystem::create_directories(markers);
  std::vector<std::string> agent_flags = {"--rejoin_timeout=60s", "--log_level=info"};
  if (by_marker) agent_flags.push_back("--rejoin_if_restarted=" + markers);
  Cluster cluster(2, 3, scheme, agent_flags);
  ASSERT_TRUE(cluster.ok());
  const std::vector<std::string> slow = {"--compute_scale=10000", "--timeout_ms=120000"};
  std::vector<std::unique_ptr<Subprocess>> synths;
  for (int r = 0; r < 3; ++r) {
    std::vector<std::string> flags = slow;
    if (r == 1) flags.push_back("--print_iterations");
    synths.push_back(cluster.Synth(r, kTiny, 60, flags));
  }
  // Rank 1 is killed once it has done 10 iterations (however slow the build is to start).
  bool running = false;
  while (auto line = synths[1]->ReadLine(milliseconds(60000))) {
    if (line->find("iteration 10 ends") != std::string::npos) {
      running = true;
      break;
    }
  }
  ASSERT_TRUE(running) << "rank 1 did not reach iteration 10";
  if (by_marker) {
    EXPECT_TRUE(std::filesystem::exists(markers + "/poseidon-1-1.joined"));
  }
  synths[1]->Signal(SIGKILL);
  synths[1]->Wait(milliseconds(10000));
  ASSERT_TRUE(cluster.RejoinAgent(1, /*flag=*/!by_marker)) << cluster.early_output(1);
  synths[1] = cluster.Synth(1, kTiny, 60, slow);
  for (int r = 0; r < 3; ++r) {
    const std::string out = synths[r]->ReadAll(milliseconds(120000));
    ASSERT_EQ(synths[r]->Wait(milliseconds(10000)), 0) << out;
    EXPECT_NE(out.find(", 0 mismatches"), std::string::npos) << out;
    if (scheme == "sfb") {
      EXPECT_NE(out.find("3 on SFB"), std::string::npos) << out;
    }
    if (r != 1) {
      EXPECT_NE(out.find("verified 480 results"), std::string::npos) << out;  // 60 x 8 layers
      continue;
    }
    const size_t at = out.find("takes up the job at iteration ");
    ASSERT_NE(at, std::string::npos) << out;
    const int first = std::stoi(out.substr(at + 30));
    EXPECT_GT(first, 1) << out;
    EXPECT_NE(out.find("verified " + std::to_string((60 - first + 1) * 8) + " results"),
              std::string::npos)
        << out;
  }
  const std::string log = cluster.early_output(1) + cluster.agent(1).ReadAll(milliseconds(20000));
  EXPECT_NE(log.find("rank 1 rejoins job 1 at iteration"), std::string::npos) << log;
  if (scheme == "sfb") {
    const std::string log0 = cluster.early_output(0) + cluster.agent(0).ReadAll(milliseconds(20000));
    EXPECT_NE(log0.find("waiting up to 1m for it to rejoin"), std::string::npos) << log0;
    EXPECT_NE(log0.find("took up the job at iteration"), std::string::npos) << log0;
    // Rank 0 had sent its factors of the iteration taken up (the job completed it): again.
    EXPECT_NE(log0.find("sent rank 1 again"), std::string::npos) << log0;
  }
  if (by_marker) {
    EXPECT_NE(log.find("poseidon-1-1.joined exists: this agent restarts rank 1 of job 1 and "
                       "takes up the running job"),
              std::string::npos)
        << log;
  }
  std::filesystem::remove_all(markers);
}

TEST(Elastic, AKilledRankRestartedWithRejoinTakesUpTheRunningJobExactly) {
  KilledRankTakesUpTheRunningJob(/*by_marker=*/false);
}

TEST(Elastic, AKilledRankWithSfbLayersTakesUpTheRunningJobExactly) {
  KilledRankTakesUpTheRunningJob(/*by_marker=*/false, "sfb");
}

// The same restarted as it was first started (--rejoin_if_restarted): a Kubernetes pod's
// containers restart with the same arguments, and the marker in the pod's emptyDir tells.
TEST(Elastic, AnAgentRestartedAsItStartedRejoinsByItsMarker) {
  KilledRankTakesUpTheRunningJob(/*by_marker=*/true);
}

// Stop and resume (docs/operations.md): rank 0's agent has the server checkpoint the job after
// iterations 5 and 10 and at the end (12); a new server restores it and new agents, told the
// iteration, go on from every key's restored clock: every result exact (a clock out of step would
// be refused by the server's BSP check), through PS layers and fused buckets alike.
TEST(Checkpoints, AJobCheckpointedBetweenIterationsResumesOnFreshDaemons) {
  const std::string dir = ::testing::TempDir() + "psd-e2e-ckpt-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  const std::vector<std::string> server_flags = {"--checkpoint_dir=" + dir,
                                                 "--checkpoint_on_exit=false"};
  {
    Cluster cluster(1, 2, "ps", {"--checkpoint_every=5", "--checkpoint_at_end=true",
                                 "--log_level=info"},
                    server_flags);
    ASSERT_TRUE(cluster.ok());
    auto s0 = cluster.Synth(0, kTiny, 12), s1 = cluster.Synth(1, kTiny, 12);
    for (auto* s : {s0.get(), s1.get()}) {
      const std::string out = s->ReadAll(milliseconds(60000));
      ASSERT_EQ(s->Wait(milliseconds(10000)), 0) << out;
      EXPECT_NE(out.find(", 0 mismatches"), std::string::npos) << out;
    }
    const std::string log = cluster.agent(0).ReadAll(milliseconds(30000));
    for (int label : {5, 10, 12}) {
      EXPECT_NE(log.find("checkpoint after iteration " + std::to_string(label) + " written"),
                std::string::npos)
          << log;
    }
  }
  {
    Cluster cluster(1, 2, "ps", {"--resumed_iteration=12", "--checkpoint_every=5"},
                    server_flags);
    ASSERT_TRUE(cluster.ok());
    EXPECT_NE(cluster.server_early_output(0).find("restored job 1 at clock 12"),
              std::string::npos)
        << cluster.server_early_output(0);
    auto s0 = cluster.Synth(0, kTiny, 8), s1 = cluster.Synth(1, kTiny, 8);
    for (auto* s : {s0.get(), s1.get()}) {
      const std::string out = s->ReadAll(milliseconds(60000));
      EXPECT_EQ(s->Wait(milliseconds(10000)), 0) << out;
      EXPECT_NE(out.find("8 iterations"), std::string::npos) << out;
      EXPECT_NE(out.find(", 0 mismatches"), std::string::npos) << out;
    }
    for (int r = 0; r < 2; ++r) EXPECT_EQ(cluster.agent(r).Wait(milliseconds(20000)), 0);
  }
  std::filesystem::remove_all(dir);
}

// --lost_servers (a resume after a server loss, docs/operations.md "Stop and resume") is checked:
// a value that is not a list of server indices is the one-line config error with exit code 2,
// and indices the job cannot take (no such server; no backups, so no other copy) fail the
// agent's registration, naming why.
TEST(Checkpoints, ALostServersListIsCheckedAgainstTheJob) {
  for (const std::string bad : {"x", "1,-2", "70000"}) {
    Subprocess p({POSEIDON_AGENT_BIN, std::string("--secret=") + kSecret, "--segment=/psd-e2e-bad",
                  "--servers=127.0.0.1:1", "--lost_servers=" + bad},
                 /*merge_stderr=*/true);
    const std::string out = p.ReadAll(milliseconds(10000));
    EXPECT_EQ(p.Wait(milliseconds(10000)), 2) << out;
    EXPECT_NE(out.find("is not a server index"), std::string::npos) << out;
  }
  struct Case {
    std::vector<std::string> flags;
    std::string says;
  };
  for (const Case& c : {Case{{"--replicas=1", "--lost_servers=5"}, "there is no such server"},
                        Case{{"--replicas=0", "--lost_servers=1"}, "have no other copy"}}) {
    Cluster cluster(2, 1, "ps", c.flags);
    ASSERT_TRUE(cluster.ok());
    auto synth = cluster.Synth(0, kTiny, 3);
    synth->ReadAll(milliseconds(60000));
    EXPECT_NE(synth->Wait(milliseconds(10000)), 0);
    const std::string log = cluster.agent(0).ReadAll(milliseconds(30000));
    EXPECT_NE(cluster.agent(0).Wait(milliseconds(30000)), 0) << log;
    EXPECT_NE(log.find("--lost_servers names KV server"), std::string::npos) << log;
    EXPECT_NE(log.find(c.says), std::string::npos) << log;
  }
}

// Four ranks train 20 iterations of tiny while server 2 of 4 is lost before they connect: every
// result is exact, and every agent says the server could not be reached at start (and `why`,
// where given) and that its keys start at server 3.
void ExpectServer2LostAtStartToCostNothing(Cluster& cluster, const std::string& why = "") {
  std::vector<std::unique_ptr<Subprocess>> synths;
  for (int r = 0; r < 4; ++r) synths.push_back(cluster.Synth(r, kTiny, 20));
  for (int r = 0; r < 4; ++r) {
    const std::string out = synths[r]->ReadAll(milliseconds(120000));
    EXPECT_EQ(synths[r]->Wait(milliseconds(10000)), 0) << "rank " << r << ": " << out;
    EXPECT_NE(out.find("20 iterations"), std::string::npos) << out;
    EXPECT_NE(out.find(", 0 mismatches"), std::string::npos) << out;
  }
  for (int r = 0; r < 4; ++r) {
    const std::string log = cluster.agent(r).ReadAll(milliseconds(30000));
    EXPECT_EQ(cluster.agent(r).Wait(milliseconds(30000)), 0) << "agent " << r << ": " << log;
    EXPECT_NE(log.find("cannot be reached at start"), std::string::npos) << log;
    EXPECT_NE(log.find(why), std::string::npos) << log;
    EXPECT_NE(log.find("its keys start at server 3"), std::string::npos) << log;
  }
}

// A server lost during start-up, before the agents connected to it: with backups its keys start
// at the next server of their chains, every result exact; two neighbours lost leave some keys
// without a copy, which the registration names.
TEST(Failover, AServerLostBeforeTheAgentsConnectCostsNothingWithBackups) {
  const std::vector<std::string> agent_flags = {"--replicas=1", "--fusion=off",
                                                "--block_bytes=65536", "--connect_timeout=3s"};
  {
    Cluster cluster(4, 4, "ps", agent_flags, {"--peer_timeout=2s"});
    ASSERT_TRUE(cluster.ok());
    cluster.server(2).Signal(SIGKILL);
    cluster.server(2).Wait(milliseconds(5000));
    ExpectServer2LostAtStartToCostNothing(cluster);
  }
  {
    Cluster cluster(4, 2, "ps", agent_flags);
    ASSERT_TRUE(cluster.ok());
    for (int s : {1, 2}) {
      cluster.server(s).Signal(SIGKILL);
      cluster.server(s).Wait(milliseconds(5000));
    }
    auto s0 = cluster.Synth(0, kTiny, 5);
    auto s1 = cluster.Synth(1, kTiny, 5);
    const std::string out = s0->ReadAll(milliseconds(60000));
    EXPECT_NE(s0->Wait(milliseconds(10000)), 0) << out;
    EXPECT_NE(out.find("the keys first held by KV server 1 have no reachable copy"),
              std::string::npos)
        << out;
    s1->Wait(milliseconds(10000));
  }
}

// A server frozen before the agents connect (SIGSTOP: the kernel still takes its connections,
// it never answers the handshake) is lost after the agents' --peer_timeout of silence, not after
// --connect_timeout of attempts: its keys start at the next server of their chains, and every
// result is exact.
TEST(Failover, AServerFrozenBeforeTheAgentsConnectIsLostAfterTheirPeerTimeout) {
  Cluster cluster(4, 4, "ps",
                  {"--replicas=1", "--fusion=off", "--block_bytes=65536", "--connect_timeout=60s",
                   "--peer_timeout=2s"},
                  {"--peer_timeout=2s"});
  ASSERT_TRUE(cluster.ok());
  cluster.server(2).Signal(SIGSTOP);
  // Given up on its silence after one attempt of peer_timeout (the handshake's "within 1.99…s"),
  // not after 10 s attempts until connect_timeout.
  ExpectServer2LostAtStartToCostNothing(cluster, "it took the connection and said nothing");
  cluster.server(2).Signal(SIGKILL);
}

// Without a coordinator, a killed agent is named by what its death closes: the server's
// connection (PS layers) and the other agents' (SFB layers). Rank 0's training process must fail
// naming rank 1 long before the 60 s sync timeout, on either path alone.
void ExpectTheOtherRankToFailNamingRank1(Cluster& cluster, const std::string& model,
                                         int signal = SIGKILL) {
  auto s0 = cluster.Synth(0, model, 100000, {"--compute_scale=500", "--timeout_ms=120000"});
  auto s1 = cluster.Synth(1, model, 100000, {"--compute_scale=500", "--timeout_ms=120000"});
  std::this_thread::sleep_for(milliseconds(1500));
  cluster.agent(1).Signal(signal);
  const std::string out = s0->ReadAll(milliseconds(30000));  // half the sync timeout
  EXPECT_EQ(s0->Wait(milliseconds(10000)), 1) << out;
  EXPECT_NE(out.find("rank 1 (127.0.0.1:"), std::string::npos) << out;
  EXPECT_NE(out.find(signal == SIGKILL ? "is gone" : "is silent"), std::string::npos) << out;
  if (signal == SIGSTOP) cluster.agent(1).Signal(SIGKILL);
  s1->Wait(milliseconds(10000));
}

TEST(Faults, AKilledAgentIsNamedByTheServerToTheOtherRanks) {
  Cluster cluster(1, 2, "ps", {"--sync_timeout=60s"});
  ExpectTheOtherRankToFailNamingRank1(cluster, kTiny);
}

TEST(Faults, AKilledAgentIsNamedByItsPeerConnectionToTheOtherRanks) {
  Cluster cluster(0, 2, "sfb", {"--sync_timeout=60s"});
  ExpectTheOtherRankToFailNamingRank1(cluster, kFcOnly);
}

// A frozen agent (SIGSTOP: its sockets stay open) stops pinging: the server (PS layers) and the
// other agent (SFB layers) each declare it silent after their peer_timeout.
TEST(Faults, AFrozenAgentIsNamedByTheServerToTheOtherRanks) {
  Cluster cluster(1, 2, "ps", {"--sync_timeout=60s"}, {"--peer_timeout=2s"});
  ExpectTheOtherRankToFailNamingRank1(cluster, kTiny, SIGSTOP);
}

TEST(Faults, AFrozenAgentIsNamedByItsPeerToTheOtherRanks) {
  Cluster cluster(0, 2, "sfb", {"--sync_timeout=60s", "--peer_timeout=2s"});
  ExpectTheOtherRankToFailNamingRank1(cluster, kFcOnly, SIGSTOP);
}

// A peer agent frozen before the others connect (its listener takes the connection, nothing
// answers the handshake) fails their registration after one attempt of their peer_timeout,
// naming it, not after connect_timeout (60 s) of 10 s attempts.
TEST(Faults, APeerAgentFrozenBeforeTheOthersConnectIsNamedAfterTheirPeerTimeout) {
  Cluster cluster(0, 2, "sfb", {"--connect_timeout=60s", "--peer_timeout=2s"});
  ASSERT_TRUE(cluster.ok());
  cluster.agent(1).Signal(SIGSTOP);
  auto s0 = cluster.Synth(0, kFcOnly, 2, {"--timeout_ms=120000"});
  const std::string out = s0->ReadAll(milliseconds(30000));  // half the connect timeout
  EXPECT_EQ(s0->Wait(milliseconds(10000)), 1) << out;
  EXPECT_NE(out.find("peer agent of rank 1 at 127.0.0.1:"), std::string::npos) << out;
  EXPECT_NE(out.find("it took the connection and said nothing"), std::string::npos) << out;
  cluster.agent(1).Signal(SIGKILL);
}

TEST(Faults, ASecondAgentOnALiveSegmentIsRefusedAndTheFirstServesOn) {
  Cluster cluster(1, 1, "ps");
  Subprocess second({POSEIDON_AGENT_BIN, std::string("--secret=") + kSecret, "--rank=0",
                     "--world_size=1", "--scheme=ps", "--segment=" + cluster.segment(0),
                     "--attach_timeout=5s", "--log_level=warn"},
                    /*merge_stderr=*/true);
  const std::string out = second.ReadAll(milliseconds(30000));
  EXPECT_EQ(second.Wait(milliseconds(10000)), 1) << out;
  EXPECT_NE(out.find("is in use by poseidon-agent pid"), std::string::npos) << out;
  // The first agent still owns its segment: a training process attaches and synchronises.
  auto synth = cluster.Synth(0, kTiny, 3);
  const std::string synth_out = synth->ReadAll(milliseconds(60000));
  EXPECT_EQ(synth->Wait(milliseconds(10000)), 0) << synth_out;
  EXPECT_NE(synth_out.find("0 mismatches"), std::string::npos) << synth_out;
}

TEST(Faults, AHostileWriterOnTheSharedMemoryDoesNotCrashTheAgent) {
  Cluster cluster(1, 1, "ps");
  auto synth = cluster.Synth(0, kTiny, 100000, {"--compute_scale=200"});
  std::this_thread::sleep_for(milliseconds(1500));
  const int fd = shm_open(cluster.segment(0).c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  auto* control = static_cast<unsigned char*>(
      mmap(nullptr, PSD_SHM_CONTROL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  ASSERT_NE(control, MAP_FAILED);
  std::mt19937_64 rng(3);
  const auto end = std::chrono::steady_clock::now() + milliseconds(2000);
  while (std::chrono::steady_clock::now() < end) {
    // Scribble on the framework-to-agent ring (indices and events) and the layer table.
    const size_t ring_at = PSD_SHM_TO_AGENT_OFFSET + rng() % sizeof(psd_shm_ring);
    control[ring_at] = static_cast<unsigned char>(rng());
    auto* ring = reinterpret_cast<psd_shm_ring*>(control + PSD_SHM_TO_AGENT_OFFSET);
    if (rng() % 4 == 0) __atomic_store_n(&ring->tail, rng(), __ATOMIC_RELEASE);
    const size_t layer_at = PSD_SHM_LAYERS_OFFSET + rng() % (8 * sizeof(psd_shm_layer));
    control[layer_at] = static_cast<unsigned char>(rng());
  }
  munmap(control, PSD_SHM_CONTROL_BYTES);
  synth->Signal(SIGKILL);
  synth->Wait(milliseconds(10000));
  // The agent survived the scribbling: it noticed the training process died and exited clearly
  // (3), not by a signal or a sanitizer report.
  const std::string out = cluster.agent(0).ReadAll(milliseconds(30000));
  const auto code = cluster.agent(0).Wait(milliseconds(10000));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 3) << out;
  EXPECT_EQ(out.find("AddressSanitizer"), std::string::npos) << out;
  EXPECT_EQ(out.find("runtime error"), std::string::npos) << out;
}

// PSD_LAYER_COUNTERS is held by the KV servers under a server-side rule: without one the agent
// refuses it, naming the layer.
TEST(CAbi, ACountersLayerNeedsAServerSideRule) {
  Cluster cluster(1, 1, "ps");
  psd_context* ctx = cluster.Attach(0);
  ASSERT_NE(ctx, nullptr);
  const uint64_t shape[1] = {2};
  psd_layer_desc layer{"position", PSD_LAYER_OTHER, PSD_FLOAT32, 1, shape, 0, PSD_LAYER_COUNTERS};
  EXPECT_EQ(psd_register_layers(ctx, &layer, 1, 30000), PSD_FAILED_PRECONDITION);
  const std::string why = psd_last_error();
  EXPECT_NE(why.find("layer position is a layer of counters (PSD_LAYER_COUNTERS)"),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("psd_set_server_rule"), std::string::npos) << why;
  psd_detach(ctx);
}

TEST(CAbi, MisuseReturnsTheRightStatus) {
  Cluster cluster(0, 1, "sfb");  // an SFB-only model needs no server
  psd_config config;
  psd_config_init(&config);
  const std::string segment = cluster.segment(0);
  config.segment = segment.c_str();
  psd_context* ctx = nullptr;
  ASSERT_EQ(psd_attach(&config, &ctx), PSD_OK) << psd_last_error();
  psd_context* second = nullptr;
  EXPECT_EQ(psd_attach(&config, &second), PSD_ALREADY_ATTACHED);
  EXPECT_NE(std::string(psd_last_error()).find("attached"), std::string::npos);
  EXPECT_EQ(psd_layer_ready(ctx, 0, 1), PSD_FAILED_PRECONDITION) << "before registration";
  // The world it trains in: the one the job started with until it shrinks (ops_shrink).
  uint32_t world_rank = 9, world_size = 9;
  uint64_t generation = 9;
  ASSERT_EQ(psd_world(ctx, &world_rank, &world_size, &generation), PSD_OK) << psd_last_error();
  EXPECT_EQ(world_rank, 0u);
  EXPECT_EQ(world_size, 1u);
  EXPECT_EQ(generation, 0u);
  EXPECT_EQ(psd_world(ctx, &world_rank, &world_size, nullptr), PSD_INVALID_ARGUMENT);
  EXPECT_EQ(psd_world(nullptr, &world_rank, &world_size, &generation), PSD_INVALID_ARGUMENT);
  // No rank took up the job, and the agent waits for none (no --rejoin_timeout).
  uint64_t takeovers = 9;
  uint32_t rejoin_ms = 9;
  ASSERT_EQ(psd_takeovers(ctx, &takeovers, &rejoin_ms), PSD_OK) << psd_last_error();
  EXPECT_EQ(takeovers, 0u);
  EXPECT_EQ(rejoin_ms, 0u);
  EXPECT_EQ(psd_takeovers(ctx, &takeovers, nullptr), PSD_INVALID_ARGUMENT);

  const uint64_t bad_shape[2] = {0, 4};
  psd_layer_desc bad{"fc.weight", PSD_LAYER_FC, PSD_FLOAT32, 2, bad_shape, 4, 0};
  EXPECT_EQ(psd_register_layers(ctx, &bad, 1, 10000), PSD_INVALID_ARGUMENT);
  const uint64_t shape[2] = {8, 4};
  psd_layer_desc unknown_flag{"fc.weight", PSD_LAYER_FC, PSD_FLOAT32, 2, shape, 4, 32u};
  EXPECT_EQ(psd_register_layers(ctx, &unknown_flag, 1, 10000), PSD_INVALID_ARGUMENT);
  EXPECT_NE(std::string(psd_last_error()).find("unknown flags 0x20"), std::string::npos)
      << psd_last_error();
  psd_layer_desc fused_own_clock{"fc.weight", PSD_LAYER_FC, PSD_FLOAT32, 2, shape, 4,
                                 PSD_LAYER_OWN_CLOCK | PSD_LAYER_FUSABLE};
  EXPECT_EQ(psd_register_layers(ctx, &fused_own_clock, 1, 10000), PSD_INVALID_ARGUMENT);
  EXPECT_NE(std::string(psd_last_error()).find("exclude each other"), std::string::npos)
      << psd_last_error();
  psd_layer_desc good{"fc.weight", PSD_LAYER_FC, PSD_FLOAT32, 2, shape, 4, 0};
  ASSERT_EQ(psd_register_layers(ctx, &good, 1, 30000), PSD_OK) << psd_last_error();
  EXPECT_EQ(psd_register_layers(ctx, &good, 1, 1000), PSD_FAILED_PRECONDITION) << "twice";

  psd_layer_info info;
  EXPECT_EQ(psd_get_layer_info(ctx, 7, &info), PSD_INVALID_ARGUMENT) << "bad layer";
  ASSERT_EQ(psd_get_layer_info(ctx, 0, &info), PSD_OK);
  EXPECT_EQ(info.scheme, PSD_SYNC_SFB);
  EXPECT_EQ(info.elements, 32u);
  EXPECT_EQ(psd_layer_ready(ctx, 3, 1), PSD_INVALID_ARGUMENT) << "bad layer";
  EXPECT_EQ(psd_layer_ready(ctx, 0, 2), PSD_INVALID_ARGUMENT) << "skips iteration 1";
  EXPECT_EQ(psd_wait_layer(ctx, 0, 1, 100), PSD_FAILED_PRECONDITION) << "never posted";
  for (int i = 0; i < 32; ++i) info.u[i] = 1.0f, info.v[i] = 1.0f;
  ASSERT_EQ(psd_layer_ready(ctx, 0, 1), PSD_OK) << psd_last_error();
  ASSERT_EQ(psd_wait_layer(ctx, 0, 1, 30000), PSD_OK) << psd_last_error();
  EXPECT_EQ(info.grad[0], 4.0f) << "U^T V with K = 4 ones";
  EXPECT_EQ(psd_wait_layer(ctx, 0, 2, 100), PSD_FAILED_PRECONDITION) << "a future iteration";
  psd_config old = config;
  old.abi_version = 99;
  EXPECT_EQ(psd_attach(&old, &second), PSD_VERSION_MISMATCH);
  psd_config missing = config;
  missing.segment = "/psd-no-such-segment";
  missing.attach_timeout_ms = 100;
  EXPECT_EQ(psd_attach(&missing, &second), PSD_NOT_FOUND);
  EXPECT_EQ(psd_detach(ctx), PSD_OK);
  EXPECT_EQ(cluster.agent(0).Wait(milliseconds(20000)), 0) << "detach ends the agent cleanly";
}

// Writes an event onto the framework-to-agent ring as a (misbehaving) framework would, behind
// libposeidon's back (the agent polls the ring every 100 ms even without a wake-up).
void ForgeEvent(psd_shm_ring& ring, const psd_shm_event& event) {
  const uint64_t tail = __atomic_load_n(&ring.tail, __ATOMIC_ACQUIRE);
  ring.events[tail % PSD_SHM_RING_CAPACITY] = event;
  __atomic_store_n(&ring.tail, tail + 1, __ATOMIC_RELEASE);
  __atomic_add_fetch(&ring.doorbell, 1, __ATOMIC_RELEASE);
}

// The CUDA calls fail clearly where CUDA cannot be used, and the agent refuses a layer posted on
// the GPU by a framework that never attached an arena (a forged event on the ring).
TEST(CAbi, CudaMisuseAndNoDeviceAreReportedClearly) {
  Cluster cluster(0, 1, "sfb");
  psd_context* ctx = cluster.Attach(0);
  ASSERT_NE(ctx, nullptr);
  EXPECT_EQ(psd_cuda_enable(ctx, 0, 1000), PSD_FAILED_PRECONDITION) << "before registration";
  const uint64_t shape[2] = {8, 4};
  psd_layer_desc good{"fc.weight", PSD_LAYER_FC, PSD_FLOAT32, 2, shape, 4, 0};
  ASSERT_EQ(psd_register_layers(ctx, &good, 1, 30000), PSD_OK) << psd_last_error();
  float *g = nullptr, *u = nullptr, *v = nullptr;
  EXPECT_EQ(psd_cuda_layer_buffers(ctx, 0, &g, &u, &v), PSD_FAILED_PRECONDITION);
  EXPECT_EQ(psd_cuda_layer_ready(ctx, 0, 1, nullptr), PSD_FAILED_PRECONDITION);
  EXPECT_NE(std::string(psd_last_error()).find("CUDA is not enabled"), std::string::npos);
  bool have_device = false;
#ifdef POSEIDON_HAVE_CUDA
  int devices = 0;
  have_device = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#endif
  if (!have_device) {
    EXPECT_EQ(psd_cuda_enable(ctx, 0, 10000), PSD_FAILED_PRECONDITION);
    const std::string why = psd_last_error();
    EXPECT_TRUE(why.find("no CUDA device") != std::string::npos ||
                why.find("CUDA runtime") != std::string::npos)
        << why;
  } else {
    EXPECT_EQ(psd_cuda_enable(ctx, 99, 10000), PSD_INVALID_ARGUMENT) << "no such device";
  }

  // A LAYER_READY "on the device" written straight onto the ring: the agent must fail the
  // layer (no arena), not read device memory it does not have.
  const int fd = shm_open(cluster.segment(0).c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  auto* control = static_cast<unsigned char*>(
      mmap(nullptr, PSD_SHM_CONTROL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  ASSERT_NE(control, MAP_FAILED);
  auto* ring = reinterpret_cast<psd_shm_ring*>(control + PSD_SHM_TO_AGENT_OFFSET);
  auto* layer = reinterpret_cast<psd_shm_layer*>(control + PSD_SHM_LAYERS_OFFSET);
  __atomic_store_n(&layer->ready_iteration, 1, __ATOMIC_RELEASE);
  ForgeEvent(*ring, {PSD_EVENT_LAYER_READY, 0, 1, 0, 0, PSD_READY_DEVICE});
  EXPECT_EQ(psd_wait_layer(ctx, 0, 1, 30000), PSD_SYNC_FAILED);
  EXPECT_NE(std::string(psd_last_error()).find("no CUDA arena"), std::string::npos)
      << psd_last_error();

  // A forged CUDA attach with a garbage arena handle: the agent loads its CUDA plugin, and
  // refuses (no device here, or a handle that does not open) with the reason, and lives on.
  auto* header = reinterpret_cast<psd_shm_header*>(control);
  header->cuda_device = 0;
  __atomic_store_n(&header->cuda_arena_bytes, __atomic_load_n(&header->data_bytes, __ATOMIC_ACQUIRE),
                   __ATOMIC_RELEASE);
  std::memset(header->cuda_arena_handle, 0x5a, sizeof(header->cuda_arena_handle));
  __atomic_store_n(&header->cuda_state, PSD_CUDA_REQUESTED, __ATOMIC_RELEASE);
  ForgeEvent(*ring, {PSD_EVENT_CUDA_ATTACH, 0, 0, 0, 0, 0});
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (__atomic_load_n(&header->cuda_state, __ATOMIC_ACQUIRE) == PSD_CUDA_REQUESTED &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_EQ(__atomic_load_n(&header->cuda_state, __ATOMIC_ACQUIRE), PSD_CUDA_FAILED);
  const std::string why(header->error, strnlen(header->error, PSD_SHM_ERROR_BYTES));
  EXPECT_TRUE(why.find("CUDA") != std::string::npos) << why;
  EXPECT_EQ(__atomic_load_n(&header->agent_state, __ATOMIC_ACQUIRE), PSD_AGENT_SERVING);
  munmap(control, PSD_SHM_CONTROL_BYTES);
  EXPECT_EQ(psd_detach(ctx), PSD_OK);
  EXPECT_EQ(cluster.agent(0).Wait(milliseconds(20000)), 0);
}

}  // namespace
}  // namespace poseidon::testing

namespace poseidon::testing {
namespace {

// Fused layers are synchronised from host memory only: one posted "on the GPU" fails clearly.
TEST(Buckets, AFusedLayerPostedOnTheGpuIsRefused) {
  Cluster cluster(1, 1, "ps");
  psd_context* ctx = cluster.Attach(0);
  ASSERT_NE(ctx, nullptr);
  const uint64_t shape[1] = {16};
  psd_layer_desc layers[2] = {{"a", PSD_LAYER_OTHER, PSD_FLOAT32, 1, shape, 0, PSD_LAYER_FUSABLE},
                              {"b", PSD_LAYER_OTHER, PSD_FLOAT32, 1, shape, 0, PSD_LAYER_FUSABLE}};
  ASSERT_EQ(psd_register_layers(ctx, layers, 2, 30000), PSD_OK) << psd_last_error();
  const int fd = shm_open(cluster.segment(0).c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  auto* control = static_cast<unsigned char*>(
      mmap(nullptr, PSD_SHM_CONTROL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  ASSERT_NE(control, MAP_FAILED);
  auto* layer = reinterpret_cast<psd_shm_layer*>(control + PSD_SHM_LAYERS_OFFSET);
  __atomic_store_n(&layer->ready_iteration, 1, __ATOMIC_RELEASE);
  ForgeEvent(*reinterpret_cast<psd_shm_ring*>(control + PSD_SHM_TO_AGENT_OFFSET),
             {PSD_EVENT_LAYER_READY, 0, 1, 0, 0, PSD_READY_DEVICE});
  EXPECT_EQ(psd_wait_layer(ctx, 0, 1, 30000), PSD_SYNC_FAILED);
  EXPECT_NE(std::string(psd_last_error()).find("fused"), std::string::npos) << psd_last_error();
  munmap(control, PSD_SHM_CONTROL_BYTES);
  EXPECT_EQ(psd_detach(ctx), PSD_OK);
}

// Which layer the agent starts a chunk of, in the order it started them: the "queue" spans of
// its timeline (written as each chunk starts), and where each layer's "ready" came in among them
// (-1 - layer). The timeline is written in that order under one mutex.
std::vector<int> StartsAndReadies(const std::string& path) {
  std::ifstream in(path);
  std::vector<int> out;
  std::string line;
  const std::regex event("\"name\": \"(queue|ready)\".*\"tid\": ([0-9]+)");
  while (std::getline(in, line)) {
    std::smatch m;
    if (!std::regex_search(line, m, event)) continue;
    const int layer = std::stoi(m[2].str());
    out.push_back(m[1].str() == "queue" ? layer : -1 - layer);
  }
  return out;
}

// Layers posted top first (as backward does) are synchronised by priority: layer 0, which the
// next forward needs first, overtakes the queued chunks of the larger layers posted before it.
// Checked on the agent's own record of what it started when, so that how fast the posts follow
// each other (a test thread descheduled under load) does not matter: once layer 0 is ready the
// next chunk started is layer 0's (one other may be starting as it arrives: with 4 KiB of credit
// and 64 KiB chunks a chunk starts only when every one in flight is parked), and once all four
// are ready chunks start in layer order (after at most one already starting).
TEST(Scheduling, TheLayerTheNextForwardNeedsFirstIsSynchronisedFirst) {
  const std::string timeline =
      "/tmp/psd-timeline-sched-" + std::to_string(::getpid()) + "-{rank}.json";
  std::string path = timeline;
  path.replace(path.find("{rank}"), 6, "0");
  Cluster cluster(1, 1, "ps",
                  {"--sync_threads=1", "--credit_bytes=4096", "--block_bytes=65536",
                   "--timeline=" + timeline});
  psd_context* ctx = cluster.Attach(0);
  ASSERT_NE(ctx, nullptr);
  const uint64_t small[1] = {1024}, big[1] = {1u << 20};
  psd_layer_desc layers[4] = {{"l0", PSD_LAYER_OTHER, PSD_FLOAT32, 1, small, 0, 0},
                              {"l1", PSD_LAYER_OTHER, PSD_FLOAT32, 1, big, 0, 0},
                              {"l2", PSD_LAYER_OTHER, PSD_FLOAT32, 1, big, 0, 0},
                              {"l3", PSD_LAYER_OTHER, PSD_FLOAT32, 1, big, 0, 0}};
  ASSERT_EQ(psd_register_layers(ctx, layers, 4, 30000), PSD_OK) << psd_last_error();
  for (uint32_t l = 4; l-- > 0;) ASSERT_EQ(psd_layer_ready(ctx, l, 1), PSD_OK);
  for (uint32_t l = 0; l < 4; ++l) {
    ASSERT_EQ(psd_wait_layer(ctx, l, 1, 60000), PSD_OK) << "layer " << l << ": "
                                                        << psd_last_error();
  }
  EXPECT_EQ(psd_detach(ctx), PSD_OK);
  EXPECT_EQ(cluster.agent(0).Wait(milliseconds(20000)), 0);  // the timeline is closed

  const std::vector<int> record = StartsAndReadies(path);
  std::remove(path.c_str());
  std::string text;
  for (int e : record) text += (e < 0 ? "r" + std::to_string(-1 - e) : std::to_string(e)) + " ";
  const auto ready_of = [&](int layer) {
    return std::find(record.begin(), record.end(), -1 - layer) - record.begin();
  };
  ASSERT_EQ(std::count_if(record.begin(), record.end(), [](int e) { return e >= 0; }),
            1 + 3 * 64)
      << "one chunk for l0, 64 of 64 KiB for each 4 MiB layer: " << text;
  for (int l = 0; l < 4; ++l) ASSERT_LT(ready_of(l), static_cast<long>(record.size())) << text;
  // After l0 is ready: at most one other chunk starts before l0's.
  const long l0_ready = ready_of(0);
  const long l0_start = std::find(record.begin() + l0_ready, record.end(), 0) - record.begin();
  ASSERT_LT(l0_start, static_cast<long>(record.size())) << text;
  long others = 0;
  for (long i = l0_ready + 1; i < l0_start; ++i) others += record[static_cast<size_t>(i)] > 0;
  EXPECT_LE(others, 1) << "chunks started after l0 was ready and before l0's: " << text;
  // After all four are ready: layer order, after at most one chunk already starting.
  const long all_ready = std::max({ready_of(0), ready_of(1), ready_of(2), ready_of(3)});
  std::vector<int> after;
  for (long i = all_ready + 1; i < static_cast<long>(record.size()); ++i) {
    if (record[static_cast<size_t>(i)] >= 0) after.push_back(record[static_cast<size_t>(i)]);
  }
  if (!after.empty()) after.erase(after.begin());
  EXPECT_TRUE(std::is_sorted(after.begin(), after.end()))
      << "chunk starts once every layer was ready: " << text;
}

}  // namespace
}  // namespace poseidon::testing

namespace poseidon::testing {
namespace {

std::string HttpGet(const std::string& host_port, const std::string& path) {
  const auto colon = host_port.rfind(':');
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(host_port.substr(colon + 1))));
  inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: x\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

// Observability of the agent: its metrics, its timeline, and the stall detector naming what a
// layer waits for.
TEST(Observability, MetricsTimelineAndStallReports) {
  const std::string timeline = "/tmp/psd-timeline-" + std::to_string(::getpid()) + "-{rank}.json";
  Cluster cluster(1, 2, "ps",
                  {"--stall_timeout=1s", "--metrics_listen=127.0.0.1:0", "--timeline=" + timeline});
  // Rank 1's training process never starts: rank 0's layers wait for its pushes.
  auto synth = cluster.Synth(0, kTiny, 3, {"--timeout_ms=4000"});
  std::string agent_out = cluster.early_output(0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::string metrics_address;
  if (auto at = agent_out.find("metrics on "); at != std::string::npos) {
    metrics_address = agent_out.substr(at + 11, agent_out.find('\n', at) - at - 11);
  }
  while (std::chrono::steady_clock::now() < deadline) {
    auto line = cluster.agent(0).ReadLine(milliseconds(500));
    if (!line) continue;
    agent_out += *line + "\n";
    if (auto at = line->find("metrics on "); at != std::string::npos) {
      metrics_address = line->substr(at + 11);
    }
    if (line->find("stall:") != std::string::npos) break;
  }
  EXPECT_NE(agent_out.find("stall: layer"), std::string::npos) << agent_out;
  EXPECT_NE(agent_out.find("chunks [key"), std::string::npos) << "names the chunks: " << agent_out;
  ASSERT_FALSE(metrics_address.empty()) << agent_out;
  const std::string metrics = HttpGet(metrics_address, "/metrics");
  const auto stall = metrics.find("poseidon_agent_errors_total{kind=\"stall\"} ");
  ASSERT_NE(stall, std::string::npos) << metrics;
  EXPECT_GE(std::stoi(metrics.substr(stall + 42)), 1) << metrics.substr(stall, 60);
  EXPECT_NE(metrics.find("poseidon_agent_layer_scheme{layer=\"fc1.weight\"} 1"), std::string::npos);
  EXPECT_NE(metrics.find("poseidon_agent_push_bytes_total"), std::string::npos);
  synth->Wait(milliseconds(30000));
  cluster.agent(0).Signal(SIGTERM);
  cluster.agent(0).Wait(milliseconds(10000));
  // The timeline is valid Chrome-trace JSON with the ready events of every layer.
  std::string path = timeline;
  path.replace(path.find("{rank}"), 6, "0");
  std::ifstream in(path);
  const std::string json((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(json.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(json.find("\"name\": \"ready\""), std::string::npos) << json.substr(0, 500);
  // The merge command reads it back (it is valid JSON) into one view.
  const std::string merged = path + ".merged";
  const std::string cmd = std::string("/usr/bin/python3 ") + POSEIDON_SOURCE_DIR +
                          "/tools/timeline_merge.py -o " + merged + " " + path;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream merged_in(merged);
  const std::string merged_json((std::istreambuf_iterator<char>(merged_in)), {});
  EXPECT_NE(merged_json.find("\"ready\""), std::string::npos);
  std::remove(path.c_str());
  std::remove(merged.c_str());
}

}  // namespace
}  // namespace poseidon::testing
