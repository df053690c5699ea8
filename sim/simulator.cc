#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <queue>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/shm_layout.h"
#include "coordinator/planner/cost_model.h"
#include "coordinator/planner/time_model.h"
#include "sim/shared_cpus.h"

namespace poseidon::sim {
namespace {

using poseidon::v1::SyncScheme;

uint64_t AlignUp(uint64_t x) { return PSD_SHM_ALIGN_UP(x); }

// The bytes a PS key of `float_bytes` (float32) moves each way on `wire` (LayerPlan.wire_type): half
// on a 16-bit wire. The casts' CPU time is not simulated (the planner weighs it).
uint64_t WireBytes(poseidon::v1::ElementType wire, uint64_t float_bytes) {
  return planner::IsLossyWire(wire) ? float_bytes / 2 : float_bytes;
}

// What one scheduler task moves. PS chunks and buckets are keys on a server.
enum class UnitKind : uint8_t { kChunk, kBucket, kSfb };
struct Unit {
  UnitKind kind = UnitKind::kChunk;
  uint32_t layer = 0;  // the chunk's or SFB layer; a bucket's first (lowest-index) member
  uint32_t last = 0;   // a bucket's last member
  uint32_t server = 0;
  uint64_t bytes = 0;         // chunk or bucket bytes; SFB: the factors of one peer
  uint64_t task_bytes = 0;    // credit the task takes
};

enum class LayerMode : uint8_t { kPs, kBucketed, kSfb, kRing };
struct Layer {
  LayerMode mode = LayerMode::kPs;
  std::vector<uint32_t> units;  // submitted when this layer is posted (PS chunks, bucket, SFB)
  bool trigger = true;          // its post does something (bucket members: only the first)
  int bucket_unit = -1;
  double forward = 0, backward = 0;
  double rebuild = 0;        // SFB: seconds of the rebuild GEMM
  double ring_seconds = 0;   // all-reduce: the layer's collective, or its bucket's (first member)
  uint32_t ring_last = 0;    // all-reduce: the last layer its collective completes (itself alone)
  double ring_steps = 0;     // all-reduce: the steps of its collective (or its bucket's)
};

enum class EventType : uint8_t {
  kWake, kPost, kArrive, kDeliver, kPark, kSfbDone, kRingDone, kReplicated
};
struct Event {
  double t;
  uint64_t seq;
  EventType type;
  uint32_t a;  // worker or message
  uint32_t b;  // layer or unit
  uint64_t c;  // iteration
  bool operator>(const Event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
};

enum class MessageKind : uint8_t { kPush, kAnswer, kFactors, kReplicate };
struct Message {
  MessageKind kind;
  uint32_t src, dst;  // hosts
  uint32_t worker;    // push: the sender; answer: the receiver; factors: the sender
  uint32_t unit;
  uint64_t iteration;
  uint64_t bytes;
  double up_end;
  bool received = false;  // off the link; its receiver's CPU work (if any) is done or under way
};

struct Task {
  uint32_t priority;
  uint64_t seq;
  uint32_t unit;
  uint64_t iteration;
  uint64_t bytes;
  bool operator>(const Task& o) const {
    return priority != o.priority ? priority > o.priority : seq > o.seq;
  }
};

enum class TaskState : uint8_t { kIdle, kRunning, kParked };

// Both parity slots of a per-iteration counter (at most two iterations of one layer are ever in
// flight: a layer is posted for t+1 only after its sync of t completed on that worker).
struct Slot {
  uint64_t iteration = 0;
  uint32_t count = 0;
  double time = 0;
};

struct Bucket {
  double tokens = 0;  // bytes; filled from time 0
  double time = 0;    // of `tokens`
};

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  double Uniform() {  // (0, 1)
    return (static_cast<double>(engine_() >> 11) + 0.5) * 0x1.0p-53;
  }
  double Normal() {  // Box-Muller, the cosine half only: one draw per call keeps streams simple
    const double u = Uniform(), v = Uniform();
    return std::sqrt(-2 * std::log(u)) * std::cos(2 * M_PI * v);
  }

