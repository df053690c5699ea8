#include "coordinator/planner/fusion.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace poseidon::planner {
namespace {

using ::testing::ElementsAre;

// α = 100 µs, 1 GB/s: a key of b bytes takes 100 µs + b ns; B* = 8 α × 1 GB/s = 800,000 bytes.
FusionOptions Options(double alpha = 100e-6, uint64_t max_bucket = uint64_t{4} << 20) {
  FusionOptions o;
  o.max_bucket_bytes = max_bucket;
  o.message_seconds = alpha;
  o.sync_seconds = [alpha](uint64_t bytes) { return alpha + static_cast<double>(bytes) / 1e9; };
  return o;
}

std::vector<FusionLayer> Layers(const std::vector<uint64_t>& bytes, double backward = 0,
                                double forward = 0) {
  std::vector<FusionLayer> layers;
  const FusionOptions o = Options();
  for (uint64_t b : bytes) {
    FusionLayer l;
    l.bytes = b;
    l.eligible = true;
    l.timing = LayerTiming{forward, backward, o.sync_seconds(b), 1};
    layers.push_back(l);
  }
  return layers;
}

TEST(FusionTest, TheTargetIsWhereATransferTakesEightTimesItsMessage) {
  EXPECT_NEAR(static_cast<double>(FusionTargetBytes(Options())), 800000, 4);
  EXPECT_EQ(FusionTargetBytes(Options()) % 4, 0u);
  // Ten times the latency, ten times the bytes.
  EXPECT_NEAR(static_cast<double>(FusionTargetBytes(Options(1e-3, uint64_t{16} << 20))), 8000000, 4);
  // Never larger than a key may be.
  EXPECT_EQ(FusionTargetBytes(Options(1e-3, 1 << 20)), uint64_t{1} << 20);
  // Messages that cost nothing are never worth fusing.
  EXPECT_EQ(FusionTargetBytes(Options(0)), 0u);
  EXPECT_EQ(PlanFusion(Layers({100, 100, 100}), Options(0)).buckets, 0u);
}

TEST(FusionTest, WithoutComputeTimesBucketsGrowToTheTargetInReadyOrder) {
  // Backward makes layer 7 ready first: {7, 6}; 5 is as large as B* and goes alone; {4, 3};
  // 2 would take {4, 3} past B*, so it opens the next one with 1 and 0.
  const FusionResult r =
      PlanFusion(Layers({1000, 1000, 400000, 500000, 1000, 1200000, 1000, 1000}), Options());
  EXPECT_THAT(r.bucket, ElementsAre(1, 1, 1, 2, 2, 0, 3, 3));
  EXPECT_EQ(r.buckets, 3u);
  EXPECT_FALSE(r.model_consulted);
}

TEST(FusionTest, IneligibleLayersAndElementSizesBreakBucketsAndOneMemberIsAlone) {
  std::vector<FusionLayer> layers = Layers({100, 100, 100, 100, 100, 100});
  layers[3].eligible = false;  // an SFB layer, or one of several chunks
  layers[1].element_bytes = 2;
  // Ready order: {5, 4}; 3 breaks; 2 alone (1 has another element size); 1 alone; 0 alone.
  EXPECT_THAT(PlanFusion(layers, Options()).bucket, ElementsAre(0, 0, 0, 0, 1, 1));
}

TEST(FusionTest, TheModelKeepsTheLastReadyLayerOutOfABucketThatWouldDelayIt) {
  // Compute-bound: 1 ms of backward per layer hides every sync but the last one. A bucket of all
  // four would send layer 0's gradient only with the others', 3 µs of bytes later than alone:
  // the iteration model says so and layer 0 goes alone; the other three fuse for free.
  const std::vector<FusionLayer> layers = Layers({1000, 1000, 1000, 1000}, 1e-3, 1e-3);
  FusionOptions o = Options();
  o.compute_known = true;
  const FusionResult r = PlanFusion(layers, o);
  EXPECT_TRUE(r.model_consulted);
  EXPECT_THAT(r.bucket, ElementsAre(0, 1, 1, 1));
  const double fused = PredictIteration(FusedTimings(layers, r.bucket, o)).iteration_seconds;
  const double alone =
      PredictIteration(FusedTimings(layers, {0, 0, 0, 0}, o)).iteration_seconds;
  const double all = PredictIteration(FusedTimings(layers, {1, 1, 1, 1}, o)).iteration_seconds;
  EXPECT_DOUBLE_EQ(fused, alone);
  EXPECT_GT(all, fused);
}

TEST(FusionTest, TheModelFusesWhereMessagesAreTheBottleneck) {
  // Backward of 1 µs per layer: four keys queue 4 × 101 µs on the interface, one bucket 104 µs.
  const std::vector<FusionLayer> layers = Layers({1000, 1000, 1000, 1000}, 1e-6, 1e-6);
  FusionOptions o = Options();
  o.compute_known = true;
  const FusionResult r = PlanFusion(layers, o);
  EXPECT_THAT(r.bucket, ElementsAre(1, 1, 1, 1));
  EXPECT_LT(PredictIteration(FusedTimings(layers, r.bucket, o)).iteration_seconds,
            PredictIteration(FusedTimings(layers, {0, 0, 0, 0}, o)).iteration_seconds);
}

TEST(FusionTest, ABucketsSyncBelongsToItsLowestMember) {
  const std::vector<FusionLayer> layers = Layers({1000, 2000, 3000, 4000});
  const std::vector<LayerTiming> t = FusedTimings(layers, {0, 1, 1, 0}, Options());
  EXPECT_DOUBLE_EQ(t[0].sync_seconds, layers[0].timing.sync_seconds);
  EXPECT_DOUBLE_EQ(t[1].sync_seconds, 100e-6 + 5000 / 1e9);
  EXPECT_DOUBLE_EQ(t[2].sync_seconds, 0);
  EXPECT_DOUBLE_EQ(t[3].sync_seconds, layers[3].timing.sync_seconds);
}

}  // namespace
}  // namespace poseidon::planner
