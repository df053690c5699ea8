#include "transport/inproc/inproc_context.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "transport/checksum.h"
#include "transport/error_frame.h"

namespace poseidon::transport {
namespace {

using Task = absl::AnyInvocable<void()>;

// One thread running posted tasks in order, and delayed tasks at their time.
class Executor {
 public:
  Executor() : thread_([this] { Run(); }) {}
  ~Executor() { Shutdown(); }

  void Post(Task task) { PostAt(absl::InfinitePast(), std::move(task)); }

  void PostAfter(absl::Duration delay, Task task) { PostAt(absl::Now() + delay, std::move(task)); }

  // Runs what is queued now (immediate tasks), drops timers, and joins the thread.
  void Shutdown() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else if (thread_.joinable()) {
      thread_.join();
    }
  }

  bool stopping() {
    std::lock_guard<std::mutex> lock(mu_);
    return stopping_;
  }

 private:
  struct Entry {
    absl::Time when;
    uint64_t order;
    mutable Task task;
    bool operator>(const Entry& o) const {
      return when != o.when ? when > o.when : order > o.order;
    }
  };

  void PostAt(absl::Time when, Task task) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stopping_ && when != absl::InfinitePast()) return;  // timers die with the executor
      if (exited_) {
        // Nobody runs the queue any more: complete here so no callback is lost.
        lock.unlock();
        task();
        return;
      }
      queue_.push(Entry{when, next_order_++, std::move(task)});
    }
    cv_.notify_one();
  }

  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      if (queue_.empty()) {
        if (stopping_) {
          exited_ = true;
          return;
        }
        cv_.wait(lock);
        continue;
      }
      const Entry& top = queue_.top();
      if (top.when != absl::InfinitePast()) {
        if (stopping_) {
          queue_.pop();  // a timer after shutdown: drop it
          continue;
        }
        const absl::Time now = absl::Now();
        if (top.when > now) {
          cv_.wait_for(lock, absl::ToChronoNanoseconds(top.when - now));
          continue;
        }
      }
      Task task = std::move(top.task);
      queue_.pop();
      lock.unlock();
      task();
      task = nullptr;  // destroy captured state outside the lock
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue_;
  uint64_t next_order_ = 0;
  bool stopping_ = false;
  bool exited_ = false;
  std::thread thread_;
};

struct ContextState;

// Frames travelling one way, and the reader waiting for them.
struct Direction {
  struct InFrame {
    EncodedHeader header;
    std::vector<ConstBuffer> payload;
    std::string owned;  // payload owned by the transport (error frames)
    DoneCallback done;
    bool header_delivered = false;
  };
  enum class ReadState { kIdle, kWaitHeader, kAwaitPayload, kWaitPayload, kCopying };

  std::deque<InFrame> frames;
  ReadState read_state = ReadState::kIdle;
  HeaderCallback header_done;
  uint64_t header_wait_generation = 0;
  DoneCallback payload_done;
  MutableBuffer into;
  bool discard = false;
};

struct Pipe {
  std::mutex mu;
  Direction dirs[2];  // dirs[i]: frames sent by side i
  bool closed = false;
  absl::Status close_reason;
  std::string names[2];
};

struct ContextState {
  explicit ContextState(const ContextOptions& o) : options(o) {}
  ContextOptions options;
  Executor executor;
  std::atomic<bool> closed{false};
};

