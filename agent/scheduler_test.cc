// The scheduler's contract: priority order, the credit bound on bytes in flight (taken when a
// task starts, returned when its last transfer completes), parked credit and the deadlock it
// prevents. Transfers are simulated: a task's run hands its Credit to the test, which completes
// the "transfer" by dropping it.
#include "agent/scheduler.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace poseidon::agent {
namespace {

// Records started tasks and holds their credit until the test releases it.
class Transfers {
 public:
  std::function<void(std::shared_ptr<Credit>)> Run(int id) {
    return [this, id](std::shared_ptr<Credit> credit) {
      std::lock_guard<std::mutex> lock(mu_);
      started_.push_back(id);
      held_[id] = std::move(credit);
      cv_.notify_all();
    };
  }
  // Waits until `n` tasks have started (bounded) and returns their ids in start order.
  std::vector<int> WaitStarted(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] { return started_.size() >= n; });
    return started_;
  }
  // Whether a task beyond the first `n` starts within a short while (it must not).
  bool MoreThan(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::milliseconds(200),
                        [&] { return started_.size() > n; });
  }
  void Complete(int id) {
    std::shared_ptr<Credit> credit;
    {
      std::lock_guard<std::mutex> lock(mu_);
      credit = std::move(held_[id]);
    }
    credit.reset();
  }
  void Park(int id) {
    std::lock_guard<std::mutex> lock(mu_);
    held_[id]->Park();
  }
  void CompleteAll() {
    std::map<int, std::shared_ptr<Credit>> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      held.swap(held_);
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> started_;
  std::map<int, std::shared_ptr<Credit>> held_;
};

Scheduler::Task MakeTask(Transfers& t, int id, uint32_t priority, uint64_t bytes) {
  return {priority, bytes, t.Run(id)};
}

TEST(Scheduler, CreditBoundsBytesInFlightUntilTransfersComplete) {
  Transfers t;
  Scheduler s({/*credit_bytes=*/100, /*priority=*/true, /*threads=*/4});
  s.Start();
  for (int i = 0; i < 4; ++i) s.Submit(MakeTask(t, i, 0, 40));
  // Two fit (80 <= 100), the third would make 120.
  EXPECT_EQ(t.WaitStarted(2).size(), 2u);
  EXPECT_FALSE(t.MoreThan(2)) << "a third task started past the credit";
  EXPECT_EQ(s.in_flight_bytes(), 80u);
  t.Complete(0);  // the transfer completed: its credit comes back
  EXPECT_EQ(t.WaitStarted(3).size(), 3u);
  EXPECT_FALSE(t.MoreThan(3));
  t.CompleteAll();
  EXPECT_EQ(t.WaitStarted(4).size(), 4u);
  t.CompleteAll();
  s.Stop();
  EXPECT_EQ(s.in_flight_bytes(), 0u);
}

TEST(Scheduler, LowerPriorityValueGoesFirstWhenCreditReturns) {
  Transfers t;
  Scheduler s({100, true, 2});
  s.Start();
  s.Submit(MakeTask(t, 0, 5, 100));  // fills the credit
  ASSERT_EQ(t.WaitStarted(1).size(), 1u);
  s.Submit(MakeTask(t, 1, 9, 60));
  s.Submit(MakeTask(t, 2, 1, 60));  // more urgent, submitted later
  s.Submit(MakeTask(t, 3, 1, 60));  // same priority: after task 2
  EXPECT_FALSE(t.MoreThan(1));
  t.Complete(0);
  std::vector<int> order = t.WaitStarted(2);
  ASSERT_GE(order.size(), 2u);
  EXPECT_EQ(order[1], 2);
  t.Complete(2);
  order = t.WaitStarted(3);
  ASSERT_GE(order.size(), 3u);
  EXPECT_EQ(order[2], 3);
  t.CompleteAll();
  order = t.WaitStarted(4);
  EXPECT_EQ(order.back(), 1);
  t.CompleteAll();
}

TEST(Scheduler, WithoutPriorityTasksGoInSubmissionOrder) {
  Transfers t;
  Scheduler s({10, /*priority=*/false, 1});
  s.Start();
  s.Submit(MakeTask(t, 0, 7, 10));
  ASSERT_EQ(t.WaitStarted(1).size(), 1u);
  s.Submit(MakeTask(t, 1, 9, 10));
  s.Submit(MakeTask(t, 2, 0, 10));
  t.Complete(0);
  t.WaitStarted(2);
  t.Complete(1);
  std::vector<int> order = t.WaitStarted(3);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  t.CompleteAll();
}

TEST(Scheduler, TaskLargerThanTheCreditGoesAlone) {
  Transfers t;
  Scheduler s({100, true, 2});
  s.Start();
  s.Submit(MakeTask(t, 0, 0, 500));
  EXPECT_EQ(t.WaitStarted(1).size(), 1u) << "a task larger than the credit must still go";
  s.Submit(MakeTask(t, 1, 0, 1));
  EXPECT_FALSE(t.MoreThan(1));
  t.Complete(0);
  EXPECT_EQ(t.WaitStarted(2).size(), 2u);
  t.CompleteAll();
}

TEST(Scheduler, ComputationTasksNeverWaitForCredit) {
  Transfers t;
  Scheduler s({100, true, 2});
  s.Start();
  s.Submit(MakeTask(t, 0, 0, 100));
  ASSERT_EQ(t.WaitStarted(1).size(), 1u);
  s.Submit(MakeTask(t, 1, 0, 0));  // a rebuild: no bytes
  EXPECT_EQ(t.WaitStarted(2).size(), 2u);
  t.CompleteAll();
}

// Two agents whose credit is full of layers each waiting for the other's next push would wait
// forever; parked credit (own sends done, waiting for other ranks) lets the next task go.
TEST(Scheduler, ParkedCreditLetsTheNextTaskGo) {
  Transfers t;
  Scheduler s({100, true, 2});
  s.Start();
  s.Submit(MakeTask(t, 0, 0, 100));
  ASSERT_EQ(t.WaitStarted(1).size(), 1u);
  s.Submit(MakeTask(t, 1, 0, 100));
  s.Submit(MakeTask(t, 2, 0, 100));
  EXPECT_FALSE(t.MoreThan(1)) << "task 0's transfer is still active";
  t.Park(0);
  EXPECT_EQ(t.WaitStarted(2).size(), 2u);
  // Task 1 is active (not parked): the credit holds task 2 back again.
  EXPECT_FALSE(t.MoreThan(2));
  EXPECT_EQ(s.in_flight_bytes(), 200u);
  EXPECT_EQ(s.parked_bytes(), 100u);
  t.Park(1);
  EXPECT_EQ(t.WaitStarted(3).size(), 3u);
  t.CompleteAll();
  s.Stop();
  EXPECT_EQ(s.in_flight_bytes(), 0u);
  EXPECT_EQ(s.parked_bytes(), 0u);
}

TEST(Scheduler, StopDropsQueuedTasksAndJoins) {
  Transfers t;
  auto s = std::make_unique<Scheduler>(SchedulerOptions{10, true, 3});
  s->Start();
  s->Submit(MakeTask(t, 0, 0, 10));
  ASSERT_EQ(t.WaitStarted(1).size(), 1u);
  s->Submit(MakeTask(t, 1, 0, 10));
  s->Stop();
  EXPECT_EQ(s->queued(), 1u);
  t.CompleteAll();  // a credit returned after Stop is still accounted
  EXPECT_EQ(s->in_flight_bytes(), 0u);
}

}  // namespace
}  // namespace poseidon::agent
