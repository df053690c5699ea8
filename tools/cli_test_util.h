// The CLI tests' helpers: run the `poseidon` binary (POSEIDON_CLI_PATH, a compile definition) as
// a user would (popen) and read its exit code and one stream; a field of its --json output.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

#include "google/protobuf/struct.pb.h"

namespace poseidon::tools::testing {

struct CliRun {
  int exit_code = -1;
  std::string output;
};

// Runs the CLI with `args` (shell syntax); `redirect` chooses which stream is captured.
inline CliRun RunCli(const std::string& args, const std::string& redirect) {
  const std::string command = std::string(POSEIDON_CLI_PATH) + " " + args + " " + redirect;
  CliRun run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  std::array<char, 4096> buffer{};
  size_t n = 0;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) {
    run.output.append(buffer.data(), n);
  }
  const int status = pclose(pipe);
  if (WIFEXITED(status)) run.exit_code = WEXITSTATUS(status);
  return run;
}

inline CliRun Stdout(const std::string& args) {
  return RunCli(args, "2>/dev/null");
}
inline CliRun Stderr(const std::string& args) {
  return RunCli(args, "2>&1 >/dev/null");
}

inline const google::protobuf::Value& Field(const google::protobuf::Struct& s,
                                            const std::string& key) {
  static const google::protobuf::Value missing;
  const auto it = s.fields().find(key);
  return it == s.fields().end() ? missing : it->second;
}

}  // namespace poseidon::tools::testing