class InprocConnection final : public Connection,
                               public std::enable_shared_from_this<InprocConnection> {
 public:
  InprocConnection(std::shared_ptr<ContextState> ctx, std::shared_ptr<Pipe> pipe, int side)
      : ctx_(std::move(ctx)), pipe_(std::move(pipe)), side_(side) {}

  void Send(const FrameHeader& header_in, std::vector<ConstBuffer> payload,
            DoneCallback done) override {
    FrameHeader header = header_in;
    if (absl::Status s = PrepareSend(header, payload, ctx_->options); !s.ok()) {
      Post(std::move(done), std::move(s));
      return;
    }
    Direction::InFrame frame;
    frame.header = EncodeHeader(header);
    frame.payload = std::move(payload);
    frame.done = std::move(done);
    Enqueue(std::move(frame));
  }

  void ReadHeader(HeaderCallback done, absl::Duration timeout) override {
    std::unique_lock<std::mutex> lock(pipe_->mu);
    Direction& in = pipe_->dirs[1 - side_];
    if (pipe_->closed) {
      lock.unlock();
      PostHeader(std::move(done), ClosedError());
      return;
    }
    if (in.read_state != Direction::ReadState::kIdle) {
      lock.unlock();
      PostHeader(std::move(done),
                 absl::FailedPreconditionError(
                     in.read_state == Direction::ReadState::kAwaitPayload
                         ? "ReadHeader called before the previous frame's payload was read or "
                           "discarded"
                         : "ReadHeader called while another read is outstanding"));
      return;
    }
    in.read_state = Direction::ReadState::kWaitHeader;
    in.header_done = std::move(done);
    const uint64_t generation = ++in.header_wait_generation;
    TryDeliver(lock);
    if (timeout != absl::InfiniteDuration()) {
      ctx_->executor.PostAfter(timeout, [weak = weak_from_this(), generation, timeout] {
        if (auto self = weak.lock()) self->HeaderTimeout(generation, timeout);
      });
    }
  }

  void ReadPayload(MutableBuffer into, DoneCallback done) override {
    StartPayload(into, false, std::move(done));
  }

  void DiscardPayload(DoneCallback done) override { StartPayload({}, true, std::move(done)); }

  void Close() override { CloseWith(absl::CancelledError("connection closed locally")); }

  void Abort(const absl::Status& reason) override {
    PSD_LOG_WARN("closing connection from {}: {}", PeerAddress(), reason.message());
    ErrorFrame error = MakeErrorFrame(0, reason);
    Direction::InFrame frame;
    frame.header = EncodeHeader(error.header);
    frame.owned = std::move(error.message);
    frame.done = [weak = weak_from_this(), reason](absl::Status) {
      if (auto self = weak.lock()) self->CloseWith(reason);
    };
    Enqueue(std::move(frame));
    ctx_->executor.PostAfter(absl::Seconds(1), [weak = weak_from_this(), reason] {
      if (auto self = weak.lock()) self->CloseWith(reason);
    });
  }

  std::string PeerAddress() const override { return pipe_->names[1 - side_]; }

  ConnectionStats Stats() const override { return counters_.Snapshot(); }

  // Called on the peer side's object when it closes.
  void CloseWith(const absl::Status& reason) {
    std::unique_lock<std::mutex> lock(pipe_->mu);
    if (pipe_->closed) return;
    pipe_->closed = true;
    pipe_->close_reason = reason;
    std::vector<Task> tasks;
    for (int d = 0; d < 2; ++d) {
      Direction& dir = pipe_->dirs[d];
      // Messages name the side that reads them.
      const absl::Status error =
          absl::UnavailableError(absl::StrCat("connection closed (", reason.message(), ")"));
      for (auto& frame : dir.frames) {
        tasks.push_back([done = std::move(frame.done), error]() mutable { done(error); });
      }
      dir.frames.clear();
      if (dir.read_state == Direction::ReadState::kWaitHeader) {
        tasks.push_back([done = std::move(dir.header_done), error]() mutable { done(error); });
      } else if (dir.read_state == Direction::ReadState::kWaitPayload) {
        tasks.push_back([done = std::move(dir.payload_done), error]() mutable { done(error); });
      }
      dir.read_state = Direction::ReadState::kIdle;
    }
    lock.unlock();
    for (auto& t : tasks) ctx_->executor.Post(std::move(t));
  }

 private:
  absl::Status ClosedError() const {
    return absl::UnavailableError(absl::StrCat("connection to ", PeerAddress(),
                                               " is closed: ", pipe_->close_reason.message()));
  }

  void Post(DoneCallback done, absl::Status status) {
    ctx_->executor.Post([done = std::move(done), status = std::move(status)]() mutable {
      done(std::move(status));
    });
  }

  void PostHeader(HeaderCallback done, absl::StatusOr<FrameHeader> result) {
    ctx_->executor.Post([done = std::move(done), result = std::move(result)]() mutable {
      done(std::move(result));
    });
  }

  void Enqueue(Direction::InFrame frame) {
    std::unique_lock<std::mutex> lock(pipe_->mu);
    if (pipe_->closed) {
      lock.unlock();
      Post(std::move(frame.done), ClosedError());
      return;
    }
    counters_.frames_sent.fetch_add(1, std::memory_order_relaxed);
    counters_.bytes_sent.fetch_add(kFrameHeaderSize + TotalSize(frame.payload) + frame.owned.size(),
                                   std::memory_order_relaxed);
    pipe_->dirs[side_].frames.push_back(std::move(frame));
    TryDeliverTo(lock, pipe_->dirs[side_]);
  }

  void TryDeliver(std::unique_lock<std::mutex>& lock) {
    TryDeliverTo(lock, pipe_->dirs[1 - side_]);
  }

  // Matches the reader of `dir` with the frame at its head. Unlocks `lock`.
  void TryDeliverTo(std::unique_lock<std::mutex>& lock, Direction& dir) {
    std::vector<Task> tasks;
    if (!dir.frames.empty() && dir.read_state == Direction::ReadState::kWaitHeader &&
        !dir.frames.front().header_delivered) {
      Direction::InFrame& frame = dir.frames.front();
      auto header = DecodeHeader(frame.header, ctx_->options.limits);
      auto done = std::move(dir.header_done);
      if (!header.ok()) {
        dir.read_state = Direction::ReadState::kIdle;
        lock.unlock();
        CloseWith(header.status());
        PostHeader(std::move(done), header.status());
        return;
      }
      frame.header_delivered = true;
      if (header->payload_length == 0) {
        tasks.push_back([d = std::move(frame.done)]() mutable { d(absl::OkStatus()); });
        dir.frames.pop_front();
        dir.read_state = Direction::ReadState::kIdle;
      } else {
        dir.read_state = Direction::ReadState::kAwaitPayload;
      }
      tasks.push_back(
          [done = std::move(done), h = std::move(header)]() mutable { done(std::move(h)); });
    } else if (!dir.frames.empty() && dir.read_state == Direction::ReadState::kWaitPayload) {
      Direction::InFrame frame = std::move(dir.frames.front());
      dir.frames.pop_front();
      dir.read_state = Direction::ReadState::kCopying;  // until the copy task has run
      MutableBuffer into = dir.into;
      const bool discard = dir.discard;
      auto done = std::move(dir.payload_done);
      // The copy runs on the executor; the reader cannot start another read until `done` runs.
      tasks.push_back([this_dir = &dir, frame = std::move(frame), into, discard,
                       done = std::move(done), self = shared_from_this()]() mutable {
        size_t offset = 0;
        if (!discard) {
          for (const auto& b : frame.payload) {
            if (!b.empty()) std::memcpy(into.data() + offset, b.data(), b.size());
            offset += b.size();
          }
          if (!frame.owned.empty())
            std::memcpy(into.data(), frame.owned.data(), frame.owned.size());
        }
        {
          std::lock_guard<std::mutex> l(self->pipe_->mu);
          this_dir->read_state = Direction::ReadState::kIdle;
        }
        frame.done(absl::OkStatus());
        done(absl::OkStatus());
      });
    }
    lock.unlock();
    for (auto& t : tasks) ctx_->executor.Post(std::move(t));
  }

  void StartPayload(MutableBuffer into, bool discard, DoneCallback done) {
    std::unique_lock<std::mutex> lock(pipe_->mu);
    Direction& in = pipe_->dirs[1 - side_];
    if (pipe_->closed) {
      lock.unlock();
      Post(std::move(done), ClosedError());
      return;
    }
    if (in.read_state != Direction::ReadState::kAwaitPayload || in.frames.empty()) {
      lock.unlock();
      Post(std::move(done),
           absl::FailedPreconditionError("no frame payload is waiting to be read"));
      return;
    }
    const auto header = DecodeHeader(in.frames.front().header, ctx_->options.limits);
    if (!discard && into.size() != header->payload_length) {
      lock.unlock();
      Post(std::move(done), absl::InvalidArgumentError(absl::StrCat(
                                "payload buffer holds ", into.size(),
                                " bytes but the frame carries ", header->payload_length)));
      return;
    }
    counters_.frames_received.fetch_add(1, std::memory_order_relaxed);
    counters_.bytes_received.fetch_add(kFrameHeaderSize + header->payload_length,
                                       std::memory_order_relaxed);
    in.read_state = Direction::ReadState::kWaitPayload;
    in.into = into;
    in.discard = discard;
    in.payload_done = std::move(done);
    TryDeliver(lock);
  }

  void HeaderTimeout(uint64_t generation, absl::Duration timeout) {
    {
      std::lock_guard<std::mutex> lock(pipe_->mu);
      Direction& in = pipe_->dirs[1 - side_];
      if (in.read_state != Direction::ReadState::kWaitHeader ||
          in.header_wait_generation != generation) {
        return;
      }
    }
    const absl::Status status = absl::DeadlineExceededError(
        absl::StrCat("no frame from ", PeerAddress(), " within ", absl::FormatDuration(timeout)));
    PSD_LOG_WARN("closing connection from {}: {}", PeerAddress(), status.message());
    CloseWithReaderStatus(status);
  }

  // Closes, giving the local reader `status` rather than the generic closed error.
  void CloseWithReaderStatus(const absl::Status& status) {
    HeaderCallback done;
    {
      std::lock_guard<std::mutex> lock(pipe_->mu);
      Direction& in = pipe_->dirs[1 - side_];
      if (in.read_state == Direction::ReadState::kWaitHeader) {
        done = std::move(in.header_done);
        in.read_state = Direction::ReadState::kIdle;
      }
    }
    CloseWith(status);
    if (done) PostHeader(std::move(done), status);
  }

  std::shared_ptr<ContextState> ctx_;
  std::shared_ptr<Pipe> pipe_;
  int side_;
  ConnectionCounters counters_;
};

