#include "agent/shm_endpoint.h"

#include <fcntl.h>
#include <poll.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/log.h"

namespace poseidon::agent {
namespace {

uint64_t NowNs() { return MonotonicNs(); }

template <typename T>
T Load(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <typename T>
void Store(T* p, std::type_identity_t<T> v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

void FutexWake(uint32_t* addr) {
  syscall(SYS_futex, addr, FUTEX_WAKE, 1 << 30, nullptr, nullptr, 0);
}

void FutexWait(uint32_t* addr, uint32_t expected, absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(timeout);
  syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void CopyString(char* dst, size_t n, const std::string& s) {
  std::memset(dst, 0, n);
  std::memcpy(dst, s.data(), std::min(n - 1, s.size()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmEndpoint>> ShmEndpoint::Create(const std::string& name,
                                                                 uint32_t rank, uint32_t world_size,
                                                                 uint64_t job_id) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos ||
      name.size() + 6 >= PSD_SHM_NAME_BYTES) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment name '", name, "' must be '/name' of at most ", PSD_SHM_NAME_BYTES - 7, " bytes"));
  }
  // Before anything of ours exists (our destructor unlinks the name). A leftover of a crashed
  // agent with the same name is replaced below (we own this name); a segment
  // whose agent is alive is not: two agents (two jobs with the same id, a rank started twice)
  // must not take each other's training processes.
  if (const int old = shm_open(name.c_str(), O_RDONLY, 0); old >= 0) {
    struct stat st;
    void* p = MAP_FAILED;
    if (fstat(old, &st) == 0 && static_cast<size_t>(st.st_size) >= sizeof(psd_shm_header)) {
      p = mmap(nullptr, sizeof(psd_shm_header), PROT_READ, MAP_SHARED, old, 0);
    }
    close(old);
    if (p != MAP_FAILED) {
      const auto* h = static_cast<const psd_shm_header*>(p);
      const bool ours = Load(&h->magic) == PSD_SHM_MAGIC;
      const uint32_t pid = Load(&h->agent_pid);
      const uint32_t state = Load(&h->agent_state);
      const uint64_t owner_job = h->job_id;
      const uint32_t owner_rank = h->rank;
      const uint64_t beat = Load(&h->agent_heartbeat_ns);
      munmap(p, sizeof(psd_shm_header));
      // Alive: the process exists, has not said it ended, and beat within 2 s (every 100 ms it
      // does; a recycled pid of a SIGKILLed agent does not).
      const uint64_t now = NowNs();
      const bool alive = ours && pid > 0 && static_cast<pid_t>(pid) != ::getpid() &&
                         (kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM) &&
                         state != PSD_AGENT_EXITED && state != PSD_AGENT_FAILED &&
                         beat <= now + 1000000000ull && now - beat < 2000000000ull;
      if (alive) {
        return absl::AlreadyExistsError(absl::StrCat(
            "segment ", name, " is in use by poseidon-agent pid ", pid, " (job ", owner_job, ", rank ",
            owner_rank, "); give this agent another --segment or stop that one"));
      }
    }
  }
  std::unique_ptr<ShmEndpoint> ep(new ShmEndpoint());
  ep->name_ = name;
  ep->data_name_ = name + ".data";
  shm_unlink(name.c_str());
  shm_unlink(ep->data_name_.c_str());
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot create ", name, ": ", std::strerror(errno)));
  }
  if (ftruncate(fd, PSD_SHM_CONTROL_BYTES) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return absl::UnavailableError(absl::StrCat("cannot size ", name, ": ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, PSD_SHM_CONTROL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::UnavailableError(absl::StrCat("cannot map ", name, ": ", std::strerror(errno)));
  }
  ep->control_ = static_cast<unsigned char*>(p);
  psd_shm_header* h = ep->header();
  h->abi_version = PSD_SHM_ABI_VERSION;
  h->header_bytes = sizeof(psd_shm_header);
  h->control_bytes = PSD_SHM_CONTROL_BYTES;
  h->agent_pid = static_cast<uint32_t>(getpid());
  h->rank = rank;
  h->world_size = world_size;
  h->job_id = job_id;
  h->to_agent_offset = PSD_SHM_TO_AGENT_OFFSET;
  h->to_framework_offset = PSD_SHM_TO_FRAMEWORK_OFFSET;
  h->layers_offset = PSD_SHM_LAYERS_OFFSET;
  Store(&h->agent_heartbeat_ns, NowNs());
  Store(&h->agent_state, PSD_AGENT_WAITING);
  Store(&h->magic, PSD_SHM_MAGIC);  // last: the framework waits for it
  return ep;
}

ShmEndpoint::~ShmEndpoint() {
  if (control_) {
    if (Load(&header()->agent_state) != PSD_AGENT_FAILED)
      Store(&header()->agent_state, PSD_AGENT_EXITED);
    // Wake every waiter so it sees the state at once.
    for (uint32_t i = 0; i < PSD_SHM_MAX_LAYERS; ++i) FutexWake(&layers()[i].done_futex);
    FutexWake(&header()->registration_futex);
    munmap(control_, PSD_SHM_CONTROL_BYTES);
  }
  if (data_) munmap(data_, data_bytes_);
  if (framework_pidfd_ >= 0) close(framework_pidfd_);
  shm_unlink(name_.c_str());
  shm_unlink(data_name_.c_str());
}

void ShmEndpoint::Heartbeat() {
  Store(&header()->agent_heartbeat_ns, NowNs());
}

void ShmEndpoint::SetState(uint32_t state, const std::string& error) {
  if (!error.empty()) CopyString(header()->error, PSD_SHM_ERROR_BYTES, error);
  Store(&header()->agent_state, state);
  if (state == PSD_AGENT_FAILED || state == PSD_AGENT_EXITED) {
    for (uint32_t i = 0; i < PSD_SHM_MAX_LAYERS; ++i) FutexWake(&layers()[i].done_futex);
    FutexWake(&header()->registration_futex);
  }
}

bool ShmEndpoint::attached() const {
  return Load(&header()->attached) != 0;
}

namespace {

// Whether `pid` has ended: its pidfd (when there is one) is readable once the process has exited,
// zombie or reaped; without one, the process is gone or a zombie in /proc.
bool ProcessEnded(pid_t pid, int pidfd) {
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    return poll(&p, 1, 0) > 0;
  }
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return false;
  // "pid (comm) S ...": the state follows the last ')' (comm may hold spaces and parentheses).
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() &&
         (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

}  // namespace

absl::Status ShmEndpoint::CheckFramework() {
  if (!attached()) return absl::OkStatus();
  // Events still unread come first: a process that posted DETACH and exited at once has left,
  // not died (reading the ring drains it; a death without DETACH shows on the next check).
  const psd_shm_ring* ring = to_agent();
  if (Load(&ring->head) != Load(&ring->tail)) return absl::OkStatus();
  if (framework_pid_ == 0) {
    // The framework claims the segment, then writes its pid: 0 is a process still attaching.
    // The pid is read once; what the segment says later (it is writable by anyone who can
    // attach) cannot change which process the agent watches.
    const uint32_t pid = Load(&header()->framework_pid);
    if (pid == 0) return absl::OkStatus();
    if (pid > static_cast<uint32_t>(std::numeric_limits<pid_t>::max()) ||
        (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)) {
      return absl::DataLossError(absl::StrCat(
          "the segment names pid ", pid, " as its training process and no such process exists (",
          "the process died while attaching, or something overwrote the segment)"));
    }
    framework_pid_ = static_cast<pid_t>(pid);
    // A pidfd sees the exit itself, so a zombie whose parent has not reaped it is noticed too.
    framework_pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, framework_pid_, 0));
  }
  if (ProcessEnded(framework_pid_, framework_pidfd_)) {
    return absl::UnavailableError(
        absl::StrCat("the training process (pid ", framework_pid_, ") died"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<Event>> ShmEndpoint::NextEvent(absl::Duration timeout) {
  psd_shm_ring* ring = to_agent();
  uint64_t head = Load(&ring->head);
  uint64_t tail = Load(&ring->tail);
  if (head == tail) {
    const uint32_t bell = Load(&ring->doorbell);
    Store(&ring->consumer_sleeping, 1u);
    tail = Load(&ring->tail);
    if (head == tail) FutexWait(&ring->doorbell, bell, timeout);
    Store(&ring->consumer_sleeping, 0u);
    tail = Load(&ring->tail);
    if (head == tail) return std::optional<Event>();
  }
  if (tail - head > PSD_SHM_RING_CAPACITY || tail < head) {
    Store(&ring->head, tail);  // resynchronise: drop what cannot be trusted
    return absl::DataLossError(absl::StrCat("event ring indices are corrupt (head ", head,
                                            ", tail ", tail, "); skipped to the tail"));
  }
  const psd_shm_event e = ring->events[head % PSD_SHM_RING_CAPACITY];
  Store(&ring->head, head + 1);
  if (e.type != PSD_EVENT_REGISTER && e.type != PSD_EVENT_LAYER_READY &&
      e.type != PSD_EVENT_DETACH && e.type != PSD_EVENT_CUDA_ATTACH) {
    return absl::InvalidArgumentError(absl::StrCat("unknown event type ", e.type));
  }
  Event event{e.type, e.layer, e.iteration, e.aux & 0xff, (e.aux >> 8) & 0xff};
  if (e.type == PSD_EVENT_LAYER_READY &&
      ((event.location != PSD_READY_HOST && event.location != PSD_READY_DEVICE) ||
       (event.scheme != 0 && event.scheme != PSD_SCHEME_PS && event.scheme != PSD_SCHEME_SFB &&
        event.scheme != PSD_SCHEME_ALLREDUCE) ||
       (e.aux >> 16) != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", e.layer, " ready with an unknown location or scheme (aux ", e.aux,
                     ")"));
  }
  return std::optional<Event>(event);
}

absl::StatusOr<ShmEndpoint::ServerRule> ShmEndpoint::ReadServerRule() const {
  const psd_shm_header* h = header();
  ServerRule r;
  r.rule = Load(&h->server_rule);
  if (r.rule != 0 && r.rule != 2 && r.rule != 3 && r.rule != 4) {
    return absl::InvalidArgumentError(absl::StrCat("unknown server rule ", r.rule));
  }
  r.nesterov = h->server_nesterov != 0;
  r.lr = h->server_lr;
  r.momentum = h->server_momentum;
  r.dampening = h->server_dampening;
  r.beta1 = h->server_beta1;
  r.beta2 = h->server_beta2;
  r.eps = h->server_eps;
  r.weight_decay = h->server_weight_decay;
  for (double x : {r.lr, r.momentum, r.dampening, r.beta1, r.beta2, r.eps, r.weight_decay}) {
    if (!std::isfinite(x)) return absl::InvalidArgumentError("server rule values must be finite");
  }
  return r;
}

absl::StatusOr<std::vector<LayerDesc>> ShmEndpoint::ReadLayers() const {
  const uint32_t n = Load(&header()->num_layers);
  if (n == 0 || n > PSD_SHM_MAX_LAYERS) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer count ", n, " outside [1, ", PSD_SHM_MAX_LAYERS, "]"));
  }
  std::vector<LayerDesc> out(n);
  for (uint32_t i = 0; i < n; ++i) {
    const psd_shm_layer l = layers()[i];  // a private copy: the framework may scribble on it
    LayerDesc& d = out[i];
    const size_t len = strnlen(l.name, PSD_SHM_NAME_BYTES);
    if (len == 0 || len == PSD_SHM_NAME_BYTES) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", i, ": name missing or unterminated"));
    }
    d.name.assign(l.name, len);
    if (l.kind < PSD_KIND_FC || l.kind > PSD_KIND_OTHER) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", i, " (", d.name, "): bad kind ", l.kind));
    }
    if (l.dtype != PSD_DTYPE_F32) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", i, " (", d.name, "): only float32"));
    }
    if (l.ndim == 0 || l.ndim > PSD_SHM_MAX_DIMS) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", i, " (", d.name, "): bad ndim ", l.ndim));
    }
    d.kind = l.kind;
    d.batch_k = l.batch_k;
    if ((l.flags & ~31u) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", i, " (", d.name, "): unknown flags ", l.flags));
    }
    if ((l.flags & 9u) == 9u) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", i, " (", d.name, "): PSD_LAYER_OWN_CLOCK and PSD_LAYER_FUSABLE exclude each "
          "other"));
    }
    d.fusable = (l.flags & 1u) != 0;  // PSD_LAYER_FUSABLE
    d.average = (l.flags & 2u) != 0;   // PSD_LAYER_AVERAGE
    d.counters = (l.flags & 4u) != 0;  // PSD_LAYER_COUNTERS
    d.own_clock = (l.flags & 8u) != 0;  // PSD_LAYER_OWN_CLOCK
    d.by_servers = (l.flags & 16u) != 0;  // PSD_LAYER_BY_SERVERS
    d.elements = 1;
    for (uint32_t k = 0; k < l.ndim; ++k) {
      if (l.shape[k] == 0 || l.shape[k] > (uint64_t{1} << 32)) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", i, " (", d.name, "): bad dimension"));
      }
      d.shape.push_back(l.shape[k]);
      d.elements *= l.shape[k];
      if (d.elements > (uint64_t{1} << 34)) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", i, " (", d.name, ") is too large"));
      }
    }
    if (d.kind == PSD_KIND_FC && (l.ndim != 2 || l.batch_k == 0 || l.batch_k > (1u << 20))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", i, " (", d.name, "): FC layers need shape [M, N] and 0 < K <= 2^20"));
    }
  }
  return out;
}

