#include "tools/plan_output.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "coordinator/planner/model_spec.h"
#include "google/protobuf/util/json_util.h"
#include "tools/json_writer.h"

namespace poseidon::tools {
namespace {

using planner::LayerReport;
using planner::PlannerConfig;
using planner::PlanResult;
using planner::SchemeTotals;
using planner::SchemeVolume;

const char* KindName(poseidon::v1::LayerKind kind) {
  switch (kind) {
    case poseidon::v1::LAYER_KIND_FC:
      return "fc";
    case poseidon::v1::LAYER_KIND_CONV:
      return "conv";
    case poseidon::v1::LAYER_KIND_BIAS:
      return "bias";
    case poseidon::v1::LAYER_KIND_OTHER:
      return "other";
    default:
      return "unknown";
  }
}

const char* SchemeName(poseidon::v1::SyncScheme scheme) {
  return scheme == poseidon::v1::SYNC_SCHEME_SFB         ? "SFB"
         : scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE ? "AR"
                                                         : "PS";
}

// "13.5 KiB", "784.0 MiB", "512 B".
std::string HumanBytes(double bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return absl::StrFormat("%.0f B", bytes);
  double value = bytes;
  int unit = -1;
  while (value >= 1024 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

// "102,760,448".
std::string Thousands(uint64_t value) {
  std::string digits = absl::StrCat(value);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

// Seconds as milliseconds with three decimals.
std::string Millis(double seconds) {
  return absl::StrFormat("%.3f", seconds * 1e3);
}

std::string Seconds(double seconds) {
  return seconds >= 1 ? absl::StrFormat("%.3f s", seconds)
                      : absl::StrFormat("%.1f ms", seconds * 1e3);
}

std::string ShapeText(const std::vector<uint64_t>& shape) {
  return absl::StrJoin(shape, "x");
}

// A table of text cells; columns are left-aligned unless marked numeric.
class TextTable {
 public:
  explicit TextTable(std::vector<bool> right_aligned) : right_(std::move(right_aligned)) {}
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string Render() const {
    std::vector<size_t> width(right_.size(), 0);
    for (const auto& row : rows_) {
      for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
        width[c] = std::max(width[c], row[c].size());
      }
    }
    std::string out;
    for (const auto& row : rows_) {
      std::string line;
      for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
        const std::string pad(width[c] - row[c].size(), ' ');
        absl::StrAppend(&line, c == 0 ? "" : "  ", right_[c] ? pad : "", row[c],
                        right_[c] ? "" : pad);
      }
      while (!line.empty() && line.back() == ' ') line.pop_back();
      absl::StrAppend(&out, line, "\n");
    }
    return out;
  }

 private:
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

std::string GpuText(const PlannerConfig& config) {
  if (!config.gpu.has_value()) return "none";
  return absl::StrFormat("%s (%.1f TFLOP/s)", config.gpu->name,
                         config.gpu->flops_per_second / 1e12);
}

std::string BatchText(const PlannerConfig& config) {
  return config.batch_per_worker == 0 ? std::string("from the spec")
                                      : absl::StrCat(config.batch_per_worker);
}

double Mean(const std::vector<uint64_t>& values) {
  if (values.empty()) return 0;
  return static_cast<double>(std::accumulate(values.begin(), values.end(), uint64_t{0})) /
         static_cast<double>(values.size());
}

void WriteVolume(JsonWriter& w, const SchemeVolume& volume, double seconds) {
  w.BeginObject();
  w.Key("bytes_per_worker");
  w.Number(volume.per_worker);
  w.Key("bytes_per_server");
  w.Number(volume.per_server);
  w.Key("bytes_per_machine");
  w.Number(volume.per_machine);
  w.Key("seconds");
  w.Number(seconds);
  w.EndObject();
}

void WriteTotals(JsonWriter& w, const SchemeTotals& totals) {
  w.BeginObject();
  w.Key("bytes_per_worker");
  w.Number(totals.bytes_per_worker);
  w.Key("bytes_per_server");
  w.Number(totals.bytes_per_server);
  w.Key("bytes_per_machine");
  w.Number(totals.bytes_per_machine);
  w.Key("compared_bytes");
  w.Number(totals.compared_bytes);
  w.Key("sync_seconds");
  w.Number(totals.sync_seconds);
  w.Key("compute_seconds");
  totals.iteration.has_value() ? w.Number(totals.iteration->compute_seconds) : w.Null();
  w.Key("iteration_seconds");
  totals.iteration.has_value() ? w.Number(totals.iteration->iteration_seconds) : w.Null();
  w.Key("speedup");
  totals.speedup.has_value() ? w.Number(*totals.speedup) : w.Null();
  w.EndObject();
}

}  // namespace

std::string FormatPlanTable(const poseidon::v1::ModelSpec& model, const PlannerConfig& config,
                            const PlanResult& result) {
  const planner::PlanReport& report = result.report;
  std::string out;
  absl::StrAppend(&out, "model    ", model.name(), ": ", model.layers_size(), " tensors, ",
                  Thousands(planner::ParameterCount(model)), " parameters\n");
  absl::StrAppendFormat(&out,
                        "cluster  %u workers, %u servers%s, K = %s, %s per direction, latency %s, "
                        "block %s, gpu %s\n",
                        config.workers, config.servers, config.colocated ? " (colocated)" : "",
                        BatchText(config), FormatBandwidth(config.bandwidth_bytes_per_second),
                        absl::FormatDuration(absl::Seconds(config.latency_seconds)),
                        FormatByteSize(config.block_bytes), GpuText(config));
  absl::StrAppend(
      &out, "rule     an FC layer uses SFB when 2K(P1-1)(M+N) <= ",
      config.colocated ? "2MN(P1+P2-2)/P2 (bytes per machine)" : "2MN (bytes per worker)",
      "; every other layer uses PS\n\n");

  std::vector<bool> right = {true, false, false, false, true, false, true, true};
  std::vector<std::string> header = {"#",          "layer",  "kind",      "shape",
                                     "parameters", "scheme", "PS/worker", "PS/server"};
  if (config.colocated) {
    right.push_back(true);
    header.push_back("PS/machine");
  }
  for (const char* column : {"SFB/worker", "AR/worker"}) {
    right.push_back(true);
    header.emplace_back(column);
  }
  // The PS-16 column (and AR-16 where all-reduce is possible) and the wire chosen, when the job
  // allows a lossy wire anywhere.
  const bool lossy_column = std::any_of(report.layers.begin(), report.layers.end(),
                                        [](const LayerReport& l) { return l.ps_lossy_seconds; });
  const bool lossy_allreduce_column =
      std::any_of(report.layers.begin(), report.layers.end(),
                  [](const LayerReport& l) { return l.allreduce_lossy_seconds; });
  if (lossy_column) {
    right.push_back(true);
    header.emplace_back("PS-16/worker");
    if (lossy_allreduce_column) {
      right.push_back(true);
      header.emplace_back("AR-16/worker");
    }
    right.push_back(false);
    header.emplace_back("wire");
  }
  // The AR-LR column and the rank chosen, when the job allows a low rank anywhere it shrinks.
  const bool lowrank_column =
      std::any_of(report.layers.begin(), report.layers.end(),
                  [](const LayerReport& l) { return l.allreduce_lowrank_seconds; });
  if (lowrank_column) {
    right.push_back(true);
    header.emplace_back("AR-LR/worker");
    right.push_back(true);
    header.emplace_back("rank");
  }
  for (const char* column : {"chunks", "sync ms"}) {
    right.push_back(true);
    header.emplace_back(column);
  }
  TextTable table(right);
  table.Add(header);
  for (const LayerReport& layer : report.layers) {
    std::vector<std::string> row = {absl::StrCat(layer.index),
                                    layer.name,
                                    KindName(layer.kind),
                                    ShapeText(layer.shape),
                                    Thousands(layer.cost.parameters),
                                    SchemeName(layer.cost.scheme),
                                    HumanBytes(layer.cost.ps_bytes.per_worker),
                                    HumanBytes(layer.cost.ps_bytes.per_server)};
    if (config.colocated) row.push_back(HumanBytes(layer.cost.ps_bytes.per_machine));
    row.push_back(layer.cost.sfb_bytes.has_value() ? HumanBytes(layer.cost.sfb_bytes->per_worker)
                                                   : "-");
    row.push_back(layer.cost.allreduce_bytes.has_value()
                      ? HumanBytes(layer.cost.allreduce_bytes->per_worker)
                      : "-");
    if (lossy_column) {
      row.push_back(layer.cost.ps_lossy_bytes.has_value()
                        ? HumanBytes(layer.cost.ps_lossy_bytes->per_worker)
                        : "-");
      if (lossy_allreduce_column) {
        row.push_back(layer.cost.allreduce_lossy_bytes.has_value()
                          ? HumanBytes(layer.cost.allreduce_lossy_bytes->per_worker)
                          : "-");
      }
      row.push_back(absl::StrCat(planner::WireTypeName(layer.cost.wire), layer.wire_overridden ? "*" : ""));
    }
    if (lowrank_column) {
      row.push_back(layer.cost.allreduce_lowrank_bytes.has_value()
                        ? HumanBytes(layer.cost.allreduce_lowrank_bytes->per_worker)
                        : "-");
      const bool low = layer.cost.lowrank > 0 &&
                       layer.cost.scheme == poseidon::v1::SYNC_SCHEME_ALLREDUCE;
      row.push_back(absl::StrCat(low ? absl::StrCat(layer.cost.lowrank) : "-",
                                 layer.lowrank_overridden ? "*" : ""));
    }
    row.push_back(absl::StrCat(layer.chunks));
    row.push_back(Millis(layer.seconds));
    table.Add(std::move(row));
  }
  absl::StrAppend(&out, table.Render(), "\n");

  const SchemeTotals& plan = report.plan;
  const SchemeTotals& ps = report.ps_only;
  const char* compared = config.colocated ? "bytes per machine" : "bytes per worker";
  TextTable totals({false, true, true});
  totals.Add({"per iteration", "plan (HybComm)", "PS only"});
  totals.Add({compared, HumanBytes(plan.compared_bytes), HumanBytes(ps.compared_bytes)});
  totals.Add(
      {"bytes per server", HumanBytes(plan.bytes_per_server), HumanBytes(ps.bytes_per_server)});
  totals.Add({"synchronisation time", Seconds(plan.sync_seconds), Seconds(ps.sync_seconds)});
  if (plan.iteration.has_value() && ps.iteration.has_value()) {
    totals.Add({"compute time", Seconds(plan.iteration->compute_seconds),
                Seconds(ps.iteration->compute_seconds)});
    totals.Add({"iteration time (WFBP)", Seconds(plan.iteration->iteration_seconds),
                Seconds(ps.iteration->iteration_seconds)});
    totals.Add({absl::StrCat("speed-up at ", config.workers, " workers"),
                plan.speedup.has_value() ? absl::StrFormat("%.2f", *plan.speedup) : "-",
                ps.speedup.has_value() ? absl::StrFormat("%.2f", *ps.speedup) : "-"});
  }
  absl::StrAppend(&out, totals.Render());
  if (ps.compared_bytes > 0) {
    absl::StrAppendFormat(&out,
                          "the plan moves %.3f of PS-only's %s (%u of %d layers on SFB, %u on "
                          "ring all-reduce)\n",
                          plan.compared_bytes / ps.compared_bytes, compared, report.sfb_layers,
                          model.layers_size(), report.allreduce_layers);
  }
  if (!report.compute_unknown_reason.empty()) {
    absl::StrAppend(&out, "iteration time and speed-up unknown: ", report.compute_unknown_reason,
                    "\n");
  }
  if (lossy_column) {
    absl::StrAppend(&out, "wire     ", report.lossy_layers, " of ", model.layers_size(),
                    " layers lossy (PS-16", lossy_allreduce_column ? " or AR-16" : "",
                    " where it predicts less time than fp32, casts included",
                    "; * an operator's override)\n");
  }
  if (lowrank_column) {
    absl::StrAppend(&out, "lowrank  ", report.lowrank_layers, " of ", model.layers_size(),
                    " layers at low rank (AR-LR, PowerSGD: ",
                    config.lowrank_rank > 0
                        ? absl::StrCat("at rank ", config.lowrank_rank,
                                       " where it predicts less time than the all-reduce, "
                                       "arithmetic included")
                        : std::string("the job allows none"),
                    config.lowrank_overrides.empty() ? "" : "; * an operator's override", ")\n");
  }
  if (!report.server_bytes.empty()) {
    const auto [min, max] =
        std::minmax_element(report.server_bytes.begin(), report.server_bytes.end());
    // Every layer's chunks are placed, SFB layers' too (a later epoch may move them to PS).
    absl::StrAppend(&out, "servers  chunk bytes placed per server: min ", HumanBytes(*min),
                    ", mean ", HumanBytes(Mean(report.server_bytes)), ", max ", HumanBytes(*max),
                    " (largest chunk ", HumanBytes(report.largest_chunk_bytes), ")\n");
  }
  if (report.buckets > 0) {
    absl::StrAppend(&out, "fusion   ", report.fused_layers, " small PS layers in ",
                    report.buckets, " buckets of at most ", HumanBytes(report.bucket_target_bytes),
                    report.fusion_by_model ? " (ends chosen by the iteration model)"
                                           : " (by size: compute unknown)",
                    "\n");
  } else {
    absl::StrAppend(&out, "fusion   none\n");
  }
  if (report.allreduce_buckets > 0) {
    absl::StrAppend(&out, "ring     ", report.allreduce_fused_layers, " all-reduce layers in ",
                    report.allreduce_buckets, " buckets of at most ",
                    HumanBytes(config.allreduce_bucket_bytes),
                    " (one collective each, as the agents fuse them)\n");
  }
  return out;
}

absl::StatusOr<std::string> FormatPlanJson(const poseidon::v1::ModelSpec& model,
                                           const PlannerConfig& config, const PlanResult& result) {
  const planner::PlanReport& report = result.report;
  std::string plan_json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;  // offset 0 and index 0 too
  const auto printed =
      google::protobuf::util::MessageToJsonString(result.plan, &plan_json, options);
  if (!printed.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot print the plan as JSON: ",
                     std::string(printed.message().data(), printed.message().size())));
  }

