// `poseidon simulate`: the discrete-event simulation of one job (sim/simulator.h) for a list of
// cluster sizes: iteration time and its breakdown, throughput, speed-up and efficiency per N, as a
// table or --json; a calibration JSON (bench/cluster/calibrate.py) supplies the per-message cost,
// the compute overhead and the jitter measured on the emulated cluster.
// Thread-safety: runs on the main thread; touches only stdout, stderr and the files it names.
#pragma once

#include <string>
#include <vector>

namespace poseidon::tools {

// Runs the subcommand with the arguments after "simulate". Returns 0 on success (or --help), 2 on
// bad flags, an unknown model, an unreadable calibration or an impossible cluster.
int RunSimulateCommand(const std::vector<std::string>& args);

}  // namespace poseidon::tools
