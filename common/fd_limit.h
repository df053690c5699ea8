// The process's open-file limit: daemons raise the soft limit to the hard one at start, so that a
// burst of connections (agents, clients, an attacker's idle sockets) meets the limit the operator
// set (systemd's LimitNOFILE, ulimit -Hn) rather than the 1,024 soft default. gRPC's server does
// not recover from accept4 failing with EMFILE (grpc/grpc#20418): the higher the limit, the
// further away that is.
#pragma once

#include <cstdint>

namespace poseidon {

struct FileLimit {
  uint64_t before = 0;  // the soft limit found
  uint64_t now = 0;     // the soft limit after raising it (equal when it could not be raised)
};

// Raises RLIMIT_NOFILE's soft limit to its hard limit (at most `cap`); never lowers it.
FileLimit RaiseOpenFileLimit(uint64_t cap = uint64_t{1} << 20);

}  // namespace poseidon