  JsonWriter w;
  w.BeginObject();
  w.Key("model");
  w.BeginObject();
  w.Key("name");
  w.String(model.name());
  w.Key("description");
  w.String(model.description());
  w.Key("tensors");
  w.Unsigned(static_cast<uint64_t>(model.layers_size()));
  w.Key("parameters");
  w.Unsigned(planner::ParameterCount(model));
  w.EndObject();

  w.Key("cluster");
  w.BeginObject();
  w.Key("workers");
  w.Unsigned(config.workers);
  w.Key("servers");
  w.Unsigned(config.servers);
  w.Key("batch_per_worker");
  config.batch_per_worker == 0 ? w.Null() : w.Unsigned(config.batch_per_worker);
  w.Key("colocated");
  w.Bool(config.colocated);
  w.Key("bandwidth_bytes_per_second");
  w.Number(config.bandwidth_bytes_per_second);
  w.Key("latency_seconds");
  w.Number(config.latency_seconds);
  w.Key("block_size_bytes");
  w.Unsigned(config.block_bytes);
  w.Key("gpu");
  config.gpu.has_value() ? w.String(config.gpu->name) : w.Null();
  w.Key("gpu_flops_per_second");
  config.gpu.has_value() ? w.Number(config.gpu->flops_per_second) : w.Null();
  w.Key("compared");
  w.String(config.colocated ? "bytes_per_machine" : "bytes_per_worker");
  w.EndObject();