class InprocListener final : public Listener, public std::enable_shared_from_this<InprocListener> {
 public:
  InprocListener(std::shared_ptr<ContextState> ctx, std::string name)
      : ctx_(std::move(ctx)), name_(std::move(name)) {}

  std::string Address() const override { return name_; }

  void Accept(AcceptCallback done) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) {
      lock.unlock();
      ctx_->executor.Post(
          [done = std::move(done)]() mutable { done(absl::CancelledError("listener closed")); });
      return;
    }
    if (!backlog_.empty()) {
      auto conn = std::move(backlog_.front());
      backlog_.pop_front();
      lock.unlock();
      ctx_->executor.Post([done = std::move(done), conn = std::move(conn)]() mutable {
        done(std::shared_ptr<Connection>(std::move(conn)));
      });
      return;
    }
    waiting_.push_back(std::move(done));
  }

  void Close() override {
    std::deque<AcceptCallback> waiting;
    std::deque<std::shared_ptr<InprocConnection>> backlog;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      closed_ = true;
      waiting.swap(waiting_);
      backlog.swap(backlog_);
    }
    for (auto& conn : backlog) conn->Close();
    for (auto& done : waiting) {
      ctx_->executor.Post(
          [done = std::move(done)]() mutable { done(absl::CancelledError("listener closed")); });
    }
  }

  absl::Status Offer(std::shared_ptr<InprocConnection> conn) {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return absl::UnavailableError(absl::StrCat("listener '", name_, "' is closed"));
    if (!waiting_.empty()) {
      auto done = std::move(waiting_.front());
      waiting_.pop_front();
      lock.unlock();
      ctx_->executor.Post([done = std::move(done), conn = std::move(conn)]() mutable {
        done(std::shared_ptr<Connection>(std::move(conn)));
      });
      return absl::OkStatus();
    }
    if (backlog_.size() >= 1024) {
      return absl::ResourceExhaustedError(absl::StrCat("listener '", name_, "' backlog is full"));
    }
    backlog_.push_back(std::move(conn));
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<ContextState> ctx_;
  std::string name_;
  std::mutex mu_;
  bool closed_ = false;
  std::deque<AcceptCallback> waiting_;
  std::deque<std::shared_ptr<InprocConnection>> backlog_;
};

