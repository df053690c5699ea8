// cuda_bench: the GPU path's building blocks against what the hardware gives, in one run.
//   staging    the agent's chunked device->host staging (StageOut: wait for the ready event,
//              copy chunk by chunk into the registered host segment, one callback per chunk)
//              and host->device results (StageIn + MarkDone), against one plain cudaMemcpy of
//              the same bytes between cudaMallocHost memory and the device.
//   rebuild    the SFB rebuild (gather every rank's factors to the GPU + one cuBLAS SGEMM)
//              against the cuBLAS SGEMM alone on factors already on the GPU.
// Prints a table; ratios are reference time / our time (1.0 = as fast as the reference).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <vector>

#include "agent/cuda_stager.h"

namespace {

using poseidon::agent::CreateLocalDeviceStager;
using poseidon::agent::DeviceRange;
using poseidon::agent::DeviceStager;
using poseidon::agent::LocalDoneEvent;
using Clock = std::chrono::steady_clock;

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "cuda_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void Staging(uint64_t bytes, uint64_t chunk, int reps) {
  unsigned char* arena = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&arena), bytes), "cudaMalloc");
  Check(cudaMemset(arena, 1, bytes), "cudaMemset");
  auto* host = static_cast<unsigned char*>(std::aligned_alloc(4096, bytes));
  std::memset(host, 0, bytes);
  unsigned char* pinned = nullptr;
  Check(cudaMallocHost(reinterpret_cast<void**>(&pinned), bytes), "cudaMallocHost");
  cudaEvent_t ready;
  Check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "event");
  cudaStream_t training;
  Check(cudaStreamCreateWithFlags(&training, cudaStreamNonBlocking), "stream");
  auto stager = CreateLocalDeviceStager(0, arena, bytes, host, bytes, {ready});
  if (!stager.ok()) {
    std::fprintf(stderr, "cuda_bench: %s\n", std::string(stager.status().message()).c_str());
    std::exit(1);
  }
  std::vector<DeviceRange> ranges;
  for (uint64_t at = 0; at < bytes; at += chunk) ranges.push_back({at, std::min(chunk, bytes - at)});

  std::vector<double> out, in, ref_out, ref_in;
  for (int r = 0; r < reps + 1; ++r) {
    // Ours, device -> host.
    Check(cudaEventRecord(ready, training), "record");
    std::promise<void> all;
    std::atomic<size_t> left{ranges.size()};
    const auto t0 = Clock::now();
    if (!(*stager)->StageOut(0, ranges, [&](size_t) {
          if (--left == 0) all.set_value();
        }).ok()) {
      std::exit(1);
    }
    if (all.get_future().wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
      std::fprintf(stderr, "cuda_bench: the staged copies did not complete within 60 s\n");
      std::exit(1);
    }
    const auto t1 = Clock::now();
    // Ours, host -> device.
    for (const auto& range : ranges) (void)(*stager)->StageIn(0, range);
    (void)(*stager)->MarkDone(0);
    Check(cudaEventSynchronize(LocalDoneEvent(**stager, 0)), "done");
    const auto t2 = Clock::now();
    // The reference: one cudaMemcpy each way with cudaMallocHost memory.
    Check(cudaMemcpy(pinned, arena, bytes, cudaMemcpyDeviceToHost), "d2h");
    const auto t3 = Clock::now();
    Check(cudaMemcpy(arena, pinned, bytes, cudaMemcpyHostToDevice), "h2d");
    const auto t4 = Clock::now();
    if (r == 0) continue;  // warm-up
    out.push_back(Seconds(t0, t1));
    in.push_back(Seconds(t1, t2));
    ref_out.push_back(Seconds(t2, t3));
    ref_in.push_back(Seconds(t3, t4));
  }
  const double gb = static_cast<double>(bytes) / 1e9;
  std::printf("| staging d2h, %llu MiB in %llu MiB chunks | %8.2f GB/s | %8.2f GB/s | %5.2f |\n",
              static_cast<unsigned long long>(bytes >> 20),
              static_cast<unsigned long long>(chunk >> 20), gb / Median(out), gb / Median(ref_out),
              Median(ref_out) / Median(out));
  std::printf("| staging h2d, %llu MiB in %llu MiB chunks | %8.2f GB/s | %8.2f GB/s | %5.2f |\n",
              static_cast<unsigned long long>(bytes >> 20),
              static_cast<unsigned long long>(chunk >> 20), gb / Median(in), gb / Median(ref_in),
              Median(ref_in) / Median(in));
  stager->reset();
  cudaEventDestroy(ready);
  cudaStreamDestroy(training);
  cudaFreeHost(pinned);
  std::free(host);
  cudaFree(arena);
}

