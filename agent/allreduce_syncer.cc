// The ring all-reduce syncer: a layer's gradient is summed in place among the agents by Gloo's
// ring all-reduce (reduce-scatter, then all-gather: every rank ends with the same bits), over
// Gloo's TCP transport, connected once at registration through the rendezvous store (the
// coordinator's, agent/gloo_store.h). Exact like PS: N ranks' sum of the same gradients.
//
// On a lossy wire (the layer's LayerSpec::wire: bfloat16 or fp16, from the plan or --wire) a ring
// would round every partial sum on every hop; instead the layer is split into one shard per rank
// and each rank sums its shard in float32, as a server does: every rank encodes its gradient with
// error feedback (common/wire_codec.h) and sends each shard to its owner (Gloo's alltoallv), the
// owner decodes the W contributions into a float32 sum in rank order, encodes it with error
// feedback of its own and the shards are gathered on every rank (Gloo's allgatherv). The same
// bytes as the ring at half the element size, and every rank ends with the same bits. The
// divergence guard (agent/wire_guard.h) runs on the same sampled all-reduces on every rank; when
// any rank's encoding diverges, a one-element all-reduce of the ranks' verdicts makes every rank
// run that all-reduce and every later one in float32, each rank's (and each owner's) held-back
// residual added to it: from that all-reduce on, the results are exact.
//
// Low rank (LayerSpec::lowrank, agent/lowrank.h: PowerSGD): a unit's low-rank members go as
// their P factors in one all-reduce (with the unit's other members' gradients, uncompressed, in
// the same collective), then their Q factors in a second; the first --lowrank_warmup all-reduces
// of the unit are exact. The divergence guard, on its sampled all-reduces, sums the sketches of
// the ranks' gradients and residuals of the low-rank members (agent/lowrank.h: 2 x 256 floats in
// one more all-reduce, the same bits on every rank, so every rank decides alike): past
// --lowrank_max_held, the unit falls back to the exact all-reduce, and its next one carries each
// rank's residual: nothing held back is lost.
//
// All-reduce buckets (LayerTable::ring_groups, DDP's buckets): consecutive host-memory layers
// adjacent in the data segment go as one collective over their span once every member of the
// iteration is ready, and every member completes with it; a layer not in a bucket is a unit of
// its own. Everything below works on units (a collective's tag is its first layer's index).
//
// Elastic jobs (--min_workers): a rank removed from the job (PeerRemoved, the coordinator's
// word) leaves the ring. A Gloo context cannot drop a member, so each removal makes a new ring, a
// generation: a context among the live ranks, connected through the rendezvous store under a
// prefix naming the removed ranks (every live agent hears the same removals), on a thread of its
// own (the keeper). The old ring takes no more collectives; those in it fail (a dead neighbour's
// connection breaks; a rank whose collectives on the old ring all ended closes its connections,
// so that the failure goes round the ring instead of waiting for the timeout). A failed
// collective is run again on the next ring, from its input (each unit keeps a copy of the
// gradient it sends) — but the dead rank may have died after some ranks completed it: the first
// collective of a unit on a new ring is therefore an exchange of where each rank is (the last
// iteration it completed, a one-element all-reduce of the maximum), and where some completed
// iteration D and others not, the lowest-indexed rank that did sends D's result (each unit also
// keeps its last result) to every rank (Gloo's broadcast): those that had not completed D
// complete it with that result. Under BSP the ranks differ by at most one iteration of a unit
// (no rank completes D before every rank posted it), so every live rank ends each iteration with
// the same bits: the sum over the ranks of the ring that completed it. A layer that averages
// (PSD_LAYER_AVERAGE) divides by that ring's ranks. Lossy wires and low rank are off in an
// elastic job (their residuals and shards are per rank): its ring is float32, exact.
//
// Concurrency: Gloo's collectives block. Each posted layer's all-reduce runs on a thread of its
// own (a pool that grows to the number of layers in flight, never beyond the layer count) with
// the layer's index as Gloo's tag, so collectives of different layers proceed side by side and
// the ranks need not post layers in one order (the framework's broadcast and buffer layers are
// posted outside backward's order, at iterations of their own). A layer has at most one
// iteration in flight, so its tag is unique among the collectives running. The ring uses the
// link whole: the scheduler's credit and priority do not apply to it.
//
// Thread model: Start, Waiting and PeerRemoved on the main thread; the collectives on the pool's
// threads; a CUDA layer's staging callback on the stager's thread; the connection of a new ring
// on the keeper thread (elastic jobs). mu_ guards the queue, the pool's counts, the running set,
// the broken state, the current ring (its in-flight count and failure) and the removed ranks (a
// leaf lock; never held in Gloo). A unit's copies (UnitProgress) are used only by the thread
// running the unit (one at a time).
#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "agent/gloo_ring.h"
#include "agent/lowrank.h"
#include "agent/syncer.h"
#include "agent/telemetry_reporter.h"
#include "agent/timeline.h"
#include "common/log.h"
#include "common/status.h"
#include "common/wire_codec.h"
#include "gloo/allgatherv.h"
#include "gloo/allreduce.h"
#include "gloo/broadcast.h"
#include "gloo/alltoallv.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/transport/tcp/device.h"

namespace poseidon::agent {
namespace {

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// A lossy layer's collectives after its alltoallv (whose tag is the layer's): the allgatherv and
// the guard's vote, each in a tag space of its own.
constexpr uint32_t kGatherTagBase = 1u << 29;
constexpr uint32_t kVoteTagBase = 2u << 29;
// Elastic jobs: a unit's exchange of where the ranks are on a new ring, and the hand-over of a
// result some ranks lack.
constexpr uint32_t kWhereTagBase = 3u << 29;
constexpr uint32_t kHandOverTagBase = 4u << 29;

// A Gloo context among the ranks of the job that are in it (every rank, or those left after
// removals: elastic jobs), and its state.
struct Ring {
  uint32_t generation = 0;            // 0: the first ring; +1 for each ring made since
  std::shared_ptr<gloo::Context> context;
  std::vector<uint32_t> members;      // the job's ranks, in ring order
  std::set<uint32_t> removed;         // the job's ranks not in it
  uint32_t index = 0;                 // this rank's index in members
  // A ring a returning rank came into serves the job's iterations from `from` on; `older`, the
  // ring before, those below (0 and null: every iteration).
  uint64_t from = 0;
  std::shared_ptr<Ring> older;
  // Guarded by the syncer's mu_:
  int in_flight = 0;                  // collectives running on it
  bool failed = false;                // a collective failed on it, or a newer ring replaced it
  bool closed = false;                // failed with none in flight: its connections are closing
  bool shut = false;                  // its connections are closed: Gloo writes no more into
                                      // the buffers of its collectives
  // The options (and so the buffers) of collectives that failed in it: Gloo's device thread may
  // still complete a send on a buffer of a collective that threw, so they are freed only once
  // the ring's connections are closed (which takes them off the device's loop).
  std::vector<std::shared_ptr<void>> parked;
  uint32_t Left() const { return members[(index + members.size() - 1) % members.size()]; }
  uint32_t Right() const { return members[(index + 1) % members.size()]; }
  std::string Describe() const {
    if (members.size() < 2) {
      return absl::StrCat("the ring of this rank alone (without the other ",
                          removed.size() > 1 ? "ranks " : "rank ", absl::StrJoin(removed, ", "),
                          ")");
    }
    return absl::StrCat("the Gloo ring of ", members.size(), " ranks",
                        removed.empty() ? "" : absl::StrCat(" without rank",
                                                            removed.size() > 1 ? "s " : " ",
                                                            absl::StrJoin(removed, ", ")),
                        " (neighbours: ranks ", Left(), " and ", Right(), ")");
  }
};

// Where the ranks are with a unit on a new ring (elastic jobs): from the maximum of each rank's
// (last completed iteration, index) key and of its complement, the highest completed iteration,
// the rank that sends its result (the lowest index among those that completed it) and the lowest
// completed iteration.
struct UnitWhere {
  uint64_t highest = 0;
  uint32_t sender = 0;  // ring index
  uint64_t lowest = 0;
};
inline constexpr uint32_t kWhereIndexBits = 16;  // rings of at most 65,535 ranks
inline uint64_t WhereKey(uint64_t done, uint32_t index) {
  return (done << kWhereIndexBits) | ((1u << kWhereIndexBits) - 1 - index);
}
inline UnitWhere DecodeWhere(uint64_t max_key, uint64_t max_complement) {
  const uint64_t mask = (uint64_t{1} << kWhereIndexBits) - 1;
  return {max_key >> kWhereIndexBits, static_cast<uint32_t>(mask - (max_key & mask)),
          ~max_complement};
}

// What one collective covers: a layer, or an all-reduce bucket of consecutive layers.
struct Unit {
  uint32_t first = 0;             // the first layer (the tag; its gradient starts the span)
  std::vector<uint32_t> members;  // every layer it completes
  size_t elements = 0;            // floats of the span
  std::string name;               // the layer's or the bucket's
};

// A unit on a lossy wire (LayerSpec::wire): its residuals and buffers, allocated in Ready and
// then used only by the pool thread running the unit's all-reduce (one at a time).
struct LossyRing {
  WireType type = WireType::kF32;
  std::vector<size_t> shard;      // elements of each rank's shard (balanced, every one >= 1)
  size_t own_begin = 0;           // this rank's shard: [own_begin, own_begin + shard[rank])
  std::vector<float> residual;    // this rank's encoding of the whole gradient
  std::vector<float> owner_residual;  // this rank's encoding of its shard's sum
  std::vector<uint16_t> send, received, gathered;
  std::vector<float> sum;         // the shard's float32 sum
  uint64_t clock = 0;             // all-reduces of the layer so far (the guard's sampling)
  bool exact = false;             // fell back: float32 from now on (every rank alike)
};

// A unit with low-rank members: their compressors, where their gradients, P and Q lie in the
// unit's span and its two buffers, and the rest of the span (sent uncompressed with the Ps).
// Built in Ready; then used only by the pool thread running the unit (one at a time).
struct LowRankUnit {
  struct Member {
    uint32_t layer = 0;
    size_t offset = 0;  // floats from the unit's first gradient
    size_t p_offset = 0, q_offset = 0;
    LowRankLayer compressor;
  };
  std::vector<Member> members;
  std::vector<std::pair<size_t, size_t>> plain;  // (offset, floats) sent uncompressed
  std::vector<float> first;   // the members' P factors, then the plain ranges
  std::vector<float> second;  // the members' Q factors
  std::vector<float> check;   // the guard's: the sketches of the gradients, then the residuals
  size_t plain_elements = 0;       // the plain ranges' floats (the tail of `first`)
  uint64_t clock = 0;         // all-reduces of the unit so far (warm-up, the guard's sampling)
  bool exact = false;         // fell back (every rank alike): exact from now on
  bool released = false;      // the residuals went out with the first exact all-reduce
};

// A unit's copies in an elastic job: the gradient it posted (a failed collective goes again
// from it) and its last result (handed over to ranks that lack it), with that iteration and the
// ring generation the unit last ran in. Used only by the thread running the unit.
struct UnitProgress {
  std::vector<float> input, result;
  uint64_t done = 0;  // the last job iteration completed (0: none)
  uint32_t generation = 0;
  bool fresh = false;  // a rank coming back: `done` is where it starts, with no result to hand
};

class AllreduceSyncer final : public Syncer {
 public:
  explicit AllreduceSyncer(SyncEnv& env)
      : env_(env),
        elastic_(env.config->min_workers > 0),
        unit_of_(env.table->layers.size()),
        gathering_(env.table->ring_groups.size()) {
    // Bucket members are consecutive: the units follow the layers in order.
    const LayerTable& table = *env.table;
    for (uint32_t l = 0; l < table.layers.size(); ++l) {
      const int group = table.layers[l].ring_group;
      if (group >= 0 && table.ring_groups[static_cast<size_t>(group)].members.front() != l) {
        unit_of_[l] = unit_of_[l - 1];
        continue;
      }
      Unit u;
      u.first = l;
      if (group >= 0) {
        const RingGroupSpec& g = table.ring_groups[static_cast<size_t>(group)];
        u.members = g.members;
        u.elements = g.bytes / sizeof(float);
        u.name = g.name;
      } else {
        u.members = {l};
        u.elements = table.layers[l].desc.elements;
        u.name = table.layers[l].desc.name;
      }
      unit_of_[l] = static_cast<uint32_t>(units_.size());
      units_.push_back(std::move(u));
    }
    if (elastic_) progress_.resize(units_.size());
  }
  ~AllreduceSyncer() override { Stop(); }

