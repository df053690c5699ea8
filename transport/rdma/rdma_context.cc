// The RDMA transport: see rdma_context.h and docs/wire.md ("RDMA backend").
//
// A connection is a TCP side channel (the TCP backend) plus, once upgraded, a reliable-connected
// queue pair. Messages on the queue pair are SENDs into fixed-size receive slots:
//   [16-byte message header: kind, credits returned, peer frames read so far]
//   kind 1 (eager): the 64-byte frame header and the payload (payload <= eager_bytes)
//   kind 2 (read):  the 64-byte frame header and up to 16 segments (addr, length, rkey) of
//                   registered sender memory the receiver READs the payload from
//   kind 3 (ack):   credits and "frames read" only
// Frames need a credit (one receive slot of the peer); acks need none (the peer posts spare
// slots for them and re-posts them at once). A READ-path frame's send completes when the peer
// reports it read (or discarded) it.
//
// All of a connection's state belongs to the context's progress thread: public methods post a
// task to it; it waits in poll(2) on the completion channel and a wake-up eventfd.
#include "transport/rdma/rdma_context.h"

#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "transport/checksum.h"
#include "transport/error_frame.h"
#include "transport/tcp/tcp_context.h"

namespace poseidon::transport {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the RDMA message layout is written in host order, which must be little-endian");

using Task = absl::AnyInvocable<void()>;

// ---- the side channel's set-up frames (type data, job 0, this key; sequence = step) ----
constexpr uint64_t kSetupKey = 0x5055544553414d44ull;  // "DMASETUP"
constexpr uint32_t kSetupVersion = 1;
constexpr size_t kSetupInfoBytes = 40;

// ---- queue-pair messages ----
enum MsgKind : uint8_t { kEagerFrame = 1, kReadFrame = 2, kAck = 3 };
constexpr size_t kMsgHeaderBytes = 16;
constexpr size_t kFrameOffset = kMsgHeaderBytes;
constexpr size_t kBodyOffset = kFrameOffset + kFrameHeaderSize;  // 80
constexpr size_t kMaxSegments = 16;
constexpr size_t kSegmentBytes = 16;
constexpr size_t kReadMsgBytesMax = kBodyOffset + 8 + kMaxSegments * kSegmentBytes;
constexpr int kMaxReadsInFlight = 8;

enum WrTag : uint64_t { kTagRecv = 1, kTagSend = 2, kTagRead = 3 };
constexpr uint64_t WrId(WrTag tag, uint64_t index) { return (uint64_t{tag} << 56) | index; }
constexpr uint64_t kWrIndexMask = (uint64_t{1} << 56) - 1;

void Put32(std::byte* p, uint32_t v) { std::memcpy(p, &v, 4); }
void Put64(std::byte* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t Get32(const std::byte* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t Get64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// A copy with a status representation of its own. Copies of an absl::Status share one
// reference-counted representation, and Debian's Abseil is not built with ThreadSanitizer, so a
// representation shared by two threads' copies looks racy to it: statuses that cross between the
// side channel's threads, the callers' and the progress thread are detached first.
absl::Status Detach(const absl::Status& s) {
  return s.ok() ? absl::OkStatus() : absl::Status(s.code(), std::string(s.message()));
}
absl::StatusOr<FrameHeader> Detach(absl::StatusOr<FrameHeader> h) {
  if (h.ok()) return h;
  return Detach(h.status());
}

std::string WcError(const ibv_wc& wc) {
  return absl::StrCat(ibv_wc_status_str(wc.status), " (status ", static_cast<int>(wc.status),
                      ")");
}

// The opened device: verbs context, protection domain, completion channel, port address, and
// the registry of memory registered through RegisterMemory (for zero-copy lookups).
class Device {
 public:
  static absl::StatusOr<std::shared_ptr<Device>> Open(const RdmaOptions& options) {
    int count = 0;
    ibv_device** list = ibv_get_device_list(&count);
    if (list == nullptr || count == 0) {
      if (list != nullptr) ibv_free_device_list(list);
      return absl::UnavailableError("no RDMA device on this machine (ibv_get_device_list found none)");
    }
    auto device = std::shared_ptr<Device>(new Device());
    std::string tried;
    for (int i = 0; i < count && device->ctx_ == nullptr; ++i) {
      const std::string name = ibv_get_device_name(list[i]);
      if (!options.device.empty() && name != options.device) continue;
      ibv_context* ctx = ibv_open_device(list[i]);
      if (ctx == nullptr) {
        absl::StrAppend(&tried, tried.empty() ? "" : ", ", name, " (cannot open)");
        continue;
      }
      ibv_port_attr port{};
      if (ibv_query_port(ctx, static_cast<uint8_t>(options.port), &port) != 0 ||
          port.state != IBV_PORT_ACTIVE) {
        absl::StrAppend(&tried, tried.empty() ? "" : ", ", name, " (port ", options.port,
                        " not active)");
        ibv_close_device(ctx);
        continue;
      }
      device->ctx_ = ctx;
      device->name_ = name;
      device->port_attr_ = port;
    }
    ibv_free_device_list(list);
    if (device->ctx_ == nullptr) {
      return absl::UnavailableError(
          options.device.empty()
              ? absl::StrCat("no RDMA device with an active port: ", tried)
              : absl::StrCat("RDMA device '", options.device, "' not usable: ",
                             tried.empty() ? "not found" : tried));
    }
    if (auto s = device->Init(options); !s.ok()) return s;
    return device;
  }

  ~Device() {
    if (channel_ != nullptr) ibv_destroy_comp_channel(channel_);
    if (pd_ != nullptr) ibv_dealloc_pd(pd_);
    if (ctx_ != nullptr) ibv_close_device(ctx_);
  }

  ibv_context* ctx() const { return ctx_; }
  ibv_pd* pd() const { return pd_; }
  ibv_comp_channel* channel() const { return channel_; }
  const std::string& name() const { return name_; }
  const ibv_port_attr& port_attr() const { return port_attr_; }
  const ibv_gid& gid() const { return gid_; }
  int rd_atomic() const { return rd_atomic_; }

  void AddRegion(ibv_mr* mr) {
    std::lock_guard<std::mutex> lock(mu_);
    regions_[reinterpret_cast<uintptr_t>(mr->addr)] = mr;
  }
  void RemoveRegion(ibv_mr* mr) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(reinterpret_cast<uintptr_t>(mr->addr));
    if (it != regions_.end() && it->second == mr) regions_.erase(it);
  }
  // The registered region holding [p, p + n), or null.
  ibv_mr* FindRegion(const void* p, size_t n) const {
    const auto start = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.upper_bound(start);
    if (it == regions_.begin()) return nullptr;
    --it;
    ibv_mr* mr = it->second;
    return start + n <= it->first + mr->length ? mr : nullptr;
  }

 private:
  Device() = default;

  absl::Status Init(const RdmaOptions& options) {
    pd_ = ibv_alloc_pd(ctx_);
    if (pd_ == nullptr) return absl::UnavailableError(absl::StrCat("ibv_alloc_pd on ", name_, " failed"));
    channel_ = ibv_create_comp_channel(ctx_);
    if (channel_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("ibv_create_comp_channel on ", name_, " failed"));
    }
    const int flags = ::fcntl(channel_->fd, F_GETFL);
    ::fcntl(channel_->fd, F_SETFL, flags | O_NONBLOCK);
    ibv_device_attr attr{};
    if (ibv_query_device(ctx_, &attr) != 0) {
      return absl::UnavailableError(absl::StrCat("ibv_query_device on ", name_, " failed"));
    }
    rd_atomic_ = std::max(1, std::min({kMaxReadsInFlight, attr.max_qp_init_rd_atom,
                                       attr.max_qp_rd_atom}));
    if (ibv_query_gid(ctx_, static_cast<uint8_t>(options.port), options.gid_index, &gid_) != 0) {
      gid_ = ibv_gid{};
    }
    return absl::OkStatus();
  }

  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* channel_ = nullptr;
  std::string name_;
  ibv_port_attr port_attr_{};
  ibv_gid gid_{};
  int rd_atomic_ = 1;
  mutable std::mutex mu_;
  std::map<uintptr_t, ibv_mr*> regions_;
};

// Memory the transport owns and registered (receive and send slots, staging buffers).
class RegisteredBuffer {
 public:
  static absl::StatusOr<std::unique_ptr<RegisteredBuffer>> Make(std::shared_ptr<Device> device,
                                                                size_t size, int access) {
    auto b = std::unique_ptr<RegisteredBuffer>(new RegisteredBuffer(std::move(device), size));
    b->mr_ = ibv_reg_mr(b->device_->pd(), b->data_.get(), size, access);
    if (b->mr_ == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("ibv_reg_mr of ", size, " bytes failed: ", std::strerror(errno)));
    }
    return b;
  }
  ~RegisteredBuffer() {
    if (mr_ != nullptr) ibv_dereg_mr(mr_);
  }
  std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }

 private:
  RegisteredBuffer(std::shared_ptr<Device> device, size_t size)
      : device_(std::move(device)), data_(new std::byte[size]), size_(size) {}
  std::shared_ptr<Device> device_;
  std::unique_ptr<std::byte[]> data_;
  size_t size_;
  ibv_mr* mr_ = nullptr;
};

class RdmaMemoryRegion final : public MemoryRegion {
 public:
  RdmaMemoryRegion(std::shared_ptr<Device> device, ibv_mr* mr, MutableBuffer buffer)
      : device_(std::move(device)), mr_(mr), buffer_(buffer) {
    device_->AddRegion(mr_);
  }
  ~RdmaMemoryRegion() override {
    device_->RemoveRegion(mr_);
    ibv_dereg_mr(mr_);
  }
  MutableBuffer Buffer() const override { return buffer_; }