 private:
  std::mt19937_64 engine_;
};

double JitterFactor(Rng& rng, JitterKind kind, double sigma) {
  if (kind == JitterKind::kNone || sigma <= 0) return 1;
  const double z = rng.Normal();
  if (kind == JitterKind::kNormal) return std::max(0.0, 1 + sigma * z);
  return std::exp(sigma * z - sigma * sigma / 2);
}

struct Worker {
  explicit Worker(uint64_t seed) : rng(seed) {}
  Rng rng;
  enum class Phase : uint8_t { kForward, kBackward, kDrain, kDone } phase = Phase::kForward;
  uint64_t it = 1;
  uint32_t fwd = 0;
  double t = 0;
  double iteration_factor = 1;
  int blocked_on = -1;
  std::vector<uint64_t> done_iter;
  std::vector<double> synced_at;
  std::vector<uint32_t> parts_left;
  std::vector<uint64_t> sfb_posted;  // per layer: the last iteration whose factors were posted
  // Scheduler.
  std::priority_queue<Task, std::vector<Task>, std::greater<Task>> queue;
  uint64_t seq = 0;
  uint64_t in_flight = 0, parked = 0;
  std::vector<TaskState> state;       // per unit
  std::vector<uint64_t> state_iter;   // per unit: iteration of the running task
  std::vector<uint8_t> sfb_complete;  // per unit (SFB): the layer completed before the park
  // Measures.
  double first_end = 0, last_end = 0, final_time = 0;
  double compute = 0, stall = 0, waiting = 0;  // iterations 2..T
};

class Simulation {
 public:
  Simulation(const planner::PlannerConfig& config, const SimOptions& options,
             std::vector<Layer> layers, std::vector<Unit> units)
      : config_(config),
        options_(options),
        layers_(std::move(layers)),
        units_(std::move(units)),
        shared_cpus_(options.shared_cpus) {
    P1_ = config.workers;
    P2_ = config.servers;
    hosts_ = config.colocated ? std::max(P1_, P2_) : P1_ + P2_;
    const double bw = config.bandwidth_bytes_per_second;
    up_rate_.assign(hosts_, bw);
    down_rate_.assign(hosts_, bw);
    up_free_.assign(hosts_, 0);
    cpu_free_.assign(hosts_, 0);
    rx_free_.assign(hosts_, 0);
    if (options.shared_cpus > 0) {
      load_stretch_ = 1 / (1 - hosts_ * options.host_cpu_load / options.shared_cpus);
    }
    up_bucket_.assign(hosts_, Bucket{});
    down_bucket_.assign(hosts_, Bucket{});
    down_free_.assign(hosts_, 0);
    up_busy_.assign(hosts_, 0);
    down_busy_.assign(hosts_, 0);
    port_queue_.assign(hosts_, 0);
    latency_ = config.latency_seconds;
    const size_t L = layers_.size();
    workers_.reserve(P1_);
    for (uint32_t w = 0; w < P1_; ++w) {
      workers_.emplace_back(options.seed * 0x9E3779B97F4A7C15ull + w + 1);
      Worker& s = workers_.back();
      s.done_iter.assign(L, 0);
      s.synced_at.assign(L, 0);
      s.parts_left.assign(L, 0);
      s.sfb_posted.assign(L, 0);
      s.state.assign(units_.size(), TaskState::kIdle);
      s.state_iter.assign(units_.size(), 0);
      s.sfb_complete.assign(units_.size(), 0);
      s.iteration_factor = IterationFactor(s);
    }
    keys_.resize(units_.size());
    key_order_.resize(units_.size());
    replicas_pending_.assign(units_.size(), 0);
    replicas_ = std::min(options.replicas, P2_ > 0 ? P2_ - 1 : 0);
    last_post_.assign(L * 2, Slot{});
    ring_posted_.assign(L * 2, Slot{});
    sfb_index_.assign(units_.size(), 0);
    for (uint32_t u = 0; u < units_.size(); ++u) {
      if (units_[u].kind == UnitKind::kSfb) sfb_index_[u] = sfb_units_++;
    }
    inbox_.assign(static_cast<size_t>(P1_) * sfb_units_ * 2, Slot{});
  }

  SimResult Run() {
    for (uint32_t w = 0; w < P1_; ++w) Advance(w, 0);
    while (!events_.empty()) {
      const Event e = events_.top();
      events_.pop();
      ++event_count_;
      now_ = e.t;
      switch (e.type) {
        case EventType::kWake:
          Advance(e.a, e.t);
          break;
        case EventType::kPost:
          Post(e.a, e.b, e.c);
          break;
        case EventType::kArrive:
          Arrive(e.a);
          break;
        case EventType::kDeliver:
          Deliver(e.a);
          break;
        case EventType::kPark:
          Park(e.a, e.b, e.c);
          break;
        case EventType::kSfbDone:
          SfbDone(e.a, e.b, e.c);
          break;
        case EventType::kRingDone:
          for (uint32_t l = e.b; l <= layers_[e.b].ring_last; ++l) {
            for (uint32_t w = 0; w < P1_; ++w) LayerSynced(w, l);
          }
          break;
        case EventType::kReplicated:
          if (--replicas_pending_[e.a] == 0) Answer(e.a, e.c);
          break;
      }
    }
    return Result();
  }

 private:
  void Schedule(double t, EventType type, uint32_t a, uint32_t b = 0, uint64_t c = 0) {
    events_.push(Event{t, next_seq_++, type, a, b, c});
  }

  uint32_t ServerHost(uint32_t server) const {
    return config_.colocated ? server : P1_ + server;
  }

  // ---- Compute -------------------------------------------------------------------------------

  double IterationFactor(Worker& s) const {
    return JitterFactor(s.rng, options_.jitter.kind, options_.jitter.iteration_sigma);
  }

  // One layer pass of worker `s` from its clock on: its compute (jittered, plus the overhead),
  // then its CPU work (SimOptions::pass_cpu_seconds); returns the seconds it takes.
  double Pass(Worker& s, double nominal) {
    const double h = JitterFactor(s.rng, options_.jitter.kind, options_.jitter.layer_sigma);
    const double compute = nominal * s.iteration_factor * h + options_.compute_overhead_seconds;
    if (options_.pass_cpu_seconds <= 0) return compute;
    // The worker's passes are serial: its clock is where its previous pass's work ended.
    double worker_free = s.t;
    return CpuWorkFrom(std::max(now_, s.t + compute), worker_free, options_.pass_cpu_seconds) -
           s.t;
  }