  int Parts(uint32_t) const override { return 1; }

  absl::Status Ready() override {
    bool any = false;
    for (const LayerSpec& l : env_.table->layers) any |= l.allreduce_capable;
    if (!any || env_.rendezvous == nullptr || env_.config->world_size < 2) return absl::OkStatus();
    const uint32_t rank = env_.config->rank, world = env_.config->world_size;
    if (!came_back_.empty()) return ReadyComingBack();
    world_ = env_.ring_world;
    // The ring the agent connected before registering its model (its step went to the
    // coordinator with it), or one connected now; either way its step measured.
    GlooRing ring;
    if (env_.ring != nullptr && env_.ring->context != nullptr) {
      ring = *env_.ring;
    } else {
      gloo::rendezvous::PrefixStore keys(world_, *env_.rendezvous);
      ASSIGN_OR_RETURN(ring, ConnectGlooRing(keys, rank, world, env_.own_host,
                                             env_.config->sync_timeout));
    }
    device_ = std::move(ring.device);
    context_ = std::move(ring.context);
    {
      auto first = std::make_shared<Ring>();
      first->context = context_;
      for (uint32_t r = 0; r < world; ++r) first->members.push_back(r);
      first->index = rank;
      std::lock_guard<std::mutex> lock(mu_);
      ring_ = std::move(first);
    }
    if (elastic_) {
      // Residuals and shards are per rank and ring: an elastic job's ring is float32, exact.
      size_t off = 0;
      for (const LayerSpec& l : env_.table->layers) {
        off += l.allreduce_capable && (IsLossy(l.wire) || l.lowrank > 0) ? 1 : 0;
      }
      if (off > 0) {
        PSD_LOG_WARN("all-reduce: {} layers would go on a lossy wire or at low rank on the ring; "
                     "in a job that may shrink (--min_workers) the ring sums float32 (exact)",
                     off);
      }
      keeper_ = std::thread([this] { Keep(); });
    } else {
      if (const absl::Status s = PrepareLossy(); !s.ok()) return s;
      PrepareLowRank();
    }
    if (env_.telemetry) env_.telemetry->SetAllreduceStep(ring.step);
    PSD_LOG_INFO("all-reduce: Gloo ring of {} ranks connected ({}), {} per step", world,
                 env_.own_host.empty() ? "127.0.0.1" : env_.own_host,
                 absl::FormatDuration(ring.step));
    return absl::OkStatus();
  }

  void Start(const Post& post) override {
    if (context_ == nullptr) {
      env_.finished(post.layer, post.iteration, 0,
                    absl::FailedPreconditionError(
                        "all-reduce is not connected (one rank, or no rendezvous store)"));
      return;
    }
    const int group = env_.table->layers[post.layer].ring_group;
    if (group >= 0) {
      // A bucket's member (host memory only: the agent refuses one posted on the GPU). The
      // bucket goes once its last member of the iteration is ready.
      Gathering& g = gathering_[static_cast<size_t>(group)];
      const RingGroupSpec& bucket = env_.table->ring_groups[static_cast<size_t>(group)];
      if (g.iteration != post.iteration) {
        g.iteration = post.iteration;
        g.waiting = bucket.members.size();
      }
      if (--g.waiting != 0) return;
      Post whole = post;
      whole.layer = bucket.members.front();
      Launch(whole);
      return;
    }
    if (!post.on_device) {
      Launch(post);
      return;
    }
    const LayerSpec& spec = env_.table->layers[post.layer];
    DeviceStager* stager = env_.stager->load(std::memory_order_acquire);
    const std::vector<DeviceRange> ranges = {
        {spec.layout.grad_offset, spec.desc.elements * sizeof(float)}};
    const absl::Status s =
        stager->StageOut(post.layer, ranges, [this, post](size_t) { Launch(post); });
    if (!s.ok()) env_.finished(post.layer, post.iteration, 0, s);
  }

  std::string Waiting(uint32_t layer, uint64_t iteration,
                      const std::vector<uint8_t>&) const override {
    const Unit& unit = units_[unit_of_[layer]];
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return absl::StrCat("all-reduce (the ring failed: ", broken_.message(), ")");
    if (running_.count(unit.first) != 0 && back_.has_value() && back_->answered &&
        iteration + env_.clock_base >= back_->hold_from) {
      return absl::StrCat("all-reduce", unit.members.size() > 1 ? " of " + unit.name : "",
                          ": waiting for rank ", back_->rank, " coming back into the ring",
                          back_->from == 0 ? " to name the iteration it takes up"
                                           : absl::StrCat(" from iteration ", back_->from));
    }
    if (running_.count(unit.first) != 0 && ring_ != nullptr) {
      if (ring_->failed) {
        return absl::StrCat("all-reduce", unit.members.size() > 1 ? " of " + unit.name : "",
                            ": ", ring_->Describe(), " failed; waiting for the ring of the ranks "
                            "left (", removed_.size(), " removed from the job)");
      }
      return absl::StrCat("all-reduce", unit.members.size() > 1 ? " of " + unit.name : "",
                          " in ", ring_->Describe(), ", ", running_.size(),
                          " collectives in the ring");
    }
    if (const int group = env_.table->layers[layer].ring_group; group >= 0) {
      const Gathering& g = gathering_[static_cast<size_t>(group)];  // the main thread's
      if (g.iteration == iteration && g.waiting > 0) {
        return absl::StrCat("all-reduce of ", unit.name, ": ", g.waiting, " of its ",
                            unit.members.size(), " layers not yet ready at iteration ",
                            iteration);
      }
    }
    return "all-reduce (queued for a thread)";
  }

  void Stop() override {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      threads.swap(threads_);
    }
    cv_.notify_all();
    ring_cv_.notify_all();
    for (auto& t : threads) t.join();
    // A keeper waiting for the ranks of a ring checks every 200 ms whether the agent stops.
    if (keeper_.joinable()) keeper_.join();
  }

  // Elastic jobs: `rank` left the job. The ring it is in takes no more collectives; the keeper
  // connects one among the ranks left.
  void PeerRemoved(uint32_t rank) override {
    if (!elastic_ || rank >= env_.config->world_size || rank == env_.config->rank) return;
    std::shared_ptr<Ring> close;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // A replacement coming back is gone before it came into the ring (removed again, or
      // removed once it was waited for in its predecessor's place): what waited for it goes on
      // in the ring it had (TakeBack gives up). Its predecessor's removal, which its question
      // waits for (its servers removed it), is not that.
      if (back_.has_value() && back_->rank == rank &&
          (back_->answered || (removed_.contains(rank) && !back_->awaiting_removal))) {
        back_.reset();
      }
      if (!removed_.insert(rank).second || ring_ == nullptr) {
        ring_cv_.notify_all();
        return;
      }
      close = FailLocked(ring_);
    }
    if (close) CloseRing(*close);
    ring_cv_.notify_all();
  }