  w.Key("layers");
  w.BeginArray();
  for (const LayerReport& layer : report.layers) {
    w.BeginObject();
    w.Key("index");
    w.Unsigned(layer.index);
    w.Key("name");
    w.String(layer.name);
    w.Key("kind");
    w.String(KindName(layer.kind));
    w.Key("shape");
    w.BeginArray();
    for (const uint64_t d : layer.shape) w.Unsigned(d);
    w.EndArray();
    w.Key("parameters");
    w.Unsigned(layer.cost.parameters);
    w.Key("bytes");
    w.Unsigned(layer.cost.parameters * layer.cost.element_bytes);
    w.Key("batch_per_worker");
    w.Unsigned(layer.batch_per_worker);
    w.Key("scheme");
    w.String(SchemeName(layer.cost.scheme));
    w.Key("priority");
    w.Unsigned(layer.index);
    w.Key("chunks");
    w.Unsigned(layer.chunks);
    w.Key("ps");
    WriteVolume(w, layer.cost.ps_bytes, layer.ps_seconds);
    w.Key("sfb");
    if (layer.cost.sfb_bytes.has_value()) {
      WriteVolume(w, *layer.cost.sfb_bytes, *layer.sfb_seconds);
    } else {
      w.Null();
    }
    w.Key("allreduce");
    if (layer.cost.allreduce_bytes.has_value()) {
      WriteVolume(w, *layer.cost.allreduce_bytes, *layer.allreduce_seconds);
    } else {
      w.Null();
    }
    w.Key("ps_lossy");
    if (layer.cost.ps_lossy_bytes.has_value()) {
      WriteVolume(w, *layer.cost.ps_lossy_bytes, *layer.ps_lossy_seconds);
    } else {
      w.Null();
    }
    w.Key("allreduce_lossy");
    if (layer.cost.allreduce_lossy_bytes.has_value()) {
      WriteVolume(w, *layer.cost.allreduce_lossy_bytes, *layer.allreduce_lossy_seconds);
    } else {
      w.Null();
    }
    w.Key("allreduce_lowrank");
    if (layer.cost.allreduce_lowrank_bytes.has_value()) {
      WriteVolume(w, *layer.cost.allreduce_lowrank_bytes, *layer.allreduce_lowrank_seconds);
    } else {
      w.Null();
    }
    w.Key("lowrank_rank");
    w.Unsigned(layer.cost.lowrank);
    w.Key("lowrank_overridden");
    w.Bool(layer.lowrank_overridden);
    w.Key("wire");
    w.String(planner::WireTypeName(layer.cost.wire));
    w.Key("sync_seconds");
    w.Number(layer.seconds);
    w.Key("forward_seconds");
    layer.compute.has_value() ? w.Number(layer.compute->forward) : w.Null();
    w.Key("backward_seconds");
    layer.compute.has_value() ? w.Number(layer.compute->backward) : w.Null();
    w.EndObject();
  }
  w.EndArray();

