// The `poseidon` command line: dispatches on its first word to one subcommand (DESIGN.md,
// "Processes": plan today; run, status and bench to come). Adding one is a function and a row in
// kSubcommands. Thread-safety: main thread only.

#include <cstdio>
#include <string>
#include <vector>

#include "tools/plan_command.h"
#include "tools/run_command.h"
#include "tools/simulate_command.h"
#include "tools/status_command.h"

namespace {

struct Subcommand {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);  // arguments after the name; exit code
};

constexpr Subcommand kSubcommands[] = {
    {"plan", "per-layer HybComm plan and predicted bytes and time for a model and a cluster",
     &poseidon::tools::RunPlanCommand},
    {"run", "start a local cluster and a training command on every rank (poseidon run -n 4 -- cmd)",
     &poseidon::tools::RunRunCommand},
    {"simulate", "discrete-event simulation of a job on N machines: iteration time, speed-up",
     &poseidon::tools::RunSimulateCommand},
    {"status", "servers, agents, plan epochs and schemes from a running coordinator",
     &poseidon::tools::RunStatusCommand},
};

void PrintUsage(std::FILE* out) {
  std::fputs(
      "usage: poseidon <command> [flags]   (poseidon <command> --help for its flags)\n\n"
      "commands:\n",
      out);
  for (const Subcommand& command : kSubcommands) {
    std::fprintf(out, "  %-8s %s\n", command.name, command.summary);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    PrintUsage(stderr);
    return 2;
  }
  const std::string word = argv[1];
  if (word == "help" || word == "--help" || word == "-h") {
    PrintUsage(stdout);
    return 0;
  }
  for (const Subcommand& command : kSubcommands) {
    if (word == command.name) return command.run(std::vector<std::string>(argv + 2, argv + argc));
  }
  std::fprintf(stderr, "poseidon: unknown command '%s' (try: poseidon help)\n", word.c_str());
  return 2;
}
