// The HybComm planner: from a model spec and the cluster's parameters to a poseidon.v1.Plan (the
// scheme, chunks, servers and priority of every layer) and a report of predicted bytes and time.
// Thread-safety: BuildPlan is a pure function of its arguments, safe from any thread.
#pragma once

// What BuildPlan does (docs/planner.md):
//   1. Validates the cluster (ValidatePlannerConfig) and the model (ValidateModelSpec).
//   2. Per layer: the cost model's bytes under PS and SFB and the scheme (cost_model.h), the
//      communication time of each (time_model.h), the compute time when known.
//   3. Cuts EVERY layer into chunks and spreads them over the servers (partition.h): a PS layer's
//      chunks are what it pushes and pulls, an SFB layer's the chunks it would use under PS. The
//      partition depends only on the model, the number of servers and the block size, never on
//      the schemes or the network, so every re-plan of one world gives every layer the same
//      chunks and a later epoch can move a layer between SFB and PS without moving bytes.
//   4. Priority = layer index: the proto's convention is "lower is sooner; layers the next
//      forward pass needs first get 0", and layers are listed in forward order, so layer 0 (the
//      first the next forward pass needs) gets 0 and the top layer, whose gradient is ready first,
//      gets the largest number.
//   5. Fusion (fusion.h): which consecutive small single-chunk PS layers share one key (a bucket),
//      from the per-key cost α = 2·latency against the overlap a bucket loses; LayerPlan.bucket
//      and Plan.bucket_bytes. Like the chunks, a world's first plan decides it for the world.
//   2b. Wire precision (PS-16 and AR-16 in cost_model.h): where the job allows a lossy wire
//      (PlannerConfig::lossy_wire, wire_overrides), a PS or all-reduce layer uses it when that
//      predicts less time than float32, casts included; the scheme rule (time rule) compares the
//      faster of the two PS columns with SFB and with the faster of the two all-reduce columns.
//      LayerPlan.wire_type; a world's first plan decides it for the world (the servers' tables
//      are registered with it).
//   2c. The ring's buckets (PlanRing in planner.cc, fusion.h RingBuckets): the agents fuse
//      consecutive all-reduce layers into one collective of at most allreduce_bucket_bytes, so
//      the time rule weighs the ring bucket by bucket (a bucket pays its step latencies once)
//      against its members' other schemes, PS keys fused; every layer on the ring gets its
//      bucket (LayerReport::allreduce_bucket) and its share of the bucket's time.
//   6. Predicts the iteration time and the speed-up, for the plan (its buckets included) and for
//      PS everywhere (no buckets).
// LayerPlan.predicted_bytes_per_worker is the per-worker column of the chosen scheme (PS: 2·S,
// SFB: 2·K·(P1−1)·(M+N), times the element size); predicted_seconds its synchronisation time.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/planner/cost_model.h"
#include "coordinator/planner/fusion.h"
#include "coordinator/planner/time_model.h"
#include "poseidon/v1/model.pb.h"
#include "poseidon/v1/plan.pb.h"

