// The agent's GPU path (issue 9): the training process's layers live in a device arena it shares
// by CUDA IPC (common/shm_layout.h, "CUDA"). The stager opens the arena and the per-layer ready
// events, copies each layer's input device -> host into the (pinned) data segment on its own
// stream once the layer's ready event has fired, and copies results host -> device, recording
// the layer's done event the framework's stream waits on. SFB layers are rebuilt on the GPU
// with one cuBLAS GEMM over the gathered factors (sum_p U_p^T V_p == [U_0;..;U_P-1]^T [V_0;..]).
//
// One interface, two builds: with CUDA (cuda_stager.cc) and without (no_cuda_stager.cc, where
// OpenDeviceStager says so). Thread-safety: every method may be called from any thread.
// Callbacks passed to StageOut run on a CUDA runtime thread: they must not call CUDA.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/shm_layout.h"

namespace poseidon::agent {

using IpcHandle = std::array<uint8_t, PSD_CUDA_IPC_HANDLE_BYTES>;

// What the framework exported (validated by ShmEndpoint).
struct DeviceAttach {
  int device = 0;
  uint64_t arena_bytes = 0;
  IpcHandle arena{};
  std::vector<IpcHandle> ready_events;  // per layer
};

// A byte range of the arena (and the same range of the host data segment).
struct DeviceRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// Reports how long the device copies and rebuilds took (start: when queued; end: when the device
// finished). Set only when someone listens: it costs one host callback per operation.
using DeviceObserver = std::function<void(const char* what, uint32_t layer, absl::Time start,
                                          absl::Time end, uint64_t bytes)>;

class DeviceStager {
 public:
  virtual ~DeviceStager() = default;

  // The agent's done events, exported for the framework (one per layer).
  virtual std::vector<IpcHandle> DoneEvents() const = 0;

  // Pins host memory the copies use (the data segment, SFB inboxes); idempotent per range.
  virtual absl::Status PinHost(void* host, uint64_t bytes) = 0;

  // After the layer's ready event: copies each range device -> host (same offsets into `host`,
  // the data segment), in order; on_copied(i) runs once range i is on the host.
  virtual absl::Status StageOut(uint32_t layer, std::span<const DeviceRange> ranges,
                                std::function<void(size_t)> on_copied) = 0;

  // Copies one range host -> device (a result that has arrived).
  virtual absl::Status StageIn(uint32_t layer, DeviceRange range) = 0;

  // Records the layer's done event after everything StageIn / Rebuild queued for it.
  virtual absl::Status MarkDone(uint32_t layer) = 0;

  // SFB: grad (M x N row-major, at grad_offset of the arena) = sum over ranks p of U_p^T V_p,
  // U_p K x M, V_p K x N. Ours (rank `me`) are in the arena at u_offset / v_offset; the others'
  // are on the host, rank p's [U_p | V_p] at peers + p * K * (M + N) floats (p != me).
  struct SfbShape {
    uint64_t m = 0, n = 0, k = 0;
    uint32_t world = 1, me = 0;
    uint64_t grad_offset = 0, u_offset = 0, v_offset = 0;
    float scale = 1.0f;  // the sum's factor (1 / the ranks counted for a mean)
  };
  // Rank `peer`'s [U | V] for `iteration` has arrived (host memory, pinned or not): start its
  // copy to the GPU now, so that the rebuild finds it there. Optional: Rebuild copies what was
  // not staged. Two iterations may be in flight per layer (iteration parity selects the buffer).
  virtual absl::Status StagePeerFactors(uint32_t layer, const SfbShape& shape, uint64_t iteration,
                                        uint32_t peer, const float* factors) = 0;
  // `peers`: every rank's [U_p | V_p] for `iteration` at peers + p * K * (M + N) floats; ranks
  // already staged for this iteration are not copied again.
  virtual absl::Status Rebuild(uint32_t layer, const SfbShape& shape, uint64_t iteration,
                               const float* peers) = 0;

  virtual void SetObserver(DeviceObserver observer) = 0;
};

// Opens what the framework exported. `host` is the data segment (`host_bytes`, equal to the
// arena's size): it is pinned for the copies.
absl::StatusOr<std::unique_ptr<DeviceStager>> OpenDeviceStager(const DeviceAttach& attach,
                                                               void* host, uint64_t host_bytes);

// ---- Building blocks, public for tests and benchmarks (CUDA builds only) ----------------------
// Whether a CUDA device is usable here, and if not why (e.g. cudaGetDeviceCount's error).
absl::Status CudaDeviceAvailable();

}  // namespace poseidon::agent
