// `poseidon status`: a live view of a cluster from its coordinator (GetClusterStatus): servers
// and agents (state, rank, host, endpoints, last heartbeat), plan epochs and the scheme of every
// layer, as a table or --json. Thread-safety: main thread only.
#pragma once

#include <string>
#include <vector>

namespace poseidon::tools {

// Exit codes: 0 shown; 2 bad flags, or the coordinator unreachable or refusing the call (one
// line on stderr).
int RunStatusCommand(const std::vector<std::string>& args);

}  // namespace poseidon::tools
