// The agent's layer table: what it knows of each layer from the framework's registration and the
// plan (sizes, PS chunks, SFB shape), the buffer layout of the data segment shared with the
// framework, the fused buckets, and each layer's scheme by iteration (the schedule a plan change
// writes). Pure data and functions: the agent fills it once at registration; only the schedules
// change afterwards.
// Thread-safety: a LayerTable is immutable after BuildLayerTable; LayerSchedules belongs to the
// agent's main thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agent/lowrank.h"
#include "agent/shm_endpoint.h"
#include "common/shm_layout.h"
#include "common/wire_codec.h"
#include "poseidon/v1/plan.pb.h"

namespace poseidon::agent {

inline constexpr uint64_t kBufferAlign = PSD_SHM_ALIGN;

// "PS", "SFB", "all-reduce" for a PSD_SCHEME_* (logs and messages); "unknown" otherwise.
const char* SchemeName(uint32_t scheme);
inline constexpr uint64_t kMaxDataBytes = uint64_t{1} << 40;  // shared buffers of one worker

struct PsChunk {
  uint64_t key = 0;
  uint64_t offset = 0;  // bytes into the layer's gradient
  uint64_t length = 0;  // bytes
  uint32_t server = 0;  // index into the plan's servers
};

struct LayerSpec {
  LayerDesc desc;
  // Buffers in the data segment; layout.scheme and layout.priority are the first plan's.
  LayerLayout layout;
  // Every layer has its PS chunks (an SFB layer uses them if a later plan makes it PS).
  std::vector<PsChunk> chunks;
  // SFB: U is k x m, V is k x n; buffers for them exist when sfb_capable.
  uint64_t m = 0, n = 0, k = 0;
  bool sfb_capable = false;
  // The layer may run ring all-reduce (the job has peers and a rendezvous for them, no
  // server-side rule), now or after a plan change; never a bucket's member.
  bool allreduce_capable = false;
  int bucket = -1;  // the bucket it is fused into (then always PS), or -1
  // The all-reduce bucket it is fused into (then always all-reduce), or -1.
  int ring_group = -1;
  // What its PS keys carry (common/wire_codec.h): the first plan's LayerPlan.wire_type, or the
  // agent's --wire; fixed for the job (the servers' tables are registered with it).
  WireType wire = WireType::kF32;
  // Low rank (agent/lowrank.h): 0, or the rank its all-reduce sends its gradient at, viewed as
  // lowrank_view (a layer the first plan puts on all-reduce, whose 2-D view that rank shrinks);
  // such a layer stays on all-reduce (a plan moving it is refused: its residual lives there).
  uint32_t lowrank = 0;
  LowRankShape lowrank_view;
};

// Consecutive small PS layers fused into one key (DDP's bucketing): their gradients are adjacent
// in the data segment, so the bucket's key covers [first member's gradient, last one's end),
// alignment padding included (zeros, which sum to zeros).
struct BucketSpec {
  std::vector<uint32_t> members;  // layer indices, consecutive
  PsChunk chunk;                  // offset relative to the first member's gradient
  std::string name;               // "bucket fc1.bias .. fc3.bias"
  WireType wire = WireType::kF32;  // its members' (a bucket's members share one wire)
};

// Consecutive all-reduce layers fused into one collective (DDP's buckets): their gradients are
// adjacent in the data segment, so the collective covers [first member's gradient, last one's
// end), alignment padding included (zeros, which sum to zeros).
struct RingGroupSpec {
  std::vector<uint32_t> members;  // layer indices, consecutive
  uint64_t bytes = 0;             // from the first member's gradient
  std::string name;               // "all-reduce bucket fc1.bias .. fc3.bias"
};

struct LayerTable {
  std::vector<LayerSpec> layers;
  std::vector<BucketSpec> buckets;
  std::vector<RingGroupSpec> ring_groups;
  uint64_t data_bytes = 0;  // the data segment's size (at least kBufferAlign)
};

struct LayerTableOptions {
  uint32_t world_size = 1;
  // SFB layers are possible at all (peers known, no server-side rule, scheme not forced to PS).
  bool sfb_possible = true;
  // Every FC layer by SFB whatever the plan says (--scheme=sfb).
  bool force_sfb = false;
  // All-reduce is possible at all (several ranks, a coordinator for Gloo's rendezvous, no
  // server-side rule, scheme not forced to PS or SFB), and forced for every layer
  // (--scheme=allreduce).
  bool allreduce_possible = false;
  bool force_allreduce = false;
  // Fusion: the plan's buckets (LayerPlan.bucket, the planner's decision: docs/planner.md,
  // "Fusion"), or, when false, consecutive small PS layers up to bucket_bytes (0: no fusion).
  bool fusion_from_plan = false;
  uint64_t bucket_bytes = 0;
  // All-reduce buckets: runs of the first plan's all-reduce layers, at most this many bytes
  // (0: none).
  uint64_t allreduce_bucket_bytes = 0;
  // Wire precision: every layer's forced (--wire=fp32|bf16|fp16), or nullopt for the plan's
  // (LayerPlan.wire_type). A lossy wire needs the sum rule: without it (lossy_possible false) a
  // plan's lossy layer is float32 (every rank has the same rule, so all of them agree).
  std::optional<WireType> force_wire;
  bool lossy_possible = true;
  // Low rank: every first-plan all-reduce layer's rank (--lowrank_rank; 0: none), or nullopt for
  // the plan's (LayerPlan.lowrank_rank). Lossy: only with lossy_possible.
  std::optional<uint32_t> force_lowrank;
};

// Whether a layer keeps buffers for SFB, so that a later plan may switch it to SFB: an FC layer
// whose factors are no larger than its gradient (k (m + n) <= m n), or that the first plan puts
// on SFB. Larger factors never pay (the cost model would not choose them) and would only cost
// memory.
bool SfbCapable(const LayerDesc& desc, bool planned_sfb);

// From the framework's layers and the first plan (all-reduce where the job cannot run it
// becomes PS): validates the plan against the layers (one
// entry per layer, chunks inside the tensor, a multiple of 4 bytes), lays out the buffers (every
// layer's gradient, then U and V of SFB-capable layers, each 64-byte aligned, in layer order;
// more than kMaxDataBytes is refused) and forms the buckets (the plan's, at most its
// max_chunk_bytes each, or by options.bucket_bytes).
absl::StatusOr<LayerTable> BuildLayerTable(const std::vector<LayerDesc>& descs,
                                           const v1::Plan& plan, const LayerTableOptions& options);

// Fuses runs of at least two adjacent, fusable, single-chunk PS layers on one wire, smaller than bucket_bytes
// into buckets of at most bucket_bytes; sets the members' `bucket`. With `plan_buckets` (one entry
// per layer, LayerPlan.bucket) a run also ends wherever the plan's bucket number changes or is 0:
// the agent fuses what the plan says, split where it cannot (a layer not fusable or not adjacent).
std::vector<BucketSpec> FormBuckets(std::vector<LayerSpec>& layers, uint64_t bucket_bytes,
                                    const std::vector<uint32_t>* plan_buckets = nullptr);

// Fuses runs of at least two adjacent, fusable layers that the first plan puts on all-reduce, on
// one wire, into groups of at most `bytes` bytes; sets the members' `ring_group`.
std::vector<RingGroupSpec> FormRingGroups(std::vector<LayerSpec>& layers, uint64_t bytes);

// A layer's scheme by iteration: `before` for iterations < switch_at, `after` from switch_at on.
// Packed into one word (PSD_SCHEDULE_* in common/shm_layout.h), which the agent publishes in the
// layer's shared-memory entry for the framework.
struct Schedule {
  uint32_t before = PSD_SCHEME_PS;
  uint32_t after = PSD_SCHEME_PS;
  uint64_t switch_at = 0;
  uint32_t At(uint64_t iteration) const { return iteration >= switch_at ? after : before; }
  uint64_t Pack() const { return PSD_SCHEDULE_PACK(before, after, switch_at); }
  static Schedule Unpack(uint64_t word);
  static Schedule Fixed(uint32_t scheme) { return {scheme, scheme, 0}; }
};

// Every layer's schedule (the agent's main thread's: it posts the layers and applies the plans;
// the framework's copy is the shared-memory word ShmEndpoint::PublishSchedule writes).
class LayerSchedules {
 public:
  explicit LayerSchedules(size_t layers) : schedules_(layers, Schedule::Fixed(PSD_SCHEME_PS)) {}
  Schedule Get(uint32_t layer) const { return schedules_[layer]; }
  uint32_t At(uint32_t layer, uint64_t iteration) const { return Get(layer).At(iteration); }
  void Set(uint32_t layer, const Schedule& schedule) { schedules_[layer] = schedule; }
  size_t size() const { return schedules_.size(); }

 private:
  std::vector<Schedule> schedules_;
};

// A plan change for one layer: from iteration `switch_at` on it runs `scheme`. `next_post` is
// the next iteration the framework will post for the layer: it may already have read the
// schedule for that one (never for a later one), so the published word must not change for
// iterations up to next_post, and switch_at must be later than next_post.
struct ScheduleChange {
  enum Outcome {
    kApply,    // publish `schedule` (changed says whether it differs from the current one)
    kDefer,    // the current schedule still has a switch between next_post and switch_at:
               // compose again once the layer has posted past it
    kRefused,  // the layer keeps its scheme: `why` (cannot run it, or too late)
  };
  Outcome outcome = kApply;
  Schedule schedule;
  bool changed = false;
  std::string why;
};
ScheduleChange ComposeSchedule(const LayerSpec& layer, const Schedule& current, uint32_t scheme,
                               uint64_t switch_at, uint64_t next_post);

}  // namespace poseidon::agent
