// Turns the cost model's bytes into seconds: per-layer communication time on a link of a given
// bandwidth and latency, compute time from FLOPs and a GPU rate, and the iteration time of BSP
// training with wait-free backpropagation. Thread-safety: pure functions, safe from any thread.
#pragma once

// The communication model (docs/planner.md, "Time"):
//   - Every machine has one full-duplex network interface of `bandwidth` bytes/s in each
//     direction. Every flow of the cost model is symmetric (each byte a machine sends is matched
//     by one it receives: push/pull, factors out/factors in), so a machine moving V bytes per
//     iteration (the table counts both directions) is busy for V / (2·bandwidth) seconds.
//   - PS: a layer's chunks are pushed to their servers, aggregated, and pulled back: two
//     message legs, 2·latency, plus the busiest interface involved. Colocated that is one machine
//     (per-machine volume); otherwise the slower of a worker's interface (2·S bytes) and a server's
//     (2·P1·S/P2 bytes). The servers' share assumes the layer is spread evenly over them, which
//     the partitioner approximates over consecutive layers.
//   - SFB: one leg (factors go to all peers at once): latency + per-worker volume / (2·bandwidth).
//   - AR (ring all-reduce): 2·(P1−1) steps, each a leg to the next rank: 2·(P1−1)·max(latency,
//     measured step) + per-worker volume / (2·bandwidth). The steps pipeline the bytes, not the
//     latencies; the measured step (a 1-element all-reduce / 2·(P1−1)) holds the collective
//     library's per-message cost.
//   Reconstructing the gradient from factors (a K×M by K×N product per peer on the GPU) is not
//   counted; neither are server CPU time nor congestion in the switch.
//
// The iteration model (PredictIteration): one worker's GPU runs forward for layers 0..L−1, then
// backward L−1..0; layer l's gradient is ready for synchronisation when its backward ends (WFBP).
// The network interface is one server for all layers, working in pieces (a PS layer's chunks; an
// SFB layer is one piece): whenever it is free it takes the next piece of the ready layer with the
// lowest index (priority), so an urgent layer waits for at most one piece of another. The next
// iteration's forward of layer l waits for layer l's synchronisation (and for layer l−1's forward).
// The iteration time is the steady state period, from one backward start to the next; with no
// communication it equals the compute time Σ(forward + backward). Speed-up at P1 workers = P1 ·
// compute / iteration.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/planner/cost_model.h"
#include "poseidon/v1/model.pb.h"

namespace poseidon::planner {

// A link as the time model sees it.
struct NetworkModel {
  double bandwidth_bytes_per_second = 0;  // per direction, per machine
  double latency_seconds = 0;             // per message leg
};

// Seconds one iteration's PS synchronisation of a layer takes (`ps` in bytes).
double PsSeconds(const SchemeVolume& ps, bool colocated, const NetworkModel& network);

// Seconds one iteration's SFB synchronisation of a layer takes (`sfb` in bytes).
double SfbSeconds(const SchemeVolume& sfb, const NetworkModel& network);

// Seconds one iteration's ring all-reduce of a layer takes among `workers` (`allreduce` in bytes),
// each of its 2·(P1−1) steps costing at least `step_seconds` (the measured cost of a step).
double AllreduceSeconds(const SchemeVolume& allreduce, uint32_t workers,
                        const NetworkModel& network, double step_seconds = 0);

// Seconds one iteration of a layer of `parameters` elements takes at low rank (AR-LR): two ring
// all-reduces (P's, then Q's: twice the 2·(P1−1) steps) moving `factors` bytes in all, and the
// agent's arithmetic (kLowRankSecondsPerElement an element). The planner's column and the
// simulator's layer.
double LowRankSeconds(const SchemeVolume& factors, uint64_t parameters, uint32_t workers,
                      const NetworkModel& network, double step_seconds = 0);

// A GPU's sustained floating-point rate for the compute model.
struct GpuRate {
  std::string name;  // "titanx", or the number as given
  double flops_per_second = 0;
};

// The named rates, peak dense fp32 from the vendors' data sheets (docs/planner.md):
// titanx 6.1e12 (GTX Titan X, Maxwell: 3072 cores × 1.0 GHz × 2; the GPU of the Poseidon paper),
// v100 15.7e12 (SXM2), a100 19.5e12 (SXM4, fp32 without tensor cores), h100 67e12 (SXM5).
std::vector<GpuRate> KnownGpuRates();

// A name from KnownGpuRates (case-insensitive), or a positive FLOP/s number with an optional
// G/T/P prefix and optional "FLOPS"/"FLOP/s": "12.5T", "8e12", "900GFLOPS".
absl::StatusOr<GpuRate> ParseGpuRate(absl::string_view text);

// Compute seconds of one layer for a batch of `batch` samples: the spec's measured times when
// both are present, else its FLOPs (per sample) × batch / rate when both are present and a rate is
// given, else nullopt.
struct ComputeSeconds {
  double forward = 0;
  double backward = 0;
};
std::optional<ComputeSeconds> LayerComputeSeconds(const poseidon::v1::LayerSpec& layer,
                                                  uint32_t batch, const GpuRate* gpu);

// One layer's inputs to the iteration model.
struct LayerTiming {
  double forward_seconds = 0;
  double backward_seconds = 0;
  double sync_seconds = 0;
  // The sync is sent as this many equal pieces (0 counts as 1; more than 4096 as 4096).
  uint64_t pieces = 1;
};

// The iteration model above, layers in forward order.
struct IterationPrediction {
  double compute_seconds = 0;  // Σ forward + backward
  double sync_seconds = 0;     // Σ synchronisation (the interface's busy time)
  double iteration_seconds = 0;
};
IterationPrediction PredictIteration(const std::vector<LayerTiming>& layers);

}  // namespace poseidon::planner
