// A child process for multi-process tests: spawned with posix_spawn, optional capture of stdout
// and stderr, signals, and waits that always have a timeout. The destructor kills and reaps the
// child so a failing test never leaves processes behind.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <random>

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace poseidon::testing {

class Subprocess {
 public:
  // Starts argv[0] with the arguments; stdout (and stderr too with merge_stderr) is captured
  // for ReadLine, stderr otherwise goes to the test's stderr.
  explicit Subprocess(const std::vector<std::string>& argv, bool merge_stderr = false) {
    int fds[2];
    if (pipe(fds) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    if (merge_stderr) posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    out_ = fds[0];
  }
  ~Subprocess() {
    if (pid_ > 0 && !exited_) {
      // Ask first, so a daemon can clean up (segments, files); insist after 3 s.
      kill(pid_, SIGTERM);
      if (!Wait(std::chrono::milliseconds(3000))) {
        kill(pid_, SIGKILL);
        int status;
        waitpid(pid_, &status, 0);
      }
    }
    if (out_ >= 0) close(out_);
  }
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  bool started() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  // The next line of stdout, or nullopt after `timeout` or at end of output.
  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      if (auto nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char buf[4096];
      const ssize_t n = read(out_, buf, sizeof(buf));
      if (n <= 0) return std::nullopt;
      buffer_.append(buf, static_cast<size_t>(n));
    }
  }

  // Everything the child writes until it exits (or `timeout`).
  std::string ReadAll(std::chrono::milliseconds timeout) {
    std::string all;
    while (auto line = ReadLine(timeout)) all += *line + "\n";
    all += buffer_;
    buffer_.clear();
    return all;
  }

  void Signal(int sig) {
    if (pid_ > 0 && !exited_) kill(pid_, sig);
  }

  // The exit code (or 128 + signal), or nullopt if it is still running after `timeout`.
  std::optional<int> Wait(std::chrono::milliseconds timeout) {
    if (exited_) return code_;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        return code_;
      }
      if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  std::string buffer_;
  bool exited_ = false;
  int code_ = -1;
};

// A loopback port that is free now, below the ephemeral range (32768+), so that no outgoing
// connection can take it before the agent binds it. Another test may still pick the same one:
// Cluster retries with new ports when an agent cannot bind.
inline int FreeLoopbackPort() {
  static std::mt19937 rng(static_cast<unsigned>(::getpid()) * 7919u +
                          static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()));
  while (true) {
    const int port = 20000 + static_cast<int>(rng() % 12000);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    close(fd);
    if (ok) return port;
  }
}


}  // namespace poseidon::testing