namespace poseidon::planner {

// Largest cluster dimensions the planner accepts (they bound the cost model's integer arithmetic
// and the size of per-server tables).
inline constexpr uint32_t kMaxWorkers = 65536;
inline constexpr uint32_t kMaxServers = 65536;
inline constexpr uint32_t kMaxBatchPerWorker = 1u << 20;

inline constexpr uint64_t kDefaultBlockBytes = uint64_t{4} << 20;
// The agents' default --allreduce_bucket_bytes (DDP's bucket_cap_mb).
inline constexpr uint64_t kDefaultAllreduceBucketBytes = uint64_t{25} << 20;
// Where no layer's compute time is known (the coordinator's plans: the agents register shapes
// only), the overlap an all-reduce bucket gives up by waiting for its last member cannot be
// weighed; a bucket is then chosen only where its collective takes at most 1/this of what its
// members take on their other schemes. Measured in the emulated cluster (docs/cluster.md, "The
// coordinator's ring by cost"): with one server for eight workers (PS's incast at the server)
// the bucketed ring ran 1.5-4.4x faster than PS/SFB; colocated (P2 = P1) the schemes move the
// same bytes, and GoogLeNet's one bucket, chosen without the margin, ran 1.3x slower than PS.
inline constexpr double kRingBucketMarginWithoutCompute = 2.0;

// How an FC layer's scheme is chosen (every other kind always uses PS).
enum class SchemeRule {
  // Poseidon's rule: SFB when it moves no more bytes than PS through a worker machine's interface
  // (cost_model.h). Independent of bandwidth and latency.
  kBytes,
  // SFB when its predicted synchronisation time is at most PS's (time_model.h: PsSeconds,
  // SfbSeconds): the bytes rule plus per-leg latency (PS two legs, SFB one) and, not colocated,
  // the servers' interfaces. It depends on bandwidth and latency, so measured telemetry can move
  // a layer near the boundary from one scheme to the other (the coordinator re-plans then). Any
  // layer goes by ring all-reduce (PlannerConfig::allreduce, allreduce_step_seconds) when that
  // is strictly faster than the better of the other two (AllreduceSeconds: 2·(P1−1) steps, each
  // the larger of the latency and the measured step), weighed with the agents' all-reduce
  // buckets where it shares one (2c. below).
  kTime,
};

// Whether the plan fuses small PS layers into buckets.
enum class FusionRule {
  kOff,   // every layer its own keys
  kCost,  // the cost model decides (fusion.h)
};

// The cluster and the plan's bookkeeping.
struct PlannerConfig {
  uint32_t workers = 1;  // P1
  uint32_t servers = 1;  // P2
  // K for every layer; 0 takes each layer's LayerSpec.batch_per_worker.
  uint32_t batch_per_worker = 0;
  bool colocated = false;
  double bandwidth_bytes_per_second = 0;  // per direction of each machine's interface; > 0
  double latency_seconds = 50e-6;         // per message leg; >= 0
  uint64_t block_bytes = kDefaultBlockBytes;
  // The rate that turns a spec's FLOPs into compute time; without it only measured times count.
  std::optional<GpuRate> gpu;
  SchemeRule scheme_rule = SchemeRule::kBytes;
  FusionRule fusion = FusionRule::kCost;
  // Ring all-reduce is on the menu (the agents can run it: P1 > 1 and a coordinator for its
  // rendezvous). The time rule chooses it only with a measured cost of one ring step (the
  // agents' tiny all-reduce, which holds the collective library's per-message overhead, not
  // only the network's latency): without one, only an operator's override puts a layer on it.
  bool allreduce = true;
  std::optional<double> allreduce_step_seconds;
  // The agents' --allreduce_bucket_bytes (RegisterModelRequest.allreduce_bucket_bytes): they fuse
  // consecutive all-reduce layers into one collective of at most this many bytes (fusion.h,
  // RingBuckets); 0: one collective per layer. The time rule weighs the ring by the buckets the
  // agents will form, and the prediction runs each bucket as one collective.
  uint64_t allreduce_bucket_bytes = kDefaultAllreduceBucketBytes;
  // A re-plan of a running world: per layer, the all-reduce bucket the agents formed from the
  // world's first plan (LayerPlan.allreduce_bucket; they form buckets only then). Its members
  // stay on all-reduce (the agents refuse to move a member) and run in those buckets; a layer
  // outside them that goes by ring runs alone. Empty: the buckets are formed from this plan. A
  // size other than the model's layers, or a member that cannot go by ring, is an error.
  std::vector<uint32_t> fixed_allreduce_buckets;
  // The agents can run SFB (their --scheme is auto or sfb): FC layers get factor buffers after
  // their gradients, which end an all-reduce bucket (RingBuckets). false: --scheme ps or
  // allreduce.
  bool sfb_possible = true;
  // Layer name -> scheme forced instead of the rule's choice (an operator's override).
  // SYNC_SCHEME_PS or SYNC_SCHEME_ALLREDUCE for any layer, SYNC_SCHEME_SFB only for FC layers;
  // an unknown name, SFB for a non-FC layer or any other value is an error naming the layer.
  std::map<std::string, poseidon::v1::SyncScheme, std::less<>> scheme_overrides;
  // Wire precision (issue 15; cost_model.h, PS-16, AR-16): the lossy type (BF16 or F16) a PS or
  // all-reduce layer may use where its predicted synchronisation time, casts included, is lower
  // than float32's. F32
  // (or UNSPECIFIED), the default: exact only, a lossy wire is never chosen.
  poseidon::v1::ElementType lossy_wire = poseidon::v1::ELEMENT_TYPE_F32;
  // Layer name -> wire forced instead of the rule's choice: F32 keeps the layer exact whatever
  // lossy_wire allows; BF16 or F16 puts it on that wire whenever it is on PS or all-reduce (an
  // operator's per-layer allowance). An unknown name, another type, or a lossy wire for a layer
  // whose scheme override is SFB is an error naming the layer.
  std::map<std::string, poseidon::v1::ElementType, std::less<>> wire_overrides;
  // Low rank (issue 15; cost_model.h, AR-LR): the rank r (1 to 1024) a layer on all-reduce with
  // a 2-D gradient that r shrinks may be sent at (PowerSGD's factors, lossy, error feedback)
  // where its predicted time, arithmetic included, is lower than the all-reduce's otherwise;
  // 0, the default: never. A layer with a wire override of F32 stays exact.
  uint32_t lowrank_rank = 0;
  // Layer name -> the rank forced instead of the rule's choice (an operator's per-layer say):
  // r > 0 (to 1024) sends that layer by all-reduce at rank r whatever the cost (it must be a
  // tensor r shrinks, common/lowrank_shape.h, with all-reduce possible, and no scheme override
  // other than all-reduce nor a wire override on it); 0 keeps it off low rank whatever
  // lowrank_rank allows. Anything else is an error naming the layer (ParseLowRankOverrides
  // reads "fc6.weight=4,conv1.weight=0").
  std::map<std::string, uint32_t, std::less<>> lowrank_overrides;

