// `poseidon run`: the launcher. It is the Python launcher (libclient/python/poseidon/run.py),
// exec'ed with the package on PYTHONPATH and this build's binaries named, so that the C++ CLI and
// `python3 -m poseidon.run` behave the same. Thread-safety: main thread only (it execs).
#pragma once

#include <string>
#include <vector>

namespace poseidon::tools {

int RunRunCommand(const std::vector<std::string>& args);

}  // namespace poseidon::tools
