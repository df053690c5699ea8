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

  const NetworkModel network{config.bandwidth_bytes_per_second, config.latency_seconds};
  const GpuRate* gpu = config.gpu.has_value() ? &*config.gpu : nullptr;
  PlanResult result;
  PlanReport& report = result.report;
  std::vector<PartitionInput> partitioned;  // every layer, whatever its scheme

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
      if (config.scheme_rule == SchemeRule::kTime && config.allreduce_step_seconds.has_value() &&
          allreduce_best < best_other) {
        layer.cost.scheme = poseidon::v1::SYNC_SCHEME_ALLREDUCE;
      }
    }
    if (const auto forced = config.scheme_overrides.find(spec.name());
        forced != config.scheme_overrides.end()) {
      layer.cost.scheme = forced->second;  // checked above: PS, all-reduce, or SFB for FC
      layer.overridden = true;
    }
    if (rank_forced) {
      layer.lowrank_overridden = true;
      if (layer.cost.lowrank > 0) layer.cost.scheme = poseidon::v1::SYNC_SCHEME_ALLREDUCE;
    }
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
    if (layer.cost.scheme == poseidon::v1::SYNC_SCHEME_SFB) ++report.sfb_layers;
    if (layer.cost.scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE) ++report.allreduce_layers;
    if (IsLossyWire(layer.cost.wire)) ++report.lossy_layers;
    if (layer.cost.scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE && layer.cost.lowrank > 0) {
      ++report.lowrank_layers;
    }
    Accumulate(layer.cost, layer.cost.scheme, layer.cost.wire, layer.seconds, config.colocated,
               report.plan);
    Accumulate(layer.cost, poseidon::v1::SYNC_SCHEME_PS, poseidon::v1::ELEMENT_TYPE_F32,
               layer.ps_seconds, config.colocated, report.ps_only);
    report.layers.push_back(std::move(layer));
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
