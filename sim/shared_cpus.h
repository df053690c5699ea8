#pragma once

// The CPUs an emulated cluster's hosts share (SimOptions::shared_cpus): k CPUs on which every
// host's message work runs, first come first served in simulated time.
//
// The simulation books work when it is decided, not when it starts: a host that sends a burst of
// messages books them all at once, one after the other (its own work is serial). A booking is
// therefore a stretch of simulated time on one CPU, and a piece of work booked later may start
// earlier than one booked before it. Booking only "after the CPU's last booking" would leave the
// gaps between a host's bookings unused by every other host: one host's burst on two CPUs would
// hold both for its whole length, as if the machine had one. Here a piece of work takes the
// earliest stretch of its length, at or after the time it can start, that some CPU has free,
// gaps between earlier bookings included.

#include <cstdint>
#include <map>
#include <vector>

namespace poseidon::sim {

class SharedCpus {
 public:
  explicit SharedCpus(uint32_t cpus) : busy_(cpus) {}

  bool empty() const { return busy_.empty(); }
  uint32_t size() const { return static_cast<uint32_t>(busy_.size()); }

  // Books `work` seconds (> 0) on the CPU that has them free earliest at or after `from`
  // (the lowest-numbered one on a tie) and returns when the work starts. `now` is the
  // simulation's clock: no later call books before it, so bookings that ended by then are
  // forgotten. Requires now <= from.
  double Book(double now, double from, double work);

  // The bookings CPU `cpu` holds (start -> end, disjoint, adjacent ones merged), for tests.
  const std::map<double, double>& Bookings(uint32_t cpu) const { return busy_[cpu]; }

 private:
  // The earliest start at or after `from` of `work` free seconds on `cpu`.
  double EarliestFree(const std::map<double, double>& busy, double from, double work) const;

  std::vector<std::map<double, double>> busy_;  // per CPU: start -> end
};

}  // namespace poseidon::sim
