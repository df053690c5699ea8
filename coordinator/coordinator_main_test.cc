// poseidon-coordinator as a process: it prints its port, serves agents and servers of two jobs
// (tokens file), exposes metrics, answers a waiting call and exits 0 on SIGTERM, and refuses a bad
// configuration with one line on stderr and exit code 2.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "coordinator/test_util.h"

extern char** environ;

namespace poseidon::coordinator::testing {
namespace {

using ::testing::HasSubstr;

// A child process with its stdout and stderr captured; killed and reaped if still running when
// destroyed.
class Process {
 public:
  explicit Process(std::vector<std::string> argv) {
    int out[2];
    int err[2];
    if (pipe(out) != 0 || pipe(err) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, err[1], STDERR_FILENO);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    posix_spawn_file_actions_addclose(&actions, err[0]);
    std::vector<char*> args;
    for (std::string& arg : argv) args.push_back(arg.data());
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    close(out[1]);
    close(err[1]);
    out_ = out[0];
    err_ = err[0];
  }
  ~Process() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
    if (out_ >= 0) close(out_);
    if (err_ >= 0) close(err_);
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  bool started() const { return pid_ > 0; }
  void Signal(int sig) {
    if (pid_ > 0 && !exited_) kill(pid_, sig);
  }

  // The next stdout line, or nullopt at end of output or after `timeout`.
  std::optional<std::string> ReadLine(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      if (const size_t nl = out_buffer_.find('\n'); nl != std::string::npos) {
        std::string line = out_buffer_.substr(0, nl);
        out_buffer_.erase(0, nl + 1);
        return line;
      }
      const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (left <= 0) return std::nullopt;
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char buffer[4096];
      const ssize_t n = read(out_, buffer, sizeof(buffer));
      if (n <= 0) return std::nullopt;
      out_buffer_.append(buffer, static_cast<size_t>(n));
    }
  }

  // Exit code (128 + signal when killed), or nullopt if still running after `timeout`.
  std::optional<int> Wait(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (!exited_) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        break;
      }
      if (absl::Now() >= deadline) return std::nullopt;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return code_;
  }

  // Everything the process wrote to stderr (call after it exited).
  std::string Stderr() {
    std::string text;
    char buffer[4096];
    ssize_t n = 0;
    while ((n = read(err_, buffer, sizeof(buffer))) > 0)
      text.append(buffer, static_cast<size_t>(n));
    return text;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  int err_ = -1;
  std::string out_buffer_;
  bool exited_ = false;
  int code_ = -1;
};

// The body of GET http://address/metrics.
std::string HttpGetMetrics(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) return "";
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      ssize_t n = 0;
      while ((n = read(fd, buffer, sizeof(buffer))) > 0) {
        response.append(buffer, static_cast<size_t>(n));
      }
    }
  }
  close(fd);
  return response;
}

class CoordinatorDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/poseidon-coordinator-daemon-XXXXXX";
    const char* made = mkdtemp(pattern);
    ASSERT_NE(made, nullptr);
    dir_ = made;
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::string WriteFile(const std::string& name, const std::string& text) {
    const std::string path = absl::StrCat(dir_, "/", name);
    std::ofstream(path) << text;
    return path;
  }

  static std::vector<std::string> Command(std::vector<std::string> flags) {
    std::vector<std::string> argv = {POSEIDON_COORDINATOR_BIN};
    argv.insert(argv.end(), flags.begin(), flags.end());
    return argv;
  }

  // Runs the daemon expecting a refusal: exit 2 and one line on stderr containing `message`.
  void ExpectRefusal(std::vector<std::string> flags, const std::string& message) {
    SCOPED_TRACE(message);
    Process process(Command(std::move(flags)));
    ASSERT_TRUE(process.started());
    const std::optional<int> code = process.Wait(absl::Seconds(30));
    ASSERT_TRUE(code.has_value()) << "still running";
    EXPECT_EQ(*code, 2);
    const std::string err = process.Stderr();
    EXPECT_THAT(err, HasSubstr(message));
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  }

  std::string dir_;
};

