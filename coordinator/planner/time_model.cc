#include "coordinator/planner/time_model.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace poseidon::planner {

double PsSeconds(const SchemeVolume& ps, bool colocated, const NetworkModel& network) {
  const double busiest = colocated ? ps.per_machine : std::max(ps.per_worker, ps.per_server);
  return 2 * network.latency_seconds + busiest / (2 * network.bandwidth_bytes_per_second);
}

double SfbSeconds(const SchemeVolume& sfb, const NetworkModel& network) {
  return network.latency_seconds + sfb.per_worker / (2 * network.bandwidth_bytes_per_second);
}

double AllreduceSeconds(const SchemeVolume& allreduce, uint32_t workers,
                        const NetworkModel& network, double step_seconds) {
  const double steps = 2.0 * (std::max<uint32_t>(workers, 1) - 1);
  return steps * std::max(network.latency_seconds, step_seconds) +
         allreduce.per_worker / (2 * network.bandwidth_bytes_per_second);
}

double LowRankSeconds(const SchemeVolume& factors, uint64_t parameters, uint32_t workers,
                      const NetworkModel& network, double step_seconds) {
  const double steps = 2.0 * (std::max<uint32_t>(workers, 1) - 1);
  return 2 * steps * std::max(network.latency_seconds, step_seconds) +
         factors.per_worker / (2 * network.bandwidth_bytes_per_second) +
         static_cast<double>(parameters) * kLowRankSecondsPerElement;
}

std::vector<GpuRate> KnownGpuRates() {
  return {
      {"titanx", 6.1e12},
      {"v100", 15.7e12},
      {"a100", 19.5e12},
      {"h100", 67e12},
  };
}

absl::StatusOr<GpuRate> ParseGpuRate(absl::string_view text) {
  const std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  for (const GpuRate& known : KnownGpuRates()) {
    if (lower == known.name) return known;
  }
  absl::string_view rest = lower;
  if (absl::ConsumeSuffix(&rest, "flop/s") || absl::ConsumeSuffix(&rest, "flops")) {
    rest = absl::StripTrailingAsciiWhitespace(rest);
  }
  double scale = 1;
  if (absl::ConsumeSuffix(&rest, "g")) {
    scale = 1e9;
  } else if (absl::ConsumeSuffix(&rest, "t")) {
    scale = 1e12;
  } else if (absl::ConsumeSuffix(&rest, "p")) {
    scale = 1e15;
  }
  double value = 0;
  if (rest.empty() || !absl::SimpleAtod(rest, &value) || !std::isfinite(value * scale) ||
      value <= 0) {
    std::vector<std::string> names;
    for (const GpuRate& known : KnownGpuRates()) names.push_back(known.name);
    return absl::InvalidArgumentError(absl::StrCat("gpu '", text, "' is neither a known GPU (",
                                                   absl::StrJoin(names, ", "),
                                                   ") nor a positive FLOP/s rate such as 12.5T"));
  }
  return GpuRate{std::string(absl::StripAsciiWhitespace(text)), value * scale};
}

std::optional<ComputeSeconds> LayerComputeSeconds(const poseidon::v1::LayerSpec& layer,
                                                  uint32_t batch, const GpuRate* gpu) {
  if (layer.has_forward_time_ns() && layer.has_backward_time_ns()) {
    return ComputeSeconds{static_cast<double>(layer.forward_time_ns()) * 1e-9,
                          static_cast<double>(layer.backward_time_ns()) * 1e-9};
  }
  if (gpu != nullptr && layer.has_forward_flops() && layer.has_backward_flops()) {
    const double samples = batch;
    return ComputeSeconds{
        static_cast<double>(layer.forward_flops()) * samples / gpu->flops_per_second,
        static_cast<double>(layer.backward_flops()) * samples / gpu->flops_per_second};
  }
  return std::nullopt;
}

namespace {

// Pieces beyond a few thousand per layer change nothing but the run time of the simulation.
constexpr uint64_t kMaxPiecesPerLayer = 4096;

uint64_t Pieces(const LayerTiming& layer) {
  return std::clamp<uint64_t>(layer.pieces, 1, kMaxPiecesPerLayer);
}

}  // namespace

IterationPrediction PredictIteration(const std::vector<LayerTiming>& layers) {
  IterationPrediction out;
  const size_t count = layers.size();
  // Backward, top layer first, starting at t = 0: ready[l] is when layer l's gradient exists.
  std::vector<double> ready(count);
  double t = 0;
  for (size_t i = count; i-- > 0;) {
    t += layers[i].backward_seconds;
    ready[i] = t;
    out.compute_seconds += layers[i].forward_seconds + layers[i].backward_seconds;
    out.sync_seconds += layers[i].sync_seconds;
  }
  const double backward_end = t;

  // The interface: piece by piece, the ready layer with the lowest index first. Layers become
  // ready in decreasing index order, so `next` walks down from the top.
  std::vector<double> synced(count);
  std::vector<uint64_t> left(count);
  for (size_t l = 0; l < count; ++l) left[l] = Pieces(layers[l]);
  std::set<size_t> waiting;
  size_t next = count;  // layers [next, count) have been made ready
  double link = 0;
  for (size_t done = 0; done < count;) {
    while (next > 0 && ready[next - 1] <= link) waiting.insert(--next);
    if (waiting.empty()) {
      link = ready[next - 1];
      waiting.insert(--next);
    }
    const size_t l = *waiting.begin();
    link += layers[l].sync_seconds / static_cast<double>(Pieces(layers[l]));
    if (--left[l] == 0) {
      synced[l] = link;
      waiting.erase(waiting.begin());
      ++done;
    }
  }

  // The next forward pass: layer l starts once layer l−1's forward and layer l's sync are done.
  t = backward_end;
  for (size_t l = 0; l < count; ++l) t = std::max(t, synced[l]) + layers[l].forward_seconds;
  out.iteration_seconds = t;  // the next backward starts here; this one started at 0
  return out;
}

}  // namespace poseidon::planner
