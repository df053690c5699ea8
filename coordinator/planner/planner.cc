#include "coordinator/planner/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/lowrank_shape.h"
#include "common/shm_layout.h"
#include "common/status.h"
#include "coordinator/planner/model_spec.h"
#include "coordinator/planner/partition.h"
#include "proto/wire_type.h"

namespace poseidon::planner {

using poseidon::v1::LayerSpec;
using poseidon::v1::ModelSpec;

absl::StatusOr<std::map<std::string, uint32_t, std::less<>>> ParseLowRankOverrides(
    absl::string_view text) {
  std::map<std::string, uint32_t, std::less<>> out;
  for (absl::string_view entry : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(entry, '=');
    uint32_t rank = 0;
    if (kv.first.empty() || !absl::SimpleAtoi(kv.second, &rank) || rank > 1024) {
      return absl::InvalidArgumentError(absl::StrCat(
          "low-rank override '", entry, "' is not LAYER=RANK with RANK 0 (never) to 1024"));
    }
    out[std::string(kv.first)] = rank;
  }
  return out;
}

absl::Status ValidatePlannerConfig(const PlannerConfig& config) {
  if (config.workers < 1 || config.workers > kMaxWorkers) {
    return absl::InvalidArgumentError(
        absl::StrCat("workers (P1) must be in [1, ", kMaxWorkers, "], got ", config.workers));
  }
  if (config.servers < 1 || config.servers > kMaxServers) {
    return absl::InvalidArgumentError(
        absl::StrCat("servers (P2) must be in [1, ", kMaxServers, "], got ", config.servers));
  }
  if (config.batch_per_worker > kMaxBatchPerWorker) {
    return absl::InvalidArgumentError(absl::StrCat("batch_per_worker (K) must be in [1, ",
                                                   kMaxBatchPerWorker, "], got ",
                                                   config.batch_per_worker));
  }
  if (!(config.bandwidth_bytes_per_second > 0) ||
      !std::isfinite(config.bandwidth_bytes_per_second)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bandwidth must be a finite number of bytes/s > 0, got ",
                     config.bandwidth_bytes_per_second));
  }
  if (!(config.latency_seconds >= 0) || !std::isfinite(config.latency_seconds)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "latency must be a finite number of seconds >= 0, got ", config.latency_seconds));
  }
  if (config.allreduce_step_seconds.has_value() &&
      (!(*config.allreduce_step_seconds >= 0) || !std::isfinite(*config.allreduce_step_seconds))) {
    return absl::InvalidArgumentError(
        absl::StrCat("allreduce_step_seconds must be a finite number of seconds >= 0, got ",
                     *config.allreduce_step_seconds));
  }
  if (config.block_bytes < 1) {
    return absl::InvalidArgumentError("block_size must be at least 1 byte, got 0");
  }
  if (config.gpu.has_value() &&
      (!(config.gpu->flops_per_second > 0) || !std::isfinite(config.gpu->flops_per_second))) {
    return absl::InvalidArgumentError(absl::StrCat("gpu '", config.gpu->name,
                                                   "': rate must be a finite FLOP/s > 0, got ",
                                                   config.gpu->flops_per_second));
  }
  if (!WireFromProto(config.lossy_wire).has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("lossy_wire must be F32 (none), BF16 or F16, got ",
                     poseidon::v1::ElementType_Name(config.lossy_wire)));
  }
  if (config.lowrank_rank > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("lowrank_rank must be 0 (none) to 1024, got ", config.lowrank_rank));
  }
  if (!config.server_node_ids.empty() && config.server_node_ids.size() != config.servers) {
    return absl::InvalidArgumentError(absl::StrCat("server_node_ids has ",
                                                   config.server_node_ids.size(), " entries for ",
                                                   config.servers, " servers"));
  }
  return absl::OkStatus();
}

