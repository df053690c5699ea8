// --transport=auto|tcp|rdma on poseidon-server and poseidon-agent, as real processes: a bad value
// and --transport=rdma on a machine without an RDMA device are one-line refusals with exit code
// 2; servers and agents started with --transport=tcp train end to end with every result exact;
// and `auto` (the default) logs its one choice, TCP here. (RDMA between processes needs a device:
// the test verbs provider is in-process only, docs/wire.md.)
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include <chrono>
#include <random>

#include "absl/strings/str_split.h"
#include "tests/subprocess.h"
#include "transport/rdma/rdma_context.h"

namespace poseidon::testing {
namespace {

using std::chrono::milliseconds;

constexpr char kSecret[] = "transport-flag-secret";
const std::string kTiny = POSEIDON_TEST_MODELS "/tiny.json";

// The non-empty lines of `out`.
std::vector<std::string> Lines(const std::string& out) {
  return absl::StrSplit(out, '\n', absl::SkipWhitespace());
}

bool RdmaDeviceHere() {
#ifdef POSEIDON_HAVE_RDMA
  return transport::RdmaDeviceStatus(transport::RdmaOptions{}).ok();
#else
  return false;
#endif
}

struct Exited {
  int code = -1;
  std::string output;  // stdout and stderr
};

Exited RunToExit(const std::vector<std::string>& argv) {
  Subprocess p(argv, /*merge_stderr=*/true);
  Exited r;
  r.output = p.ReadAll(milliseconds(30000));
  r.code = p.Wait(milliseconds(30000)).value_or(-1);
  return r;
}

std::vector<std::string> ServerArgs(std::vector<std::string> extra) {
  std::vector<std::string> args{POSEIDON_SERVER_BIN, "--listen=127.0.0.1:0", "--job_id=1",
                                std::string("--job_secret=") + kSecret};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::vector<std::string> AgentArgs(const std::string& segment, std::vector<std::string> extra) {
  std::vector<std::string> args{POSEIDON_AGENT_BIN, std::string("--secret=") + kSecret,
                                "--segment=" + segment, "--attach_timeout=60s"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST(TransportFlag, RdmaWithoutADeviceIsAOneLineRefusalWithExitCode2) {
  if (RdmaDeviceHere()) GTEST_SKIP() << "this machine has an RDMA device";
  const std::string segment = "/psd-tflag-" + std::to_string(::getpid()) + "-rdma";
  for (const auto& argv : {ServerArgs({"--transport=rdma"}),
                           AgentArgs(segment, {"--transport=rdma", "--servers=127.0.0.1:1"})}) {
    const Exited r = RunToExit(argv);
    EXPECT_EQ(r.code, 2) << argv[0] << ":\n" << r.output;
    const std::vector<std::string> lines = Lines(r.output);
    ASSERT_EQ(lines.size(), 1u) << argv[0] << ":\n" << r.output;
    EXPECT_NE(lines[0].find("refusing to start: --transport=rdma, but RDMA is not usable here"),
              std::string::npos)
        << lines[0];
  }
  // The agent refused before creating its shared-memory segment.
  EXPECT_EQ(shm_unlink(segment.c_str()), -1);
}

TEST(TransportFlag, AnUnknownValueIsTheOneLineConfigError) {
  const std::string segment = "/psd-tflag-" + std::to_string(::getpid()) + "-bad";
  for (const auto& argv :
       {ServerArgs({"--transport=infiniband"}), AgentArgs(segment, {"--transport=infiniband"})}) {
    const Exited r = RunToExit(argv);
    EXPECT_EQ(r.code, 2) << r.output;
    const std::vector<std::string> lines = Lines(r.output);
    ASSERT_EQ(lines.size(), 1u) << r.output;
    EXPECT_NE(lines[0].find("--transport"), std::string::npos) << lines[0];
    EXPECT_NE(lines[0].find("auto, tcp, rdma"), std::string::npos) << lines[0];
  }
}

// One server, two agents (PS and SFB layers: the tiny model's plan at 2 ranks), each training
// process verifying every result against the exact sum. `transport_flag` on every daemon (empty:
// the default); returns what the agents logged.
std::string TrainTinyModel(const std::string& transport_flag) {
  std::vector<std::string> extra;
  if (!transport_flag.empty()) extra.push_back(transport_flag);
  std::vector<std::string> server_args = ServerArgs(extra);
  server_args.push_back("--log_level=info");
  Subprocess server(server_args, /*merge_stderr=*/true);
  std::string address, server_said;
  while (auto line = server.ReadLine(milliseconds(20000))) {
    server_said += *line + "\n";
    if (auto at = line->find("listening on "); at != std::string::npos) {
      address = line->substr(at + 13);
      break;
    }
  }
  EXPECT_FALSE(address.empty()) << server_said;
  if (address.empty()) return "";
  // Both agents' peer ports: free loopback ports below the ephemeral range, chosen here; one
  // taken meanwhile (by another test) makes that agent refuse at once: start both again.
  auto free_port = [] { return "127.0.0.1:" + std::to_string(FreeLoopbackPort()); };
  std::vector<std::unique_ptr<Subprocess>> agents, synths;
  std::vector<std::string> segments, said;
  auto unlink_segments = [&] {
    for (const std::string& segment : segments) {
      shm_unlink(segment.c_str());
      shm_unlink((segment + ".data").c_str());
    }
  };
  bool all_ready = false;
  for (int attempt = 0; attempt < 5 && !all_ready; ++attempt) {
    agents.clear();
    unlink_segments();
    segments.clear();
    said.assign(2, "");
    const std::string peers = free_port() + "," + free_port();
    static int clusters = 0;  // unique per cluster: a killed agent leaves its segment behind
    const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(clusters++);
    for (int r = 0; r < 2; ++r) {
      segments.push_back("/psd-tflag-" + tag + "-" + std::to_string(r));
      std::vector<std::string> argv = AgentArgs(
          segments.back(), {"--rank=" + std::to_string(r), "--world_size=2", "--servers=" + address,
                            "--peers=" + peers, "--scheme=auto", "--log_level=info"});
      argv.insert(argv.end(), extra.begin(), extra.end());
      agents.push_back(std::make_unique<Subprocess>(argv, /*merge_stderr=*/true));
    }
    all_ready = true;
    bool port_taken = false;
    for (int r = 0; r < 2; ++r) {
      bool ready = false;
      while (auto line = agents[r]->ReadLine(milliseconds(20000))) {
        said[r] += *line + "\n";
        if (line->find("poseidon-agent ready") != std::string::npos) {
          ready = true;
          break;
        }
      }
      all_ready = all_ready && ready;
      port_taken = port_taken || said[r].find("Address already in use") != std::string::npos;
    }
    if (!all_ready && !port_taken) break;
  }
  EXPECT_TRUE(all_ready) << "agent 0:\n" << said[0] << "agent 1:\n" << said[1];
  if (!all_ready) {
    unlink_segments();
    return "";
  }
  for (int r = 0; r < 2; ++r) {
    synths.push_back(std::make_unique<Subprocess>(
        std::vector<std::string>{POSEIDON_SYNTH_BIN, "--segment=" + segments[r], "--model=" + kTiny,
                                 "--batch=8", "--iterations=20", "--verify"},
        /*merge_stderr=*/true));
  }
  std::vector<std::string> trained(2);
  for (int r = 0; r < 2; ++r) {
    trained[r] = synths[r]->ReadAll(milliseconds(120000));
    trained[r] += "exit code " + std::to_string(synths[r]->Wait(milliseconds(10000)).value_or(-1));
  }
  std::string all;
  for (int r = 0; r < 2; ++r) {
    said[r] += agents[r]->ReadAll(milliseconds(20000));
    all += said[r];
    EXPECT_EQ(agents[r]->Wait(milliseconds(20000)), 0) << said[r];
  }
  for (int r = 0; r < 2; ++r) {
    // What every process said, on a failure.
    EXPECT_NE(trained[r].find("exit code 0"), std::string::npos)
        << "training process " << r << ":\n"
        << trained[r] << "\nagents:\n"
        << all;
    EXPECT_NE(trained[r].find("verified 160 results, 0 mismatches"), std::string::npos)
        << trained[r];
  }
  unlink_segments();
  server.Signal(SIGTERM);
  server_said += server.ReadAll(milliseconds(20000));
  EXPECT_EQ(server.Wait(milliseconds(20000)), 0) << server_said;
  return all + server_said;
}

size_t Count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

TEST(TransportFlag, TcpServersAndAgentsTrainEndToEndExactly) {
  const std::string said = TrainTinyModel("--transport=tcp");
  // Two agents and the server, each said its choice once.
  EXPECT_EQ(Count(said, "transport: tcp (--transport=tcp)"), 3u) << said;
}

TEST(TransportFlag, AutoWithoutACoordinatorIsTcpAndSaysSoOnce) {
  // The default. Without a coordinator the --servers and --peers lists are TCP addresses,
  // whether or not this machine has a device.
  const std::string said = TrainTinyModel("");
  EXPECT_EQ(Count(said, "transport: tcp (--transport=auto without a coordinator"), 3u) << said;
  EXPECT_EQ(Count(said, "transport: "), 3u) << said;
}

}  // namespace
}  // namespace poseidon::testing