TEST_F(CoordinatorDaemonTest, ServesJobsAndStopsOnSigterm) {
  const std::string tokens = WriteFile("tokens", "# job token\njob-a secret-a\n\njob-b secret-b\n");
  Process daemon(Command({"--listen=127.0.0.1:0", "--tokens_file=" + tokens,
                          "--cluster_token=cluster-secret", "--metrics_listen=127.0.0.1:0",
                          "--liveness_timeout=5s", "--shutdown_timeout=200ms"}));
  ASSERT_TRUE(daemon.started());
  std::string address;
  std::string metrics_address;
  while (address.empty() || metrics_address.empty()) {
    const std::optional<std::string> line = daemon.ReadLine(absl::Seconds(30));
    ASSERT_TRUE(line.has_value()) << "the daemon did not say where it listens";
    for (const char* prefix :
         {"poseidon-coordinator listening on ", "poseidon-coordinator metrics on "}) {
      if (absl::StartsWith(*line, prefix)) {
        (absl::StrContains(prefix, "metrics") ? metrics_address : address) =
            line->substr(strlen(prefix));
      }
    }
  }

  auto connect = [&](const std::string& job, const std::string& token) {
    auto client = CoordinatorClient::Connect(address, job, token);
    EXPECT_TRUE(client.ok()) << client.status();
    return std::move(*client);
  };
  auto server = connect("", "cluster-secret");
  ServerRegistration registration;
  registration.host = "127.0.0.1";
  registration.endpoints.push_back(MakeEndpoint(v1::TRANSPORT_KIND_TCP, "127.0.0.1:7100"));
  ASSERT_TRUE(server->RegisterServer(registration).ok());

  // Two agents of job-a form a world and get a plan.
  std::vector<std::unique_ptr<CoordinatorClient>> agents;
  agents.push_back(connect("job-a", "secret-a"));
  agents.push_back(connect("job-a", "secret-a"));
  std::vector<absl::StatusOr<v1::Plan>> plans(2, absl::UnknownError(""));
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      auto world = agents[i]->RegisterAgentAndRendezvous(Agent(i, 2), absl::Seconds(30));
      if (!world.ok()) {
        plans[i] = world.status();
        return;
      }
      plans[i] = agents[i]->RegisterModel(TinyModel(), {}, {}, absl::Seconds(30));
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const auto& plan : plans) {
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->plan_epoch(), 1u);
  }
  auto status = server->GetClusterStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->nodes_size(), 3);
  EXPECT_EQ(status->jobs_size(), 1);

  // Wrong token: refused, and counted.
  EXPECT_EQ(connect("job-a", "nope")->GetPlan().status().code(),
            absl::StatusCode::kUnauthenticated);
  const std::string metrics = HttpGetMetrics(metrics_address);
  EXPECT_THAT(metrics,
              HasSubstr(R"(poseidon_coordinator_rpcs_total{code="OK",method="Rendezvous"} 2)"));
  EXPECT_THAT(
      metrics,
      HasSubstr(R"(poseidon_coordinator_rpcs_total{code="UNAUTHENTICATED",method="GetPlan"} 1)"));

  // An agent of job-b waits for a world that will not form; SIGTERM answers it and exits 0.
  auto waiting = connect("job-b", "secret-b");
  ASSERT_TRUE(waiting->RegisterAgent(Agent(0, 2)).ok());
  absl::StatusOr<World> world = absl::UnknownError("");
  std::thread waiter([&] { world = waiting->Rendezvous(absl::Seconds(60)); });
  absl::SleepFor(absl::Milliseconds(200));  // let the call be parked (either order is fine)
  daemon.Signal(SIGTERM);
  const std::optional<int> code = daemon.Wait(absl::Seconds(30));
  waiter.join();
  ASSERT_TRUE(code.has_value()) << "no exit after SIGTERM";
  EXPECT_EQ(*code, 0) << daemon.Stderr();
  EXPECT_FALSE(world.ok());
}