void Rebuild(const char* name, uint64_t m, uint64_t n, uint64_t k, uint32_t world, int reps) {
  const uint64_t floats = k * (m + n);
  const uint64_t grad_offset = 0, u_offset = (m * n * 4 + 63) / 64 * 64,
                 v_offset = u_offset + (k * m * 4 + 63) / 64 * 64,
                 bytes = v_offset + (k * n * 4 + 63) / 64 * 64;
  unsigned char* arena = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&arena), bytes), "cudaMalloc");
  Check(cudaMemset(arena, 0, bytes), "memset");
  auto* host = static_cast<unsigned char*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
  std::vector<float> peers(world * floats, 0.5f);
  cudaEvent_t ready;
  Check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "event");
  auto stager = CreateLocalDeviceStager(0, arena, bytes, host, bytes, {ready});
  if (!stager.ok()) std::exit(1);
  (void)(*stager)->PinHost(peers.data(), peers.size() * 4);  // the agent pins its inboxes too
  DeviceStager::SfbShape shape{m, n, k, world, 0, grad_offset, u_offset, v_offset};
  // The reference: the same GEMM on factors already gathered on the GPU.
  float* gathered = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&gathered), world * floats * 4), "cudaMalloc");
  Check(cudaMemset(gathered, 0, world * floats * 4), "memset");
  cublasHandle_t blas;
  cublasCreate(&blas);
  cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH);
  const float one = 1.0f, zero = 0.0f;
  std::vector<double> ours, staged, ref;
  uint64_t iteration = 0;
  for (int r = 0; r < reps + 1; ++r) {
    // Cold: every peer's factors gathered from the host by the rebuild itself.
    auto t0 = Clock::now();
    if (!(*stager)->Rebuild(0, shape, ++iteration, peers.data()).ok()) std::exit(1);
    (void)(*stager)->MarkDone(0);
    Check(cudaEventSynchronize(LocalDoneEvent(**stager, 0)), "done");
    auto t1 = Clock::now();
    // As the agent runs it: each peer's factors copied when they arrive (that overlaps the
    // network, so it is not timed), then the rebuild.
    ++iteration;
    for (uint32_t p = 1; p < world; ++p) {
      (void)(*stager)->StagePeerFactors(0, shape, iteration, p, peers.data() + p * floats);
    }
    Check(cudaDeviceSynchronize(), "staging");
    auto s0 = Clock::now();
    if (!(*stager)->Rebuild(0, shape, iteration, peers.data()).ok()) std::exit(1);
    (void)(*stager)->MarkDone(0);
    Check(cudaEventSynchronize(LocalDoneEvent(**stager, 0)), "done");
    auto s1 = Clock::now();
    cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(n), static_cast<int>(m),
                static_cast<int>(k * world), &one, gathered + world * k * m, static_cast<int>(n),
                gathered, static_cast<int>(m), &zero, reinterpret_cast<float*>(arena),
                static_cast<int>(n));
    Check(cudaDeviceSynchronize(), "gemm");
    auto t2 = Clock::now();
    if (r == 0) continue;
    ours.push_back(Seconds(t0, t1));
    staged.push_back(Seconds(s0, s1));
    ref.push_back(Seconds(s1, t2));
  }
  const double flops = 2.0 * static_cast<double>(m * n * k * world);
  for (int staged_rows = 0; staged_rows < 2; ++staged_rows) {
    const double t = Median(staged_rows ? staged : ours);
    std::printf("| rebuild %s %llux%llu, K=%llu, P=%u, %s | %8.3f ms (%.1f TFLOP/s) | %8.3f ms "
                "| %5.2f |\n",
                name, static_cast<unsigned long long>(m), static_cast<unsigned long long>(n),
                static_cast<unsigned long long>(k), world,
                staged_rows ? "factors staged on arrival" : "gathered at rebuild", t * 1e3,
                flops / t / 1e12, Median(ref) * 1e3, Median(ref) / t);
  }
  cublasDestroy(blas);
  stager->reset();
  cudaFree(gathered);
  cudaEventDestroy(ready);
  std::free(host);
  cudaFree(arena);
}

}  // namespace

int main() {
  if (absl::Status s = poseidon::agent::CudaDeviceAvailableHere(); !s.ok()) {
    std::printf("cuda_bench: skipped: %s\n", std::string(s.message()).c_str());
    return 0;
  }
  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, 0), "properties");
  std::printf("cuda_bench on %s\n\n", prop.name);
  std::printf("| what | Poseidon | reference | ratio |\n|---|---|---|---|\n");
  Staging(256ull << 20, 4ull << 20, 5);
  Staging(256ull << 20, 16ull << 20, 5);
  Staging(64ull << 20, 1ull << 20, 5);
  // VGG-16's FC layers (M outputs x N inputs), K = 32 per worker, 8 workers.
  Rebuild("fc6", 4096, 25088, 32, 8, 5);
  Rebuild("fc7", 4096, 4096, 32, 8, 5);
  Rebuild("fc8", 1000, 4096, 32, 8, 5);
  Rebuild("fc6", 4096, 25088, 32, 2, 5);
  return 0;
}