  // Copied into the Plan.
  std::string job_id;
  uint64_t plan_epoch = 1;
  uint64_t effective_iteration = 0;
  uint64_t membership_epoch = 0;
  // Plan.servers' node ids: empty for "server-0" .. "server-<P2-1>", else exactly P2 entries.
  std::vector<std::string> server_node_ids;
};

// "LAYER=R,LAYER=R" (R: 0 to 1024) into PlannerConfig::lowrank_overrides; an error quoting the
// entry that is not of that form. BuildPlan checks the layers.
absl::StatusOr<std::map<std::string, uint32_t, std::less<>>> ParseLowRankOverrides(
    absl::string_view text);

// Checks P1, P2 in [1, 65536], K <= 2^20, bandwidth > 0, latency >= 0, block_bytes >= 1, the GPU
// rate > 0 and server_node_ids; errors name the field.
absl::Status ValidatePlannerConfig(const PlannerConfig& config);

// One layer as planned.
struct LayerReport {
  uint32_t index = 0;
  std::string name;
  poseidon::v1::LayerKind kind = poseidon::v1::LAYER_KIND_UNSPECIFIED;
  std::vector<uint64_t> shape;
  uint32_t batch_per_worker = 0;  // K used for this layer
  LayerCost cost;                 // bytes under PS and (FC) SFB, and the chosen scheme
  double ps_seconds = 0;
  std::optional<double> sfb_seconds;
  std::optional<double> allreduce_seconds;  // P1 > 1
  // PS on the lossy wire the job allows for this layer (casts included); unset: none allowed.
  std::optional<double> ps_lossy_seconds;
  // All-reduce on that lossy wire (AR-16, casts included); unset: none allowed or no all-reduce.
  std::optional<double> allreduce_lossy_seconds;
  // All-reduce at the job's low rank (AR-LR, arithmetic included); unset: not allowed, no
  // all-reduce, or a tensor the rank does not shrink.
  std::optional<double> allreduce_lowrank_seconds;
  bool wire_overridden = false;  // the wire came from PlannerConfig::wire_overrides
  bool lowrank_overridden = false;  // the rank came from PlannerConfig::lowrank_overrides
  double seconds = 0;  // of the chosen scheme
  std::optional<ComputeSeconds> compute;
  uint32_t chunks = 0;      // chunks of the layer in the plan (an SFB layer's are used under PS)
  uint64_t ps_chunks = 0;   // chunks the layer has on PS (the same as chunks)
  bool overridden = false;  // the scheme came from PlannerConfig::scheme_overrides
  uint32_t bucket = 0;      // LayerPlan.bucket: 0 alone, else the bucket it is fused into
  // On all-reduce: 0 alone, else the agents' all-reduce bucket it is in (fusion.h RingBuckets;
  // 1, 2, … in forward order). A member's `seconds` is its share: its bytes' time plus the
  // bucket's step latencies split evenly among the members.
  uint32_t allreduce_bucket = 0;
};

// Totals over all layers when every layer uses the given schemes (bytes per iteration).
struct SchemeTotals {
  double bytes_per_worker = 0;
  double bytes_per_server = 0;
  double bytes_per_machine = 0;                  // colocated machine: worker + server
  double compared_bytes = 0;                     // per machine when colocated, per worker otherwise
  double sync_seconds = 0;                       // Σ per-layer synchronisation time
  std::optional<IterationPrediction> iteration;  // when every layer's compute time is known
  std::optional<double> speedup;                 // P1 · compute / iteration
};

// Everything `poseidon plan` prints besides the Plan itself.
struct PlanReport {
  std::vector<LayerReport> layers;
  SchemeTotals plan;     // the chosen schemes
  SchemeTotals ps_only;  // PS for every layer, for comparison
  uint32_t sfb_layers = 0;
  uint32_t allreduce_layers = 0;
  uint32_t lossy_layers = 0;  // PS and all-reduce layers on a 16-bit wire (LayerCost::wire)
  uint32_t lowrank_layers = 0;  // all-reduce layers at low rank (LayerCost::lowrank)
  uint32_t allreduce_buckets = 0;  // the agents' all-reduce buckets (LayerReport::allreduce_bucket)
  uint32_t allreduce_fused_layers = 0;  // all-reduce layers in them
  // Empty when every layer's compute time is known; else why not (names the first such layer).
  std::string compute_unknown_reason;
  // Bytes of the chunks placed on each server (every layer's, SFB layers' included: the
  // partition's balance).
  std::vector<uint64_t> server_bytes;
  uint64_t largest_chunk_bytes = 0;
  // Fusion: the buckets of the plan, the target size B* they grew to (0: no fusion), and whether
  // the iteration model decided their ends (every layer's compute known) or the size alone.
  uint32_t buckets = 0;
  uint32_t fused_layers = 0;
  uint64_t bucket_target_bytes = 0;
  bool fusion_by_model = false;
};

// The plan and its report.
struct PlanResult {
  poseidon::v1::Plan plan;
  PlanReport report;
};

// Plans `model` on the cluster of `config`. Deterministic: the same inputs give the same plan.
absl::StatusOr<PlanResult> BuildPlan(const poseidon::v1::ModelSpec& model,
                                     const PlannerConfig& config);

}  // namespace poseidon::planner