  void Advance(uint32_t w, double now) {
    Worker& s = workers_[w];
    const auto L = static_cast<uint32_t>(layers_.size());
    const uint64_t T = options_.iterations;
    while (true) {
      switch (s.phase) {
        case Worker::Phase::kDone:
          return;
        case Worker::Phase::kForward: {
          if (s.fwd == L) {
            s.phase = Worker::Phase::kBackward;
            break;
          }
          const uint32_t l = s.fwd;
          const uint64_t need = s.it - 1;
          if (!WaitFor(w, s, l, need, now)) return;
          const double f = Pass(s, layers_[l].forward);
          if (s.it >= 2) s.compute += f;
          s.t += f;
          ++s.fwd;
          break;
        }
        case Worker::Phase::kBackward: {
          for (uint32_t l = L; l-- > 0;) {
            const double b = Pass(s, layers_[l].backward);
            if (s.it >= 2) s.compute += b;
            s.t += b;
            if (options_.wfbp) Posted(w, l, s.t);
          }
          if (!options_.wfbp) {
            for (uint32_t l = L; l-- > 0;) Posted(w, l, s.t);
          }
          if (s.it == 1) s.first_end = s.t;
          if (s.it == T) s.last_end = s.t;
          ++s.it;
          s.fwd = 0;
          s.iteration_factor = IterationFactor(s);
          s.phase = s.it > T ? Worker::Phase::kDrain : Worker::Phase::kForward;
          break;
        }
        case Worker::Phase::kDrain: {
          while (s.fwd < L) {
            if (!WaitFor(w, s, s.fwd, T, now)) return;
            ++s.fwd;
          }
          s.final_time = s.t;
          s.phase = Worker::Phase::kDone;
          return;
        }
      }
    }
  }

  // Layer l's sync of iteration `need` is complete at or before the worker's clock (moving the
  // clock to it, counting the stall); false when the worker has to wait for an event.
  bool WaitFor(uint32_t w, Worker& s, uint32_t l, uint64_t need, double now) {
    if (need == 0) return true;
    if (s.done_iter[l] < need) {
      if (s.t > now) {
        Schedule(s.t, EventType::kWake, w);
      } else {
        s.blocked_on = static_cast<int>(l);
      }
      return false;
    }
    if (s.synced_at[l] > s.t) {
      const double stall = s.synced_at[l] - s.t;
      if (s.phase == Worker::Phase::kForward && s.it >= 2) {
        s.stall += stall;
        const Slot& slot = last_post_[l * 2 + need % 2];
        const double last_post = slot.iteration == need ? slot.time : s.t;
        s.waiting += std::clamp(last_post - s.t, 0.0, stall);
      }
      s.t = s.synced_at[l];
    }
    return true;
  }

  // Worker w's backward posts layer l at time t (the post's effects are an event at t).
  void Posted(uint32_t w, uint32_t l, double t) {
    const uint64_t it = workers_[w].it;
    Slot& slot = last_post_[l * 2 + it % 2];
    if (slot.iteration != it) slot = Slot{it, 0, t};
    slot.time = std::max(slot.time, t);
    if (layers_[l].trigger) Schedule(t, EventType::kPost, w, l, it);
  }

  void LayerSynced(uint32_t w, uint32_t l) {
    Worker& s = workers_[w];
    ++s.done_iter[l];
    s.synced_at[l] = now_;
    if (s.blocked_on == static_cast<int>(l)) {
      s.blocked_on = -1;
      Advance(w, now_);
    }
  }

  // ---- Agent ---------------------------------------------------------------------------------

  void Post(uint32_t w, uint32_t l, uint64_t it) {
    Worker& s = workers_[w];
    const Layer& layer = layers_[l];
    switch (layer.mode) {
      case LayerMode::kPs:
        s.parts_left[l] = static_cast<uint32_t>(layer.units.size());
        break;
      case LayerMode::kBucketed:
        break;
      case LayerMode::kSfb:
        s.sfb_posted[l] = it;
        if (P1_ == 1) {  // nothing to exchange
          LayerSynced(w, l);
          return;
        }
        break;
      case LayerMode::kRing: {
        Slot& slot = ring_posted_[l * 2 + it % 2];
        if (slot.iteration != it) slot = Slot{it, 0, 0};
        if (++slot.count == P1_) {
          const double start = std::max(now_, ring_free_);
          double end = start + layer.ring_seconds;
          // On shared CPUs (an emulation) every rank's work per step takes its turn there too:
          // the collective ends no earlier than the last rank's work.
          if (options_.allreduce_cpu_seconds_per_step > 0 && !shared_cpus_.empty()) {
            const double work = layer.ring_steps * options_.allreduce_cpu_seconds_per_step;
            for (uint32_t rank = 0; rank < P1_; ++rank) {
              end = std::max(end, CpuWorkFrom(start, cpu_free_[rank], work));
            }
          }
          ring_free_ = end;
          Schedule(ring_free_, EventType::kRingDone, 0, l, it);
        }
        return;
      }
    }
    for (uint32_t u : layer.units) {
      const uint32_t priority = options_.priority ? units_[u].layer : 0;
      s.queue.push(Task{priority, s.seq++, u, it, units_[u].task_bytes});
    }
    if (layer.mode == LayerMode::kSfb) CheckSfb(w, layer.units.front(), it);
    TryStart(w);
  }

