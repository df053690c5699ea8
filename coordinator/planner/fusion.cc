#include "coordinator/planner/fusion.h"

#include <algorithm>
#include <cmath>

#include "common/shm_layout.h"

namespace poseidon::planner {

uint64_t FusionTargetBytes(const FusionOptions& options) {
  if (options.max_bucket_bytes == 0 || !options.sync_seconds || !(options.message_seconds > 0)) {
    return 0;
  }
  // The transfer is linear in the bytes (time_model.h): measure its slope on 1 MiB.
  constexpr uint64_t kReference = uint64_t{1} << 20;
  const double transfer = options.sync_seconds(kReference) - options.message_seconds;
  if (!(transfer > 0)) return options.max_bucket_bytes & ~uint64_t{3};
  const double target =
      kFusionTransferPerMessage * options.message_seconds / transfer * static_cast<double>(kReference);
  if (!(target < static_cast<double>(options.max_bucket_bytes))) {
    return options.max_bucket_bytes & ~uint64_t{3};
  }
  return static_cast<uint64_t>(target) & ~uint64_t{3};
}

std::vector<LayerTiming> FusedTimings(const std::vector<FusionLayer>& layers,
                                      const std::vector<uint32_t>& bucket,
                                      const FusionOptions& options) {
  std::vector<LayerTiming> timings;
  timings.reserve(layers.size());
  for (const FusionLayer& layer : layers) timings.push_back(layer.timing);
  for (size_t i = 0; i < layers.size();) {
    size_t end = i + 1;
    if (bucket[i] != 0) {
      while (end < layers.size() && bucket[end] == bucket[i]) ++end;
    }
    if (end - i >= 2) {
      uint64_t bytes = 0;
      for (size_t j = i; j < end; ++j) {
        bytes += layers[j].bytes;
        timings[j].sync_seconds = 0;
        timings[j].pieces = 1;
      }
      const uint32_t wire = layers[i].wire;
      timings[i].sync_seconds = wire > 1 && options.wire_sync_seconds
                                    ? options.wire_sync_seconds(bytes, wire)
                                    : options.sync_seconds(bytes);
    }
    i = end;
  }
  return timings;
}

FusionResult PlanFusion(const std::vector<FusionLayer>& layers, const FusionOptions& options) {
  FusionResult result;
  result.bucket.assign(layers.size(), 0);
  result.target_bytes = FusionTargetBytes(options);
  const uint64_t target = result.target_bytes;
  if (target == 0 || layers.size() < 2) return result;
  const bool model = options.compute_known && layers.size() <= kFusionModelMaxLayers;
  result.model_consulted = model;

  // Working ids: every bucket opened gets a new one; renumbered in forward order at the end.
  std::vector<uint32_t>& assign = result.bucket;
  uint32_t open_id = 0;  // 0: no bucket open
  uint32_t next_id = 1;
  uint64_t open_bytes = 0, open_element = 0;
  uint32_t open_wire = 0;
  auto close = [&] {
    open_id = 0;
    open_bytes = 0;
  };
  for (size_t l = layers.size(); l-- > 0;) {
    const FusionLayer& layer = layers[l];
    if (!layer.eligible || layer.bytes >= target) {
      close();
      continue;
    }
    if (open_id != 0 &&
        (layer.element_bytes != open_element || layer.wire != open_wire ||
         open_bytes + layer.bytes > target)) {
      close();
    }
    if (open_id != 0 && model) {
      assign[l] = open_id;
      const double joined =
          PredictIteration(FusedTimings(layers, assign, options)).iteration_seconds;
      assign[l] = 0;
      const double alone =
          PredictIteration(FusedTimings(layers, assign, options)).iteration_seconds;
      if (joined > alone * (1 + 1e-9)) close();
    }
    if (open_id == 0) {
      open_id = next_id++;
      open_element = layer.element_bytes;
      open_wire = layer.wire;
    }
    assign[l] = open_id;
    open_bytes += layer.bytes;
  }

  // Forward-order numbers for buckets of two or more; a bucket of one is a layer alone.
  uint32_t number = 0;
  for (size_t i = 0; i < assign.size();) {
    size_t end = i + 1;
    if (assign[i] != 0) {
      while (end < assign.size() && assign[end] == assign[i]) ++end;
    }
    const uint32_t id = end - i >= 2 ? ++number : 0;
    for (size_t j = i; j < end; ++j) assign[j] = id;
    i = end;
  }
  result.buckets = number;
  return result;
}

std::vector<uint32_t> RingBuckets(const std::vector<RingLayer>& layers, uint64_t cap_bytes) {
  std::vector<uint32_t> bucket(layers.size(), 0);
  if (cap_bytes == 0) return bucket;
  uint32_t number = 0;
  std::vector<size_t> run;
  uint64_t offset = 0, run_start = 0, run_end = 0;
  auto close = [&] {
    if (run.size() >= 2) {
      ++number;
      for (size_t l : run) bucket[l] = number;
    }
    run.clear();
  };
  for (size_t i = 0; i < layers.size(); ++i) {
    const RingLayer& layer = layers[i];
    const uint64_t start = offset;
    offset = PSD_SHM_ALIGN_UP(offset + layer.bytes) + layer.factor_bytes;
    if (!layer.ring || layer.bytes >= cap_bytes) {
      close();
      continue;
    }
    if (!run.empty() && (start != PSD_SHM_ALIGN_UP(run_end) ||
                         start + layer.bytes - run_start > cap_bytes ||
                         layers[run.back()].wire != layer.wire)) {
      close();
    }
    if (run.empty()) run_start = start;
    run.push_back(i);
    run_end = start + layer.bytes;
  }
  close();
  return bucket;
}

}  // namespace poseidon::planner