absl::Status ShmEndpoint::PublishLayout(const std::vector<LayerDesc>& descs,
                                        const std::vector<LayerLayout>& layout,
                                        uint64_t data_bytes, uint64_t start_iteration) {
  const int fd = shm_open(data_name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot create ", data_name_, ": ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(data_bytes)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot size ", data_name_, " to ", data_bytes,
                                               " bytes: ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, data_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    return absl::UnavailableError(
        absl::StrCat("cannot map ", data_name_, ": ", std::strerror(errno)));
  }
  data_ = static_cast<unsigned char*>(p);
  data_bytes_ = data_bytes;
  layout_ = layout;
  for (size_t i = 0; i < layout.size(); ++i) {
    psd_shm_layer& l = layers()[i];
    l.scheme = layout[i].scheme;
    l.priority = layout[i].priority;
    l.elements = descs[i].elements;
    l.grad_offset = layout[i].grad_offset;
    l.u_offset = layout[i].u_offset;
    l.v_offset = layout[i].v_offset;
    l.agent_flags = layout[i].sfb_buffers ? PSD_LAYER_SFB_BUFFERS : 0;
    Store(&l.schedule, PSD_SCHEDULE_PACK(layout[i].scheme, layout[i].scheme, 0));
    Store(&l.done_iteration, uint64_t{0});
    Store(&l.done_status, 0);
  }
  psd_shm_header* h = header();
  CopyString(h->data_name, PSD_SHM_NAME_BYTES, data_name_);
  Store(&h->data_bytes, data_bytes);
  Store(&h->start_iteration, start_iteration);
  Store(&h->agent_state, PSD_AGENT_SERVING);
  Store(&h->registration_state, PSD_REG_DONE);
  __atomic_add_fetch(&h->registration_futex, 1u, __ATOMIC_RELEASE);
  FutexWake(&h->registration_futex);
  return absl::OkStatus();
}