  // A replacement of `rank` registered (the coordinator's word): the keeper answers its question
  // once it asks (TakeBack).
  void PeerReturning(uint32_t rank) override {
    if (!elastic_ || rank >= env_.config->world_size || rank == env_.config->rank) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (context_ == nullptr || ring_ == nullptr || back_.has_value()) return;
    back_ = Return{};
    back_->rank = rank;
    ring_cv_.notify_all();
  }

  // This rank comes back into the ring (a replacement, --rejoin): it asks every live agent
  // where its all-reduces are (TakeBack answers) and returns the job iteration it can take up —
  // where it was removed, the one after the highest any live agent started (they hold their
  // all-reduces from there until it names the iteration it takes up, Ready); where it rejoins
  // before being removed (its ring broke with its predecessor), the highest any completed
  // (those that lack it get it handed over in the new ring).
  absl::StatusOr<uint64_t> ComeBack(absl::Time deadline) override;

 private:
  // Marks `ring` failed (mu_ held); the ring to close now when nothing runs on it any more.
  static std::shared_ptr<Ring> FailLocked(const std::shared_ptr<Ring>& ring) {
    ring->failed = true;
    if (ring->in_flight > 0 || ring->closed) return nullptr;
    ring->closed = true;
    return ring;
  }

  // Closes a failed ring's connections (mu_ not held): its peers' collectives in it fail at once
  // instead of waiting for their timeout. Then frees its failed collectives' buffers.
  void CloseRing(Ring& ring) {
    try {
      if (ring.context != nullptr) ring.context->closeConnections();
    } catch (const std::exception& e) {
      PSD_LOG_DEBUG("all-reduce: closing {}: {}", ring.Describe(), e.what());
    }
    std::vector<std::shared_ptr<void>> parked;
    {
      std::lock_guard<std::mutex> lock(mu_);
      parked.swap(ring.parked);
      ring.shut = true;
    }
    ring_cv_.notify_all();
  }

  // Runs one collective of an elastic job's ring: `opts` (Gloo's options, holding its buffers)
  // goes to `run`; on Gloo's exception the options are parked with the ring (Ring::parked) and
  // the error returned as UNAVAILABLE, prefixed with `what`.
  // `keep`: memory its buffers point at that would be freed on return (parked with it).
  template <typename Options, typename Run>
  absl::Status RunInRing(Ring& ring, std::unique_ptr<Options> opts, Run run,
                         absl::string_view what, std::shared_ptr<void> keep = nullptr) {
    try {
      run(*opts);
    } catch (const std::exception& e) {
      const absl::Status s = absl::UnavailableError(absl::StrCat(what, e.what()));
      std::lock_guard<std::mutex> lock(mu_);
      ring.parked.push_back(std::shared_ptr<Options>(std::move(opts)));
      if (keep) ring.parked.push_back(std::move(keep));
      return s;
    }
    return absl::OkStatus();
  }

  // After a collective failed in `ring`: waits until its connections are closed (every
  // collective of this agent in it ended), so that no late receive of the failed one writes into
  // the unit's buffers once its input is back there. False at `deadline` or when stopping.
  bool AwaitShut(Ring& ring, absl::Time deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return ring_cv_.wait_until(lock, absl::ToChronoTime(deadline),
                               [&] { return stopping_ || ring.shut; }) &&
           ring.shut;
  }

  // The sum of `count` floats in place in an elastic job's ring (a unit's tag).
  absl::Status SumInRing(Ring& ring, float* data, size_t count, uint32_t tag) {
    auto opts = std::make_unique<gloo::AllreduceOptions>(ring.context);
    opts->setOutput(data, count);
    opts->setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    opts->setTag(tag);
    opts->setTimeout(Millis(env_.config->sync_timeout));
    return RunInRing(ring, std::move(opts), [](gloo::AllreduceOptions& o) { gloo::allreduce(o); },
                     "");
  }

