#include "sim/shared_cpus.h"

#include <algorithm>
#include <iterator>

namespace poseidon::sim {

double SharedCpus::EarliestFree(const std::map<double, double>& busy, double from,
                                double work) const {
  double start = from;
  auto next = busy.upper_bound(start);  // the first booking that starts after `start`
  if (next != busy.begin()) {
    const auto before = std::prev(next);
    start = std::max(start, before->second);
  }
  // Walk the bookings until a gap of `work` opens before the next one.
  while (next != busy.end() && next->first < start + work) {
    start = std::max(start, next->second);
    ++next;
  }
  return start;
}

double SharedCpus::Book(double now, double from, double work) {
  if (busy_.empty() || work <= 0) return from;
  uint32_t best = 0;
  double best_start = 0;
  for (uint32_t cpu = 0; cpu < busy_.size(); ++cpu) {
    std::map<double, double>& busy = busy_[cpu];
    while (!busy.empty() && busy.begin()->second <= now) busy.erase(busy.begin());
    const double start = EarliestFree(busy, from, work);
    if (cpu == 0 || start < best_start) {
      best = cpu;
      best_start = start;
      if (start == from) break;  // nothing starts earlier
    }
  }
  std::map<double, double>& busy = busy_[best];
  double start = best_start, end = best_start + work;
  auto next = busy.lower_bound(start);
  if (next != busy.end() && next->first == end) {  // merge with the booking right after
    end = next->second;
    next = busy.erase(next);
  }
  if (next != busy.begin()) {
    const auto before = std::prev(next);
    if (before->second == start) {  // merge with the booking right before
      before->second = end;
      return best_start;
    }
  }
  busy.emplace_hint(next, start, end);
  return best_start;
}

}  // namespace poseidon::sim
