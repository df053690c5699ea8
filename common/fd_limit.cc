#include "common/fd_limit.h"

#include <sys/resource.h>

#include <algorithm>

namespace poseidon {

FileLimit RaiseOpenFileLimit(uint64_t cap) {
  FileLimit out;
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return out;
  out.before = out.now = limit.rlim_cur;
  const rlim_t target = limit.rlim_max == RLIM_INFINITY
                            ? static_cast<rlim_t>(cap)
                            : std::min<rlim_t>(limit.rlim_max, static_cast<rlim_t>(cap));
  if (target <= limit.rlim_cur) return out;
  limit.rlim_cur = target;
  if (setrlimit(RLIMIT_NOFILE, &limit) == 0) out.now = target;
  return out;
}

}  // namespace poseidon