  // Connects `ring` (its members and index set) through the rendezvous store under `prefix`.
  // Every member first announces itself (`prefix`/present/<rank>), and the Gloo mesh is
  // connected only once all have: agents that heard of two removals in different orders first
  // wait for different rings, and one that waits for a dead rank (a removal it has not heard
  // of yet) must be able to leave that ring for the next one, which a Gloo connection in
  // progress (it blocks, and its keys can be set only once) would not let it. Between its
  // checks, every 200 ms, the wait ends when a further rank was removed (CANCELLED: try the
  // ring without it), the agent stops, or `give_up` passed.
  // `expect`: the removals under which the ring is still the one to make (default: its own).
  absl::Status ConnectRing(Ring& ring, const std::string& prefix, absl::Time give_up,
                           const std::set<uint32_t>* expect = nullptr) {
    if (expect == nullptr) expect = &ring.removed;
    try {
      gloo::rendezvous::PrefixStore store(absl::StrCat(world_, "/", prefix), *env_.rendezvous);
      store.set(absl::StrCat("present/", env_.config->rank), {'1'});
      std::vector<std::string> present;
      for (uint32_t r : ring.members) present.push_back(absl::StrCat("present/", r));
      while (true) {
        try {
          store.wait(present, std::chrono::milliseconds(200));
          break;
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mu_);
          if (stopping_) return absl::CancelledError("the agent stops");
          if (removed_ != *expect) return absl::CancelledError("a further rank was removed");
          if (absl::Now() >= give_up) {
            return absl::DeadlineExceededError(absl::StrCat(
                "not every rank left came within ", absl::FormatDuration(
                    2 * env_.config->sync_timeout), " (", e.what(), ")"));
          }
        }
      }
      gloo::rendezvous::PrefixStore mesh(absl::StrCat(world_, "/", prefix, "/mesh"),
                                         *env_.rendezvous);
      auto context = std::make_shared<gloo::rendezvous::Context>(
          static_cast<int>(ring.index), static_cast<int>(ring.members.size()));
      context->setTimeout(Millis(env_.config->sync_timeout));
      context->connectFullMesh(mesh, device_);
      ring.context = std::move(context);
    } catch (const std::exception& e) {
      return absl::UnavailableError(e.what());
    }
    return absl::OkStatus();
  }

  // The keeper (elastic jobs): once ranks were removed, connects the ring of the ranks left
  // through the rendezvous store under a prefix naming the removed ranks (ConnectRing), and
  // makes it the current ring. With a further removal meanwhile it connects the ring without
  // that rank too; a set of removals whose ring cannot connect within two sync timeouts fails
  // what waits for the ring.
  void Keep() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ring_cv_.wait(lock, [&] {
        return stopping_ || removed_ != ring_->removed ||
               (back_.has_value() && !back_->answered);
      });
      if (stopping_) return;
      if (removed_ == ring_->removed) {  // a replacement coming back (removals go first)
        lock.unlock();
        TakeBack();
        lock.lock();
        continue;
      }
      const std::set<uint32_t> removed = removed_;
      const uint32_t returns = returns_;
      const absl::Time give_up = absl::Now() + 2 * env_.config->sync_timeout;
      const uint32_t generation = ring_->generation + 1;
      lock.unlock();
      auto next = std::make_shared<Ring>();
      next->generation = generation;
      next->removed = removed;
      for (uint32_t r = 0; r < env_.config->world_size; ++r) {
        if (removed.contains(r)) continue;
        if (r == env_.config->rank) next->index = static_cast<uint32_t>(next->members.size());
        next->members.push_back(r);
      }
      // This rank alone (--min_workers 1): no context; its all-reduces are its own gradients.
      const absl::Status s =
          next->members.size() < 2
              ? absl::OkStatus()
              : ConnectRing(*next, absl::StrCat("ring-r", returns, "-without-",
                                                absl::StrJoin(removed, "-")),
                            give_up);
      lock.lock();
      if (stopping_) return;
      if (!s.ok()) {
        if (removed_ != removed) continue;  // a further removal: connect without it too
        const absl::Status error = absl::UnavailableError(absl::StrCat(
            "all-reduce: connecting the ring of the ", next->members.size(),
            " ranks left (without rank", removed.size() > 1 ? "s " : " ",
            absl::StrJoin(removed, ", "), "): ", s.message()));
        PSD_LOG_ERROR("{}", error.message());
        if (broken_.ok()) broken_ = error;
        lock.unlock();
        ring_cv_.notify_all();
        return;
      }
      const std::shared_ptr<Ring> old = ring_;
      const std::shared_ptr<Ring> close = FailLocked(old);
      ring_ = next;
      lock.unlock();
      if (close) CloseRing(*close);
      PSD_LOG_WARN("all-reduce: {} connected (ring generation {}): the all-reduces that "
                   "failed in the ring before go again in it", next->Describe(), generation);
      ring_cv_.notify_all();
      lock.lock();
    }
  }

  // Ready for a replacement that asked to come back (ComeBack): it names the iteration it takes
  // up (its process's first, SyncEnv::clock_base + 1) and connects the ring with the live
  // agents, which take its all-reduces from there (TakeBack). Each unit starts as having
  // completed the iteration before, with no result to hand over (UnitProgress::fresh).
  absl::Status ReadyComingBack() {
    const uint32_t me = env_.config->rank;
    const uint64_t from = env_.clock_base + 1;
    if (named_ != from) RETURN_IF_ERROR(TakeUpAt(from));
    ASSIGN_OR_RETURN(device_, MakeGlooDevice(env_.own_host));
    auto ring = std::make_shared<Ring>();
    ring->generation = 1;  // its units' first collective in it is the exchange of where
    ring->members = back_members_;
    for (uint32_t r = 0; r < env_.config->world_size; ++r) {
      if (std::find(back_members_.begin(), back_members_.end(), r) == back_members_.end()) {
        ring->removed.insert(r);
      }
    }
    ring->index = static_cast<uint32_t>(
        std::find(back_members_.begin(), back_members_.end(), me) - back_members_.begin());
    {
      std::lock_guard<std::mutex> lock(mu_);
      removed_ = ring->removed;
      returns_ = back_returns_ + 1;
    }
    if (ring->members.size() > 1) {
      RETURN_IF_ERROR(Annotate(
          ConnectRing(*ring, absl::StrCat(came_back_, "/ring"),
                      absl::Now() + 2 * env_.config->sync_timeout),
          absl::StrCat("all-reduce: coming back into the ring of ranks ",
                       absl::StrJoin(ring->members, ", "))));
    }
    context_ = ring->context;
    try {
      // Answered and in: a live agent told of this replacement later (its first heartbeat
      // answer) finds no question to answer.
      gloo::rendezvous::PrefixStore root(absl::StrCat("return-", me), *env_.rendezvous);
      root.set("nonce", {});
    } catch (const std::exception& e) {
      PSD_LOG_DEBUG("all-reduce: clearing this rank's question: {}", e.what());
    }
    for (size_t u = 0; u < units_.size(); ++u) {
      UnitProgress& at = progress_[u];
      at.input.assign(units_[u].elements, 0.0f);
      at.result.assign(units_[u].elements, 0.0f);
      at.done = from - 1;
      at.fresh = true;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ring_ = ring;
    }
    keeper_ = std::thread([this] { Keep(); });
    PSD_LOG_WARN("all-reduce: this rank is back in {} (ring generation {}) from iteration {}",
                 ring->Describe(), ring->generation, from);
    return absl::OkStatus();
  }

  absl::Status TakeUpAt(uint64_t from) override {
    if (came_back_.empty()) return absl::OkStatus();
    try {
      gloo::rendezvous::PrefixStore asked(came_back_, *env_.rendezvous);
      const std::string text = absl::StrCat(from, " ", absl::StrJoin(back_ids_, ","));
      asked.set("from", std::vector<char>(text.begin(), text.end()));
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("all-reduce: naming the iteration this rank takes up: ", e.what()));
    }
    named_ = from;
    return absl::OkStatus();
  }

  // What a live agent answers a replacement coming back, in the store (TakeBack, ComeBack).
  // Its fields: returns, started, completed, removed (0/1), the ring's ranks, the answer's id
  // (the replacement's word on its first iteration lists the ids it heard, so that a stale word
  // of an earlier replacement is not taken for it) and the world's rendezvous prefix.
  static std::string AnswerText(uint32_t returns, uint64_t started, uint64_t completed,
                                bool removed, const std::vector<uint32_t>& members,
                                const std::string& id, const std::string& world) {
    return absl::StrCat(returns, " ", started, " ", completed, " ", removed ? 1 : 0, " ",
                        absl::StrJoin(members, ","), " ", id, " ", world);
  }
  static std::string RandomId() {
    std::mt19937_64 random(std::random_device{}());
    return absl::StrCat(absl::Hex(random(), absl::kZeroPad16));
  }

  // The keeper: a replacement of back_->rank registered (PeerReturning). Once it asks (its
  // question under return-<rank>/: a nonce of its own, and whether its KV servers removed the
  // rank), this agent answers where it is and holds its all-reduces from the iteration after
  // the highest it started; once the replacement names the iteration F it takes up (…/from),
  // those below F go on in the current ring, and this agent connects the ring with the rank,
  // which takes those from F on. A replacement whose servers removed the rank is answered once
  // this agent removed it too (the coordinator's word; the keeper makes the ring without it
  // first), so that every layer leaves it out alike. The return ends without the rank (the
  // current ring goes on) when another rank is removed once it answered, the replacement is
  // removed again, or it does not come within the wait.
  void TakeBack() {
    uint32_t rank = 0;
    std::set<uint32_t> expect;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!back_.has_value() || back_->answered) return;
      rank = back_->rank;
      expect = removed_;
    }
    auto abandon = [&](const std::string& why) {
      std::lock_guard<std::mutex> lock(mu_);
      if (back_.has_value() && back_->rank == rank) back_.reset();
      if (!why.empty()) {
        PSD_LOG_WARN("all-reduce: rank {}'s replacement does not come into the ring ({}); the "
                     "all-reduces go on in {}", rank, why, ring_->Describe());
      }
      ring_cv_.notify_all();
    };
    // Why to stop waiting: the agent stops, the return was called off, or a rank was removed
    // (the keeper makes that ring first, then asks again, unless this agent answered already).
    enum class Off { kNo, kStopping, kCalledOff, kRemoval };
    auto off = [&] {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return Off::kStopping;
      if (!back_.has_value() || back_->rank != rank) return Off::kCalledOff;
      if (removed_ != expect) return Off::kRemoval;
      return Off::kNo;
    };
    auto stop_waiting = [&](Off why) {
      abandon(why == Off::kStopping    ? ""
              : why == Off::kCalledOff ? "it was removed again"
                                       : "another rank was removed meanwhile");
    };
    const absl::Duration patience = std::max(env_.config->connect_timeout, absl::Seconds(30)) +
                                    2 * env_.config->sync_timeout;
    try {
      gloo::rendezvous::PrefixStore root(absl::StrCat("return-", rank), *env_.rendezvous);
      // (nonce, whether its KV servers removed the rank), or an empty nonce.
      auto read_question = [&](std::chrono::milliseconds wait) {
        std::pair<std::string, bool> q;
        try {
          root.wait({"nonce"}, wait);
          const std::vector<char> v = root.get("nonce");
          const std::vector<std::string> f =
              absl::StrSplit(absl::string_view(v.data(), v.size()), ' ');
          if (f.size() == 2 && !f[0].empty()) {
            q = {f[0], f[1] == "1"};
          } else {
            std::this_thread::sleep_for(wait);  // a question answered (cleared): none yet
          }
        } catch (const std::exception&) {
        }
        return q;
      };
      // Until the replacement asks: it may be waiting for its training process to attach
      // (--attach_timeout), then registers with the servers; one that never asks (it came in
      // already, or left unnoticed) is not waited for longer.
      const absl::Duration ask_wait = env_.config->attach_timeout + patience;
      const absl::Time ask_by = absl::Now() + ask_wait;
      std::pair<std::string, bool> question;
      while (question.first.empty()) {
        question = read_question(std::chrono::milliseconds(200));
        if (question.first.empty()) {
          const Off why = off();
          if (why == Off::kRemoval) return;  // asked again after
          if (why != Off::kNo) return stop_waiting(why);
          if (absl::Now() > ask_by) {
            return abandon(
                absl::StrCat("it asked nothing within ", absl::FormatDuration(ask_wait)));
          }
        }
      }
      bool removed = false;
      {
        std::shared_ptr<Ring> close;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (!back_.has_value() || back_->rank != rank) return;
          removed = removed_.contains(rank);
          if (question.second && !removed) {
            // Its KV servers removed it, and this agent has not heard (a replacement that
            // registered before the coordinator's word reached this agent is the rank's holder
            // now: that word never comes). The ring leaves it out as the servers' keys do —
            // those that failed without it go again without it — and answers from there.
            PSD_LOG_WARN("all-reduce: rank {}'s replacement asks to come back after its KV "
                         "servers removed it: the ring leaves it out first", rank);
            back_->awaiting_removal = true;
            removed_.insert(rank);
            close = FailLocked(ring_);
          }
        }
        if (close) CloseRing(*close);
        if (question.second && !removed) {
          ring_cv_.notify_all();
          return;  // the keeper makes the ring without it, then answers
        }
      }
      // Its predecessor is gone with its ring (a rejoin before the removal): the collectives in
      // it end, so that what this agent completed is known before it answers.
      std::shared_ptr<Ring> dead;
      if (!removed) {
        std::shared_ptr<Ring> close;
        {
          std::lock_guard<std::mutex> lock(mu_);
          dead = ring_;
          close = FailLocked(dead);
        }
        if (close) CloseRing(*close);
      }
      std::string nonce = question.first;
      while (true) {
        if (dead != nullptr && !AwaitShut(*dead, absl::Now() + env_.config->sync_timeout)) {
          return abandon("the collectives of its predecessor's ring did not end");
        }
        std::string answer;
        const std::string id = RandomId();
        uint64_t hold = 0;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (!back_.has_value() || back_->rank != rank) return abandon("");
          back_->answered = true;
          back_->hold_from = hold = started_ + 1;
          answer = AnswerText(returns_, started_, completed_, removed, ring_->members, id,
                              world_);
        }
        ring_cv_.notify_all();
        gloo::rendezvous::PrefixStore asked(absl::StrCat("return-", rank, "-", nonce),
                                            *env_.rendezvous);
        asked.set(absl::StrCat("where/", env_.config->rank),
                  std::vector<char>(answer.begin(), answer.end()));
        PSD_LOG_INFO("all-reduce: rank {}'s replacement asks to come back into the ring; this "
                     "agent's all-reduces wait from iteration {} until it names its first",
                     rank, hold);
        // Its first iteration; a newer replacement's question (a new nonce) is answered afresh.
        const absl::Time give_up = absl::Now() + patience;
        uint64_t from = 0;
        std::string renewed;
        while (from == 0 && renewed.empty()) {
          try {
            asked.wait({"from"}, std::chrono::milliseconds(200));
            const std::vector<char> v = asked.get("from");
            const std::vector<std::string> f =
                absl::StrSplit(absl::string_view(v.data(), v.size()), ' ');
            if (f.size() != 2 || !absl::SimpleAtoi(f[0], &from) || from == 0) {
              return abandon("its first iteration is not a number");
            }
            const std::vector<std::string> heard = absl::StrSplit(f[1], ',');
            if (std::find(heard.begin(), heard.end(), id) == heard.end()) {
              from = 0;  // an earlier replacement's word (it asked under the same nonce)
              throw std::runtime_error("stale");
            }
          } catch (const std::exception&) {
            if (const Off why = off(); why != Off::kNo) return stop_waiting(why);
            if (absl::Now() > give_up) {
              return abandon(absl::StrCat("it named no first iteration within ",
                                          absl::FormatDuration(patience)));
            }
            if (std::string now = read_question(std::chrono::milliseconds(1)).first;
                !now.empty() && now != nonce) {
              renewed = now;
            }
          }
        }
        if (!renewed.empty()) {
          nonce = renewed;
          continue;
        }
        return JoinReturned(rank, removed, nonce, from, expect);
      }
    } catch (const std::exception& e) {
      return abandon(e.what());
    }
  }

  // TakeBack, once the replacement named its first iteration `from`: the iterations below it go
  // on in the current ring; the ring with the rank is connected and takes those from it on.
  void JoinReturned(uint32_t rank, bool removed, const std::string& nonce, uint64_t from,
                    const std::set<uint32_t>& expect) {
    auto next = std::make_shared<Ring>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!back_.has_value() || back_->rank != rank) return;
      back_->from = from;
      next->generation = ring_->generation + 1;
      next->removed = removed_;
      next->removed.erase(rank);
    }
    ring_cv_.notify_all();
    for (uint32_t r = 0; r < env_.config->world_size; ++r) {
      if (next->removed.contains(r)) continue;
      if (r == env_.config->rank) next->index = static_cast<uint32_t>(next->members.size());
      next->members.push_back(r);
    }
    const absl::Status s = ConnectRing(*next, absl::StrCat("return-", rank, "-", nonce, "/ring"),
                                       absl::Now() + 2 * env_.config->sync_timeout, &expect);
    std::lock_guard<std::mutex> lock(mu_);
    if (!s.ok() || !back_.has_value() || back_->rank != rank) {
      if (back_.has_value() && back_->rank == rank) back_.reset();
      PSD_LOG_WARN("all-reduce: rank {}'s replacement did not come into the ring ({}); the "
                   "all-reduces go on in {}",
                   rank, s.ok() ? "it was removed again" : s.message(), ring_->Describe());
      ring_cv_.notify_all();
      return;
    }
    if (removed) {
      next->from = from;
      next->older = ring_;
      ring_->older = nullptr;  // every unit is past the ring before it (no chain of rings)
    }
    removed_.erase(rank);
    ring_ = next;
    ++returns_;
    back_.reset();
    PSD_LOG_WARN("all-reduce: rank {} is back in {} (ring generation {}): the all-reduces of "
                 "iteration {} on go in it", rank, next->Describe(), next->generation, from);
    ring_cv_.notify_all();
  }

  // The ring job iteration `job` of a unit goes in (mu_ held): the current ring, or the one
  // before it below the iteration a returning rank came in at; null while it is not at least
  // `generation` or failed, or while the iteration waits for a returning rank (TakeBack).
  std::shared_ptr<Ring> UsableLocked(uint32_t generation, uint64_t job) const {
    if (back_.has_value() && back_->answered && job >= back_->hold_from &&
        (back_->from == 0 || job >= back_->from)) {
      return nullptr;
    }
    std::shared_ptr<Ring> r = ring_;
    if (r != nullptr && job < r->from) r = r->older;
    if (r == nullptr || r->generation < generation || r->failed) return nullptr;
    return r;
  }

  // The ring for job iteration `job` once it is at least `generation` and not failed
  // (UsableLocked), counted in flight; null with why when the keeper failed, the syncer stops,
  // or `deadline` passed.
  std::shared_ptr<Ring> AcquireRing(uint32_t generation, uint64_t job, absl::Time deadline,
                                    absl::Status* why) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto until = absl::ToChronoTime(deadline);
    std::shared_ptr<Ring> ring;
    const bool ready = ring_cv_.wait_until(lock, until, [&] {
      if (stopping_ || !broken_.ok()) return true;
      ring = UsableLocked(generation, job);
      return ring != nullptr;
    });
    if (stopping_) {
      *why = absl::CancelledError("the agent stops");
      return nullptr;
    }
    if (!broken_.ok()) {
      *why = broken_;
      return nullptr;
    }
    if (!ready) {
      *why = absl::DeadlineExceededError(
          back_.has_value() && back_->answered
              ? absl::StrCat("iteration ", job, " waited ", absl::FormatDuration(
                                 3 * env_.config->sync_timeout), " for the ring with rank ",
                             back_->rank, " coming back")
              : absl::StrCat("no ring without the lost rank came within ",
                             absl::FormatDuration(3 * env_.config->sync_timeout), " (",
                             removed_.size(), " ranks removed from the job; --min_workers ",
                             env_.config->min_workers, ")"));
      return nullptr;
    }
    ++ring->in_flight;
    started_ = std::max(started_, job);
    return ring;
  }

  // A collective on `ring` ended (`ok`: it completed; `job`: the iteration it completed).
  void ReleaseRing(const std::shared_ptr<Ring>& ring, bool ok, uint64_t job = 0) {
    std::shared_ptr<Ring> close;
    {
      std::lock_guard<std::mutex> lock(mu_);
      --ring->in_flight;
      if (ok) completed_ = std::max(completed_, job);
      if (!ok || ring->failed) close = FailLocked(ring);
    }
    if (close) CloseRing(*close);
    if (!ok) ring_cv_.notify_all();
  }

  // Divides the members of a unit that average (PSD_LAYER_AVERAGE) by the ranks summed.
  void Average(const Unit& unit, float* span, size_t ranks) const {
    const float scale = 1.0f / static_cast<float>(ranks);
    const uint64_t base = env_.table->layers[unit.first].layout.grad_offset;
    for (uint32_t member : unit.members) {
      const LayerSpec& spec = env_.table->layers[member];
      if (!spec.desc.average) continue;
      float* v = span + (spec.layout.grad_offset - base) / sizeof(float);
      for (uint64_t i = 0; i < spec.desc.elements; ++i) v[i] *= scale;
    }
  }

  // One all-reduce of a unit in an elastic job (the file's comment): on the current ring, again
  // on the next one after a failure, each time from the gradient posted. `ring_out`: the ring it
  // completed in (its size and neighbours for the telemetry).
  absl::Status ElasticReduce(const Post& post, const Unit& unit,
                             std::shared_ptr<Ring>* ring_out) {
    float* grad = env_.shm->Grad(post.layer);
    const size_t n = unit.elements;
    const uint64_t job = post.iteration + env_.clock_base;
    UnitProgress& at = progress_[unit_of_[post.layer]];
    if (at.input.size() != n) {
      at.input.assign(n, 0.0f);
      at.result.assign(n, 0.0f);
    }
    std::copy(grad, grad + n, at.input.begin());
    // A failed collective ends within a sync timeout, a new ring connects within two (Keep).
    const absl::Time deadline = absl::Now() + 3 * env_.config->sync_timeout;
    uint32_t generation = 0;
    absl::Status first;  // the first failure (the one to report)
    while (true) {
      absl::Status why;
      std::shared_ptr<Ring> ring = AcquireRing(generation, job, deadline, &why);
      if (ring == nullptr) {
        return first.ok() ? why : Annotate(first, absl::StrCat("and then ", why.message()));
      }
      bool handed_over = false;
      absl::Status s;
      if (ring->members.size() < 2) {
        // Alone: the sum over the ranks left is this rank's gradient (its own from the input).
      } else if (at.generation != ring->generation) {
        s = Where(*ring, job, post, unit, at, &handed_over);
        if (s.ok()) at.generation = ring->generation;
      }
      if (s.ok() && !handed_over && ring->members.size() > 1) {
        s = SumInRing(*ring, grad, n, post.layer);
        if (s.ok() && env_.allreduce_fault) s = env_.allreduce_fault(unit.first, post.iteration);
        if (s.ok()) Average(unit, grad, ring->members.size());
      }
      ReleaseRing(ring, s.ok(), job);
      if (s.code() == absl::StatusCode::kInternal) return Annotate(s, ring->Describe());
      if (s.ok()) {
        at.done = job;
        at.fresh = false;
        std::copy(grad, grad + n, at.result.begin());
        *ring_out = std::move(ring);
        return absl::OkStatus();
      }
      if (first.ok()) first = Annotate(s, ring->Describe());
      PSD_LOG_WARN("all-reduce of {} iteration {} failed in {} ({}): it goes again in the ring "
                   "of the ranks left", unit.name, post.iteration, ring->Describe(), s.message());
      if (!AwaitShut(*ring, deadline)) {
        return Annotate(first, absl::StrCat("and then the failed ring's other collectives did "
                                            "not end within ",
                                            absl::FormatDuration(env_.config->sync_timeout)));
      }
      std::copy(at.input.begin(), at.input.end(), grad);
      generation = ring->generation + 1;
    }
  }

  // The first collective of a unit on a new ring (elastic jobs): where the ranks are with it, and
  // the hand-over of the highest completed iteration's result to the ranks without it.
  // `handed_over`: this rank's post completed with it.
  // `job`: the post's job iteration. A rank coming back (UnitProgress::fresh) holds no result:
  // it never sends one.
  absl::Status Where(Ring& ring, uint64_t job, const Post& post, const Unit& unit,
                     UnitProgress& at, bool* handed_over) {
    // Kept with the options (a failed exchange's buffer is parked with them).
    auto keys = std::make_shared<std::array<uint64_t, 2>>(std::array<uint64_t, 2>{
        at.fresh ? at.done << kWhereIndexBits : WhereKey(at.done, ring.index), ~at.done});
    {
      auto opts = std::make_unique<gloo::AllreduceOptions>(ring.context);
      opts->setOutput(keys->data(), 2);
      opts->setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::max<uint64_t>));
      opts->setTag(kWhereTagBase + unit.first);
      opts->setTimeout(Millis(env_.config->sync_timeout));
      RETURN_IF_ERROR(RunInRing(
          ring, std::move(opts), [](gloo::AllreduceOptions& o) { gloo::allreduce(o); },
          "where the ranks are: ", keys));
    }
    const UnitWhere where = DecodeWhere((*keys)[0], (*keys)[1]);
    if (where.lowest == where.highest) return absl::OkStatus();  // all alike
    if (where.highest > where.lowest + 1 || at.done + 1 < where.highest ||
        where.sender >= ring.members.size()) {
      return absl::InternalError(absl::StrCat(
          "the ranks of ", ring.Describe(), " are ", where.highest - where.lowest,
          " iterations apart on ", unit.name, " (completed ", where.lowest, " to ", where.highest,
          "): more than BSP allows"));
    }
    const bool lacks = at.done < where.highest;
    if (lacks && job != where.highest) {
      return absl::InternalError(absl::StrCat("iteration ", where.highest, " of ", unit.name,
                                              " came from another rank while this one posted ",
                                              job));
    }
    float* out = lacks ? env_.shm->Grad(post.layer) : at.result.data();
    auto opts = std::make_unique<gloo::BroadcastOptions>(ring.context);
    opts->setOutput(out, unit.elements);
    opts->setRoot(static_cast<int>(where.sender));
    opts->setTag(kHandOverTagBase + unit.first);
    opts->setTimeout(Millis(env_.config->sync_timeout));
    RETURN_IF_ERROR(RunInRing(ring, std::move(opts),
                              [](gloo::BroadcastOptions& o) { gloo::broadcast(o); },
                              absl::StrCat("handing over iteration ", where.highest, ": ")));
    if (lacks) {
      *handed_over = true;
      PSD_LOG_WARN("all-reduce of {} iteration {}: rank {} completed it before the ring lost a "
                   "rank and handed its result over", unit.name, where.highest,
                   ring.members[where.sender]);
    }
    return absl::OkStatus();
  }

  // The neighbours in the first ring (every rank).
  uint32_t Left() const {
    const uint32_t w = env_.config->world_size;
    return (env_.config->rank + w - 1) % w;
  }
  uint32_t Right() const { return (env_.config->rank + 1) % env_.config->world_size; }

  // Queues the layer for a pool thread; a new thread when every one is busy.
  void Launch(const Post& post) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      queue_.push_back(post);
      if (queue_.size() > idle_) threads_.emplace_back([this] { Loop(); });
    }
    cv_.notify_one();
  }

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ++idle_;
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      --idle_;
      if (stopping_) return;
      const Post post = queue_.front();
      queue_.pop_front();
      running_.insert(post.layer);
      const absl::Status broken = broken_;
      lock.unlock();

      const absl::Time start = absl::Now();
      const Unit& unit = units_[unit_of_[post.layer]];
      const auto found = lossy_.find(post.layer);
      LossyRing* const ring = found == lossy_.end() ? nullptr : found->second.get();
      const auto low = lowrank_.find(post.layer);
      LowRankUnit* const lr = low == lowrank_.end() ? nullptr : low->second.get();
      bool factored = false;  // this all-reduce sent low-rank factors
      std::shared_ptr<Ring> in;  // the ring it completed in (elastic jobs)
      absl::Status s = !broken.ok() ? broken
                       : elastic_   ? ElasticReduce(post, unit, &in)
                                    : Reduce(post, unit, ring, lr, &factored);
      if (s.ok() && !elastic_) Average(unit, env_.shm->Grad(post.layer), env_.config->world_size);
      const uint64_t bytes = unit.elements * sizeof(float);
      // What went on the wire: half the bytes while the layer is lossy (one that fell back in
      // this Reduce sent float32; this thread is the only one using the entry now), the factors
      // and the plain ranges at low rank.
      const uint64_t wire_bytes =
          factored ? (lr->first.size() + lr->second.size()) * sizeof(float)
          : ring != nullptr && !ring->exact ? bytes / 2
                                            : bytes;
      if (env_.timeline) {
        env_.timeline->Span("allreduce", post.layer, unit.name, post.iteration, start,
                            absl::Now());
      }
      if (s.ok() && env_.metrics.allreduce_bytes) {
        env_.metrics.allreduce_bytes->Increment(static_cast<double>(bytes));
      }
      if (s.ok() && env_.telemetry) {
        // The ring's bytes: 2 (P - 1) / P of the gradient to the right neighbour, as much from
        // the left (`poseidon status`'s peer links).
        const auto w = static_cast<uint32_t>(in ? in->members.size() : env_.config->world_size);
        const uint64_t moved = 2 * (w - 1) * wire_bytes / w;
        env_.telemetry->AddPeerBytes(in ? in->Right() : Right(), moved, 0);
        env_.telemetry->AddPeerBytes(in ? in->Left() : Left(), 0, moved);
      }
      if (s.ok() && post.on_device) {  // a layer of its own (buckets are host memory)
        s = env_.stager->load(std::memory_order_acquire)
                ->StageIn(post.layer,
                          {env_.table->layers[post.layer].layout.grad_offset, bytes});
      }
      {
        std::lock_guard<std::mutex> relock(mu_);
        running_.erase(post.layer);
        // After a failed collective the ring's state is unknown: every later one fails too.
        if (!s.ok() && broken_.ok()) broken_ = s;
      }
      for (uint32_t member : unit.members) env_.finished(member, post.iteration, 0, s);
      lock.lock();
    }
  }

  // One Gloo all-reduce (sum) of `count` floats in place in the first ring (or in `context`),
  // bounded by sync_timeout; Gloo's exception as UNAVAILABLE.
  absl::Status Sum(float* data, size_t count, uint32_t tag) {
    return Sum(context_, data, count, tag);
  }
  absl::Status Sum(const std::shared_ptr<gloo::Context>& context, float* data, size_t count,
                   uint32_t tag) {
    try {
      gloo::AllreduceOptions opts(context);
      opts.setOutput(data, count);
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setTag(tag);
      opts.setTimeout(Millis(env_.config->sync_timeout));
      gloo::allreduce(opts);
    } catch (const std::exception& e) {
      return absl::UnavailableError(e.what());
    }
    return absl::OkStatus();
  }

  // The state of every all-reduce-capable layer on a lossy wire. A layer with fewer elements than
  // ranks (a shard would be empty) stays float32: it saves nothing.
  absl::Status PrepareLossy() {
    const uint32_t world = env_.config->world_size, rank = env_.config->rank;
    if (env_.table->layers.size() >= kGatherTagBase) {
      return absl::InvalidArgumentError(absl::StrCat(
          "all-reduce: ", env_.table->layers.size(), " layers; at most ", kGatherTagBase - 1));
    }
    size_t lossy = 0;
    for (const Unit& unit : units_) {
      // A bucket's members share one wire.
      const LayerSpec& spec = env_.table->layers[unit.first];
      if (!spec.allreduce_capable || !IsLossy(spec.wire) || unit.elements < world) continue;
      if (AnyLowRank(unit)) continue;  // factored instead (PrepareLowRank)
      auto ring = std::make_unique<LossyRing>();
      ring->type = spec.wire;
      const uint64_t n = unit.elements;
      for (uint32_t j = 0; j < world; ++j) {
        const uint64_t begin = n * j / world, end = n * (j + 1) / world;
        if (j == rank) ring->own_begin = begin;
        ring->shard.push_back(end - begin);
      }
      ring->residual.assign(n, 0.0f);
      ring->owner_residual.assign(ring->shard[rank], 0.0f);
      ring->send.resize(n);
      ring->received.resize(ring->shard[rank] * world);
      ring->gathered.resize(n);
      ring->sum.resize(ring->shard[rank]);
      lossy_[unit.first] = std::move(ring);
      ++lossy;
    }
    if (lossy > 0) {
      PSD_LOG_INFO("all-reduce: {} layers or buckets on a lossy wire when on the ring (float32 "
                   "sums by shard, error feedback)", lossy);
    }
    return absl::OkStatus();
  }

  bool AnyLowRank(const Unit& unit) const {
    return std::any_of(unit.members.begin(), unit.members.end(),
                       [&](uint32_t l) { return env_.table->layers[l].lowrank > 0; });
  }

  // The state of every unit with low-rank members (LayerSpec::lowrank: the layer table chose
  // them); such a unit is not on the 16-bit path (PrepareLossy leaves it out).
  void PrepareLowRank() {
    size_t layers = 0, full = 0, sent = 0;
    for (const Unit& unit : units_) {
      if (!AnyLowRank(unit)) continue;
      auto lr = std::make_unique<LowRankUnit>();
      const uint64_t base = env_.table->layers[unit.first].layout.grad_offset;
      size_t covered = 0, p = 0, q = 0;
      for (uint32_t member : unit.members) {
        const LayerSpec& spec = env_.table->layers[member];
        if (spec.lowrank == 0) continue;
        const size_t offset = (spec.layout.grad_offset - base) / sizeof(float);
        if (offset > covered) lr->plain.emplace_back(covered, offset - covered);
        LowRankLayer compressor(spec.lowrank_view, spec.lowrank, member);
        lr->members.push_back({member, offset, p, q, std::move(compressor)});
        p += lr->members.back().compressor.p_size();
        q += lr->members.back().compressor.q_size();
        covered = offset + spec.desc.elements;
      }
      if (covered < unit.elements) lr->plain.emplace_back(covered, unit.elements - covered);
      size_t plain = 0;
      for (const auto& range : lr->plain) plain += range.second;
      lr->first.resize(p + plain);
      lr->plain_elements = plain;
      lr->second.resize(q);
      layers += lr->members.size();
      full += unit.elements;
      sent += lr->first.size() + lr->second.size();
      lowrank_[unit.first] = std::move(lr);
    }
    if (layers > 0) {
      PSD_LOG_INFO("all-reduce: {} layers at low rank (PowerSGD, error feedback; exact for the "
                   "first {} all-reduces): {} of {} floats per iteration in {} units", layers,
                   env_.config->lowrank_warmup, sent, full, lowrank_.size());
    }
  }

  // Adds each low-rank member's residual to its gradient and releases it (the first exact
  // all-reduce after the fallback carries what the compressors held back).
  void ReleaseLowRank(LowRankUnit& lr, float* grad) {
    for (LowRankUnit::Member& m : lr.members) {
      const std::span<const float> held = m.compressor.residual();
      for (size_t i = 0; i < held.size(); ++i) grad[m.offset + i] += held[i];
      m.compressor.ReleaseResidual();
    }
    lr.first = {};
    lr.second = {};
    lr.check = {};
    lr.released = true;
  }

  // One all-reduce of a unit with low-rank members (the file's comment). `factored`: whether it
  // sent the factors (not in warm-up, not exact).
  absl::Status LowRankReduce(const Post& post, const Unit& unit, LowRankUnit& lr,
                             bool* factored) {
    float* grad = env_.shm->Grad(post.layer);
    const uint32_t world = env_.config->world_size;
    ++lr.clock;
    if (lr.exact) {
      if (!lr.released) ReleaseLowRank(lr, grad);
      return Sum(grad, unit.elements, post.layer);
    }
    if (lr.clock <= env_.config->lowrank_warmup) return Sum(grad, unit.elements, post.layer);
    *factored = true;
    const uint64_t compressed = lr.clock - env_.config->lowrank_warmup;
    const bool check = ShouldCheckWire(env_.wire_guard, compressed);
    if (check) {
      // The sketches of the gradients (then of the residuals), by index among the members.
      lr.check.assign(2 * kSketchSlots, 0.0f);
      size_t index = 0;
      for (const LowRankUnit::Member& m : lr.members) {
        const size_t n = m.compressor.rows() * m.compressor.cols();
        AddToSketch({grad + m.offset, n}, index, {lr.check.data(), kSketchSlots});
        index += n;
      }
    }
    for (LowRankUnit::Member& m : lr.members) {
      const size_t n = m.compressor.rows() * m.compressor.cols();
      m.compressor.Project({grad + m.offset, n}, {lr.first.data() + m.p_offset,
                                                  m.compressor.p_size()});
    }
    const size_t plain_begin = lr.first.size() - lr.plain_elements;
    size_t at = plain_begin;
    for (const auto& [offset, n] : lr.plain) {
      std::copy(grad + offset, grad + offset + n, lr.first.begin() + at);
      at += n;
    }
    if (const absl::Status s = Sum(lr.first.data(), lr.first.size(), post.layer); !s.ok()) {
      return Annotate(s, "summing the P factors");
    }
    at = plain_begin;
    for (const auto& [offset, n] : lr.plain) {
      std::copy(lr.first.begin() + at, lr.first.begin() + at + n, grad + offset);
      at += n;
    }
    for (LowRankUnit::Member& m : lr.members) {
      m.compressor.ProjectBack({lr.first.data() + m.p_offset, m.compressor.p_size()},
                               {lr.second.data() + m.q_offset, m.compressor.q_size()});
    }
    if (const absl::Status s =
            Sum(lr.second.data(), lr.second.size(), kGatherTagBase + post.layer);
        !s.ok()) {
      return Annotate(s, "summing the Q factors");
    }
    for (LowRankUnit::Member& m : lr.members) {
      const size_t n = m.compressor.rows() * m.compressor.cols();
      m.compressor.Reconstruct({lr.first.data() + m.p_offset, m.compressor.p_size()},
                               {lr.second.data() + m.q_offset, m.compressor.q_size()}, world,
                               {grad + m.offset, n});
    }
    if (!check) return absl::OkStatus();
    size_t index = 0;
    for (const LowRankUnit::Member& m : lr.members) {
      const std::span<const float> held = m.compressor.residual();
      AddToSketch(held, index, {lr.check.data() + kSketchSlots, kSketchSlots});
      index += held.size();
    }
    // The same sums on every rank: every rank reaches the same verdict without a vote.
    if (const absl::Status s = Sum(lr.check.data(), lr.check.size(), kVoteTagBase + post.layer);
        !s.ok()) {
      return Annotate(s, "the divergence guard's sum of the sketches");
    }
    const double ratio = SketchedHeldBackRatio({lr.check.data() + kSketchSlots, kSketchSlots},
                                               {lr.check.data(), kSketchSlots});
    if (!(ratio <= env_.config->lowrank_max_held)) {
      PSD_LOG_WARN("{} (all-reduce): the low-rank compressors hold back {:.3g} times the "
                   "gradient's norm at all-reduce {} (limit {}): falling back to the exact "
                   "all-reduce for the rest of the job (the next one carries what was held back)",
                   unit.name, ratio, lr.clock, env_.config->lowrank_max_held);
      lr.exact = true;
      if (env_.telemetry) {
        for (const LowRankUnit::Member& m : lr.members) env_.telemetry->LayerWireFellBack(m.layer);
      }
    }
    return absl::OkStatus();
  }

  // The guard's vote on a sampled all-reduce: whether any rank's encoding diverged.
  absl::StatusOr<bool> AnyDiverged(bool mine, uint32_t layer) {
    float votes = mine ? 1.0f : 0.0f;
    RETURN_IF_ERROR(Sum(&votes, 1, kVoteTagBase + layer));
    return votes > 0;
  }

  // One lossy all-reduce (the file's comment): alltoallv of the encoded shards, a float32 sum of
  // this rank's shard, allgatherv of the encoded sums, decoded in place.
  absl::Status LossyReduce(const Post& post, const Unit& unit, LossyRing& ring) {
    const uint32_t world = env_.config->world_size, rank = env_.config->rank;
    float* grad = env_.shm->Grad(post.layer);
    const size_t n = unit.elements;
    const std::span<float> values(grad, n);
    ++ring.clock;
    if (!ring.exact) {
      EncodeWithFeedback(ring.type, values, ring.residual, ring.send);
      if (ShouldCheckWire(env_.wire_guard, ring.clock)) {
        const double error = RelativeWireError(ring.type, values, ring.send);
        const bool mine = WireDiverged(env_.wire_guard, error);
        if (mine) {
          PSD_LOG_WARN("{} (all-reduce): the {} wire's error is {:.3g} of the gradient's norm at "
                       "all-reduce {} (limit {})", unit.name, WireName(ring.type), error,
                       ring.clock, env_.wire_guard.max_error);
        }
        ASSIGN_OR_RETURN(const bool any, AnyDiverged(mine, post.layer));
        if (any) {
          PSD_LOG_WARN("{} (all-reduce): the divergence guard of {} fell back from the {} wire at "
                       "all-reduce {}: falling back to float32 (exact) for the rest of the job",
                       unit.name, mine ? "this rank" : "another rank", WireName(ring.type),
                       ring.clock);
          ring.exact = true;
          if (env_.telemetry) {
            for (uint32_t member : unit.members) env_.telemetry->LayerWireFellBack(member);
          }
          // This all-reduce goes as float32 with what the roundings held back: the gradient plus
          // this rank's residual (decode(send) + new residual), and on its own shard the
          // residual of its sums (added once: only the owner holds it).
          for (size_t i = 0; i < n; ++i) {
            values[i] = FromWire16(ring.type, ring.send[i]) + ring.residual[i];
          }
          for (size_t i = 0; i < ring.owner_residual.size(); ++i) {
            values[ring.own_begin + i] += ring.owner_residual[i];
          }
          ring.residual = {};
          ring.owner_residual = {};
          ring.send = {};
          ring.received = {};
          ring.gathered = {};
          ring.sum = {};
        }
      }
    }
    if (ring.exact) return Sum(grad, n, post.layer);
    try {
      gloo::AlltoallvOptions scatter(context_);
      std::vector<int64_t> out_counts(world);
      std::vector<int64_t> in_counts(world, static_cast<int64_t>(ring.shard[rank]));
      for (uint32_t j = 0; j < world; ++j) out_counts[j] = static_cast<int64_t>(ring.shard[j]);
      scatter.setInput(ring.send.data(), out_counts);
      scatter.setOutput(ring.received.data(), in_counts);
      scatter.setTag(post.layer);
      scatter.setTimeout(Millis(env_.config->sync_timeout));
      gloo::alltoallv(scatter);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("exchanging the shards (alltoallv): ", e.what()));
    }
    // The shard's sum in float32, in rank order (deterministic, as a server's).
    const size_t mine = ring.shard[rank];
    SumShardWithFeedback(ring.type, ring.received, ring.sum, ring.owner_residual,
                         std::span<uint16_t>(ring.send.data() + ring.own_begin, mine));
    try {
      gloo::AllgathervOptions gather(context_);
      gather.setInput(ring.send.data() + ring.own_begin, mine);
      gather.setOutput(ring.gathered.data(), ring.shard);
      gather.setTag(kGatherTagBase + post.layer);
      gather.setTimeout(Millis(env_.config->sync_timeout));
      gloo::allgatherv(gather);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("gathering the sums (allgatherv): ", e.what()));
    }
    DecodeWire16(ring.type, ring.gathered, values);
    return absl::OkStatus();
  }

  // The unit's all-reduce (post.layer is its first layer); `ring` its lossy state (null: float32).
  absl::Status Reduce(const Post& post, const Unit& unit, LossyRing* ring, LowRankUnit* lr,
                      bool* factored) {
    const bool sixteen = ring != nullptr && !ring->exact;
    // The first layer is the tag: unique among the collectives running (one iteration a unit).
    const absl::Status s =
        lr != nullptr     ? LowRankReduce(post, unit, *lr, factored)
        : ring != nullptr ? LossyReduce(post, unit, *ring)
                          : Sum(env_.shm->Grad(post.layer), unit.elements, post.layer);
    const std::string what =
        unit.members.size() > 1
            ? absl::StrCat("layers ", unit.members.front(), "-", unit.members.back())
            : absl::StrCat("layer ", post.layer);
    return Annotate(s, absl::StrCat("all-reduce of ", what, " (", unit.name, ") iteration ", post.iteration, " in the Gloo ring of ",
                                 env_.config->world_size, " ranks (neighbours: ranks ", Left(),
                                 " and ", Right(), ")",
                                 sixteen ? absl::StrCat(", ", WireName(ring->type),
                                                        " wire")
                                 : *factored ? ", low rank"
                                             : ""));
  }

  SyncEnv& env_;
  const bool elastic_;  // --min_workers: rings of the ranks left (the file's comment)
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;  // set in Ready, before any layer is posted
  // The units, and each layer's (built at construction, then only read).
  std::vector<Unit> units_;
  std::vector<uint32_t> unit_of_;
  // Lossy units by first layer: built in Ready, then the map is only read and each entry is used
  // by the thread running its unit (one iteration of a unit at a time).
  std::map<uint32_t, std::unique_ptr<LossyRing>> lossy_;
  // Units with low-rank members by first layer, likewise.
  std::map<uint32_t, std::unique_ptr<LowRankUnit>> lowrank_;
  // The buckets' members ready so far in their current iteration (the main thread's).
  struct Gathering {
    uint64_t iteration = UINT64_MAX;
    size_t waiting = 0;
  };
  std::vector<Gathering> gathering_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Post> queue_;           // posted, waiting for a thread
  std::vector<std::thread> threads_;  // the pool (grows; joined by Stop)
  size_t idle_ = 0;                  // threads waiting for work
  std::set<uint32_t> running_;       // units in the ring now (by first layer)
  absl::Status broken_;              // the first failure: every later all-reduce fails with it
  bool stopping_ = false;
  std::shared_ptr<Ring> ring_;       // the current ring (Ready; elastic jobs: the keeper's)
  std::set<uint32_t> removed_;       // the ranks removed from the job (PeerRemoved)
  std::condition_variable ring_cv_;  // removed_, ring_ or broken_ changed, or stopping_
  std::thread keeper_;               // elastic jobs: connects the rings of the ranks left
  // A rank coming back into the ring (PeerReturning, TakeBack).
  struct Return {
    uint32_t rank = 0;
    bool answered = false;   // this agent answered its replacement's question
    uint64_t hold_from = 0;  // answered: this agent's all-reduces from this job iteration wait
    uint64_t from = 0;       // the iteration it takes up (0: not yet named)
    bool awaiting_removal = false;  // its servers removed it: the ring left it out on its
                                    // question (TakeBack), not on the coordinator's word
  };
  std::optional<Return> back_;
  uint64_t started_ = 0;    // the highest job iteration a unit's collective started in a ring
  uint64_t completed_ = 0;  // the highest job iteration a unit completed
  uint32_t returns_ = 0;    // returns completed: part of every later ring's rendezvous prefix
  // This agent is a replacement coming back (ComeBack, then Ready): the keys of its question
  // ("return-<rank>-<nonce>"), the ring's ranks it joins and the live agents' returns count.
  std::string came_back_;
  std::vector<uint32_t> back_members_;
  uint32_t back_returns_ = 0;
  std::vector<std::string> back_ids_;  // the live agents' answers (their ids)
  uint64_t named_ = 0;                 // the iteration it named (TakeUpAt)
  // The rendezvous prefix of this job's world (SyncEnv::ring_world; a replacement coming back:
  // the live agents'). Set in Ready or ComeBack, then only read.
  std::string world_;
  // Elastic jobs, by unit: each used only by the thread running the unit.
  std::vector<UnitProgress> progress_;
};