namespace {

// A byte count from the cost model's double, clamped to uint64.
uint64_t ToBytes(double bytes) {
  if (!(bytes > 0)) return 0;
  if (bytes >= 18446744073709551616.0) return std::numeric_limits<uint64_t>::max();  // 2^64
  return static_cast<uint64_t>(std::round(bytes));
}

// The bytes of a layer under `scheme`, on `wire` when PS or all-reduce.
const SchemeVolume& VolumeOf(const LayerCost& cost, poseidon::v1::SyncScheme scheme,
                             poseidon::v1::ElementType wire) {
  if (scheme == poseidon::v1::SYNC_SCHEME_SFB) return *cost.sfb_bytes;
  if (scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE) {
    if (cost.lowrank > 0) return *cost.allreduce_lowrank_bytes;  // chosen over the others
    return IsLossyWire(wire) ? *cost.allreduce_lossy_bytes : *cost.allreduce_bytes;
  }
  return IsLossyWire(wire) ? *cost.ps_lossy_bytes : cost.ps_bytes;
}

// Adds one layer's bytes under `scheme` (on `wire` when PS or all-reduce) to `totals`.
void Accumulate(const LayerCost& cost, poseidon::v1::SyncScheme scheme,
                poseidon::v1::ElementType wire, double seconds, bool colocated,
                SchemeTotals& totals) {
  const SchemeVolume& volume = VolumeOf(cost, scheme, wire);
  totals.bytes_per_worker += volume.per_worker;
  totals.bytes_per_server += volume.per_server;
  totals.bytes_per_machine += volume.per_machine;
  totals.compared_bytes += ComparedVolume(volume, colocated);
  totals.sync_seconds += seconds;
}

// The iteration model's input for one layer: its compute (zero when unknown) and its sync under
// the plan's scheme or under PS.
LayerTiming TimingOf(const LayerReport& layer, bool use_plan) {
  // An SFB layer and an all-reduce are one piece each.
  const bool one_piece = use_plan && layer.cost.scheme != poseidon::v1::SYNC_SCHEME_PS;
  return LayerTiming{layer.compute ? layer.compute->forward : 0,
                     layer.compute ? layer.compute->backward : 0,
                     use_plan ? layer.seconds : layer.ps_seconds,
                     one_piece ? uint64_t{1} : layer.ps_chunks};
}

// Fusion's view of the layers (fusion.h) and its options for this cluster.
std::vector<FusionLayer> FusionLayers(const std::vector<LayerReport>& layers, bool enabled) {
  std::vector<FusionLayer> out;
  out.reserve(layers.size());
  for (const LayerReport& layer : layers) {
    FusionLayer f;
    f.bytes = layer.cost.parameters * layer.cost.element_bytes;
    f.element_bytes = layer.cost.element_bytes;
    f.eligible = enabled && layer.cost.scheme == poseidon::v1::SYNC_SCHEME_PS && layer.chunks == 1;
    f.wire = static_cast<uint32_t>(layer.cost.wire);
    f.timing = TimingOf(layer, /*use_plan=*/true);
    out.push_back(f);
  }
  return out;
}

FusionOptions FusionOptionsFor(const PlannerConfig& config, bool compute_known) {
  FusionOptions o;
  o.max_bucket_bytes = config.block_bytes;
  o.message_seconds = 2 * config.latency_seconds;  // PsSeconds' two legs
  const ClusterShape cluster{config.workers, config.servers, 1, config.colocated};
  const NetworkModel network{config.bandwidth_bytes_per_second, config.latency_seconds};
  const bool colocated = config.colocated;
  // PS volume is linear in the elements: in bytes for a key of `bytes` bytes.
  o.sync_seconds = [cluster, network, colocated](uint64_t bytes) {
    return PsSeconds(PsElements(bytes, cluster), colocated, network);
  };
  // A bucket on a 16-bit wire: half the bytes, and the casts of its bytes / 4 elements.
  o.wire_sync_seconds = [cluster, network, colocated](uint64_t bytes, uint32_t wire) {
    const uint64_t elements = bytes / sizeof(float);
    return PsSeconds(PsElements(elements * 2, cluster), colocated, network) +
           static_cast<double>(elements) *
               WireCastSecondsPerElement(static_cast<poseidon::v1::ElementType>(wire));
  };
  o.compute_known = compute_known;
  return o;
}

// What the time rule weighed for one layer, for the ring's buckets (PlanRing).
struct RingChoice {
  bool has_ring = false;   // all-reduce is possible for it
  bool candidate = false;  // the rule may move it onto or off the ring (no override decides)
  poseidon::v1::SyncScheme other = poseidon::v1::SYNC_SCHEME_PS;  // the better of PS and SFB
  double other_seconds = 0;
  poseidon::v1::ElementType ps_wire = poseidon::v1::ELEMENT_TYPE_F32;
  double ring_seconds = 0;  // its best all-reduce column alone (float32, 16-bit or low rank)
  poseidon::v1::ElementType ring_wire = poseidon::v1::ELEMENT_TYPE_F32;
};

// The agents' view of the layers with `on` on the ring (fusion.h RingLayer).
std::vector<RingLayer> RingLayersOf(const std::vector<LayerReport>& layers,
                                    const std::vector<RingChoice>& choices,
                                    const std::vector<bool>& on, bool sfb_possible) {
  std::vector<RingLayer> out(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerReport& layer = layers[i];
    RingLayer& r = out[i];
    r.bytes = layer.cost.parameters * sizeof(float);
    r.ring = on[i];
    r.wire = static_cast<uint32_t>(on[i] && layer.cost.lowrank == 0
                                       ? choices[i].ring_wire
                                       : poseidon::v1::ELEMENT_TYPE_F32);
    // agent/layer_table.cc SfbCapable: where the agents can run SFB, an FC matrix whose factors
    // are no larger than its gradient, or planned on SFB, gets factor buffers after its
    // gradient. (A candidate off the ring is on its other scheme.)
    const bool sfb = !on[i] && (choices[i].candidate
                                    ? choices[i].other == poseidon::v1::SYNC_SCHEME_SFB
                                    : layer.cost.scheme == poseidon::v1::SYNC_SCHEME_SFB);
    if (sfb_possible && layer.kind == poseidon::v1::LAYER_KIND_FC && layer.shape.size() == 2) {
      const uint64_t m = layer.shape[0], n = layer.shape[1], k = layer.batch_per_worker;
      if (sfb || k * (m + n) <= m * n) {
        r.factor_bytes = PSD_SHM_ALIGN_UP(k * m * sizeof(float)) +
                         PSD_SHM_ALIGN_UP(k * n * sizeof(float));
      }
    }
  }
  return out;
}

// The members of each bucket of `bucket` (RingBuckets), in forward order.
std::vector<std::vector<size_t>> BucketMembers(const std::vector<uint32_t>& bucket) {
  std::vector<std::vector<size_t>> members;
  for (size_t i = 0; i < bucket.size(); ++i) {
    if (bucket[i] == 0) continue;
    if (members.size() < bucket[i]) members.resize(bucket[i]);
    members[bucket[i] - 1].push_back(i);
  }
  return members;
}

// The time rule with the agents' all-reduce buckets (docs/planner.md, "All-reduce buckets"). A
// bucket is one collective: its members share its 2·(P1−1) step latencies, which a layer alone
// pays in full. Starting with every candidate on the ring, the agents' buckets are formed and,
// until nothing changes:
//   - a member whose bytes cost more on the ring than on its better other scheme leaves (the
//     latencies it shares are paid anyway); a PS layer that fusion.h could fuse is charged its
//     bytes' share of a B*-byte key's message there;
//   - a bucket whose collective (the step latencies once and its members' bytes) is no faster
//     than its members on their other schemes (PS keys fused: one message per B* bytes) breaks
//     up: its members go back to the per-layer rule;
//   - a layer alone keeps the per-layer rule;
// and the buckets are formed again (a member leaving splits its bucket). Layers only leave the
// ring, so this ends. Without compute times a bucket must be kRingBucketMarginWithoutCompute
// times faster than its members' other schemes (the overlap it gives up is unknown). Where every layer's compute is known, the iteration model then weighs the
// overlap each bucket gives up (it is sent when its last member is ready): a bucket whose
// members on the per-layer rule predict a shorter iteration breaks up, one at a time. Then
// every layer on the ring gets its bucket and its share of the bucket's time.
void PlanRing(const PlannerConfig& config, const std::vector<RingChoice>& choices,
              bool compute_known, std::vector<LayerReport>& layers) {
  const size_t L = layers.size();
  const NetworkModel network{config.bandwidth_bytes_per_second, config.latency_seconds};
  const double step = config.allreduce_step_seconds.value_or(0);
  const double latency = AllreduceSeconds(SchemeVolume{}, config.workers, network, step);
  // A layer's collective without its step latencies (two all-reduces at low rank).
  auto ring_bytes_seconds = [&](size_t i) {
    return choices[i].ring_seconds - latency * (layers[i].cost.lowrank > 0 ? 2 : 1);
  };
  std::vector<bool> on(L);
  for (size_t i = 0; i < L; ++i) {
    on[i] = layers[i].cost.scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE;
  }
  // A re-plan of a running world keeps the buckets of its first plan (fixed_allreduce_buckets):
  // no bucket forms or grows, so a layer moved onto the ring runs alone (the per-layer rule).
  const bool fixed = !config.fixed_allreduce_buckets.empty();
  const bool decide = config.scheme_rule == SchemeRule::kTime &&
                      config.allreduce_step_seconds.has_value() &&
                      config.allreduce_bucket_bytes > 0 && !fixed;
  const std::vector<bool> per_layer = on;  // the per-layer rule's choice
  if (decide) {
    for (size_t i = 0; i < L; ++i) {
      if (choices[i].candidate) on[i] = true;
    }
    const FusionOptions fusion = FusionOptionsFor(config, /*compute_known=*/false);
    const uint64_t target = config.fusion == FusionRule::kCost ? FusionTargetBytes(fusion) : 0;
    const double ps_message = 2 * config.latency_seconds;  // PsSeconds' two legs
    for (bool changed = true; changed;) {
      changed = false;
      const std::vector<uint32_t> bucket = RingBuckets(
          RingLayersOf(layers, choices, on, config.sfb_possible), config.allreduce_bucket_bytes);
      for (size_t i = 0; i < L; ++i) {  // alone on the ring: the per-layer rule
        if (on[i] && bucket[i] == 0 && choices[i].candidate &&
            !(choices[i].ring_seconds < choices[i].other_seconds)) {
          on[i] = false;
          changed = true;
        }
      }
      // A PS layer's cost apart from the message it would share with fused neighbours.
      auto fusable_ps = [&](size_t i) {
        const uint64_t bytes = layers[i].cost.parameters * layers[i].cost.element_bytes;
        return choices[i].other == poseidon::v1::SYNC_SCHEME_PS && layers[i].ps_chunks == 1 &&
               bytes < target;
      };
      for (const std::vector<size_t>& members : BucketMembers(bucket)) {
        bool left = false;
        for (size_t i : members) {
          const RingChoice& c = choices[i];
          if (!c.candidate || c.ring_seconds < c.other_seconds) continue;
          double other_marginal = c.other_seconds;
          if (fusable_ps(i)) {
            const double bytes =
                static_cast<double>(layers[i].cost.parameters * layers[i].cost.element_bytes);
            other_marginal -= ps_message * (1 - bytes / static_cast<double>(target));
          }
          if (ring_bytes_seconds(i) >= other_marginal) {
            on[i] = false;
            left = changed = true;
          }
        }
        if (left) continue;  // weighed again once the buckets are formed again
        bool lowrank_any = false, lowrank_fixed = false, fixed_member = false;
        double ring = 0, other = 0;
        uint64_t fused_bytes = 0;
        for (size_t i : members) {
          const RingChoice& c = choices[i];
          const bool lowrank = layers[i].cost.lowrank > 0;
          lowrank_any = lowrank_any || lowrank;
          if (!c.candidate) {
            fixed_member = true;
            lowrank_fixed = lowrank_fixed || lowrank;
            continue;
          }
          ring += ring_bytes_seconds(i);
          if (fusable_ps(i)) {
            other += c.other_seconds - ps_message;  // its message is shared with others
            fused_bytes += layers[i].cost.parameters * layers[i].cost.element_bytes;
          } else {
            other += c.other_seconds;
          }
        }
        // The step latencies the candidates add to the collective (none where members the rule
        // does not move pay them already).
        ring += latency * ((lowrank_any ? 2 : 1) - (fixed_member ? (lowrank_fixed ? 2 : 1) : 0));
        if (target > 0 && fused_bytes > 0) {
          other += ps_message * std::ceil(static_cast<double>(fused_bytes) /
                                          static_cast<double>(target));
        }
        // Without compute times the overlap the bucket gives up is unknown (up to its whole
        // collective, sent after the backward): it must beat the other schemes by a margin.
        const double margin = compute_known ? 1.0 : kRingBucketMarginWithoutCompute;
        if (ring * margin < other) continue;
        for (size_t i : members) {
          const RingChoice& c = choices[i];
          if (c.candidate && !(c.ring_seconds < c.other_seconds)) {
            on[i] = false;
            changed = true;
          }
        }
      }
    }
    if (compute_known) {
      // The overlap a bucket gives up: it is sent when its last member is ready. A bucket stays
      // only if the iteration model (time_model.h) predicts no shorter an iteration with its
      // members back on the per-layer rule.
      // The plan's layers with `ring` on the ring and the rest on their other schemes, PS keys
      // fused as `fusion` says, as the iteration model sees them.
      auto iteration = [&](const std::vector<bool>& ring, const FusionOptions& fusion) {
        const std::vector<uint32_t> bucket = RingBuckets(
            RingLayersOf(layers, choices, ring, config.sfb_possible), config.allreduce_bucket_bytes);
        std::vector<LayerReport> trial = layers;
        for (size_t i = 0; i < L; ++i) {
          const RingChoice& c = choices[i];
          LayerReport& layer = trial[i];
          layer.chunks = static_cast<uint32_t>(layer.ps_chunks);  // placed after this pass
          if (ring[i]) {
            layer.cost.scheme = poseidon::v1::SYNC_SCHEME_ALLREDUCE;
            layer.seconds = bucket[i] == 0 ? c.ring_seconds : ring_bytes_seconds(i);
          } else if (c.candidate) {
            layer.cost.scheme = c.other;
            layer.cost.wire = c.other == poseidon::v1::SYNC_SCHEME_PS ? c.ps_wire
                                                                      : poseidon::v1::ELEMENT_TYPE_F32;
            layer.seconds = c.other_seconds;
          }
        }
        const std::vector<FusionLayer> fused =
            FusionLayers(trial, config.fusion == FusionRule::kCost);
        std::vector<LayerTiming> timings =
            FusedTimings(fused, PlanFusion(fused, fusion).bucket, fusion);
        for (const std::vector<size_t>& members : BucketMembers(bucket)) {
          bool lowrank = false;
          for (size_t i : members) lowrank = lowrank || layers[i].cost.lowrank > 0;
          double total = latency * (lowrank ? 2 : 1);
          for (size_t i : members) {
            total += timings[i].sync_seconds;
            timings[i].sync_seconds = 0;
          }
          timings[members.front()].sync_seconds = total;
        }
        return PredictIteration(timings).iteration_seconds;
      };
      // Fused by size while buckets are weighed (fusion.h without the iteration model, whose
      // decision per layer would make this quadratic in the layers once more).
      const FusionOptions by_size = FusionOptionsFor(config, /*compute_known=*/false);
      for (bool changed = true; changed;) {
        changed = false;
        const double with = iteration(on, by_size);
        for (const std::vector<size_t>& members : BucketMembers(RingBuckets(
                 RingLayersOf(layers, choices, on, config.sfb_possible),
                 config.allreduce_bucket_bytes))) {
          std::vector<bool> without = on;
          bool moved = false;
          for (size_t i : members) {
            if (choices[i].candidate && !(choices[i].ring_seconds < choices[i].other_seconds)) {
              without[i] = false;
              moved = true;
            }
          }
          if (moved && iteration(without, by_size) < with * (1 - 1e-9)) {
            on = std::move(without);
            changed = true;
            break;
          }
        }
      }
      // Last, the whole against the per-layer rule's choice (which the agents would bucket
      // too), PS fused as the plan will be: the buckets' plan only where it predicts shorter.
      const FusionOptions planned = FusionOptionsFor(config, /*compute_known=*/true);
      if (!(iteration(on, planned) < iteration(per_layer, planned) * (1 - 1e-9))) on = per_layer;
    }
    for (size_t i = 0; i < L; ++i) {
      const RingChoice& c = choices[i];
      if (!c.candidate) continue;
      LayerCost& cost = layers[i].cost;
      cost.scheme = on[i] ? poseidon::v1::SYNC_SCHEME_ALLREDUCE : c.other;
      cost.wire = cost.scheme == poseidon::v1::SYNC_SCHEME_PS ? c.ps_wire
                  : cost.scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE && cost.lowrank == 0
                      ? c.ring_wire
                      : poseidon::v1::ELEMENT_TYPE_F32;
      layers[i].seconds = on[i] ? c.ring_seconds : c.other_seconds;
    }
  }
  const std::vector<uint32_t> bucket =
      fixed ? config.fixed_allreduce_buckets
            : RingBuckets(RingLayersOf(layers, choices, on, config.sfb_possible),
                          config.allreduce_bucket_bytes);
  for (const std::vector<size_t>& members : BucketMembers(bucket)) {
    if (members.empty()) continue;  // a fixed bucket's number without members
    bool lowrank = false;
    for (size_t i : members) lowrank = lowrank || layers[i].cost.lowrank > 0;
    const double share = latency * (lowrank ? 2 : 1) / static_cast<double>(members.size());
    for (size_t i : members) {
      layers[i].allreduce_bucket = bucket[i];
      layers[i].seconds = ring_bytes_seconds(i) + share;
    }
  }
}

// Fills totals.iteration and totals.speedup from per-layer compute and sync times; under the
// plan with its buckets (`bucket`, empty for none).
// `fused` is fusion's view of the layers (FusionLayers) when `bucket` is not empty.
void Predict(const std::vector<LayerReport>& layers, bool use_plan, uint32_t workers,
             const std::vector<FusionLayer>& fused, const std::vector<uint32_t>& bucket,
             const FusionOptions& fusion, SchemeTotals& totals) {
  std::vector<LayerTiming> timings;
  if (use_plan && !bucket.empty()) {
    timings = FusedTimings(fused, bucket, fusion);
  } else {
    timings.reserve(layers.size());
    for (const LayerReport& layer : layers) timings.push_back(TimingOf(layer, use_plan));
  }
  if (use_plan) {
    // An all-reduce bucket is one collective, run when its lowest-index member is ready: its
    // members' shares (their seconds) belong to that member.
    for (size_t i = 0; i < layers.size(); ++i) {
      const uint32_t b = layers[i].allreduce_bucket;
      if (b == 0 || (i > 0 && layers[i - 1].allreduce_bucket == b)) continue;
      for (size_t j = i + 1; j < layers.size() && layers[j].allreduce_bucket == b; ++j) {
        timings[i].sync_seconds += timings[j].sync_seconds;
        timings[j].sync_seconds = 0;
      }
    }
  }
  totals.iteration = PredictIteration(timings);
  if (totals.iteration->iteration_seconds > 0) {
    totals.speedup =
        workers * totals.iteration->compute_seconds / totals.iteration->iteration_seconds;
  }
}

}  // namespace

