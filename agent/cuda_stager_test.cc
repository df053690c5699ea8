// The GPU staging path on a real device: device->host staging and host->device results are
// bit-exact and ordered after the training stream's ready event; the done event orders the
// training stream after the results; the SFB rebuild on cuBLAS matches a float64 reference.
// Without a device every test skips with cudaGetDeviceCount's answer.
#include "agent/cuda_stager.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <random>

namespace poseidon::agent {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(call)

class CudaStagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (absl::Status s = CudaDeviceAvailableHere(); !s.ok()) GTEST_SKIP() << s.message();
  }
};

// Page-aligned host memory (what the shared-memory segment is).
struct HostBuffer {
  explicit HostBuffer(uint64_t bytes)
      : bytes(bytes), p(static_cast<unsigned char*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096))) {
    std::memset(p, 0, bytes);
  }
  ~HostBuffer() { std::free(p); }
  uint64_t bytes;
  unsigned char* p;
};

std::vector<unsigned char> RandomBytes(uint64_t n, uint64_t seed) {
  std::vector<unsigned char> v(n);
  std::mt19937_64 rng(seed);
  for (uint64_t i = 0; i < n; i += 8) {
    const uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<uint64_t>(8, n - i));
  }
  return v;
}

TEST_F(CudaStagerTest, StagingRoundTripIsBitExactAndWaitsForTheReadyEvent) {
  const uint64_t bytes = (48ull << 20) + 4100;  // not a multiple of anything convenient
  const uint64_t half = bytes / 2 / 4 * 4;
  unsigned char* arena = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&arena), bytes));
  HostBuffer host(bytes);
  cudaEvent_t ready[2];
  for (auto& e : ready) CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaStream_t training;
  CUDA_OK(cudaStreamCreateWithFlags(&training, cudaStreamNonBlocking));
  auto stager = CreateLocalDeviceStager(0, arena, bytes, host.p, bytes, {ready[0], ready[1]});
  ASSERT_TRUE(stager.ok()) << stager.status();

  // The training stream writes layer 0's data and records its ready event; the stager is asked
  // at once, so its copies are correct only if they wait for the event on the device.
  const auto data = RandomBytes(bytes, 1);
  CUDA_OK(cudaMemcpyAsync(arena, data.data(), bytes, cudaMemcpyHostToDevice, training));
  CUDA_OK(cudaEventRecord(ready[0], training));
  std::vector<DeviceRange> ranges;
  for (uint64_t at = 0; at < half;) {  // uneven chunks, as a plan makes them
    const uint64_t len = std::min<uint64_t>(half - at, (3ull << 20) + 4 * (ranges.size() % 5));
    ranges.push_back({at, len});
    at += len;
  }
  std::atomic<size_t> copied{0};
  std::promise<void> all;
  std::vector<int> order;
  std::mutex order_mu;
  ASSERT_TRUE((*stager)
                  ->StageOut(0, ranges,
                             [&](size_t i) {
                               {
                                 std::lock_guard<std::mutex> lock(order_mu);
                                 order.push_back(static_cast<int>(i));
                               }
                               if (++copied == ranges.size()) all.set_value();
                             })
                  .ok());
  ASSERT_EQ(all.get_future().wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_EQ(std::memcmp(host.p, data.data(), half), 0) << "device->host staging is not bit-exact";
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(order[i], static_cast<int>(i));

  // Results back: new host data for the second half, then the done event orders the training
  // stream's read after the copy.
  const auto result = RandomBytes(bytes - half, 2);
  std::memcpy(host.p + half, result.data(), result.size());
  ASSERT_TRUE((*stager)->StageIn(1, {half, (bytes - half) / 2}).ok());
  ASSERT_TRUE((*stager)->StageIn(1, {half + (bytes - half) / 2, bytes - half - (bytes - half) / 2}).ok());
  ASSERT_TRUE((*stager)->MarkDone(1).ok());
  std::vector<unsigned char> back(bytes - half);
  CUDA_OK(cudaStreamWaitEvent(training, LocalDoneEvent(**stager, 1), 0));
  CUDA_OK(cudaMemcpyAsync(back.data(), arena + half, back.size(), cudaMemcpyDeviceToHost, training));
  CUDA_OK(cudaStreamSynchronize(training));
  EXPECT_EQ(std::memcmp(back.data(), result.data(), back.size()), 0)
      << "host->device results are not bit-exact";

  stager->reset();
  for (auto& e : ready) cudaEventDestroy(e);
  cudaStreamDestroy(training);
  cudaFree(arena);
}

