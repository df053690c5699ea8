// `poseidon plan`: the what-if view of HybComm. Reads a model spec and cluster flags, runs the
// planner and prints the per-layer plan with predicted bytes and time (table or --json).
// Thread-safety: runs on the main thread; touches only stdout and stderr.
#pragma once

#include <string>
#include <vector>

namespace poseidon::tools {

// Runs the subcommand with the arguments after "plan". Returns the exit code: 0 on success (or
// --help), 2 on bad flags, an unknown or malformed model, or an impossible cluster (one line on
// stderr). With --coordinator or --set: the live form (plan_live_command.h).
int RunPlanCommand(const std::vector<std::string>& args);

}  // namespace poseidon::tools
