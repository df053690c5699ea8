// CLOCK_MONOTONIC in nanoseconds: the clock of the shared segment's heartbeats (shm_layout.h)
// and of the daemons' liveness stamps, comparable across the processes of one machine.
// Thread-safety: a pure function.
#pragma once

#include <time.h>

#include <cstdint>

namespace poseidon {

inline uint64_t MonotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace poseidon