  w.Key("totals");
  w.BeginObject();
  w.Key("plan");
  WriteTotals(w, report.plan);
  w.Key("ps_only");
  WriteTotals(w, report.ps_only);
  w.Key("bytes_ratio");
  report.ps_only.compared_bytes > 0
      ? w.Number(report.plan.compared_bytes / report.ps_only.compared_bytes)
      : w.Null();
  w.Key("sfb_layers");
  w.Unsigned(report.sfb_layers);
  w.Key("allreduce_layers");
  w.Unsigned(report.allreduce_layers);
  w.Key("lossy_layers");
  w.Unsigned(report.lossy_layers);
  w.Key("lowrank_layers");
  w.Unsigned(report.lowrank_layers);
  w.Key("compute_unknown_reason");
  report.compute_unknown_reason.empty() ? w.Null() : w.String(report.compute_unknown_reason);
  w.Key("server_bytes");
  w.BeginArray();
  for (const uint64_t bytes : report.server_bytes) w.Unsigned(bytes);
  w.EndArray();
  w.Key("largest_chunk_bytes");
  w.Unsigned(report.largest_chunk_bytes);
  w.Key("buckets");
  w.Unsigned(report.buckets);
  w.Key("fused_layers");
  w.Unsigned(report.fused_layers);
  w.Key("bucket_target_bytes");
  w.Unsigned(report.bucket_target_bytes);
  w.Key("fusion_by_model");
  w.Bool(report.fusion_by_model);
  w.Key("allreduce_buckets");
  w.Unsigned(report.allreduce_buckets);
  w.Key("allreduce_fused_layers");
  w.Unsigned(report.allreduce_fused_layers);
  w.Key("allreduce_bucket_bytes");
  w.Unsigned(config.allreduce_bucket_bytes);
  w.EndObject();

  w.Key("plan");
  w.Raw(plan_json);
  w.EndObject();
  return w.str();
}

}  // namespace poseidon::tools
