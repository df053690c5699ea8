// The agent's scheduler: owns priority and credit (DESIGN.md, "Scheduling"). Synchronisation
// tasks wait in one priority queue (lower value sooner; FIFO among equals) and start when their
// bytes fit in the credit: the bytes in flight, taken when a task starts and returned when the
// last of its transfers completes (BytePS's credit, returned when the stage's asynchronous
// operation finishes). A task's transfers hold its Credit; dropping the last reference returns
// it. A task that has done its own sends and only waits for other ranks (a PS pull waiting for
// the clock, SFB factors not all in) parks its credit: parked bytes still count against the
// limit, but when everything in flight is parked the next task starts anyway — otherwise two
// agents whose credit is full of layers waiting for each other's next sends would deadlock.
// Thread model: `threads` worker threads run the tasks' `run`, which must not block on the
// network (start asynchronous transfers and return). Submit, Credit::Park and the release are
// thread-safe; Stop joins the workers (queued tasks are dropped, unrun).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
#include <thread>
#include <vector>

#include "absl/time/time.h"

namespace poseidon::agent {

class Scheduler;

// Credit held by one started task. Thread-safe.
class Credit {
 public:
  ~Credit();  // returns the bytes
  Credit(const Credit&) = delete;
  Credit& operator=(const Credit&) = delete;
  // The task's own transfers are done; it waits for other ranks only. Idempotent.
  void Park();
  uint64_t bytes() const { return bytes_; }

 private:
  friend class Scheduler;
  Credit(Scheduler* scheduler, uint64_t bytes) : scheduler_(scheduler), bytes_(bytes) {}
  Scheduler* scheduler_;
  uint64_t bytes_;
  bool parked_ = false;  // guarded by the scheduler's mutex
};

struct SchedulerOptions {
  uint64_t credit_bytes = uint64_t{64} << 20;
  bool priority = true;  // false: FIFO (for comparisons)
  int threads = 8;
};

class Scheduler {
 public:
  struct Task {
    uint32_t priority = 0;
    uint64_t bytes = 0;  // 0: computation only, never held back by the credit
    // Runs on a worker thread; keep `credit` alive until the task's transfers complete.
    std::function<void(std::shared_ptr<Credit> credit)> run;
  };
  // Observers of the queue depth and the credit in use (bytes), e.g. gauges; may be null.
  struct Observers {
    std::function<void(size_t)> queue_depth;
    std::function<void(uint64_t)> in_flight;
  };

  explicit Scheduler(SchedulerOptions options, Observers observers = {});
  ~Scheduler();  // Stop()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  void Start();
  void Stop();
  void Submit(Task task);

  // For tests and metrics.
  uint64_t in_flight_bytes() const;
  uint64_t parked_bytes() const;
  size_t queued() const;

 private:
  friend class Credit;
  struct Queued {
    uint32_t priority;
    uint64_t seq;
    uint64_t bytes;
    std::function<void(std::shared_ptr<Credit>)> run;
    bool operator<(const Queued& o) const {  // std::priority_queue is a max-heap: invert
      return priority != o.priority ? priority > o.priority : seq > o.seq;
    }
  };
  void Worker();
  bool CanStartLocked() const;
  void Return(Credit* credit);
  void ParkCredit(Credit* credit);

  const SchedulerOptions options_;
  const Observers observers_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::priority_queue<Queued> queue_;
  uint64_t in_flight_ = 0;  // bytes of started tasks not yet returned (parked included)
  uint64_t parked_ = 0;     // of which parked
  uint64_t next_seq_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace poseidon::agent