absl::StatusOr<PlanResult> BuildPlan(const ModelSpec& model, const PlannerConfig& config) {
  RETURN_IF_ERROR(ValidatePlannerConfig(config));
  RETURN_IF_ERROR(ValidateModelSpec(model));
  for (const auto& override_entry : config.scheme_overrides) {
    const std::string& name = override_entry.first;
    const poseidon::v1::SyncScheme scheme = override_entry.second;
    const auto layer = std::find_if(model.layers().begin(), model.layers().end(),
                                    [&](const LayerSpec& spec) { return spec.name() == name; });
    if (layer == model.layers().end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("scheme override for layer '", name, "': the model has no such layer"));
    }
    if (scheme != poseidon::v1::SYNC_SCHEME_PS && scheme != poseidon::v1::SYNC_SCHEME_SFB &&
        scheme != poseidon::v1::SYNC_SCHEME_ALLREDUCE) {
      return absl::InvalidArgumentError(absl::StrCat("scheme override for layer '", name,
                                                     "': scheme must be PS, SFB or ALLREDUCE, "
                                                     "got ", static_cast<int>(scheme)));
    }
    if (scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE && (config.workers < 2 || !config.allreduce)) {
      return absl::InvalidArgumentError(
          absl::StrCat("scheme override for layer '", name,
                       "': all-reduce needs at least 2 workers and all-reduce enabled"));
    }
    if (scheme == poseidon::v1::SYNC_SCHEME_SFB && layer->kind() != poseidon::v1::LAYER_KIND_FC) {
      return absl::InvalidArgumentError(absl::StrCat("scheme override for layer '", name,
                                                     "': SFB needs an FC layer, this one is ",
                                                     poseidon::v1::LayerKind_Name(layer->kind())));
    }
  }

  for (const auto& [name, rank] : config.lowrank_overrides) {
    const auto layer = std::find_if(model.layers().begin(), model.layers().end(),
                                    [&name = name](const LayerSpec& spec) {
                                      return spec.name() == name;
                                    });
    const std::string what = absl::StrCat("low-rank override for layer '", name, "': ");
    if (layer == model.layers().end()) {
      return absl::InvalidArgumentError(absl::StrCat(what, "the model has no such layer"));
    }
    if (rank > 1024) {
      return absl::InvalidArgumentError(absl::StrCat(what, "the rank must be 0 to 1024, got ", rank));
    }
    if (rank == 0) continue;  // kept off low rank: always possible
    if (config.workers < 2 || !config.allreduce) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "low rank goes by all-reduce, which needs at least 2 workers and all-reduce "
                "enabled"));
    }
    const std::vector<uint64_t> shape(layer->shape().begin(), layer->shape().end());
    if (!LowRankPays(shape, rank, nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "rank ", rank, " does not shrink its tensor of shape [", absl::StrJoin(shape, ", "),
          "] (it needs 2 or more dimensions, the rank below both sides of its matrix, and "
          "(rows + cols) x rank below rows x cols)"));
    }
    if (const auto scheme = config.scheme_overrides.find(name);
        scheme != config.scheme_overrides.end() &&
        scheme->second != poseidon::v1::SYNC_SCHEME_ALLREDUCE) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "low rank goes by all-reduce, and the layer's scheme is forced to ",
          poseidon::v1::SyncScheme_Name(scheme->second)));
    }
    if (config.wire_overrides.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "a low-rank layer sends float32 factors; it cannot have a wire override too"));
    }
  }

  for (const auto& [name, wire] : config.wire_overrides) {
    if (std::none_of(model.layers().begin(), model.layers().end(),
                     [&name = name](const LayerSpec& spec) { return spec.name() == name; })) {
      return absl::InvalidArgumentError(
          absl::StrCat("wire override for layer '", name, "': the model has no such layer"));
    }
    if (wire != poseidon::v1::ELEMENT_TYPE_F32 && !IsLossyWire(wire)) {
      return absl::InvalidArgumentError(
          absl::StrCat("wire override for layer '", name, "': the wire must be F32, BF16 or F16, got ",
                       poseidon::v1::ElementType_Name(wire)));
    }
    const auto scheme = config.scheme_overrides.find(name);
    if (IsLossyWire(wire) && scheme != config.scheme_overrides.end() &&
        scheme->second == poseidon::v1::SYNC_SCHEME_SFB) {
      return absl::InvalidArgumentError(absl::StrCat(
          "wire override for layer '", name, "': a lossy wire is for PS and all-reduce, and the "
          "layer's scheme is forced to ", poseidon::v1::SyncScheme_Name(scheme->second)));
    }
  }

  const std::vector<uint32_t>& fixed = config.fixed_allreduce_buckets;
  if (!fixed.empty() && fixed.size() != static_cast<size_t>(model.layers_size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("fixed_allreduce_buckets has ", fixed.size(), " entries for ",
                     model.layers_size(), " layers"));
  }
  const NetworkModel network{config.bandwidth_bytes_per_second, config.latency_seconds};
  const GpuRate* gpu = config.gpu.has_value() ? &*config.gpu : nullptr;
  PlanResult result;
  PlanReport& report = result.report;
  std::vector<PartitionInput> partitioned;  // every layer, whatever its scheme
  std::vector<RingChoice> choices;          // per layer, for the ring's buckets (PlanRing)

  for (int i = 0; i < model.layers_size(); ++i) {
    const LayerSpec& spec = model.layers(i);
    LayerReport layer;
    layer.index = static_cast<uint32_t>(i);
    layer.name = spec.name();
    layer.kind = spec.kind();
    layer.shape.assign(spec.shape().begin(), spec.shape().end());
    layer.batch_per_worker =
        config.batch_per_worker != 0 ? config.batch_per_worker : spec.batch_per_worker();
    if (layer.batch_per_worker < 1 || layer.batch_per_worker > kMaxBatchPerWorker) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", i, " '", spec.name(), "': batch_per_worker (K) must be in [1, ",
                       kMaxBatchPerWorker, "], got ", layer.batch_per_worker,
                       " (set the cluster's batch_per_worker, --batch, or the layer's "
                       "batch_per_worker in the spec)"));
    }
    ASSIGN_OR_RETURN(const uint64_t element_bytes, ElementBytes(spec.element_type()));
    const ClusterShape cluster{config.workers, config.servers, layer.batch_per_worker,
                               config.colocated};
    layer.cost = CostOfLayer(spec, element_bytes, cluster);
    layer.ps_seconds = PsSeconds(layer.cost.ps_bytes, config.colocated, network);
    // The wire a PS layer would use: the job's lossy type where it pays, or the override's.
    poseidon::v1::ElementType ps_wire = poseidon::v1::ELEMENT_TYPE_F32;
    const auto forced_wire = config.wire_overrides.find(spec.name());
    const poseidon::v1::ElementType lossy =
        forced_wire != config.wire_overrides.end() ? forced_wire->second : config.lossy_wire;
    {
      layer.wire_overridden = forced_wire != config.wire_overrides.end();
      if (IsLossyWire(lossy)) {
        const SchemeVolume half = ScaleVolume(PsElements(layer.cost.parameters, cluster), 2);
        layer.cost.ps_lossy_bytes = half;
        layer.ps_lossy_seconds =
            PsSeconds(half, config.colocated, network) +
            static_cast<double>(layer.cost.parameters) * WireCastSecondsPerElement(lossy);
        if (layer.wire_overridden || *layer.ps_lossy_seconds < layer.ps_seconds) ps_wire = lossy;
      }
    }
    const double ps_best = IsLossyWire(ps_wire) ? *layer.ps_lossy_seconds : layer.ps_seconds;
    if (layer.cost.sfb_bytes.has_value()) {
      layer.sfb_seconds = SfbSeconds(*layer.cost.sfb_bytes, network);
      if (config.scheme_rule == SchemeRule::kTime) {
        layer.cost.scheme = *layer.sfb_seconds <= ps_best ? poseidon::v1::SYNC_SCHEME_SFB
                                                          : poseidon::v1::SYNC_SCHEME_PS;
      }
    }
    if (!config.allreduce) layer.cost.allreduce_bytes.reset();
    const auto forced_rank = config.lowrank_overrides.find(spec.name());
    const bool rank_forced = forced_rank != config.lowrank_overrides.end();
    // The wire an all-reduce layer would use (AR-16 where it pays, or the override's); a layer
    // with fewer elements than workers stays float32 (the agents' shards would be empty).
    poseidon::v1::ElementType allreduce_wire = poseidon::v1::ELEMENT_TYPE_F32;
    double allreduce_best = 0;
    RingChoice choice;
    if (layer.cost.allreduce_bytes.has_value()) {
      const double step = config.allreduce_step_seconds.value_or(0);
      layer.allreduce_seconds =
          AllreduceSeconds(*layer.cost.allreduce_bytes, config.workers, network, step);
      allreduce_best = *layer.allreduce_seconds;
      if (IsLossyWire(lossy) && layer.cost.parameters >= config.workers) {
        layer.cost.allreduce_lossy_bytes =
            ScaleVolume(AllreduceElements(layer.cost.parameters, cluster), 2);
        layer.allreduce_lossy_seconds =
            AllreduceSeconds(*layer.cost.allreduce_lossy_bytes, config.workers, network, step) +
            static_cast<double>(layer.cost.parameters) * WireCastSecondsPerElement(lossy);
        if (layer.wire_overridden || *layer.allreduce_lossy_seconds < allreduce_best) {
          allreduce_wire = lossy;
          allreduce_best = *layer.allreduce_lossy_seconds;
        }
      }
      // AR-LR: both factors' all-reduces and the arithmetic; not for a layer kept exact by its
      // wire override. A low-rank override's rank instead of the job's, chosen whatever the cost.
      LowRankShape view;
      const bool kept_exact = layer.wire_overridden && !IsLossyWire(lossy);
      const uint32_t rank = rank_forced ? forced_rank->second : config.lowrank_rank;
      if (rank > 0 && !kept_exact && LowRankPays(layer.shape, rank, &view) &&
          view.rows * view.cols == layer.cost.parameters) {
        const uint64_t p = view.rows * rank, q = view.cols * rank;
        const SchemeVolume vp = ScaleVolume(AllreduceElements(p, cluster), sizeof(float));
        const SchemeVolume vq = ScaleVolume(AllreduceElements(q, cluster), sizeof(float));
        layer.cost.allreduce_lowrank_bytes =
            SchemeVolume{vp.per_worker + vq.per_worker, vp.per_server + vq.per_server,
                         vp.per_machine + vq.per_machine};
        layer.allreduce_lowrank_seconds = LowRankSeconds(*layer.cost.allreduce_lowrank_bytes,
                                                         layer.cost.parameters, config.workers,
                                                         network, step);
        if (rank_forced || *layer.allreduce_lowrank_seconds < allreduce_best) {
          // The rank it goes at when on all-reduce, whatever scheme wins (LayerPlan.lowrank_rank).
          layer.cost.lowrank = rank;
          allreduce_best = *layer.allreduce_lowrank_seconds;
        }
      }
      const double best_other = layer.cost.scheme == poseidon::v1::SYNC_SCHEME_SFB
                                    ? *layer.sfb_seconds
                                    : ps_best;
      choice.has_ring = true;
      choice.other = layer.cost.scheme;
      choice.other_seconds = best_other;
      choice.ring_seconds = allreduce_best;
      choice.ring_wire = allreduce_wire;
      if (config.scheme_rule == SchemeRule::kTime && config.allreduce_step_seconds.has_value() &&
          allreduce_best < best_other) {
        layer.cost.scheme = poseidon::v1::SYNC_SCHEME_ALLREDUCE;
      }
    }
    choice.ps_wire = ps_wire;
    if (const auto forced = config.scheme_overrides.find(spec.name());
        forced != config.scheme_overrides.end()) {
      layer.cost.scheme = forced->second;  // checked above: PS, all-reduce, or SFB for FC
      layer.overridden = true;
    }
    if (rank_forced) {
      layer.lowrank_overridden = true;
      if (layer.cost.lowrank > 0) layer.cost.scheme = poseidon::v1::SYNC_SCHEME_ALLREDUCE;
    }
    // A member of an all-reduce bucket the agents formed from the world's first plan stays on
    // the ring (they refuse to move it).
    if (!fixed.empty() && fixed[i] != 0) {
      if (!choice.has_ring || (layer.overridden &&
                               layer.cost.scheme != poseidon::v1::SYNC_SCHEME_ALLREDUCE)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "layer ", i, " '", spec.name(), "' is in all-reduce bucket ", fixed[i],
            ", which the agents formed from the world's first plan: it stays on all-reduce",
            choice.has_ring ? "" : " (which this plan cannot use)"));
      }
      layer.cost.scheme = poseidon::v1::SYNC_SCHEME_ALLREDUCE;
    }
    choice.candidate = choice.has_ring && !layer.overridden && !layer.lowrank_overridden &&
                       (fixed.empty() || fixed[i] == 0);
    choices.push_back(choice);
    // Only a PS or all-reduce layer is on a lossy wire (an SFB layer stays exact).
    if (layer.cost.scheme == poseidon::v1::SYNC_SCHEME_PS) layer.cost.wire = ps_wire;
    if (layer.cost.scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE) {
      // Low rank sends float32 factors: its layer's wire is exact.
      layer.cost.wire = layer.cost.lowrank > 0 ? poseidon::v1::ELEMENT_TYPE_F32 : allreduce_wire;
    }
    layer.seconds = layer.cost.scheme == poseidon::v1::SYNC_SCHEME_SFB ? *layer.sfb_seconds
                    : layer.cost.scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE ? allreduce_best
                                                                               : ps_best;
    layer.compute = LayerComputeSeconds(spec, layer.batch_per_worker, gpu);
    if (!layer.compute.has_value() && report.compute_unknown_reason.empty()) {
      report.compute_unknown_reason =
          absl::StrCat("layer ", i, " '", spec.name(), "' has no measured times",
                       gpu == nullptr ? " and no GPU rate was given" : " and no FLOPs");
    }
    layer.ps_chunks = ChunkCount(layer.cost.parameters, element_bytes, config.block_bytes);
    // Every layer is partitioned, so its chunks do not depend on the schemes (planner.h, 3.).
    partitioned.push_back(PartitionInput{layer.index, layer.cost.parameters, element_bytes});
    report.layers.push_back(std::move(layer));
  }

  PlanRing(config, choices, report.compute_unknown_reason.empty(), report.layers);
  for (const LayerReport& layer : report.layers) {
    if (layer.cost.scheme == poseidon::v1::SYNC_SCHEME_SFB) ++report.sfb_layers;
    if (layer.cost.scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE) ++report.allreduce_layers;
    if (IsLossyWire(layer.cost.wire)) ++report.lossy_layers;
    if (layer.cost.scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE && layer.cost.lowrank > 0) {
      ++report.lowrank_layers;
    }
    if (layer.allreduce_bucket != 0) {
      ++report.allreduce_fused_layers;
      report.allreduce_buckets = std::max(report.allreduce_buckets, layer.allreduce_bucket);
    }
    Accumulate(layer.cost, layer.cost.scheme, layer.cost.wire, layer.seconds, config.colocated,
               report.plan);
    Accumulate(layer.cost, poseidon::v1::SYNC_SCHEME_PS, poseidon::v1::ELEMENT_TYPE_F32,
               layer.ps_seconds, config.colocated, report.ps_only);
  }

  ASSIGN_OR_RETURN(const std::vector<ChunkAssignment> chunks,
                   PartitionLayers(partitioned, config.servers, config.block_bytes));
  report.server_bytes = ServerLoads(chunks, config.servers);

  poseidon::v1::Plan& plan = result.plan;
  plan.set_job_id(config.job_id);
  plan.set_plan_epoch(config.plan_epoch);
  plan.set_effective_iteration(config.effective_iteration);
  plan.set_membership_epoch(config.membership_epoch);
  plan.set_max_chunk_bytes(config.block_bytes);
  for (uint32_t s = 0; s < config.servers; ++s) {
    plan.add_servers()->set_node_id(config.server_node_ids.empty() ? absl::StrCat("server-", s)
                                                                   : config.server_node_ids[s]);
  }
  for (const LayerReport& layer : report.layers) {
    poseidon::v1::LayerPlan* out = plan.add_layers();
    out->set_layer_index(layer.index);
    out->set_layer_name(layer.name);
    out->set_scheme(layer.cost.scheme);
    out->set_priority(layer.index);
    const SchemeVolume& volume = VolumeOf(layer.cost, layer.cost.scheme, layer.cost.wire);
    out->set_predicted_bytes_per_worker(ToBytes(volume.per_worker));
    if (IsLossyWire(layer.cost.wire)) out->set_wire_type(layer.cost.wire);
    out->set_lowrank_rank(layer.cost.lowrank);
    out->set_allreduce_bucket(layer.allreduce_bucket);
    out->set_predicted_seconds(layer.seconds);
  }
  // Chunks come grouped by layer in layer order, in offset order within a layer.
  for (const ChunkAssignment& chunk : chunks) {
    poseidon::v1::Chunk* out =
        plan.mutable_layers(static_cast<int>(chunk.layer_index))->add_chunks();
    out->set_key(chunk.key);
    out->set_offset(chunk.offset);
    out->set_length(chunk.length);
    out->set_server_index(chunk.server_index);
    report.layers[chunk.layer_index].chunks++;
    report.largest_chunk_bytes = std::max(report.largest_chunk_bytes, chunk.length);
  }

  const bool compute_known = report.compute_unknown_reason.empty();
  const FusionOptions fusion = FusionOptionsFor(config, compute_known);
  const std::vector<FusionLayer> fusion_layers =
      FusionLayers(report.layers, config.fusion == FusionRule::kCost);
  const FusionResult fused = PlanFusion(fusion_layers, fusion);
  report.buckets = fused.buckets;
  report.fusion_by_model = fused.model_consulted && fused.buckets > 0;
  if (fused.buckets > 0) {
    report.bucket_target_bytes = fused.target_bytes;
    plan.set_bucket_bytes(fused.target_bytes);
  }
  for (size_t i = 0; i < report.layers.size(); ++i) {
    report.layers[i].bucket = fused.bucket[i];
    plan.mutable_layers(static_cast<int>(i))->set_bucket(fused.bucket[i]);
    if (fused.bucket[i] != 0) ++report.fused_layers;
  }

  if (compute_known) {
    Predict(report.layers, /*use_plan=*/true, config.workers, fusion_layers, fused.bucket, fusion,
            report.plan);
    Predict(report.layers, /*use_plan=*/false, config.workers, fusion_layers, {}, fusion,
            report.ps_only);
  }
  return result;
}

}  // namespace poseidon::planner