// A TCP connection that never starts its HTTP/2 handshake is closed after --handshake_timeout
// (gRPC's default holds it ~2 minutes: cheap slots for an unauthenticated client), and the
// daemon goes on serving.
TEST_F(CoordinatorDaemonTest, ASilentConnectionIsClosedAfterTheHandshakeTimeout) {
  const std::string tokens = WriteFile("tokens", "job-a secret-a\n");
  Process daemon(Command({"--listen=127.0.0.1:0", "--tokens_file=" + tokens,
                          "--cluster_token=cluster-secret", "--handshake_timeout=500ms",
                          "--shutdown_timeout=200ms"}));
  ASSERT_TRUE(daemon.started());
  std::string address;
  while (address.empty()) {
    const std::optional<std::string> line = daemon.ReadLine(absl::Seconds(30));
    ASSERT_TRUE(line.has_value()) << "the daemon did not say where it listens";
    if (absl::StartsWith(*line, "poseidon-coordinator listening on ")) {
      address = line->substr(strlen("poseidon-coordinator listening on "));
    }
  }
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0) << strerror(errno);
  // The server's HTTP/2 SETTINGS come first; then the daemon closes it (EOF or a reset) well
  // before gRPC's default of two minutes.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  bool closed = false;
  while (!closed && std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 1000) != 1) continue;
    char buffer[256];
    closed = recv(fd, buffer, sizeof(buffer), 0) <= 0;
  }
  close(fd);
  EXPECT_TRUE(closed) << "the silent connection was still open after 20 s";
  auto client = CoordinatorClient::Connect(address, "", "cluster-secret");
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->GetClusterStatus().ok());
}

TEST_F(CoordinatorDaemonTest, RefusesABadConfiguration) {
  ExpectRefusal({"--listen=127.0.0.1:0"}, "refusing to start: no job to serve");
  ExpectRefusal({"--job_id=a", "--job_token=t", "--replan_threshold=-1"},
                "replan_threshold: must be in [0, 100], got -1");
  ExpectRefusal({"--job_id=a", "--job_token=t", "--bandwidth=fast"}, "bandwidth");
  ExpectRefusal({"--job_id=a", "--job_token=t", "--plan_lead_time=-1s"},
                "plan_lead_time: invalid duration '-1s': must not be negative");
  ExpectRefusal({"--job_id=a", "--job_token=t", "--plan_lead_time=2h"},
                "plan_lead_time: must be in [0, 1h], got 2h");
  ExpectRefusal({"--job_id=a", "--job_token=t", "--replan_min_interval=soon"},
                "replan_min_interval: invalid duration 'soon'");
  ExpectRefusal({"--job_id=a", "--job_token=t", "--replan_min_interval=25h"},
                "replan_min_interval: must be in [0, 24h], got 25h");
  ExpectRefusal({"--job_id=a", "--job_token=t", "--scheme_rule=fastest"}, "scheme_rule");
  ExpectRefusal({"--job_id=a"}, "job_id is set but job_token is not");
  ExpectRefusal({"--job_id=a", "--job_token=t", "--listen=127.0.0.1:0", "--tls_key=/tmp/k"},
                "tls_key is set but tls_cert is not");
  ExpectRefusal({"--tokens_file=/nonexistent/tokens"}, "cannot read tokens file");
  ExpectRefusal({"--tokens_file=" + WriteFile("bad", "job-a secret\njob-b\n")},
                "bad:2: expected '<job id> <token>'");
  ExpectRefusal({"--tokens_file=" + WriteFile("dup", "job-a one\njob-a two\n")},
                "configured twice with different tokens");
}

}  // namespace
}  // namespace poseidon::coordinator::testing