void ShmEndpoint::FailRegistration(const std::string& why) {
  psd_shm_header* h = header();
  CopyString(h->error, PSD_SHM_ERROR_BYTES, why);
  Store(&h->registration_state, PSD_REG_FAILED);
  __atomic_add_fetch(&h->registration_futex, 1u, __ATOMIC_RELEASE);
  FutexWake(&h->registration_futex);
}

absl::StatusOr<DeviceAttach> ShmEndpoint::ReadCudaAttach() const {
  const psd_shm_header* h = header();
  if (data_ == nullptr) {
    return absl::FailedPreconditionError("CUDA attach before the layers were registered");
  }
  if (Load(&h->cuda_state) != PSD_CUDA_REQUESTED) {
    return absl::FailedPreconditionError("CUDA attach event without a CUDA request");
  }
  DeviceAttach a;
  a.device = h->cuda_device;
  a.arena_bytes = Load(&h->cuda_arena_bytes);
  if (a.device < 0) return absl::InvalidArgumentError(absl::StrCat("CUDA device ", a.device));
  if (a.arena_bytes != data_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("the CUDA arena has ", a.arena_bytes,
                                                   " bytes; the layers' buffers take ",
                                                   data_bytes_));
  }
  std::memcpy(a.arena.data(), h->cuda_arena_handle, a.arena.size());
  a.ready_events.resize(layout_.size());
  for (size_t i = 0; i < layout_.size(); ++i) {
    std::memcpy(a.ready_events[i].data(), layers()[i].cuda_ready_event, PSD_CUDA_IPC_HANDLE_BYTES);
  }
  return a;
}

