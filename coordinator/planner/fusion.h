// Fusion as a plan decision: which consecutive small PS layers share one key (a bucket, DDP's
// bucketing), chosen by the cost model rather than a fixed size (docs/planner.md, "Fusion").
// Thread-safety: pure functions, safe from any thread.
#pragma once

// The decision weighs the per-message cost α a bucket saves against the overlap it loses:
//   - α is the PS time model's per-key cost, its two message legs (2·latency, the measured
//     latency where the coordinator has one): every key a layer pushes and pulls pays it.
//   - The target size B* is where a key's transfer takes kFusionTransferPerMessage times its α:
//     a bucket of B* bytes spends at most 1 / (1 + kFusionTransferPerMessage) of its sync time on
//     its message, so fusing beyond it saves little and only holds gradients back longer. B* is
//     clamped to the largest chunk (a bucket is one key). A layer of B* bytes or more goes alone.
//     The factor 8 is calibrated: α counts the network's latency but not the agent's and the
//     server's work per message (measured by the timeline at 50-200 µs on a loaded 2-vCPU host,
//     docs/benchmarks.md), and with 8 the nominal cluster (10 Gbit/s, 50 µs, colocated) gets
//     ~0.5 MiB, the fixed size that measured best (docs/cluster.md, "Fusion at the right scale").
//   - Walking the layers in the order backward makes them ready (the top layer first), a layer
//     joins the open bucket while the bucket stays within B*, and, where every layer's compute
//     time is known, only if the iteration model (time_model.h, PredictIteration: WFBP with the
//     interface working by priority) predicts no longer an iteration with it in the bucket than
//     with the bucket closed before it. A bucket is sent when its last member (its lowest index)
//     is ready, so this is where the overlap lost shows: near the end of backward, a bucket
//     holding back gradients the interface could already move lengthens the iteration, and the
//     layer starts a new bucket instead.
// Exactness is untouched: a bucket's sum is its members' sums side by side.

#include <cstdint>
#include <functional>
#include <vector>

#include "coordinator/planner/time_model.h"

namespace poseidon::planner {

inline constexpr double kFusionTransferPerMessage = 8.0;
// Above this many layers the iteration model is not consulted (the size rule alone decides):
// each layer's decision runs the model once, over all layers.
inline constexpr size_t kFusionModelMaxLayers = 1024;

// One layer, in forward order.
struct FusionLayer {
  uint64_t bytes = 0;          // the gradient's bytes (one key's payload when alone)
  uint64_t element_bytes = 4;  // members of one bucket have one element size
  // The wire its PS key would use (ElementType: F32, BF16, F16): members of one bucket share it.
  uint32_t wire = 1;
  // PS with one chunk: it may share a key with its neighbours.
  bool eligible = false;
  // Its compute and its synchronisation alone, for the iteration model (used only when
  // FusionOptions::compute_known).
  LayerTiming timing;
};

struct FusionOptions {
  uint64_t max_bucket_bytes = 0;  // the largest chunk: a bucket is one key
  double message_seconds = 0;     // α: what one key costs besides its bytes (PS: 2·latency)
  // One PS key's synchronisation time for `bytes` bytes, α included (PsSeconds of its volume).
  std::function<double(uint64_t bytes)> sync_seconds;
  // The same for a key on a lossy wire (FusionLayer::wire not F32); unset: sync_seconds.
  std::function<double(uint64_t bytes, uint32_t wire)> wire_sync_seconds;
  bool compute_known = false;  // every layer's timing.forward/backward_seconds is known
};

struct FusionResult {
  // Per layer: 0 when it goes alone, else its bucket's number (1, 2, … in forward order).
  // A bucket has at least two members, consecutive layers.
  std::vector<uint32_t> bucket;
  uint32_t buckets = 0;
  uint64_t target_bytes = 0;  // B* (0: nothing fuses, e.g. with no message cost)
  bool model_consulted = false;
};

// B*: the smallest size whose transfer (sync_seconds(B*) − α) is kFusionTransferPerMessage × α,
// clamped to [0, max_bucket_bytes] and rounded down to whole 4-byte words.
uint64_t FusionTargetBytes(const FusionOptions& options);

// The buckets, as described at the top of this file.
FusionResult PlanFusion(const std::vector<FusionLayer>& layers, const FusionOptions& options);

// The iteration model's inputs with `bucket` applied: a bucket's synchronisation, one key of its
// members' bytes, belongs to its lowest-index member (it is sent when that one is ready, and the
// next forward pass needs that one first); the other members have none of their own.
std::vector<LayerTiming> FusedTimings(const std::vector<FusionLayer>& layers,
                                      const std::vector<uint32_t>& bucket,
                                      const FusionOptions& options);

// ---- The ring's buckets ----------------------------------------------------------------------
// The agents fuse consecutive all-reduce layers into one collective (agent/layer_table.cc
// FormRingGroups, DDP's bucket_cap_mb; the agents' --allreduce_bucket_bytes): runs of two or more
// layers on the ring, each smaller than the cap, adjacent in the agent's data segment (an FC
// layer with SFB factor buffers ends a run: they follow its gradient), on one wire, spanning at
// most the cap, alignment padding included. RingBuckets finds the same runs, so that the planner
// weighs the ring as the agents will run it (docs/planner.md, "All-reduce buckets").

// One layer, in forward order, as the agents lay it out.
struct RingLayer {
  uint64_t bytes = 0;         // its gradient in the agent's buffers: elements × 4
  uint64_t factor_bytes = 0;  // its SFB factor buffers after it (U, then V, each aligned); 0: none
  bool ring = false;          // the plan puts it on all-reduce
  uint32_t wire = 1;          // ElementType: members of one bucket share it
};

// Per layer: 0 when it is not in a bucket (alone on the ring, or not on it), else its bucket's
// number (1, 2, … in forward order). `cap_bytes` 0: no buckets.
std::vector<uint32_t> RingBuckets(const std::vector<RingLayer>& layers, uint64_t cap_bytes);

}  // namespace poseidon::planner