TEST_F(CudaStagerTest, BadRangesAndLayersAreRefused) {
  const uint64_t bytes = 1 << 20;
  unsigned char* arena = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&arena), bytes));
  HostBuffer host(bytes);
  cudaEvent_t ready;
  CUDA_OK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  auto stager = CreateLocalDeviceStager(0, arena, bytes, host.p, bytes, {ready});
  ASSERT_TRUE(stager.ok()) << stager.status();
  const DeviceRange beyond{bytes - 4, 8}, wraps{8, ~uint64_t{0}};
  EXPECT_EQ((*stager)->StageOut(0, std::span(&beyond, 1), [](size_t) {}).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*stager)->StageIn(0, wraps).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*stager)->MarkDone(1).code(), absl::StatusCode::kInvalidArgument);
  DeviceStager::SfbShape too_big{1000, 1000, 8, 2, 0, 0, 0, 0};
  EXPECT_FALSE((*stager)->Rebuild(0, too_big, 1, reinterpret_cast<float*>(host.p)).ok());
  EXPECT_FALSE((*stager)->StagePeerFactors(0, too_big, 1, 1, reinterpret_cast<float*>(host.p)).ok());
  stager->reset();
  cudaEventDestroy(ready);
  cudaFree(arena);
}

TEST_F(CudaStagerTest, SfbRebuildMatchesAFloat64Reference) {
  const uint64_t m = 300, n = 200, k = 16;
  const uint32_t world = 4, me = 2;
  const uint64_t floats = k * (m + n);
  // Arena: grad (m x n), then our U (k x m), V (k x n), 64-byte aligned like the agent's layout.
  const uint64_t grad_offset = 0, u_offset = (m * n * 4 + 63) / 64 * 64,
                 v_offset = u_offset + (k * m * 4 + 63) / 64 * 64,
                 bytes = v_offset + (k * n * 4 + 63) / 64 * 64;
  unsigned char* arena = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&arena), bytes));
  CUDA_OK(cudaMemset(arena, 0xff, bytes));  // NaNs: the GEMM must overwrite, not accumulate
  HostBuffer host(bytes);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> factors(world * floats);  // rank p: [U_p | V_p]
  for (float& x : factors) x = dist(rng);
  CUDA_OK(cudaMemcpy(arena + u_offset, factors.data() + me * floats, k * m * 4,
                     cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(arena + v_offset, factors.data() + me * floats + k * m, k * n * 4,
                     cudaMemcpyHostToDevice));
  std::vector<float> peers = factors;  // what the inbox holds; our own slot is stale there
  std::fill(peers.begin() + me * floats, peers.begin() + (me + 1) * floats, 99.0f);
  cudaEvent_t ready;
  CUDA_OK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  auto stager = CreateLocalDeviceStager(0, arena, bytes, host.p, bytes, {ready});
  ASSERT_TRUE(stager.ok()) << stager.status();
  DeviceStager::SfbShape shape{m, n, k, world, me, grad_offset, u_offset, v_offset};
  // Iteration 1: everything gathered at rebuild time. Iteration 2 (the other buffer): ranks 0
  // and 3 staged on arrival, rank 1 left to the rebuild. Both must give the same sum.
  ASSERT_TRUE((*stager)->Rebuild(0, shape, 1, peers.data()).ok());
  ASSERT_TRUE((*stager)->MarkDone(0).ok());
  CUDA_OK(cudaEventSynchronize(LocalDoneEvent(**stager, 0)));
  std::vector<float> got(m * n), got2(m * n);
  CUDA_OK(cudaMemcpy(got.data(), arena + grad_offset, m * n * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemset(arena + grad_offset, 0xff, m * n * 4));
  ASSERT_TRUE((*stager)->StagePeerFactors(0, shape, 2, 0, peers.data()).ok());
  ASSERT_TRUE((*stager)->StagePeerFactors(0, shape, 2, 3, peers.data() + 3 * floats).ok());
  EXPECT_FALSE((*stager)->StagePeerFactors(0, shape, 2, me, peers.data()).ok()) << "ourselves";
  ASSERT_TRUE((*stager)->Rebuild(0, shape, 2, peers.data()).ok());
  ASSERT_TRUE((*stager)->MarkDone(0).ok());
  CUDA_OK(cudaEventSynchronize(LocalDoneEvent(**stager, 0)));
  CUDA_OK(cudaMemcpy(got2.data(), arena + grad_offset, m * n * 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(got.data(), got2.data(), m * n * 4), 0)
      << "staged and gathered factors give different sums";

  double max_ref = 0, max_err = 0;
  for (uint64_t r = 0; r < m; ++r) {
    for (uint64_t c = 0; c < n; ++c) {
      double ref = 0;
      for (uint32_t p = 0; p < world; ++p) {
        const float* u = factors.data() + p * floats;
        const float* v = u + k * m;
        for (uint64_t i = 0; i < k; ++i) ref += double{u[i * m + r]} * double{v[i * n + c]};
      }
      max_ref = std::max(max_ref, std::abs(ref));
      max_err = std::max(max_err, std::abs(ref - double{got[r * n + c]}));
    }
  }
  // FP32 GEMM (no TF32): max |error| relative to max |reference|.
  EXPECT_LE(max_err / max_ref, 1e-5) << "max error " << max_err << " of " << max_ref;
  stager->reset();
  cudaEventDestroy(ready);
  cudaFree(arena);
}

}  // namespace
}  // namespace poseidon::agent