void ShmEndpoint::AnswerCuda(const std::vector<IpcHandle>& done_events) {
  for (size_t i = 0; i < done_events.size() && i < layout_.size(); ++i) {
    std::memcpy(layers()[i].cuda_done_event, done_events[i].data(), PSD_CUDA_IPC_HANDLE_BYTES);
  }
  psd_shm_header* h = header();
  Store(&h->cuda_state, PSD_CUDA_READY);
  __atomic_add_fetch(&h->registration_futex, 1u, __ATOMIC_RELEASE);
  FutexWake(&h->registration_futex);
}

void ShmEndpoint::FailCuda(const std::string& why) {
  psd_shm_header* h = header();
  CopyString(h->error, PSD_SHM_ERROR_BYTES, why);
  Store(&h->cuda_state, PSD_CUDA_FAILED);
  __atomic_add_fetch(&h->registration_futex, 1u, __ATOMIC_RELEASE);
  FutexWake(&h->registration_futex);
}

float* ShmEndpoint::Grad(uint32_t layer) const {
  return reinterpret_cast<float*>(data_ + layout_[layer].grad_offset);
}
float* ShmEndpoint::FactorU(uint32_t layer) const {
  return reinterpret_cast<float*>(data_ + layout_[layer].u_offset);
}
float* ShmEndpoint::FactorV(uint32_t layer) const {
  return reinterpret_cast<float*>(data_ + layout_[layer].v_offset);
}