  void TryStart(uint32_t w) {
    Worker& s = workers_[w];
    while (!s.queue.empty()) {
      const Task& top = s.queue.top();
      if (!(top.bytes == 0 || s.in_flight == s.parked ||
            s.in_flight + top.bytes <= options_.credit_bytes)) {
        return;
      }
      const Task task = top;
      s.queue.pop();
      s.in_flight += task.bytes;
      s.state[task.unit] = TaskState::kRunning;
      s.state_iter[task.unit] = task.iteration;
      Start(w, task);
    }
  }

  void Start(uint32_t w, const Task& task) {
    const Unit& unit = units_[task.unit];
    if (unit.kind != UnitKind::kSfb) {
      Send(Message{MessageKind::kPush, w, ServerHost(unit.server), w, task.unit, task.iteration,
                   unit.bytes, 0});
      return;
    }
    double sent = now_;
    for (uint32_t k = 1; k < P1_; ++k) {
      const uint32_t peer = (w + k) % P1_;
      sent = Send(Message{MessageKind::kFactors, w, peer, w, task.unit, task.iteration,
                          unit.bytes, 0});
    }
    Schedule(sent, EventType::kPark, w, task.unit, task.iteration);
  }

  void Park(uint32_t w, uint32_t u, uint64_t it) {
    Worker& s = workers_[w];
    if (s.state[u] != TaskState::kRunning || s.state_iter[u] != it) return;
    if (units_[u].kind == UnitKind::kSfb && s.sfb_complete[u]) {
      s.sfb_complete[u] = 0;
      Release(w, u);
      return;
    }
    s.state[u] = TaskState::kParked;
    s.parked += units_[u].task_bytes;
    TryStart(w);
  }

  void Release(uint32_t w, uint32_t u) {
    Worker& s = workers_[w];
    if (s.state[u] == TaskState::kParked) s.parked -= units_[u].task_bytes;
    s.in_flight -= units_[u].task_bytes;
    s.state[u] = TaskState::kIdle;
    TryStart(w);
  }

  // ---- SFB -----------------------------------------------------------------------------------

  Slot& Inbox(uint32_t w, uint32_t u, uint64_t it) {
    return inbox_[(static_cast<size_t>(w) * sfb_units_ + sfb_index_[u]) * 2 + it % 2];
  }

  // The layer completes at worker w once its own factors are posted and every peer's are in.
  void CheckSfb(uint32_t w, uint32_t u, uint64_t it) {
    Worker& s = workers_[w];
    const uint32_t l = units_[u].layer;
    Slot& box = Inbox(w, u, it);
    if (s.sfb_posted[l] != it || box.iteration != it || box.count != P1_ - 1) return;
    box = Slot{};
    const double rebuild = layers_[l].rebuild;
    if (rebuild > 0) {
      Schedule(now_ + rebuild, EventType::kSfbDone, w, u, it);
    } else {
      SfbDone(w, u, it);
    }
  }

  void SfbDone(uint32_t w, uint32_t u, uint64_t it) {
    Worker& s = workers_[w];
    if (s.state[u] == TaskState::kParked && s.state_iter[u] == it) {
      Release(w, u);
    } else if (s.state[u] == TaskState::kRunning && s.state_iter[u] == it) {
      s.sfb_complete[u] = 1;  // returned when the sends are done
    } else {
      // Not started yet (held by the credit): its sends still go, then it returns at once.
      s.sfb_complete[u] = 1;
    }
    LayerSynced(w, units_[u].layer);
  }

  // ---- Network -------------------------------------------------------------------------------

  // The bytes a message of `bytes` takes on a link: its TCP segments' headers and framing
  // (SimOptions::mtu) included.
  uint64_t OnWire(uint64_t bytes) const {
    if (options_.mtu == 0) return bytes;
    const uint64_t payload = options_.mtu - kTcpIpHeaderBytes;
    const uint64_t segments = std::max<uint64_t>(1, (bytes + payload - 1) / payload);
    return bytes + segments * (kTcpIpHeaderBytes + options_.frame_overhead_bytes);
  }

  // Seconds a link of `rate` takes for `bytes` starting at `start`, its token bucket (tc tbf)
  // holding up to link_burst_bytes: what the bucket holds goes at once, the rest at the rate.
  double Transmit(Bucket& bucket, double rate, double start, uint64_t bytes) const {
    const auto size = static_cast<double>(bytes);
    if (options_.link_burst_bytes == 0) return size / rate;
    const double burst = static_cast<double>(options_.link_burst_bytes);
    const double tokens = std::min(burst, bucket.tokens + rate * (start - bucket.time));
    double seconds = 0;
    if (size <= tokens) {
      bucket.tokens = tokens - size;
    } else {
      seconds = (size - tokens) / rate;
      bucket.tokens = 0;
    }
    bucket.time = start + seconds;
    return seconds;
  }