 private:
  std::shared_ptr<Device> device_;
  ibv_mr* mr_;
  MutableBuffer buffer_;
};

class CqOwner {
 public:
  virtual ~CqOwner() = default;
  virtual void OnCompletions() = 0;
};

// The progress thread: posted tasks in order, timers, and completion events.
class Progress {
 public:
  explicit Progress(ibv_comp_channel* channel)
      : channel_(channel), wake_fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  ~Progress() {
    if (thread_.joinable()) thread_.detach();
    ::close(wake_fd_);
  }

  void Start() { thread_ = std::thread([this] { Run(); }); }

  // Runs `task` on the progress thread; once it has exited, here (serialized).
  void Post(Task task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!exited_) {
        tasks_.push_back(std::move(task));
        Wake();
        return;
      }
    }
    std::lock_guard<std::recursive_mutex> lock(inline_mu_);
    task();
  }

  // Runs `task` at `when` (dropped when the thread stops).
  void PostAt(absl::Time when, Task task) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    timers_.emplace(when, std::move(task));
    Wake();
  }

  // Progress thread only.
  void Watch(ibv_cq* cq, std::shared_ptr<CqOwner> owner) { owners_[cq] = std::move(owner); }
  void Unwatch(ibv_cq* cq) { owners_.erase(cq); }

  // Runs `close_all` on the thread, then the tasks it causes, then stops and joins.
  void Shutdown(Task close_all) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      close_all_ = std::move(close_all);
      timers_.clear();
      Wake();
    }
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // closed from a callback: the thread ends when this task returns
    } else if (thread_.joinable()) {
      thread_.join();
    }
  }

 private:
  void Wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof one);
  }

  void Run() {
    while (true) {
      std::vector<Task> tasks;
      Task close_all;
      bool stopping;
      {
        std::lock_guard<std::mutex> lock(mu_);
        tasks.swap(tasks_);
        stopping = stopping_;
        close_all = std::move(close_all_);
      }
      for (auto& t : tasks) {
        t();
        t = nullptr;
      }
      if (stopping) {
        if (close_all) {
          close_all();
          continue;
        }
        std::lock_guard<std::mutex> lock(mu_);
        if (tasks_.empty()) {
          exited_ = true;
          return;
        }
        continue;
      }
      const absl::Time now = absl::Now();
      std::vector<Task> due;
      absl::Time next = absl::InfiniteFuture();
      {
        std::lock_guard<std::mutex> lock(mu_);
        while (!timers_.empty() && timers_.begin()->first <= now) {
          due.push_back(std::move(timers_.begin()->second));
          timers_.erase(timers_.begin());
        }
        if (!timers_.empty()) next = timers_.begin()->first;
        if (!tasks_.empty()) next = now;
      }
      for (auto& t : due) {
        t();
        t = nullptr;
      }
      if (!due.empty()) continue;
      int timeout_ms = -1;
      if (next != absl::InfiniteFuture()) {
        timeout_ms = static_cast<int>(
            std::clamp<int64_t>(absl::ToInt64Milliseconds(next - now) + 1, 0, 60000));
      }
      pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {channel_->fd, POLLIN, 0}};
      const int n = ::poll(fds, 2, timeout_ms);
      if (n <= 0) continue;
      if (fds[0].revents & POLLIN) {
        uint64_t value;
        [[maybe_unused]] ssize_t r = ::read(wake_fd_, &value, sizeof value);
      }
      if (fds[1].revents & POLLIN) DrainEvents();
    }
  }

  void DrainEvents() {
    std::vector<ibv_cq*> ready;
    ibv_cq* cq = nullptr;
    void* context = nullptr;
    while (ibv_get_cq_event(channel_, &cq, &context) == 0) {
      ibv_ack_cq_events(cq, 1);
      if (std::find(ready.begin(), ready.end(), cq) == ready.end()) ready.push_back(cq);
    }
    for (ibv_cq* c : ready) {
      auto it = owners_.find(c);
      if (it == owners_.end()) continue;
      std::shared_ptr<CqOwner> owner = it->second;  // OnCompletions may unwatch it
      owner->OnCompletions();
    }
  }

  ibv_comp_channel* channel_;
  int wake_fd_;
  std::thread thread_;
  std::mutex mu_;
  std::vector<Task> tasks_;
  std::multimap<absl::Time, Task> timers_;
  Task close_all_;
  bool stopping_ = false;
  bool exited_ = false;
  std::recursive_mutex inline_mu_;
  std::map<ibv_cq*, std::shared_ptr<CqOwner>> owners_;  // progress thread only
};

class RdmaConn;

// What a context and its connections share.
struct Shared {
  RdmaOptions options;
  absl::Status viable;
  std::shared_ptr<Device> device;
  std::unique_ptr<Progress> progress;
  std::shared_ptr<Context> tcp;
  std::atomic<bool> closed{false};
  std::mutex mu;
  std::vector<std::weak_ptr<RdmaConn>> conns;
};

// What the peer told us in the set-up exchange.
struct QpInfo {
  uint32_t version = kSetupVersion;
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint32_t credits = 0;
  uint32_t slot_bytes = 0;
  uint32_t rd_atomic = 0;
  uint16_t lid = 0;
  uint8_t mtu = 0;
  uint8_t gid[16] = {};

};

std::vector<std::byte> EncodeInfo(const QpInfo& info) {
  std::vector<std::byte> out(kSetupInfoBytes + 8);
  std::byte* p = out.data();
  Put32(p, info.version);
  Put32(p + 4, info.qpn);
  Put32(p + 8, info.psn);
  Put32(p + 12, info.credits);
  Put32(p + 16, info.slot_bytes);
  Put32(p + 20, info.rd_atomic);
  std::memcpy(p + 24, &info.lid, 2);
  p[26] = std::byte{info.mtu};
  p[27] = std::byte{0};
  std::memcpy(p + 28, info.gid, 16);
  return out;
}

absl::StatusOr<QpInfo> DecodeInfo(std::span<const std::byte> b) {
  if (b.size() != kSetupInfoBytes + 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("RDMA set-up message of ", b.size(), " bytes, expected ", kSetupInfoBytes + 8));
  }
  QpInfo info;
  const std::byte* p = b.data();
  info.version = Get32(p);
  info.qpn = Get32(p + 4);
  info.psn = Get32(p + 8);
  info.credits = Get32(p + 12);
  info.slot_bytes = Get32(p + 16);
  info.rd_atomic = Get32(p + 20);
  std::memcpy(&info.lid, p + 24, 2);
  info.mtu = static_cast<uint8_t>(p[26]);
  std::memcpy(info.gid, p + 28, 16);
  if (info.version != kSetupVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("peer speaks RDMA set-up version ", info.version, ", this side ", kSetupVersion));
  }
  if (info.credits == 0 || info.credits > 4096 || info.slot_bytes < kReadMsgBytesMax ||
      info.slot_bytes > (1u << 20) || info.rd_atomic == 0 || info.rd_atomic > 64 ||
      info.mtu < IBV_MTU_256 || info.mtu > IBV_MTU_4096 || info.qpn == 0 ||
      info.qpn >= (1u << 24)) {
    return absl::InvalidArgumentError("RDMA set-up message with values out of range");
  }
  return info;
}

constexpr size_t kSetupMessageBytes = kSetupInfoBytes + 8;

// One connection's state; owned by the progress thread (every method below but the public entry
// points runs there).
class RdmaConn final : public CqOwner, public std::enable_shared_from_this<RdmaConn> {
 public:
  RdmaConn(std::shared_ptr<Shared> shared, std::shared_ptr<Connection> tcp, bool server)
      : sh_(std::move(shared)), tcp_(std::move(tcp)), server_(server), peer_(tcp_->PeerAddress()) {}

  static std::shared_ptr<RdmaConn> Make(std::shared_ptr<Shared> shared,
                                        std::shared_ptr<Connection> tcp, bool server) {
    auto conn = std::make_shared<RdmaConn>(shared, std::move(tcp), server);
    std::lock_guard<std::mutex> lock(shared->mu);
    if (shared->conns.size() >= 64 && shared->conns.size() % 64 == 0) {
      std::erase_if(shared->conns, [](const auto& w) { return w.expired(); });
    }
    shared->conns.push_back(conn);
    return conn;
  }