class InprocContext final : public Context {
 public:
  explicit InprocContext(const ContextOptions& options)
      : state_(std::make_shared<ContextState>(options)) {}
  ~InprocContext() override { InprocContext::Close(); }

  absl::string_view Name() const override { return "inproc"; }
  bool IsViable() const override { return true; }
  const ContextOptions& Options() const override { return state_->options; }

  absl::StatusOr<std::shared_ptr<Listener>> Listen(absl::string_view address) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_->closed) return absl::FailedPreconditionError("transport context is closed");
    std::string name(address);
    if (name.empty() || name.ends_with(":0")) name = absl::StrCat("inproc-", next_id_++);
    if (auto it = listeners_.find(name); it != listeners_.end() && !it->second.expired()) {
      return absl::AlreadyExistsError(absl::StrCat("inproc address '", name, "' is in use"));
    }
    auto listener = std::make_shared<InprocListener>(state_, name);
    listeners_[name] = listener;
    return std::shared_ptr<Listener>(listener);
  }

  absl::StatusOr<std::shared_ptr<Connection>> Connect(absl::string_view address,
                                                      absl::Duration /*timeout*/) override {
    std::shared_ptr<InprocListener> listener;
    std::string client_name;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_->closed) return absl::FailedPreconditionError("transport context is closed");
      auto it = listeners_.find(std::string(address));
      if (it != listeners_.end()) listener = it->second.lock();
      client_name = absl::StrCat("inproc-client-", next_id_++);
    }
    if (!listener) {
      return absl::UnavailableError(absl::StrCat("connect to ", address, " failed: no listener"));
    }
    auto pipe = std::make_shared<Pipe>();
    pipe->names[0] = client_name;
    pipe->names[1] = std::string(address);
    auto client = std::make_shared<InprocConnection>(state_, pipe, 0);
    auto server = std::make_shared<InprocConnection>(state_, pipe, 1);
    if (auto s = listener->Offer(server); !s.ok()) return s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      connections_.push_back(client);
      connections_.push_back(server);
      std::erase_if(connections_, [](const auto& w) { return w.expired(); });
    }
    return std::shared_ptr<Connection>(client);
  }

  void Close() override {
    std::vector<std::weak_ptr<InprocConnection>> connections;
    std::map<std::string, std::weak_ptr<InprocListener>> listeners;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_->closed.exchange(true)) return;
      connections.swap(connections_);
      listeners.swap(listeners_);
    }
    for (auto& [name, weak] : listeners) {
      if (auto l = weak.lock()) l->Close();
    }
    for (auto& weak : connections) {
      if (auto c = weak.lock()) c->Close();
    }
    state_->executor.Shutdown();
  }

 private:
  std::shared_ptr<ContextState> state_;
  std::mutex mu_;
  uint64_t next_id_ = 1;
  std::map<std::string, std::weak_ptr<InprocListener>> listeners_;
  std::vector<std::weak_ptr<InprocConnection>> connections_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<Context>> CreateInprocContext(const ContextOptions& options) {
  return std::shared_ptr<Context>(std::make_shared<InprocContext>(options));
}

}  // namespace poseidon::transport