absl::StatusOr<uint64_t> AllreduceSyncer::ComeBack(absl::Time deadline) {
  bool any = false;
  for (const LayerSpec& l : env_.table->layers) any |= l.allreduce_capable;
  if (!any || env_.rendezvous == nullptr || env_.config->world_size < 2) return uint64_t{0};
  if (!elastic_) {
    return absl::FailedPreconditionError(
        "this job's plan runs layers by ring all-reduce, and a ring takes a rank back only in a "
        "job that may shrink (--min_workers)");
  }
  const uint32_t me = env_.config->rank;
  std::mt19937_64 random(std::random_device{}());
  const std::string nonce = absl::StrCat(absl::Hex(random(), absl::kZeroPad16));
  const std::string keys = absl::StrCat("return-", me, "-", nonce);
  struct Answer {
    uint32_t returns = 0;
    uint64_t started = 0, completed = 0;
    bool removed = false;
    std::vector<uint32_t> members;
    std::string id, world;
  };
  std::map<uint32_t, Answer> answers;
  std::vector<uint32_t> members;  // the live agents' ring (from the first answer)
  try {
    gloo::rendezvous::PrefixStore root(absl::StrCat("return-", me), *env_.rendezvous);
    // The question: its nonce, and whether its KV servers removed this rank (the live agents
    // then answer once they removed it too).
    const std::string question = absl::StrCat(nonce, " ", env_.removed_by_servers ? 1 : 0);
    root.set("nonce", std::vector<char>(question.begin(), question.end()));
    gloo::rendezvous::PrefixStore asked(keys, *env_.rendezvous);
    while (true) {
      std::vector<uint32_t> waiting;
      for (uint32_t r = 0; r < env_.config->world_size; ++r) {
        if (r == me || answers.contains(r)) continue;
        if (members.empty() || std::find(members.begin(), members.end(), r) != members.end()) {
          waiting.push_back(r);
        }
      }
      if (!members.empty() && waiting.empty()) break;
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "all-reduce: rank ", me, " asked the live agents where their all-reduces are to come "
            "back into their ring, and rank", waiting.size() > 1 ? "s " : " ",
            absl::StrJoin(waiting, ", "), " did not answer by ", absl::FormatTime(deadline)));
      }
      for (uint32_t r : waiting) {
        const std::string key = absl::StrCat("where/", r);
        std::vector<char> value;
        try {
          asked.wait({key}, std::chrono::milliseconds(members.empty() ? 50 : 200));
          value = asked.get(key);
        } catch (const std::exception&) {
          continue;
        }
        const std::vector<std::string> f =
            absl::StrSplit(absl::string_view(value.data(), value.size()), ' ');
        Answer a;
        uint32_t removed = 0;
        bool ok = f.size() == 7 && absl::SimpleAtoi(f[0], &a.returns) &&
                  absl::SimpleAtoi(f[1], &a.started) && absl::SimpleAtoi(f[2], &a.completed) &&
                  absl::SimpleAtoi(f[3], &removed) && removed <= 1;
        for (absl::string_view m : absl::StrSplit(ok ? f[4] : "", ',', absl::SkipEmpty())) {
          uint32_t rank = 0;
          ok = ok && absl::SimpleAtoi(m, &rank) && rank < env_.config->world_size;
          a.members.push_back(rank);
        }
        if (!ok || a.members.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "all-reduce: rank ", r, "'s answer to this rank coming back is not one ('",
              absl::CHexEscape(absl::string_view(value.data(), value.size())), "')"));
        }
        a.removed = removed == 1;
        a.id = f[5];
        a.world = f[6];
        if (members.empty()) {
          for (uint32_t m : a.members) {
            if (m != me) members.push_back(m);
          }
        }
        answers[r] = std::move(a);
      }
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("all-reduce: asking the live agents to come back into their ring: ",
                     e.what()));
  }
  const Answer& first = answers.begin()->second;
  uint64_t started = 0, completed = 0;
  for (const auto& [r, a] : answers) {
    if (a.members != first.members || a.returns != first.returns ||
        a.removed != first.removed || a.world != first.world) {
      return absl::UnavailableError(absl::StrCat(
          "all-reduce: the live agents answered this rank coming back from different rings "
          "(rank ", answers.begin()->first, ": ranks ", absl::StrJoin(first.members, ", "),
          "; rank ", r, ": ranks ", absl::StrJoin(a.members, ", "),
          "): a rank was removed or came back meanwhile; start it again"));
    }
    started = std::max(started, a.started);
    completed = std::max(completed, a.completed);
  }
  came_back_ = keys;
  world_ = first.world;
  back_ids_.clear();
  for (const auto& [r, a] : answers) back_ids_.push_back(a.id);
  back_members_ = members;
  back_members_.push_back(me);
  std::sort(back_members_.begin(), back_members_.end());
  back_returns_ = first.returns;
  // Removed: the live ranks hold their all-reduces from the iteration after the highest any
  // started. Rejoining in its predecessor's place: from the highest any completed (a rank that
  // completed it hands the result over to the others in the new ring).
  const uint64_t from = first.removed ? started + 1 : std::max<uint64_t>(completed, 1);
  PSD_LOG_INFO("all-reduce: the {} live agents answered (their all-reduces started up to "
               "iteration {}, completed up to {}): this rank {} the ring at iteration {} at the "
               "earliest", answers.size(), started, completed,
               first.removed ? "comes back into" : "rejoins", from);
  return from;
}

}  // namespace

std::unique_ptr<Syncer> MakeAllreduceSyncer(SyncEnv& env) {
  return std::make_unique<AllreduceSyncer>(env);
}

}  // namespace poseidon::agent
