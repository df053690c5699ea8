// Background work on a fixed period, and the log lines of a periodic report that fails.
#pragma once
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace poseidon {

// Runs `tick` every `interval` on a thread of its own until Stop (or destruction); Stop wakes
// the thread at once and joins it, so it returns within one tick's duration.
class PeriodicThread {
 public:
  PeriodicThread() = default;
  ~PeriodicThread() { Stop(); }
  PeriodicThread(const PeriodicThread&) = delete;
  PeriodicThread& operator=(const PeriodicThread&) = delete;

  // Once (a second Start while running does nothing). With run_now, `tick` also runs at once.
  void Start(absl::Duration interval, std::function<void()> tick, bool run_now = false);
  void Stop();

 private:
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

// One warning when a periodic report starts failing and one line when it works again, instead
// of a line per attempt.
class OutageLog {
 public:
  explicit OutageLog(std::string what) : what_(std::move(what)) {}
  void Note(const absl::Status& status, absl::Duration retry_interval);

 private:
  const std::string what_;
  bool failing_ = false;
};

}  // namespace poseidon