void ShmEndpoint::PublishSchedule(uint32_t layer, uint64_t word) {
  Store(&layers()[layer].schedule, word);
}

void ShmEndpoint::SetLiveWorld(uint32_t rank, uint32_t size, uint64_t generation) {
  Store(&header()->live_world, PSD_LIVE_WORLD_PACK(rank, size, generation));
}

void ShmEndpoint::SetTakeovers(uint64_t takeovers) {
  // Heartbeat answers may arrive out of order: the count only grows.
  uint64_t seen = __atomic_load_n(&header()->takeovers, __ATOMIC_ACQUIRE);
  while (takeovers > seen && !__atomic_compare_exchange_n(&header()->takeovers, &seen,
                                                          takeovers, false, __ATOMIC_ACQ_REL,
                                                          __ATOMIC_ACQUIRE)) {
  }
}

void ShmEndpoint::SetRejoinTimeout(uint32_t ms) { Store(&header()->rejoin_timeout_ms, ms); }

void ShmEndpoint::LayerDone(uint32_t layer, uint64_t iteration) {
  psd_shm_layer& l = layers()[layer];
  Store(&l.done_iteration, iteration);
  __atomic_add_fetch(&l.done_futex, 1u, __ATOMIC_RELEASE);
  FutexWake(&l.done_futex);
}

void ShmEndpoint::LayerFailed(uint32_t layer, uint64_t /*iteration*/, const std::string& why) {
  psd_shm_layer& l = layers()[layer];
  CopyString(l.message, sizeof(l.message), why);
  Store(&l.done_status, 7);  // PSD_SYNC_FAILED
  __atomic_add_fetch(&l.done_futex, 1u, __ATOMIC_RELEASE);
  FutexWake(&l.done_futex);
}

}  // namespace poseidon::agent
