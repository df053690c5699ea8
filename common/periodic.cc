#include "common/periodic.h"

#include "common/log.h"

namespace poseidon {

void PeriodicThread::Start(absl::Duration interval, std::function<void()> tick, bool run_now) {
  if (thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = false;
  }
  thread_ = std::thread([this, interval, tick = std::move(tick), run_now] {
    if (run_now) tick();
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (wake_.wait_for(lock, absl::ToChronoNanoseconds(interval), [this] { return stop_; })) {
          return;
        }
      }
      tick();
    }
  });
}

void PeriodicThread::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void OutageLog::Note(const absl::Status& status, absl::Duration retry_interval) {
  if (!status.ok() && !failing_) {
    PSD_LOG_WARN("{} failed (retrying every {}): {}", what_, absl::FormatDuration(retry_interval),
                 status.message());
  } else if (status.ok() && failing_) {
    PSD_LOG_INFO("{} works again", what_);
  }
  failing_ = !status.ok();
}

}  // namespace poseidon