  // `work` seconds of CPU from now on, after what `host_free` (one host's FIFO) holds and, with
  // shared CPUs, at the earliest free stretch of one of them (SharedCpus); returns when it ends.
  double CpuWork(double& host_free, double work) { return CpuWorkFrom(now_, host_free, work); }

  // The same from time `from` (>= now) on.
  double CpuWorkFrom(double from, double& host_free, double work) {
    cpu_work_ += work;
    double start = std::max(from, host_free);
    if (!shared_cpus_.empty()) {
      work *= load_stretch_;
      start = shared_cpus_.Book(now_, start, work);
    }
    host_free = start + work;
    return host_free;
  }

  // Returns when the message has left the sender's link.
  double Send(const Message& m) {
    uint32_t id;
    if (!free_messages_.empty()) {
      id = free_messages_.back();
      free_messages_.pop_back();
      messages_[id] = m;
    } else {
      id = static_cast<uint32_t>(messages_.size());
      messages_.push_back(m);
    }
    ++message_count_;
    Message& msg = messages_[id];
    // The sender's per-message work (alpha and per byte), one message after the other,
    // pipelined with the link: while message k crosses the link, message k+1 is being prepared.
    // On shared CPUs it also waits for the first of them to be free (FIFO: messages are sent in
    // the order of simulated time).
    const double cpu_end = CpuWork(
        cpu_free_[msg.src],
        options_.alpha_seconds + options_.cpu_seconds_per_byte * static_cast<double>(msg.bytes));
    if (msg.src == msg.dst) {
      msg.up_end = cpu_end;
      Schedule(msg.up_end, EventType::kDeliver, id);
      return msg.up_end;
    }
    const double start = std::max(cpu_end, up_free_[msg.src]);
    const double end =
        start + Transmit(up_bucket_[msg.src], up_rate_[msg.src], start, OnWire(msg.bytes));
    up_free_[msg.src] = end;
    up_busy_[msg.src] += end - start;
    msg.up_end = end;
    Schedule(start + latency_, EventType::kArrive, id);
    return end;
  }

  void Arrive(uint32_t id) {
    Message& msg = messages_[id];
    const double start = std::max(now_, down_free_[msg.dst]);
    const double end = std::max(
        start + Transmit(down_bucket_[msg.dst], down_rate_[msg.dst], start, OnWire(msg.bytes)),
                                msg.up_end + latency_);
    down_free_[msg.dst] = end;
    down_busy_[msg.dst] += end - start;
    if (++port_queue_[msg.dst] > max_port_queue_) {
      max_port_queue_ = port_queue_[msg.dst];
      max_port_queue_host_ = msg.dst;
    }
    Schedule(end, EventType::kDeliver, id);
  }

  // The key's pull answers for `iteration`, one per worker in the order the pushes arrived.
  void Answer(uint32_t unit, uint64_t iteration) {
    std::vector<uint32_t>& order = key_order_[unit];
    const uint32_t host = ServerHost(units_[unit].server);
    for (uint32_t w : order) {
      Send(Message{MessageKind::kAnswer, host, w, w, unit, iteration, units_[unit].bytes, 0});
    }
    order.clear();
  }

  void Deliver(uint32_t id) {
    if (Message& m = messages_[id]; !m.received) {
      m.received = true;
      if (m.src != m.dst) --port_queue_[m.dst];
      if (options_.cpu_seconds_per_byte > 0 && m.bytes > 0) {
        // The receiver's work per byte (reading, summing, copying), one message after another
        // on that host: the message counts once it is done.
        Schedule(CpuWork(rx_free_[m.dst],
                         options_.cpu_seconds_per_byte * static_cast<double>(m.bytes)),
                 EventType::kDeliver, id);
        return;
      }
    }
    const Message msg = messages_[id];
    free_messages_.push_back(id);
    switch (msg.kind) {
      case MessageKind::kPush: {
        // The acknowledgement parks the sender's credit one latency later.
        Schedule(now_ + (msg.src == msg.dst ? 0 : latency_), EventType::kPark, msg.worker,
                 msg.unit, msg.iteration);
        Slot& key = keys_[msg.unit];
        std::vector<uint32_t>& order = key_order_[msg.unit];
        if (key.iteration != msg.iteration) {
          key = Slot{msg.iteration, 0, 0};
          order.clear();
        }
        order.push_back(msg.worker);
        if (++key.count == P1_) {
          key = Slot{};
          if (replicas_ == 0) {
            Answer(msg.unit, msg.iteration);
            break;
          }
          // Replicate after aggregation: the key's state to each backup (the next servers in
          // plan order); the answers leave once every backup acknowledged it.
          const uint32_t server = units_[msg.unit].server;
          replicas_pending_[msg.unit] = replicas_;
          for (uint32_t r = 1; r <= replicas_; ++r) {
            Send(Message{MessageKind::kReplicate, ServerHost(server),
                         ServerHost((server + r) % P2_), 0, msg.unit, msg.iteration,
                         units_[msg.unit].bytes, 0});
          }
        }
        break;
      }
      case MessageKind::kReplicate:
        // The acknowledgement is back one latency later.
        Schedule(now_ + (msg.src == msg.dst ? 0 : latency_), EventType::kReplicated, msg.unit, 0,
                 msg.iteration);
        break;
      case MessageKind::kAnswer: {
        const uint32_t w = msg.worker;
        Worker& s = workers_[w];
        const Unit& unit = units_[msg.unit];
        if (unit.kind == UnitKind::kBucket) {
          for (uint32_t l = unit.layer; l <= unit.last; ++l) LayerSynced(w, l);
        } else if (--s.parts_left[unit.layer] == 0) {
          LayerSynced(w, unit.layer);
        }
        Release(w, msg.unit);
        break;
      }
      case MessageKind::kFactors: {
        const uint32_t p = msg.dst;  // workers sit on hosts 0..P1-1
        Slot& box = Inbox(p, msg.unit, msg.iteration);
        if (box.iteration != msg.iteration) box = Slot{msg.iteration, 0, 0};
        ++box.count;
        CheckSfb(p, msg.unit, msg.iteration);
        break;
      }
    }
  }

