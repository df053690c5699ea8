// The CUDA implementation of DeviceStager: the plugin libposeidon_cuda_stager.so, which the
// agent loads (dlopen) when a training process attaches a CUDA arena, so that the agent itself
// neither needs the CUDA libraries nor loads cuBLAS before it is used. Linked directly by tests
// and benchmarks that build an arena in their own process (CUDA IPC handles cannot be opened by
// the process that exported them). CUDA builds only.
#pragma once
#include <cuda_runtime_api.h>

#include "agent/device_stager.h"

namespace poseidon::agent {

// Whether a CUDA device is usable (cudaGetDeviceCount's answer otherwise).
__attribute__((visibility("default"))) absl::Status CudaDeviceAvailableHere();

// A stager over an arena and ready events of this process (not owned).
__attribute__((visibility("default"))) absl::StatusOr<std::unique_ptr<DeviceStager>>
CreateLocalDeviceStager(
    int device, void* arena, uint64_t arena_bytes, void* host, uint64_t host_bytes,
    std::vector<cudaEvent_t> ready_events);

// The done event of `layer` of a stager made by CreateLocalDeviceStager.
__attribute__((visibility("default"))) cudaEvent_t LocalDoneEvent(DeviceStager& stager,
                                                                  uint32_t layer);

}  // namespace poseidon::agent