  // ---- public entry points (any thread) ----
  void Send(const FrameHeader& header_in, std::vector<ConstBuffer> payload, DoneCallback done) {
    FrameHeader header = header_in;
    absl::Status valid = PrepareSend(header, payload, sh_->options);
    Post([self = shared_from_this(), header, payload = std::move(payload), done = std::move(done),
          valid = std::move(valid)]() mutable {
      self->DoSend(header, std::move(payload), std::move(done), std::move(valid));
      self->AfterEvent();
    });
  }
  void ReadHeader(HeaderCallback done, absl::Duration timeout) {
    Post([self = shared_from_this(), done = std::move(done), timeout]() mutable {
      self->DoReadHeader(std::move(done), timeout);
      self->AfterEvent();
    });
  }
  void ReadPayload(MutableBuffer into, DoneCallback done) {
    Post([self = shared_from_this(), into, done = std::move(done)]() mutable {
      self->DoReadPayload(into, /*discard=*/false, std::move(done));
      self->AfterEvent();
    });
  }
  void DiscardPayload(DoneCallback done) {
    Post([self = shared_from_this(), done = std::move(done)]() mutable {
      self->DoReadPayload({}, /*discard=*/true, std::move(done));
      self->AfterEvent();
    });
  }
  void Close() {
    Post([self = shared_from_this()] {
      self->DoClose(absl::CancelledError("connection closed locally"), /*tell_peer=*/false);
    });
  }
  void Abort(const absl::Status& reason) {
    Post([self = shared_from_this(), reason = Detach(reason)] {
      self->FailConnection(reason, /*notify=*/true);
    });
  }
  // The user's handle is gone: close once nothing of the user's is pending.
  void Release() {
    Post([self = shared_from_this()] {
      self->abandoned_ = true;
      self->MaybeCloseAbandoned();
    });
  }
  // Starts the queue-pair exchange now (kAtConnect); `ready` gets its outcome.
  void UpgradeNow(std::shared_ptr<std::promise<absl::Status>> ready) {
    Post([self = shared_from_this(), ready = std::move(ready)]() mutable {
      self->ready_ = std::move(ready);
      self->state_ = State::kUpgrading;
      if (self->server_) {
        self->StartServerUpgrade();
      } else {
        self->StartClientUpgrade();
      }
    });
  }
  void ShutdownNow() {
    DoClose(absl::UnavailableError("transport context is closed"), /*tell_peer=*/false);
  }
  std::string PeerAddress() const { return peer_; }
  ConnectionStats Stats() const { return counters_.Snapshot(); }
  // Connection::WaitEstablished: until BecomeRdma (the client's probe acknowledged) or DoClose.
  absl::Status WaitEstablished(absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(established_mu_);
    if (!established_cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                                  [&] { return established_.has_value(); })) {
      return absl::DeadlineExceededError(absl::StrCat(
          "RDMA connection to ", peer_, " not established within ", absl::FormatDuration(timeout),
          " (its queue pair carried no message)"));
    }
    // A status of its own for the caller's thread. A copy would share the message with the
    // progress thread's, whose reference count Debian's Abseil keeps where ThreadSanitizer
    // cannot see it: the last release, on the progress thread, then looks like a race with the
    // caller's reading of the message (ops_rdma_fabric's mixed run under ThreadSanitizer).
    const absl::Status& s = *established_;
    return s.ok() ? absl::OkStatus() : absl::Status(s.code(), s.message());
  }

  void OnCompletions() override {
    if (cq_ == nullptr) return;
    auto self = shared_from_this();
    ibv_req_notify_cq(cq_, 0);
    PollCq();
    AfterEvent();
  }

 private:
  enum class State { kTcp, kUpgrading, kRdma, kClosed };
  enum class ReadState { kIdle, kWaitHeader, kAwaitPayload, kPayload };

  struct Segment {
    uint64_t addr = 0;
    uint32_t length = 0;
    uint32_t rkey = 0;
  };
  struct OutFrame {
    EncodedHeader header{};
    uint64_t payload_length = 0;
    std::vector<ConstBuffer> payload;
    std::string owned;  // an error frame's message
    DoneCallback done;
    bool closes = false;  // the connection closes once it is sent
  };
  struct SlotUse {
    DoneCallback done;
    bool closes = false;
  };
  struct AwaitRead {
    uint64_t id = 0;
    DoneCallback done;
    std::unique_ptr<RegisteredBuffer> staging;
  };
  struct InFrame {
    FrameHeader header;
    MsgKind kind = kEagerFrame;
    int slot = -1;  // eager: the receive slot holding the payload until it is consumed
    std::vector<std::byte> owned;  // eager without a slot: an ERROR frame from the side channel
    std::vector<Segment> segs;
  };
  struct ReadChunk {
    uint64_t dest_offset = 0;
    uint32_t length = 0;
  };

  void Post(Task task) { sh_->progress->Post(std::move(task)); }

  absl::Status ClosedError() const {
    return absl::UnavailableError(
        absl::StrCat("connection to ", peer_, " is closed: ", close_reason_.message()));
  }

  bool OnTcpPath() const { return state_ == State::kTcp && !auth_seen_; }

  // ---- sending ----
  void DoSend(const FrameHeader& header, std::vector<ConstBuffer> payload, DoneCallback done,
              absl::Status valid) {
    if (closed_ || close_after_flush_) {
      done(closed_ ? ClosedError() : absl::UnavailableError(absl::StrCat(
                                         "connection to ", peer_, " is closing: ",
                                         close_reason_.message())));
      return;
    }
    if (!valid.ok()) {
      done(std::move(valid));
      return;
    }
    if (OnTcpPath()) {
      const bool proves_peer = server_ && header.type == FrameType::kAuthOk &&
                               sh_->options.upgrade == RdmaOptions::Upgrade::kAfterHandshake;
      ++tcp_ops_;
      const uint64_t bytes = kFrameHeaderSize + header.payload_length;
      tcp_->Send(header, std::move(payload),
                 [self = shared_from_this(), done = std::move(done), bytes](absl::Status s) mutable {
                   self->Post([self, done = std::move(done), s = Detach(s), bytes]() mutable {
                     --self->tcp_ops_;
                     if (s.ok()) {
                       self->counters_.frames_sent.fetch_add(1, std::memory_order_relaxed);
                       self->counters_.bytes_sent.fetch_add(bytes, std::memory_order_relaxed);
                     }
                     done(std::move(s));
                     self->MaybeCloseAbandoned();
                   });
                 });
      // The handshake proved the peer: the queue pair is set up next on the side channel, after
      // AUTH_OK; frames sent from now on wait for it.
      if (proves_peer) StartServerUpgrade();
      return;
    }
    OutFrame frame;
    frame.header = EncodeHeader(header);
    frame.payload_length = header.payload_length;
    frame.payload = std::move(payload);
    frame.done = std::move(done);
    send_queue_.push_back(std::move(frame));
    Pump();
  }

  // Sends what credits, slots and the state allow.
  void Pump() {
    if (state_ != State::kRdma || closed_ || qp_ == nullptr) return;
    while (!send_queue_.empty() && peer_credits_ > 0 && !free_send_slots_.empty()) {
      OutFrame& f = send_queue_.front();
      const int slot = free_send_slots_.back();
      std::byte* p = send_pool_->data() + static_cast<size_t>(slot) * slot_bytes_;
      std::unique_ptr<RegisteredBuffer> staging;
      size_t msg_bytes;
      // An error frame always goes whole in one SEND: the close follows its completion.
      const bool eager = f.payload_length <= send_eager_max_ ||
                         (f.closes && kBodyOffset + f.payload_length <= peer_slot_bytes_);
      std::memcpy(p + kFrameOffset, f.header.data(), kFrameHeaderSize);
      if (eager) {
        std::byte* at = p + kBodyOffset;
        if (!f.owned.empty()) {
          std::memcpy(at, f.owned.data(), f.owned.size());
        } else {
          for (const auto& b : f.payload) {
            if (!b.empty()) std::memcpy(at, b.data(), b.size());
            at += b.size();
          }
        }
        msg_bytes = kBodyOffset + f.payload_length;
      } else {
        std::vector<Segment> segs;
        bool direct = true;
        for (const auto& b : f.payload) {
          if (b.empty()) continue;
          ibv_mr* mr = sh_->device->FindRegion(b.data(), b.size());
          if (mr == nullptr || segs.size() == kMaxSegments) {
            direct = false;
            break;
          }
          segs.push_back({reinterpret_cast<uint64_t>(b.data()), static_cast<uint32_t>(b.size()),
                          mr->rkey});
        }
        if (!direct) {
          // The bounce path: the payload is copied into registered memory the peer may READ.
          auto buffer = AcquireStaging(f.payload_length);
          if (!buffer.ok()) {
            auto done = std::move(f.done);
            send_queue_.pop_front();
            done(buffer.status());
            continue;
          }
          staging = std::move(*buffer);
          std::byte* at = staging->data();
          for (const auto& b : f.payload) {
            if (!b.empty()) std::memcpy(at, b.data(), b.size());
            at += b.size();
          }
          segs.clear();
          for (uint64_t off = 0; off < f.payload_length; off += uint64_t{1} << 30) {
            const uint64_t n = std::min<uint64_t>(uint64_t{1} << 30, f.payload_length - off);
            segs.push_back({reinterpret_cast<uint64_t>(staging->data()) + off,
                            static_cast<uint32_t>(n), staging->rkey()});
          }
        }
        Put32(p + kBodyOffset, static_cast<uint32_t>(segs.size()));
        Put32(p + kBodyOffset + 4, 0);
        for (size_t i = 0; i < segs.size(); ++i) {
          std::byte* s = p + kBodyOffset + 8 + i * kSegmentBytes;
          Put64(s, segs[i].addr);
          Put32(s + 8, segs[i].length);
          Put32(s + 12, segs[i].rkey);
        }
        msg_bytes = kBodyOffset + 8 + segs.size() * kSegmentBytes;
      }
      WriteMsgHeader(p, eager ? kEagerFrame : kReadFrame);
      free_send_slots_.pop_back();
      if (!PostSend(slot, msg_bytes)) return;
      --peer_credits_;
      counters_.frames_sent.fetch_add(1, std::memory_order_relaxed);
      counters_.bytes_sent.fetch_add(kFrameHeaderSize + f.payload_length,
                                     std::memory_order_relaxed);
      SlotUse& use = send_use_[static_cast<size_t>(slot)];
      use.closes = f.closes;
      if (eager) {
        use.done = std::move(f.done);
      } else {
        awaiting_read_.push_back({++read_frames_sent_, std::move(f.done), std::move(staging)});
      }
      send_queue_.pop_front();
    }
    MaybeSendAck();
    ArmWatchdog();
  }

  void WriteMsgHeader(std::byte* p, MsgKind kind) {
    p[0] = std::byte{kind};
    p[1] = p[2] = p[3] = std::byte{0};
    Put32(p + 4, static_cast<uint32_t>(owed_));
    Put64(p + 8, read_through_);
    owed_ = 0;
    reported_read_through_ = read_through_;
  }

  void MaybeSendAck() {
    if (state_ != State::kRdma || closed_ || qp_ == nullptr || free_send_slots_.empty()) return;
    if (owed_ < ack_threshold_ && read_through_ == reported_read_through_) return;
    const int slot = free_send_slots_.back();
    free_send_slots_.pop_back();
    std::byte* p = send_pool_->data() + static_cast<size_t>(slot) * slot_bytes_;
    WriteMsgHeader(p, kAck);
    PostSend(slot, kMsgHeaderBytes);
  }

  bool PostSend(int slot, size_t bytes) {
    ibv_sge sge{};
    sge.addr = reinterpret_cast<uint64_t>(send_pool_->data() + static_cast<size_t>(slot) * slot_bytes_);
    sge.length = static_cast<uint32_t>(bytes);
    sge.lkey = send_pool_->lkey();
    ibv_send_wr wr{};
    wr.wr_id = WrId(kTagSend, static_cast<uint64_t>(slot));
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    ibv_send_wr* bad = nullptr;
    if (const int rc = ibv_post_send(qp_, &wr, &bad); rc != 0) {
      FailQp(absl::UnavailableError(
          absl::StrCat("ibv_post_send to ", peer_, " failed: ", std::strerror(rc))));
      return false;
    }
    outstanding_[wr.wr_id] = absl::Now();
    return true;
  }

  void PostRecv(int slot) {
    if (qp_ == nullptr || closed_) return;
    ibv_sge sge{};
    sge.addr = reinterpret_cast<uint64_t>(recv_pool_->data() + static_cast<size_t>(slot) * slot_bytes_);
    sge.length = static_cast<uint32_t>(slot_bytes_);
    sge.lkey = recv_pool_->lkey();
    ibv_recv_wr wr{};
    wr.wr_id = WrId(kTagRecv, static_cast<uint64_t>(slot));
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (const int rc = ibv_post_recv(qp_, &wr, &bad); rc != 0) {
      FailQp(absl::UnavailableError(
          absl::StrCat("ibv_post_recv for ", peer_, " failed: ", std::strerror(rc))));
    }
  }

  absl::StatusOr<std::unique_ptr<RegisteredBuffer>> AcquireStaging(size_t n) {
    for (auto it = staging_cache_.begin(); it != staging_cache_.end(); ++it) {
      if ((*it)->size() >= n) {
        auto b = std::move(*it);
        staging_cache_.erase(it);
        return b;
      }
    }
    return RegisteredBuffer::Make(sh_->device, std::max<size_t>(n, 64 * 1024),
                                  IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  }
  // Keeps up to four staging buffers of at most 4 MiB for reuse (registering is costly); a
  // larger one is deregistered at once, so an idle connection holds at most 16 MiB of them.
  void ReleaseStaging(std::unique_ptr<RegisteredBuffer> b) {
    if (!b || b->size() > (size_t{4} << 20)) return;
    staging_cache_.push_back(std::move(b));
    std::sort(staging_cache_.begin(), staging_cache_.end(),
              [](const auto& x, const auto& y) { return x->size() < y->size(); });
    if (staging_cache_.size() > 4) staging_cache_.erase(staging_cache_.begin());
  }

  // ---- reading ----
  void DoReadHeader(HeaderCallback done, absl::Duration timeout) {
    if (closed_ && !(drain_ && DeliverableInbox())) {
      done(ClosedError());
      return;
    }
    if (OnTcpPath()) {
      ++tcp_ops_;
      tcp_user_read_ = true;
      tcp_->ReadHeader(
          [self = shared_from_this(), done = std::move(done)](absl::StatusOr<FrameHeader> h) mutable {
            self->Post([self, done = std::move(done), h = Detach(std::move(h))]() mutable {
              self->OnTcpUserHeader(std::move(done), std::move(h));
            });
          },
          timeout);
      return;
    }
    if (read_state_ != ReadState::kIdle) {
      done(absl::FailedPreconditionError(
          read_state_ == ReadState::kAwaitPayload
              ? "ReadHeader called before the previous frame's payload was read or discarded"
              : "ReadHeader called while another read is outstanding"));
      return;
    }
    read_state_ = ReadState::kWaitHeader;
    header_done_ = std::move(done);
    if (timeout != absl::InfiniteDuration()) {
      header_timeout_ = timeout;
      header_deadline_ = absl::Now() + timeout;
    } else {
      header_deadline_ = absl::InfiniteFuture();
    }
    TryDeliver();
    ArmWatchdog();
  }

  bool DeliverableInbox() const { return !inbox_.empty() && inbox_.front().kind == kEagerFrame; }

  void TryDeliver() {
    if (read_state_ != ReadState::kWaitHeader) return;
    if (closed_ && !DeliverableInbox()) {
      read_state_ = ReadState::kIdle;
      auto done = std::move(header_done_);
      done(ClosedError());
      return;
    }
    if (inbox_.empty()) return;
    InFrame in = std::move(inbox_.front());
    inbox_.pop_front();
    header_deadline_ = absl::InfiniteFuture();
    if (in.kind == kReadFrame) ++owed_;  // its slot went back at once; the credit goes now
    const FrameHeader header = in.header;
    if (header.payload_length == 0) {
      if (in.slot >= 0) RepostOwed(in.slot);
      read_state_ = ReadState::kIdle;
    } else {
      read_state_ = ReadState::kAwaitPayload;
      current_ = std::move(in);
    }
    auto done = std::move(header_done_);
    done(header);
  }

  void RepostOwed(int slot) {
    PostRecv(slot);
    ++owed_;
  }

  void DoReadPayload(MutableBuffer into, bool discard, DoneCallback done) {
    const bool eager_ready = read_state_ == ReadState::kAwaitPayload && current_.kind == kEagerFrame;
    if (closed_ && !(drain_ && eager_ready)) {
      done(ClosedError());
      return;
    }
    if (OnTcpPath()) {
      ++tcp_ops_;
      if (discard) auth_header_read_ = false;
      auto cb = [self = shared_from_this(), done = std::move(done), discard](absl::Status s) mutable {
        self->Post([self, done = std::move(done), s = Detach(s), discard]() mutable {
          self->OnTcpUserPayload(std::move(done), std::move(s), discard);
        });
      };
      if (discard) {
        tcp_->DiscardPayload(std::move(cb));
      } else {
        tcp_->ReadPayload(into, std::move(cb));
      }
      return;
    }
    if (read_state_ != ReadState::kAwaitPayload) {
      done(absl::FailedPreconditionError("no frame payload is waiting to be read"));
      return;
    }
    const uint64_t length = current_.header.payload_length;
    if (!discard && into.size() != length) {
      done(absl::InvalidArgumentError(absl::StrCat(
          "payload buffer holds ", into.size(), " bytes but the frame carries ", length)));
      return;
    }
    if (current_.kind == kEagerFrame) {
      const std::byte* from =
          current_.slot < 0
              ? current_.owned.data()
              : recv_pool_->data() + static_cast<size_t>(current_.slot) * slot_bytes_ + kBodyOffset;
      if (!discard) std::memcpy(into.data(), from, length);
      if (current_.slot >= 0) RepostOwed(current_.slot);
      read_state_ = ReadState::kIdle;
      counters_.bytes_received.fetch_add(length, std::memory_order_relaxed);
      FinishPayload(into, discard, std::move(done));
      return;
    }
    if (discard) {
      ++read_through_;
      read_state_ = ReadState::kIdle;
      done(absl::OkStatus());
      AfterEvent();
      return;
    }
    // READ the payload from the sender's memory, into the caller's buffer when it is registered
    // (zero copy), else through a staging window.
    read_state_ = ReadState::kPayload;
    payload_done_ = std::move(done);
    into_ = into;
    read_seg_ = 0;
    read_seg_offset_ = 0;
    read_dest_offset_ = 0;
    read_got_ = 0;
    dest_mr_ = sh_->device->FindRegion(into.data(), into.size());
    if (dest_mr_ == nullptr && !read_staging_) {
      auto staging = RegisteredBuffer::Make(
          sh_->device, static_cast<size_t>(max_reads_) * sh_->options.read_chunk_bytes,
          IBV_ACCESS_LOCAL_WRITE);
      if (!staging.ok()) {
        FailConnection(staging.status(), /*notify=*/true);
        return;
      }
      read_staging_ = std::move(*staging);
    }
    free_chunks_.clear();
    for (int i = max_reads_ - 1; i >= 0; --i) free_chunks_.push_back(i);
    chunks_.assign(static_cast<size_t>(max_reads_), ReadChunk{});
    last_progress_ = absl::Now();
    PostReads();
    ArmWatchdog();
  }

  void PostReads() {
    const size_t chunk_bytes = sh_->options.read_chunk_bytes;
    while (!free_chunks_.empty() && read_seg_ < current_.segs.size() && qp_ != nullptr) {
      const Segment& seg = current_.segs[read_seg_];
      const uint32_t n =
          static_cast<uint32_t>(std::min<uint64_t>(chunk_bytes, seg.length - read_seg_offset_));
      const int c = free_chunks_.back();
      free_chunks_.pop_back();
      chunks_[static_cast<size_t>(c)] = {read_dest_offset_, n};
      ibv_sge sge{};
      if (dest_mr_ != nullptr) {
        sge.addr = reinterpret_cast<uint64_t>(into_.data() + read_dest_offset_);
        sge.lkey = dest_mr_->lkey;
      } else {
        sge.addr = reinterpret_cast<uint64_t>(read_staging_->data() +
                                              static_cast<size_t>(c) * chunk_bytes);
        sge.lkey = read_staging_->lkey();
      }
      sge.length = n;
      ibv_send_wr wr{};
      wr.wr_id = WrId(kTagRead, static_cast<uint64_t>(c));
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_READ;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.wr.rdma.remote_addr = seg.addr + read_seg_offset_;
      wr.wr.rdma.rkey = seg.rkey;
      ibv_send_wr* bad = nullptr;
      if (const int rc = ibv_post_send(qp_, &wr, &bad); rc != 0) {
        FailQp(absl::UnavailableError(
            absl::StrCat("ibv_post_send (READ) to ", peer_, " failed: ", std::strerror(rc))));
        return;
      }
      outstanding_[wr.wr_id] = absl::Now();
      read_seg_offset_ += n;
      read_dest_offset_ += n;
      if (read_seg_offset_ == seg.length) {
        ++read_seg_;
        read_seg_offset_ = 0;
      }
    }
  }

  void OnReadChunkDone(int c) {
    if (read_state_ != ReadState::kPayload) return;
    const ReadChunk chunk = chunks_[static_cast<size_t>(c)];
    if (dest_mr_ == nullptr) {
      std::memcpy(into_.data() + chunk.dest_offset,
                  read_staging_->data() + static_cast<size_t>(c) * sh_->options.read_chunk_bytes,
                  chunk.length);
    }
    free_chunks_.push_back(c);
    read_got_ += chunk.length;
    last_progress_ = absl::Now();
    counters_.bytes_received.fetch_add(chunk.length, std::memory_order_relaxed);
    if (read_got_ < current_.header.payload_length) {
      PostReads();
      return;
    }
    ++read_through_;
    read_state_ = ReadState::kIdle;
    FinishPayload(into_, /*discard=*/false, std::move(payload_done_));
  }

  void FinishPayload(MutableBuffer into, bool discard, DoneCallback done) {
    if (!discard && (current_.header.flags & kFlagPayloadChecksum) != 0 &&
        Crc32c(0, into) != current_.header.payload_checksum) {
      const absl::Status status = absl::DataLossError(absl::StrCat(
          "payload checksum mismatch in ", DescribeHeader(current_.header), " from ", peer_));
      FailConnection(status, /*notify=*/true);
      done(status);
      return;
    }
    done(absl::OkStatus());
  }

  // ---- completions ----
  void PollCq() {
    ibv_wc wc[32];
    while (cq_ != nullptr) {
      const int n = ibv_poll_cq(cq_, 32, wc);
      if (n <= 0) {
        if (n < 0) FailQp(absl::UnavailableError(absl::StrCat("ibv_poll_cq for ", peer_, " failed")));
        return;
      }
      for (int i = 0; i < n && cq_ != nullptr; ++i) HandleWc(wc[i]);
    }
  }

  void HandleWc(const ibv_wc& wc) {
    const auto tag = static_cast<WrTag>(wc.wr_id >> 56);
    const auto index = static_cast<int>(wc.wr_id & kWrIndexMask);
    if (tag != kTagRecv) outstanding_.erase(wc.wr_id);
    if (wc.status != IBV_WC_SUCCESS) {
      if (tag == kTagSend) {
        SlotUse use = std::move(send_use_[static_cast<size_t>(index)]);
        free_send_slots_.push_back(index);
        if (use.done) pending_failures_.push_back(std::move(use.done));
      }
      const char* what = tag == kTagRecv ? "RECV" : tag == kTagSend ? "SEND" : "READ";
      FailQp(absl::UnavailableError(absl::StrCat("RDMA ", what, tag == kTagRecv ? " from " : " to ",
                                                 peer_, " failed: ", WcError(wc))));
      return;
    }
    switch (tag) {
      case kTagRecv:
        OnMessage(index, wc.byte_len);
        break;
      case kTagSend: {
        SlotUse use = std::move(send_use_[static_cast<size_t>(index)]);
        free_send_slots_.push_back(index);
        if (use.done) use.done(absl::OkStatus());
        if (use.closes) DoClose(close_reason_, /*tell_peer=*/false);
        break;
      }
      case kTagRead:
        OnReadChunkDone(index);
        break;
    }
  }

  void ProtocolError(const std::string& what) {
    FailConnection(absl::InvalidArgumentError(absl::StrCat("bad RDMA message from ", peer_, ": ", what)),
                   /*notify=*/true);
  }

  void OnMessage(int slot, uint32_t length) {
    const std::byte* p = recv_pool_->data() + static_cast<size_t>(slot) * slot_bytes_;
    if (length < kMsgHeaderBytes) return ProtocolError(absl::StrCat("message of ", length, " bytes"));
    const auto kind = static_cast<uint8_t>(p[0]);
    const uint32_t credits = Get32(p + 4);
    const uint64_t read_through = Get64(p + 8);
    if (peer_credits_ + static_cast<int64_t>(credits) > peer_credits_max_) {
      return ProtocolError(absl::StrCat("returns ", credits, " credits it never had"));
    }
    peer_credits_ += static_cast<int>(credits);
    if (read_through < peer_read_through_ || read_through > read_frames_sent_) {
      return ProtocolError(absl::StrCat("reports ", read_through, " frames read of ",
                                        read_frames_sent_, " sent"));
    }
    while (!awaiting_read_.empty() && awaiting_read_.front().id <= read_through) {
      AwaitRead a = std::move(awaiting_read_.front());
      awaiting_read_.pop_front();
      ReleaseStaging(std::move(a.staging));
      if (a.done) a.done(absl::OkStatus());
    }
    peer_read_through_ = read_through;
    if (kind == kAck) {
      PostRecv(slot);
      return;
    }
    if (kind != kEagerFrame && kind != kReadFrame) {
      return ProtocolError(absl::StrCat("unknown message kind ", kind));
    }
    if (length < kBodyOffset) return ProtocolError("frame message shorter than a frame header");
    auto header = DecodeHeader(std::span<const std::byte, kFrameHeaderSize>(p + kFrameOffset,
                                                                             kFrameHeaderSize),
                               sh_->options.limits);
    if (!header.ok()) {
      const absl::Status status(header.status().code(), absl::StrCat("bad frame from ", peer_, ": ",
                                                                     header.status().message()));
      FailConnection(status, /*notify=*/true);
      return;
    }
    InFrame in;
    in.header = *header;
    in.kind = static_cast<MsgKind>(kind);
    if (kind == kEagerFrame) {
      if (length != kBodyOffset + header->payload_length) {
        return ProtocolError(absl::StrCat("eager frame of ", length, " bytes declares ",
                                          header->payload_length, " payload bytes"));
      }
      in.slot = slot;
    } else {
      const uint32_t count = length >= kBodyOffset + 8 ? Get32(p + kBodyOffset) : 0;
      if (count == 0 || count > kMaxSegments || length != kBodyOffset + 8 + count * kSegmentBytes) {
        return ProtocolError("read frame with a bad segment list");
      }
      uint64_t total = 0;
      for (uint32_t i = 0; i < count; ++i) {
        const std::byte* s = p + kBodyOffset + 8 + i * kSegmentBytes;
        Segment seg{Get64(s), Get32(s + 8), Get32(s + 12)};
        if (seg.length == 0) return ProtocolError("read frame with an empty segment");
        total += seg.length;
        in.segs.push_back(seg);
      }
      if (total != header->payload_length) {
        return ProtocolError(absl::StrCat("read frame segments hold ", total,
                                          " bytes, the header declares ", header->payload_length));
      }
      PostRecv(slot);  // the credit goes back when the header is delivered
    }
    counters_.frames_received.fetch_add(1, std::memory_order_relaxed);
    counters_.bytes_received.fetch_add(kFrameHeaderSize, std::memory_order_relaxed);
    inbox_.push_back(std::move(in));
  }

  // What every event ends with: deliver, send, ack, and close an abandoned connection.
  void AfterEvent() {
    auto failures = std::move(pending_failures_);
    pending_failures_.clear();
    for (auto& done : failures) done(ClosedError());
    TryDeliver();
    Pump();
    MaybeCloseAbandoned();
  }

  // ---- errors and closing ----
  // An error completion or a lost one: the queue pair is unusable. The peer is told over the
  // side channel (an ERROR frame, then the close).
  void FailQp(const absl::Status& status) {
    if (closed_) return;
    qp_broken_ = true;  // the side channel's Abort logs the reason
    DoClose(status, /*tell_peer=*/true);
  }

  // A protocol violation, a timeout or Abort: the peer gets an ERROR frame with the reason (on the
  // queue pair when it works, else on the side channel), then the connection closes.
  void FailConnection(const absl::Status& status, bool notify) {
    if (closed_ || close_after_flush_) return;
    if (!notify || (state_ == State::kRdma && !qp_broken_ && qp_ != nullptr)) {
      PSD_LOG_WARN("closing connection from {}: {}", peer_, status.message());
    }  // else the side channel's Abort logs it
    if (notify && state_ == State::kRdma && !qp_broken_ && qp_ != nullptr) {
      ErrorFrame ef = MakeErrorFrame(0, status);
      OutFrame frame;
      frame.header = EncodeHeader(ef.header);
      frame.payload_length = ef.message.size();
      frame.owned = std::move(ef.message);
      frame.done = [](absl::Status) {};
      frame.closes = true;
      close_after_flush_ = true;
      close_reason_ = status;
      flush_deadline_ = absl::Now() + absl::Seconds(1);
      send_queue_.push_back(std::move(frame));
      Pump();
      ArmWatchdog();
      return;
    }
    DoClose(status, notify);
  }

  void DoClose(const absl::Status& reason, bool tell_peer) {
    if (closed_) return;
    auto self = shared_from_this();
    closed_ = true;
    close_reason_ = reason;
    state_ = State::kClosed;
    if (qp_ != nullptr) {
      ibv_destroy_qp(qp_);  // no DMA into anyone's memory after this
      qp_ = nullptr;
    }
    if (cq_ != nullptr) {
      sh_->progress->Unwatch(cq_);
      ibv_destroy_cq(cq_);
      cq_ = nullptr;
    }
    outstanding_.clear();
    if (tell_peer) {
      tcp_->Abort(Detach(reason));
    } else {
      tcp_->Close();
    }
    const absl::Status closed = ClosedError();
    auto queue = std::move(send_queue_);
    send_queue_.clear();
    for (auto& f : queue) {
      if (f.done) f.done(closed);
    }
    for (auto& use : send_use_) {
      if (use.done) {
        auto done = std::move(use.done);
        use.done = nullptr;
        done(closed);
      }
    }
    auto awaiting = std::move(awaiting_read_);
    awaiting_read_.clear();
    for (auto& a : awaiting) {
      if (a.done) a.done(closed);
    }
    if (!drain_) inbox_.clear();
    if (read_state_ == ReadState::kPayload) {
      read_state_ = ReadState::kIdle;
      auto done = std::move(payload_done_);
      done(reason.code() == absl::StatusCode::kDeadlineExceeded ? reason : closed);
    }
    TryDeliver();
    if (ready_) {
      ready_->set_value(closed);
      ready_.reset();
    }
    SetEstablished(reason.ok() ? closed : absl::Status(reason.code(), std::string(reason.message())));
  }

  void MaybeCloseAbandoned() {
    if (!abandoned_ || closed_) return;
    if (!send_queue_.empty() || !awaiting_read_.empty() || tcp_ops_ > 0 ||
        read_state_ == ReadState::kWaitHeader || read_state_ == ReadState::kPayload) {
      return;
    }
    for (const auto& use : send_use_) {
      if (use.done) return;
    }
    DoClose(absl::CancelledError("connection released"), /*tell_peer=*/false);
  }

  // ---- deadlines ----
  void ArmWatchdog() {
    if (closed_) return;
    absl::Time at = absl::InfiniteFuture();
    if (read_state_ == ReadState::kWaitHeader) at = std::min(at, header_deadline_);
    if (read_state_ == ReadState::kPayload) {
      at = std::min(at, last_progress_ + sh_->options.payload_idle_timeout);
    }
    for (const auto& [id, posted] : outstanding_) {
      at = std::min(at, posted + sh_->options.completion_timeout);
    }
    if (close_after_flush_) at = std::min(at, flush_deadline_);
    if (at == absl::InfiniteFuture() || at >= watchdog_at_) return;
    watchdog_at_ = at;
    sh_->progress->PostAt(at, [weak = weak_from_this()] {
      if (auto self = weak.lock()) {
        self->Watchdog();
        self->AfterEvent();
      }
    });
  }

  void Watchdog() {
    watchdog_at_ = absl::InfiniteFuture();
    if (closed_) return;
    const absl::Time now = absl::Now();
    if (read_state_ == ReadState::kWaitHeader && now >= header_deadline_) {
      read_state_ = ReadState::kIdle;
      header_deadline_ = absl::InfiniteFuture();
      auto done = std::move(header_done_);
      done(absl::DeadlineExceededError(absl::StrCat(
          "no frame from ", peer_, " within ", absl::FormatDuration(header_timeout_))));
    }
    if (read_state_ == ReadState::kPayload &&
        now >= last_progress_ + sh_->options.payload_idle_timeout) {
      FailQp(absl::DeadlineExceededError(absl::StrCat(
          "frame payload from ", peer_, " made no progress for ",
          absl::FormatDuration(sh_->options.payload_idle_timeout), " (", read_got_, " of ",
          current_.header.payload_length, " bytes)")));
      return;
    }
    for (const auto& [id, posted] : outstanding_) {
      if (now >= posted + sh_->options.completion_timeout) {
        FailQp(absl::DeadlineExceededError(absl::StrCat(
            "an RDMA work request to ", peer_, " did not complete within ",
            absl::FormatDuration(sh_->options.completion_timeout), " (lost completion)")));
        return;
      }
    }
    if (close_after_flush_ && now >= flush_deadline_) {
      DoClose(close_reason_, /*tell_peer=*/false);
      return;
    }
    ArmWatchdog();
  }

  // ---- the side channel before the upgrade ----
  void OnTcpUserHeader(HeaderCallback done, absl::StatusOr<FrameHeader> h) {
    --tcp_ops_;
    tcp_user_read_ = false;
    if (closed_ || OnTcpPath()) {
      if (h.ok()) {
        counters_.frames_received.fetch_add(1, std::memory_order_relaxed);
        counters_.bytes_received.fetch_add(kFrameHeaderSize, std::memory_order_relaxed);
        auth_header_read_ = !server_ && h->type == FrameType::kAuthOk && h->payload_length > 0 &&
                            sh_->options.upgrade == RdmaOptions::Upgrade::kAfterHandshake;
      }
      done(std::move(h));
      MaybeCloseAbandoned();
      return;
    }
    // The upgrade began while this read was out: what came is the side channel's; the caller's
    // read waits for the queue pair's frames.
    read_state_ = ReadState::kWaitHeader;
    header_done_ = std::move(done);
    header_deadline_ = absl::InfiniteFuture();
    OnSideHeader(std::move(h));
  }

  void OnTcpUserPayload(DoneCallback done, absl::Status s, bool discard) {
    --tcp_ops_;
    const bool proved = s.ok() && !discard && auth_header_read_;
    auth_header_read_ = false;
    if (proved) auth_seen_ = true;  // from here on the caller's frames wait for the queue pair
    done(std::move(s));
    if (proved) {
      // After the callback: a handshake that found the proof wrong has closed us by then (its
      // Close is queued before this), so no QP is ever offered to an unproven server.
      Post([self = shared_from_this()] {
        if (self->closed_) return;
        self->state_ = State::kUpgrading;
        self->StartClientUpgrade();
      });
    }
    MaybeCloseAbandoned();
  }

  // ---- the queue-pair exchange ----
  void StartServerUpgrade() {
    if (closed_) return;
    state_ = State::kUpgrading;
    if (auto s = CreateQp(); !s.ok()) {
      FailSetup(s);
      return;
    }
    SendSetup(1, LocalInfo());
    expected_step_ = 2;
    if (!tcp_user_read_) ArmSideRead(sh_->options.setup_timeout);
  }

  void StartClientUpgrade() {
    if (closed_) return;
    state_ = State::kUpgrading;
    expected_step_ = 1;
    if (!tcp_user_read_) ArmSideRead(sh_->options.setup_timeout);
  }

  void FailSetup(const absl::Status& s) {
    const absl::Status status(s.code(), absl::StrCat("RDMA set-up with ", peer_, " failed: ", s.message()));
    DoClose(status, /*tell_peer=*/true);  // the side channel's Abort logs it
  }

  void SendSetup(uint64_t step, std::vector<std::byte> body) {
    auto owned = std::make_shared<std::vector<std::byte>>(std::move(body));
    FrameHeader h;
    h.type = FrameType::kData;
    h.key = kSetupKey;
    h.sequence = step;
    h.payload_length = owned->size();
    std::vector<ConstBuffer> payload;
    if (!owned->empty()) payload.emplace_back(*owned);
    tcp_->Send(h, std::move(payload), [owned](absl::Status) {});
  }

  void ArmSideRead(absl::Duration timeout) {
    if (side_read_armed_ || closed_) return;
    side_read_armed_ = true;
    tcp_->ReadHeader(
        [self = shared_from_this()](absl::StatusOr<FrameHeader> h) mutable {
          self->Post([self, h = Detach(std::move(h))]() mutable {
            self->side_read_armed_ = false;
            self->OnSideHeader(std::move(h));
          });
        },
        timeout);
  }

  void OnSideHeader(absl::StatusOr<FrameHeader> h) {
    if (closed_) return;
    if (!h.ok()) {
      if (state_ == State::kRdma) {
        // The peer closed (or its side channel broke). What it sent before is delivered first.
        PollCq();
        drain_ = true;
        DoClose(h.status().code() == absl::StatusCode::kUnavailable
                    ? h.status()
                    : absl::UnavailableError(absl::StrCat("side channel to ", peer_,
                                                          " failed: ", h.status().message())),
                /*tell_peer=*/false);
      } else {
        FailSetup(h.status());
      }
      return;
    }
    if (h->type == FrameType::kError && h->payload_length <= kMaxErrorMessageBytes) {
      // The peer failed the connection and says why (before the queue pair was up, or after it
      // broke): the caller reads the ERROR frame like any other, then the close.
      ReadSidePayload(*h, [self = shared_from_this(), header = *h](std::span<const std::byte> b) {
        const absl::Status why = ParseErrorFrame(header, b);
        self->PollCq();
        InFrame in;
        in.header = header;
        in.kind = kEagerFrame;
        in.owned.assign(b.begin(), b.end());
        self->inbox_.push_back(std::move(in));
        self->counters_.frames_received.fetch_add(1, std::memory_order_relaxed);
        self->drain_ = true;
        if (self->ready_) {  // connected; what the peer said is the first frame
          self->ready_->set_value(absl::OkStatus());
          self->ready_.reset();
        }
        self->DoClose(absl::UnavailableError(absl::StrCat("peer ", self->peer_, " reported: ",
                                                          why.message())),
                      /*tell_peer=*/false);
      });
      return;
    }
    if (state_ == State::kUpgrading && h->type == FrameType::kData && h->key == kSetupKey &&
        h->sequence == expected_step_ && h->job_id == 0 &&
        h->payload_length == (expected_step_ == 3 ? 0 : kSetupMessageBytes)) {
      if (expected_step_ == 3) {
        OnSetupStep(3, {});
        return;
      }
      ReadSidePayload(*h, [self = shared_from_this(), step = expected_step_](
                              std::span<const std::byte> b) { self->OnSetupStep(step, b); });
      return;
    }
    const absl::Status status = absl::InvalidArgumentError(absl::StrCat(
        "unexpected frame on the RDMA side channel from ", peer_, ": ", DescribeHeader(*h)));
    DoClose(status, /*tell_peer=*/true);  // the side channel's Abort logs it
  }

  void ReadSidePayload(const FrameHeader& h,
                       absl::AnyInvocable<void(std::span<const std::byte>)> then) {
    auto buffer = std::make_shared<std::vector<std::byte>>(h.payload_length);
    if (h.payload_length == 0) {
      then(*buffer);
      return;
    }
    tcp_->ReadPayload(*buffer, [self = shared_from_this(), buffer,
                                then = std::move(then)](absl::Status s) mutable {
      self->Post([self, buffer, then = std::move(then), s = Detach(s)]() mutable {
        if (self->closed_) return;
        if (!s.ok()) {
          self->FailSetup(s);
          return;
        }
        then(*buffer);
      });
    });
  }

  void OnSetupStep(uint64_t step, std::span<const std::byte> body) {
    if (closed_) return;
    if (step == 3) {  // client: the server's queue pair is ready to receive
      ProbePath();
      return;
    }
    auto info = DecodeInfo(body);
    if (!info.ok()) {
      FailSetup(info.status());
      return;
    }
    if (step == 1) {  // client
      if (auto s = CreateQp(); !s.ok()) return FailSetup(s);
      if (auto s = ConnectQp(*info); !s.ok()) return FailSetup(s);
      SendSetup(2, LocalInfo());
      expected_step_ = 3;
      ArmSideRead(sh_->options.setup_timeout);
      return;
    }
    // server
    if (auto s = ConnectQp(*info); !s.ok()) return FailSetup(s);
    SendSetup(3, {});
    BecomeRdma();
  }

  // The client's last set-up step: one SEND on the new queue pair (an ack that carries nothing),
  // whose completion means the server's HCA acknowledged it (a reliable connection). Only then is
  // the connection RDMA: two devices that cannot reach each other (not on one fabric) fail here,
  // with "transport retry counter exceeded", so that Connect fails and a caller that also has the
  // peer's TCP endpoint falls back to it (agent/connect_fallback.h) rather than its first frame
  // failing later. The server is already receiving: it became RDMA before it sent step 3.
  void ProbePath() {
    const int slot = free_send_slots_.back();
    free_send_slots_.pop_back();
    WriteMsgHeader(send_pool_->data() + static_cast<size_t>(slot) * slot_bytes_, kAck);
    send_use_[static_cast<size_t>(slot)].done = [self = shared_from_this()](absl::Status s) {
      if (!s.ok()) return;  // the connection has failed, and Connect with it (DoClose)
      self->Post([self] {
        if (!self->closed_) self->BecomeRdma();
      });
    };
    PostSend(slot, kMsgHeaderBytes);
  }

  void SetEstablished(const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(established_mu_);
      if (!established_) established_ = status;
    }
    established_cv_.notify_all();
  }

  void BecomeRdma() {
    SetEstablished(absl::OkStatus());
    state_ = State::kRdma;
    ArmSideRead(absl::InfiniteDuration());
    if (ready_) {
      ready_->set_value(absl::OkStatus());
      ready_.reset();
    }
    PollCq();
    AfterEvent();
  }

  std::vector<std::byte> LocalInfo() const {
    QpInfo info;
    info.qpn = qp_->qp_num;
    info.psn = psn_;
    info.credits = static_cast<uint32_t>(credits_granted_);
    info.slot_bytes = static_cast<uint32_t>(slot_bytes_);
    info.rd_atomic = static_cast<uint32_t>(sh_->device->rd_atomic());
    info.lid = sh_->device->port_attr().lid;
    info.mtu = static_cast<uint8_t>(sh_->device->port_attr().active_mtu);
    std::memcpy(info.gid, sh_->device->gid().raw, 16);
    return EncodeInfo(info);
  }

  absl::Status CreateQp() {
    const RdmaOptions& o = sh_->options;
    Device& dev = *sh_->device;
    credits_granted_ = o.receive_credits;
    slot_bytes_ = (std::max(kBodyOffset + std::max(o.eager_bytes, kMaxErrorMessageBytes),
                            kReadMsgBytesMax) +
                   63) &
                  ~size_t{63};
    recv_slots_ = o.receive_credits + o.receive_credits / 2 + 8;  // spare slots for acks
    send_slots_ = recv_slots_;
    ack_threshold_ = std::max(1, o.receive_credits / 4);
    auto recv = RegisteredBuffer::Make(sh_->device, static_cast<size_t>(recv_slots_) * slot_bytes_,
                                       IBV_ACCESS_LOCAL_WRITE);
    if (!recv.ok()) return recv.status();
    recv_pool_ = std::move(*recv);
    auto send = RegisteredBuffer::Make(sh_->device, static_cast<size_t>(send_slots_) * slot_bytes_,
                                       IBV_ACCESS_LOCAL_WRITE);
    if (!send.ok()) return send.status();
    send_pool_ = std::move(*send);
    send_use_.resize(static_cast<size_t>(send_slots_));
    for (int i = send_slots_ - 1; i >= 0; --i) free_send_slots_.push_back(i);
    max_reads_ = dev.rd_atomic();
    const int cqe = send_slots_ + recv_slots_ + max_reads_ + 16;
    cq_ = ibv_create_cq(dev.ctx(), cqe, this, dev.channel(), 0);
    if (cq_ == nullptr) return absl::UnavailableError("ibv_create_cq failed");
    sh_->progress->Watch(cq_, shared_from_this());
    ibv_req_notify_cq(cq_, 0);
    ibv_qp_init_attr init{};
    init.send_cq = cq_;
    init.recv_cq = cq_;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = static_cast<uint32_t>(send_slots_ + max_reads_);
    init.cap.max_recv_wr = static_cast<uint32_t>(recv_slots_);
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    qp_ = ibv_create_qp(dev.pd(), &init);
    if (qp_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("ibv_create_qp failed: ", std::strerror(errno)));
    }
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = static_cast<uint8_t>(o.port);
    attr.qp_access_flags = IBV_ACCESS_REMOTE_READ;
    if (int rc = ibv_modify_qp(qp_, &attr,
                               IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
        rc != 0) {
      return absl::UnavailableError(absl::StrCat("QP to INIT failed: ", std::strerror(rc)));
    }
    for (int i = 0; i < recv_slots_; ++i) PostRecv(i);
    std::random_device rd;
    psn_ = rd() & 0xffffff;
    return closed_ ? close_reason_ : absl::OkStatus();
  }

  absl::Status ConnectQp(const QpInfo& peer) {
    const RdmaOptions& o = sh_->options;
    Device& dev = *sh_->device;
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = static_cast<ibv_mtu>(std::min<int>(peer.mtu, dev.port_attr().active_mtu));
    attr.dest_qp_num = peer.qpn;
    attr.rq_psn = peer.psn;
    attr.max_dest_rd_atomic = static_cast<uint8_t>(dev.rd_atomic());
    attr.min_rnr_timer = 12;
    attr.ah_attr.dlid = peer.lid;
    attr.ah_attr.port_num = static_cast<uint8_t>(o.port);
    ibv_gid gid{};
    std::memcpy(gid.raw, peer.gid, 16);
    if (gid.global.interface_id != 0 || gid.global.subnet_prefix != 0) {
      attr.ah_attr.is_global = 1;
      attr.ah_attr.grh.dgid = gid;
      attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(o.gid_index);
      attr.ah_attr.grh.hop_limit = 64;
    }
    if (int rc = ibv_modify_qp(qp_, &attr,
                               IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                   IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
        rc != 0) {
      return absl::UnavailableError(absl::StrCat("QP to RTR failed: ", std::strerror(rc)));
    }
    attr = ibv_qp_attr{};
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = 14;
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;  // never give up for want of a receive: credits make that rare
    attr.sq_psn = psn_;
    attr.max_rd_atomic = static_cast<uint8_t>(std::min<uint32_t>(
        static_cast<uint32_t>(max_reads_), peer.rd_atomic));
    if (int rc = ibv_modify_qp(qp_, &attr,
                               IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                   IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
        rc != 0) {
      return absl::UnavailableError(absl::StrCat("QP to RTS failed: ", std::strerror(rc)));
    }
    max_reads_ = std::min<int>(max_reads_, static_cast<int>(peer.rd_atomic));
    peer_credits_ = static_cast<int>(peer.credits);
    peer_credits_max_ = peer_credits_;
    peer_slot_bytes_ = peer.slot_bytes;
    send_eager_max_ = std::min<size_t>(o.eager_bytes, peer.slot_bytes - kBodyOffset);
    return absl::OkStatus();
  }

  std::shared_ptr<Shared> sh_;
  std::shared_ptr<Connection> tcp_;
  const bool server_;
  const std::string peer_;
  ConnectionCounters counters_;

  State state_ = State::kTcp;
  bool auth_header_read_ = false;  // connecting side: the header just read was AUTH_OK
  bool auth_seen_ = false;         // connecting side: AUTH_OK read; frames wait for the QP
  bool tcp_user_read_ = false;
  int tcp_ops_ = 0;                // the caller's operations out on the side channel
  bool side_read_armed_ = false;
  uint64_t expected_step_ = 0;
  std::shared_ptr<std::promise<absl::Status>> ready_;
  // WaitEstablished's answer (set once, on the progress thread; read by the caller's thread).
  std::mutex established_mu_;
  std::condition_variable established_cv_;
  std::optional<absl::Status> established_;

  // Verbs resources.
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  bool qp_broken_ = false;
  uint32_t psn_ = 0;
  std::unique_ptr<RegisteredBuffer> recv_pool_, send_pool_, read_staging_;
  std::vector<std::unique_ptr<RegisteredBuffer>> staging_cache_;
  size_t slot_bytes_ = 0;
  int recv_slots_ = 0, send_slots_ = 0, max_reads_ = 1;
  std::vector<int> free_send_slots_;
  std::vector<SlotUse> send_use_;
  std::map<uint64_t, absl::Time> outstanding_;  // send-queue work requests: posted when

  // Credits and read reports.
  int credits_granted_ = 0;  // receive slots this side promised the peer
  int peer_credits_ = 0, peer_credits_max_ = 0;
  int owed_ = 0;
  int ack_threshold_ = 1;
  size_t send_eager_max_ = 0;
  size_t peer_slot_bytes_ = 0;
  uint64_t read_through_ = 0, reported_read_through_ = 0;  // the peer's READ frames we finished
  uint64_t read_frames_sent_ = 0, peer_read_through_ = 0;

  std::deque<OutFrame> send_queue_;
  std::deque<AwaitRead> awaiting_read_;
  std::vector<DoneCallback> pending_failures_;

  // Receiving.
  std::deque<InFrame> inbox_;
  ReadState read_state_ = ReadState::kIdle;
  HeaderCallback header_done_;
  absl::Time header_deadline_ = absl::InfiniteFuture();
  absl::Duration header_timeout_;
  InFrame current_;
  DoneCallback payload_done_;
  MutableBuffer into_;
  ibv_mr* dest_mr_ = nullptr;
  size_t read_seg_ = 0;
  uint64_t read_seg_offset_ = 0, read_dest_offset_ = 0, read_got_ = 0;
  std::vector<int> free_chunks_;
  std::vector<ReadChunk> chunks_;
  absl::Time last_progress_;

  // Closing.
  bool closed_ = false;
  bool drain_ = false;  // closed by the peer: frames it sent before are still delivered
  bool close_after_flush_ = false;
  bool abandoned_ = false;
  absl::Status close_reason_;
  absl::Time flush_deadline_ = absl::InfiniteFuture();
  absl::Time watchdog_at_ = absl::InfiniteFuture();
};

// What users hold: dropping it closes the connection once its pending operations are done.
class RdmaConnection final : public Connection {
 public:
  explicit RdmaConnection(std::shared_ptr<RdmaConn> state) : st_(std::move(state)) {}
  ~RdmaConnection() override { st_->Release(); }
  void Send(const FrameHeader& header, std::vector<ConstBuffer> payload,
            DoneCallback done) override {
    st_->Send(header, std::move(payload), std::move(done));
  }
  void ReadHeader(HeaderCallback done, absl::Duration timeout) override {
    st_->ReadHeader(std::move(done), timeout);
  }
  void ReadPayload(MutableBuffer into, DoneCallback done) override {
    st_->ReadPayload(into, std::move(done));
  }
  void DiscardPayload(DoneCallback done) override { st_->DiscardPayload(std::move(done)); }
  void Close() override { st_->Close(); }
  void Abort(const absl::Status& reason) override { st_->Abort(reason); }
  absl::Status WaitEstablished(absl::Duration timeout) override {
    return st_->WaitEstablished(timeout);
  }
  std::string PeerAddress() const override { return st_->PeerAddress(); }
  ConnectionStats Stats() const override { return st_->Stats(); }

 private:
  std::shared_ptr<RdmaConn> st_;
};

class RdmaListener final : public Listener {
 public:
  RdmaListener(std::shared_ptr<Shared> shared, std::shared_ptr<Listener> tcp)
      : sh_(std::move(shared)), tcp_(std::move(tcp)) {}
  std::string Address() const override { return tcp_->Address(); }
  void Accept(AcceptCallback done) override {
    tcp_->Accept([sh = sh_, done = std::move(done)](
                     absl::StatusOr<std::shared_ptr<Connection>> c) mutable {
      if (!c.ok()) {
        done(c.status());
        return;
      }
      auto state = RdmaConn::Make(sh, std::move(*c), /*server=*/true);
      if (sh->options.upgrade == RdmaOptions::Upgrade::kAtConnect) state->UpgradeNow(nullptr);
      done(std::shared_ptr<Connection>(std::make_shared<RdmaConnection>(std::move(state))));
    });
  }
  void Close() override { tcp_->Close(); }

 private:
  std::shared_ptr<Shared> sh_;
  std::shared_ptr<Listener> tcp_;
};

class RdmaContext final : public Context {
 public:
  explicit RdmaContext(std::shared_ptr<Shared> shared) : sh_(std::move(shared)) {}
  ~RdmaContext() override { RdmaContext::Close(); }

  absl::string_view Name() const override { return "rdma"; }
  bool IsViable() const override { return sh_->viable.ok(); }
  const ContextOptions& Options() const override { return sh_->options; }

  absl::StatusOr<std::shared_ptr<Listener>> Listen(absl::string_view address) override {
    if (auto s = Usable(); !s.ok()) return s;
    auto tcp = sh_->tcp->Listen(address);
    if (!tcp.ok()) return tcp.status();
    return std::shared_ptr<Listener>(std::make_shared<RdmaListener>(sh_, std::move(*tcp)));
  }

  absl::StatusOr<std::shared_ptr<Connection>> Connect(absl::string_view address,
                                                      absl::Duration timeout) override {
    if (auto s = Usable(); !s.ok()) return s;
    const absl::Time deadline = absl::Now() + timeout;
    auto tcp = sh_->tcp->Connect(address, timeout);
    if (!tcp.ok()) return tcp.status();
    auto state = RdmaConn::Make(sh_, std::move(*tcp), /*server=*/false);
    auto conn = std::make_shared<RdmaConnection>(state);
    if (sh_->options.upgrade == RdmaOptions::Upgrade::kAtConnect) {
      auto ready = std::make_shared<std::promise<absl::Status>>();
      auto future = ready->get_future();
      state->UpgradeNow(std::move(ready));
      const absl::Duration wait =
          std::max(deadline - absl::Now(), absl::Milliseconds(1)) + sh_->options.setup_timeout;
      if (future.wait_for(absl::ToChronoNanoseconds(wait)) != std::future_status::ready) {
        conn->Close();
        return absl::DeadlineExceededError(
            absl::StrCat("RDMA set-up with ", address, " did not finish within ",
                         absl::FormatDuration(wait)));
      }
      if (auto s = future.get(); !s.ok()) return s;
    }
    return std::shared_ptr<Connection>(conn);
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(MutableBuffer buffer) override {
    if (auto s = Usable(); !s.ok()) return s;
    if (buffer.empty()) return Context::RegisterMemory(buffer);
    ibv_mr* mr = ibv_reg_mr(sh_->device->pd(), buffer.data(), buffer.size(),
                            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
    if (mr == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("ibv_reg_mr of ", buffer.size(),
                                                       " bytes failed: ", std::strerror(errno)));
    }
    return std::unique_ptr<MemoryRegion>(std::make_unique<RdmaMemoryRegion>(sh_->device, mr, buffer));
  }

  void Close() override {
    if (sh_->closed.exchange(true)) return;
    if (sh_->progress) {
      sh_->progress->Shutdown([sh = sh_] {
        std::vector<std::weak_ptr<RdmaConn>> conns;
        {
          std::lock_guard<std::mutex> lock(sh->mu);
          conns.swap(sh->conns);
        }
        for (auto& weak : conns) {
          if (auto conn = weak.lock()) conn->ShutdownNow();
        }
      });
    }
    if (sh_->tcp) sh_->tcp->Close();
  }

 private:
  absl::Status Usable() const {
    if (!sh_->viable.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the RDMA transport is not viable here: ", sh_->viable.message()));
    }
    if (sh_->closed.load()) return absl::FailedPreconditionError("transport context is closed");
    return absl::OkStatus();
  }

  std::shared_ptr<Shared> sh_;
};

absl::Status ValidateOptions(const RdmaOptions& o) {
  if (o.header_timeout <= absl::ZeroDuration() || o.payload_idle_timeout <= absl::ZeroDuration() ||
      o.completion_timeout <= absl::ZeroDuration() || o.setup_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("RDMA timeouts must be positive");
  }
  if (o.receive_credits < 2 || o.receive_credits > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("receive_credits must be in [2, 4096], got ", o.receive_credits));
  }
  if (o.eager_bytes > (size_t{1} << 20)) {
    return absl::InvalidArgumentError("eager_bytes must be at most 1 MiB");
  }
  if (o.read_chunk_bytes < 4096 || o.read_chunk_bytes > (size_t{1} << 30)) {
    return absl::InvalidArgumentError("read_chunk_bytes must be in [4 KiB, 1 GiB]");
  }
  if (o.port < 1 || o.port > 255 || o.gid_index < 0) {
    return absl::InvalidArgumentError("bad RDMA port or GID index");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RdmaDeviceStatus(const RdmaOptions& options) {
  auto device = Device::Open(options);
  return device.ok() ? absl::OkStatus() : device.status();
}

absl::StatusOr<std::shared_ptr<Context>> CreateRdmaContext(const RdmaOptions& options) {
  if (auto s = ValidateOptions(options); !s.ok()) return s;
  auto shared = std::make_shared<Shared>();
  shared->options = options;
  auto device = Device::Open(options);
  if (!device.ok()) {
    shared->viable = device.status();
    PSD_LOG_INFO("RDMA transport not viable: {}", device.status().message());
    return std::shared_ptr<Context>(std::make_shared<RdmaContext>(std::move(shared)));
  }
  shared->device = std::move(*device);
  TcpOptions tcp;
  static_cast<ContextOptions&>(tcp) = options;
  auto side = CreateTcpContext(tcp);
  if (!side.ok()) return side.status();
  shared->tcp = std::move(*side);
  shared->progress = std::make_unique<Progress>(shared->device->channel());
  shared->progress->Start();
  return std::shared_ptr<Context>(std::make_shared<RdmaContext>(std::move(shared)));
}

}  // namespace poseidon::transport