  SimResult Result() const {
    SimResult r;
    r.workers = P1_;
    r.servers = P2_;
    const double periods = static_cast<double>(options_.iterations - 1);
    double worst = -1;
    double end = 0;
    for (const Worker& s : workers_) {
      const double period = (s.last_end - s.first_end) / periods;
      r.iteration_seconds = std::max(r.iteration_seconds, (s.final_time - s.first_end) / periods);
      end = std::max(end, s.final_time);
      if (period > worst) {
        worst = period;
        r.period_seconds = period;
        r.breakdown.compute_seconds = s.compute / periods;
        r.breakdown.waiting_seconds = s.waiting / periods;
        r.breakdown.exposed_seconds = (s.stall - s.waiting) / periods;
      }
    }
    for (const Layer& l : layers_) {
      r.sfb_layers += l.mode == LayerMode::kSfb;
      r.allreduce_layers += l.mode == LayerMode::kRing;
      r.tasks_per_iteration += static_cast<uint32_t>(l.units.size());
    }
    r.messages = message_count_;
    r.cpu_seconds_per_iteration = cpu_work_ / static_cast<double>(options_.iterations);
    r.events = event_count_;
    r.max_port_queue = max_port_queue_;
    r.max_port_queue_host = max_port_queue_host_;
    double busiest = 0;
    for (uint32_t h = 0; h < hosts_; ++h) busiest = std::max({busiest, up_busy_[h], down_busy_[h]});
    r.link_busy_fraction = end > 0 ? busiest / end : 0;
    return r;
  }

