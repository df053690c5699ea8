#include "agent/scheduler.h"

namespace poseidon::agent {

Credit::~Credit() {
  scheduler_->Return(this);
}

void Credit::Park() {
  scheduler_->ParkCredit(this);
}

Scheduler::Scheduler(SchedulerOptions options, Observers observers)
    : options_(options), observers_(std::move(observers)) {}

Scheduler::~Scheduler() {
  Stop();
}

void Scheduler::Start() {
  for (int i = 0; i < std::max(1, options_.threads); ++i) {
    threads_.emplace_back([this] { Worker(); });
  }
}

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void Scheduler::Submit(Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push({options_.priority ? task.priority : 0, next_seq_++, task.bytes,
                 std::move(task.run)});
    if (observers_.queue_depth) observers_.queue_depth(queue_.size());
  }
  cv_.notify_one();
}

// With mu_ held. A task goes when it fits, when nothing is in flight, or when everything in
// flight is parked (waiting for other ranks, who may need this task's transfers to go on).
bool Scheduler::CanStartLocked() const {
  if (queue_.empty()) return false;
  const uint64_t bytes = queue_.top().bytes;
  return bytes == 0 || in_flight_ == parked_ || in_flight_ + bytes <= options_.credit_bytes;
}

// Wake-ups: one worker per task that can start (notify_one), never all of them: with eight
// threads per agent and several agents on a machine, waking every thread for every layer costs
// more CPU than the layer's synchronisation. A worker that takes a task wakes the next one when
// another task can start too; returned or parked credit wakes one.
void Scheduler::Worker() {
  while (true) {
    Queued task;
    std::shared_ptr<Credit> credit;
    bool more = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || CanStartLocked(); });
      if (stopping_) return;
      task = queue_.top();
      queue_.pop();
      in_flight_ += task.bytes;
      if (observers_.queue_depth) observers_.queue_depth(queue_.size());
      if (observers_.in_flight) observers_.in_flight(in_flight_);
      more = CanStartLocked();
      credit.reset(new Credit(this, task.bytes));
    }
    if (more) cv_.notify_one();
    task.run(std::move(credit));
  }
}

void Scheduler::Return(Credit* credit) {
  bool waiting;
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_ -= credit->bytes_;
    if (credit->parked_) parked_ -= credit->bytes_;
    if (observers_.in_flight) observers_.in_flight(in_flight_);
    waiting = !queue_.empty();
  }
  if (waiting) cv_.notify_one();
}

void Scheduler::ParkCredit(Credit* credit) {
  bool waiting;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (credit->parked_) return;
    credit->parked_ = true;
    parked_ += credit->bytes_;
    waiting = !queue_.empty();
  }
  if (waiting) cv_.notify_one();
}

uint64_t Scheduler::in_flight_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

uint64_t Scheduler::parked_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return parked_;
}

size_t Scheduler::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

}  // namespace poseidon::agent