  const planner::PlannerConfig& config_;
  const SimOptions& options_;
  std::vector<Layer> layers_;
  std::vector<Unit> units_;
  uint32_t P1_ = 1, P2_ = 1, hosts_ = 1;
  double latency_ = 0;
  std::vector<double> up_rate_, down_rate_, up_free_, down_free_, up_busy_, down_busy_, cpu_free_;
  std::vector<double> rx_free_;          // per host: its receiving work (per byte)
  SharedCpus shared_cpus_;               // SimOptions::shared_cpus (none: 0)
  double load_stretch_ = 1;              // SimOptions::host_cpu_load: work's length on them
  double cpu_work_ = 0;                  // the senders' CPU work, every host, every iteration
  std::vector<Bucket> up_bucket_, down_bucket_;
  std::vector<uint32_t> port_queue_;
  uint32_t max_port_queue_ = 0, max_port_queue_host_ = 0;
  std::vector<Worker> workers_;
  std::vector<Slot> keys_;
  std::vector<std::vector<uint32_t>> key_order_;
  std::vector<uint32_t> replicas_pending_;  // per unit: backups yet to acknowledge its clock
  uint32_t replicas_ = 0;                   // backups per key: min(replicas, P2 - 1)
  std::vector<Slot> last_post_;
  std::vector<Slot> ring_posted_;
  std::vector<uint32_t> sfb_index_;  // per unit: its place among the SFB units
  uint32_t sfb_units_ = 0;
  std::vector<Slot> inbox_;
  double ring_free_ = 0;
  std::vector<Message> messages_;
  std::vector<uint32_t> free_messages_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  uint64_t next_seq_ = 0;
  uint64_t event_count_ = 0, message_count_ = 0;
  double now_ = 0;
};

}  // namespace

absl::StatusOr<SimResult> Simulate(const poseidon::v1::ModelSpec& model,
                                   const planner::PlannerConfig& config,
                                   const SimOptions& options) {
  if (options.iterations < 2) {
    return absl::InvalidArgumentError("iterations must be at least 2 (the first is warm-up)");
  }
  if (!(options.alpha_seconds >= 0) || !(options.compute_overhead_seconds >= 0) ||
      !(options.allreduce_step_seconds >= 0) || !(options.allreduce_cpu_seconds_per_step >= 0) ||
      !(options.cpu_seconds_per_byte >= 0) || !(options.jitter.iteration_sigma >= 0) ||
      !(options.jitter.layer_sigma >= 0)) {
    return absl::InvalidArgumentError(
        "alpha, CPU per byte, compute overhead and jitter must be numbers >= 0");
  }
  if (!(options.pass_cpu_seconds >= 0)) {
    return absl::InvalidArgumentError("pass CPU must be a number >= 0");
  }
  if (!(options.host_cpu_load >= 0)) {
    return absl::InvalidArgumentError("the hosts' CPU load must be a number >= 0");
  }
  if (options.shared_cpus > 0) {
    const uint32_t hosts = config.colocated ? std::max(config.workers, config.servers)
                                            : config.workers + config.servers;
    if (!(hosts * options.host_cpu_load < options.shared_cpus)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the hosts' constant CPU load (", hosts, " hosts x ", options.host_cpu_load,
                       " CPU) leaves nothing of the ", options.shared_cpus, " shared CPUs"));
    }
  }
  if (options.mtu != 0 && (options.mtu < kMinMtu || options.mtu > kMaxMtu)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mtu must be 0 or in [", kMinMtu, ", ", kMaxMtu, "], not ", options.mtu));
  }
  if (options.frame_overhead_bytes > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame overhead must be at most 1024 bytes per packet, not ",
                     options.frame_overhead_bytes));
  }
  if (options.shared_cpus > kMaxSharedCpus) {
    return absl::InvalidArgumentError(absl::StrCat("shared_cpus must be at most ", kMaxSharedCpus,
                                                   ", not ", options.shared_cpus));
  }
  planner::PlannerConfig forced = config;
  // The agents' --scheme ps or allreduce gives FC layers no factor buffers.
  forced.sfb_possible = options.scheme == AgentScheme::kAuto;
  for (const poseidon::v1::LayerSpec& layer : model.layers()) {
    if (options.scheme == AgentScheme::kAllreduce && config.workers > 1) {
      forced.scheme_overrides[layer.name()] = poseidon::v1::SYNC_SCHEME_ALLREDUCE;
    } else if (options.scheme == AgentScheme::kPs && layer.kind() == poseidon::v1::LAYER_KIND_FC) {
      forced.scheme_overrides[layer.name()] = poseidon::v1::SYNC_SCHEME_PS;
    }
  }
  absl::StatusOr<planner::PlanResult> planned = planner::BuildPlan(model, forced);
  if (!planned.ok()) return planned.status();
  if (!planned->report.compute_unknown_reason.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute time unknown: ", planned->report.compute_unknown_reason));
  }
  const poseidon::v1::Plan& plan = planned->plan;
  const std::vector<planner::LayerReport>& reports = planned->report.layers;
  const size_t L = reports.size();
  const uint32_t P1 = config.workers;

  std::vector<Layer> layers(L);
  std::vector<Unit> units;
  // The agent's buckets (agent/layer_table.cc FormBuckets): the plan's (or runs by size), of
  // consecutive PS layers of one chunk smaller than the bucket, adjacent in the data segment (an SFB-capable layer's factor
  // buffers follow its gradient and end a run), spanning at most the bucket.
  std::vector<int> bucket_of(L, -1);
  std::vector<std::pair<uint32_t, uint32_t>> buckets;  // first, last
  std::vector<uint64_t> bucket_span;
  {
    uint64_t offset = 0, run_start = 0, run_end = 0;
    std::vector<uint32_t> run;
    auto close = [&] {
      if (run.size() >= 2) {
        for (uint32_t l : run) bucket_of[l] = static_cast<int>(buckets.size());
        buckets.push_back({run.front(), run.back()});
        bucket_span.push_back(run_end - run_start);
      }
      run.clear();
    };
    for (uint32_t i = 0; i < L; ++i) {
      const planner::LayerReport& rep = reports[i];
      const poseidon::v1::LayerPlan& lp = plan.layers(static_cast<int>(i));
      const uint64_t bytes = rep.cost.parameters * rep.cost.element_bytes;
      const bool sfb_capable = options.scheme == AgentScheme::kAuto && rep.kind == poseidon::v1::LAYER_KIND_FC &&
                               rep.shape.size() == 2;
      const uint64_t start = offset;
      offset = AlignUp(offset + bytes);
      if (sfb_capable) {
        offset = AlignUp(offset + uint64_t{rep.batch_per_worker} * rep.shape[0] * 4);
        offset = AlignUp(offset + uint64_t{rep.batch_per_worker} * rep.shape[1] * 4);
      }
      const uint64_t cap = options.fusion_from_plan ? plan.max_chunk_bytes() : options.bucket_bytes;
      const uint32_t planned_bucket = options.fusion_from_plan ? lp.bucket() : 1;
      if (cap == 0 || planned_bucket == 0 || lp.scheme() != poseidon::v1::SYNC_SCHEME_PS ||
          lp.chunks_size() != 1 || bytes >= cap) {
        close();
        continue;
      }
      if (!run.empty() &&
          (start != AlignUp(run_end) || start + bytes - run_start > cap ||
           plan.layers(static_cast<int>(run.back())).wire_type() != lp.wire_type() ||
           (options.fusion_from_plan &&
            plan.layers(static_cast<int>(run.back())).bucket() != planned_bucket))) {
        close();
      }
      if (run.empty()) run_start = start;
      run.push_back(i);
      run_end = start + bytes;
    }
    close();
  }

  // The ring's bytes pay the framing's share of the link (SimOptions::mtu).
  const double payload_share =
      options.mtu == 0
          ? 1.0
          : static_cast<double>(options.mtu - kTcpIpHeaderBytes) /
                static_cast<double>(options.mtu + options.frame_overhead_bytes);
  const planner::NetworkModel network{config.bandwidth_bytes_per_second * payload_share,
                                      config.latency_seconds};
  // A ring step costs at least the per-message overhead and the measured step.
  const double ring_step = std::max(options.alpha_seconds, options.allreduce_step_seconds);
  for (uint32_t i = 0; i < L; ++i) {
    const planner::LayerReport& rep = reports[i];
    const poseidon::v1::LayerPlan& lp = plan.layers(static_cast<int>(i));
    Layer& layer = layers[i];
    layer.forward = rep.compute->forward;
    layer.backward = rep.compute->backward;
    if (bucket_of[i] >= 0) {
      const auto [first, last] = buckets[static_cast<size_t>(bucket_of[i])];
      layer.mode = LayerMode::kBucketed;
      layer.trigger = i == first;
      if (i == first) {
        Unit u;
        u.kind = UnitKind::kBucket;
        u.layer = first;
        u.last = last;
        u.server = lp.chunks(0).server_index();
        // A bucket's members share one wire (LayerPlan.wire_type): a 16-bit one halves its bytes.
        u.bytes = u.task_bytes =
            WireBytes(lp.wire_type(), bucket_span[static_cast<size_t>(bucket_of[i])]);
        layer.units.push_back(static_cast<uint32_t>(units.size()));
        units.push_back(u);
      }
      continue;
    }
    switch (lp.scheme()) {
      case poseidon::v1::SYNC_SCHEME_SFB: {
        layer.mode = LayerMode::kSfb;
        Unit u;
        u.kind = UnitKind::kSfb;
        u.layer = i;
        u.bytes = uint64_t{rep.batch_per_worker} * (rep.shape[0] + rep.shape[1]) *
                  rep.cost.element_bytes;
        u.task_bytes = u.bytes * std::max<uint32_t>(1, P1 - 1);
        layer.units.push_back(static_cast<uint32_t>(units.size()));
        units.push_back(u);
        if (options.sfb_rebuild && config.gpu) {
          layer.rebuild = 2.0 * rep.batch_per_worker * static_cast<double>(rep.shape[0]) *
                          static_cast<double>(rep.shape[1]) * P1 / config.gpu->flops_per_second;
        }
        break;
      }
      case poseidon::v1::SYNC_SCHEME_ALLREDUCE: {
        layer.mode = LayerMode::kRing;
        layer.ring_last = i;
        layer.ring_steps = 2.0 * (P1 - 1) * (rep.cost.lowrank > 0 ? 2 : 1);
        // A 16-bit wire (AR-16) moves half the ring's bytes.
        const planner::SchemeVolume v =
            planner::IsLossyWire(lp.wire_type()) && rep.cost.allreduce_lossy_bytes.has_value()
                ? *rep.cost.allreduce_lossy_bytes
                : rep.cost.allreduce_bytes.value_or(planner::SchemeVolume{});
        layer.ring_seconds = planner::AllreduceSeconds(v, P1, network, ring_step);
        if (rep.cost.lowrank > 0 && rep.cost.allreduce_lowrank_bytes.has_value()) {
          // Low rank (AR-LR): two all-reduces of the factors and the agent's arithmetic, as the
          // planner's column.
          layer.ring_seconds =
              planner::LowRankSeconds(*rep.cost.allreduce_lowrank_bytes, rep.cost.parameters, P1,
                                      network, ring_step);
        }
        break;
      }
      default:
        layer.mode = LayerMode::kPs;
        for (const poseidon::v1::Chunk& c : lp.chunks()) {
          Unit u;
          u.kind = UnitKind::kChunk;
          u.layer = i;
          u.server = c.server_index();
          u.bytes = u.task_bytes = WireBytes(lp.wire_type(), c.length());
          layer.units.push_back(static_cast<uint32_t>(units.size()));
          units.push_back(u);
        }
        break;
    }
  }
  // The agents' all-reduce buckets (the report's, fusion.h RingBuckets): one collective each,
  // started when every worker posted its first (lowest-index, last ready) member, of its
  // members' bytes and one set of step latencies (two where a member is at low rank).
  const double ring_latency =
      planner::AllreduceSeconds(planner::SchemeVolume{}, P1, network, ring_step);
  for (uint32_t i = 0; i < L;) {
    const uint32_t b = reports[i].allreduce_bucket;
    uint32_t end = i + 1;
    while (b != 0 && end < L && reports[end].allreduce_bucket == b) ++end;
    if (end - i >= 2) {
      double bytes_seconds = 0;
      bool lowrank = false;
      for (uint32_t j = i; j < end; ++j) {
        const bool at_low_rank = reports[j].cost.lowrank > 0;
        lowrank = lowrank || at_low_rank;
        bytes_seconds += layers[j].ring_seconds - ring_latency * (at_low_rank ? 2 : 1);
        layers[j].trigger = j == i;
      }
      layers[i].ring_seconds = bytes_seconds + ring_latency * (lowrank ? 2 : 1);
      layers[i].ring_steps = 2.0 * (P1 - 1) * (lowrank ? 2 : 1);
      layers[i].ring_last = end - 1;
    }
    i = end;
  }
  Simulation simulation(config, options, std::move(layers), std::move(units));
  return simulation.Run();
}

}  // namespace poseidon::sim
