#include "coordinator/planner/time_model.h"

#include "gtest/gtest.h"

namespace poseidon::planner {
namespace {

TEST(TimeModelTest, PsTimeIsTheBusiestInterfacePlusTwoLegs) {
  const NetworkModel net{1e9, 1e-4};
  // Not colocated: worker 2e9 bytes, server 8e9 bytes -> server busy 8e9 / 2e9 = 4 s.
  EXPECT_DOUBLE_EQ(PsSeconds(SchemeVolume{2e9, 8e9, 0}, false, net), 4 + 2e-4);
  // Worker busier than the server.
  EXPECT_DOUBLE_EQ(PsSeconds(SchemeVolume{2e9, 1e9, 0}, false, net), 1 + 2e-4);
  // Colocated: the machine's volume.
  EXPECT_DOUBLE_EQ(PsSeconds(SchemeVolume{2e9, 8e9, 3e9}, true, net), 1.5 + 2e-4);
}

TEST(TimeModelTest, SfbTimeIsOneLegPlusTheWorkerVolume) {
  EXPECT_DOUBLE_EQ(SfbSeconds(SchemeVolume{4e9, 0, 4e9}, NetworkModel{1e9, 1e-4}), 2 + 1e-4);
}

TEST(TimeModelTest, ParsesGpuRates) {
  EXPECT_DOUBLE_EQ(ParseGpuRate("titanx")->flops_per_second, 6.1e12);
  EXPECT_DOUBLE_EQ(ParseGpuRate("TitanX")->flops_per_second, 6.1e12);
  EXPECT_DOUBLE_EQ(ParseGpuRate("v100")->flops_per_second, 15.7e12);
  EXPECT_DOUBLE_EQ(ParseGpuRate("a100")->flops_per_second, 19.5e12);
  EXPECT_DOUBLE_EQ(ParseGpuRate("h100")->flops_per_second, 67e12);
  EXPECT_DOUBLE_EQ(ParseGpuRate("12.5T")->flops_per_second, 12.5e12);
  EXPECT_DOUBLE_EQ(ParseGpuRate("900GFLOPS")->flops_per_second, 900e9);
  EXPECT_DOUBLE_EQ(ParseGpuRate("2 TFLOP/s")->flops_per_second, 2e12);
  EXPECT_DOUBLE_EQ(ParseGpuRate("8e12")->flops_per_second, 8e12);
  EXPECT_EQ(ParseGpuRate("12.5T")->name, "12.5T");
  for (const char* bad : {"", "fast", "0", "-1T", "T", "nan", "inf", "1e400"}) {
    const absl::StatusOr<GpuRate> rate = ParseGpuRate(bad);
    EXPECT_FALSE(rate.ok()) << bad;
    if (!rate.ok()) {
      EXPECT_NE(rate.status().message().find("titanx"), absl::string_view::npos);
    }
  }
}

TEST(TimeModelTest, ComputeTimePrefersMeasuredTimesThenFlops) {
  poseidon::v1::LayerSpec layer;
  const GpuRate gpu{"test", 1e12};
  EXPECT_FALSE(LayerComputeSeconds(layer, 32, &gpu).has_value());
  layer.set_forward_flops(1'000'000'000);
  layer.set_backward_flops(2'000'000'000);
  EXPECT_FALSE(LayerComputeSeconds(layer, 32, nullptr).has_value());
  std::optional<ComputeSeconds> t = LayerComputeSeconds(layer, 32, &gpu);
  ASSERT_TRUE(t.has_value());
  EXPECT_DOUBLE_EQ(t->forward, 0.032);  // 1e9 FLOP × 32 samples / 1e12 FLOP/s
  EXPECT_DOUBLE_EQ(t->backward, 0.064);
  layer.set_forward_time_ns(5'000'000);
  layer.set_backward_time_ns(7'000'000);
  t = LayerComputeSeconds(layer, 32, &gpu);
  ASSERT_TRUE(t.has_value());
  EXPECT_DOUBLE_EQ(t->forward, 0.005);
  EXPECT_DOUBLE_EQ(t->backward, 0.007);
}

TEST(TimeModelTest, IterationWithoutCommunicationIsTheComputeTime) {
  const IterationPrediction p = PredictIteration({{1, 2, 0}, {3, 4, 0}, {0.5, 1, 0}});
  EXPECT_DOUBLE_EQ(p.compute_seconds, 11.5);
  EXPECT_DOUBLE_EQ(p.sync_seconds, 0);
  EXPECT_DOUBLE_EQ(p.iteration_seconds, 11.5);
}

TEST(TimeModelTest, OneLayerCannotOverlap) {
  // Backward ends at 2, sync ends at 5, the next forward runs 5..6.
  const IterationPrediction p = PredictIteration({{1, 2, 3}});
  EXPECT_DOUBLE_EQ(p.iteration_seconds, 6);
}

TEST(TimeModelTest, TopLayerSyncOverlapsTheRestOfBackward) {
  // Layer 1 ready at 1, synced 1..4; layer 0 ready at 2, synced 4..4.5. Next forward: layer 0
  // at max(2, 4.5) = 4.5 .. 5.5, layer 1 at max(5.5, 4) .. 6.5.
  const IterationPrediction p = PredictIteration({{1, 1, 0.5}, {1, 1, 3}});
  EXPECT_DOUBLE_EQ(p.compute_seconds, 4);
  EXPECT_DOUBLE_EQ(p.sync_seconds, 3.5);
  EXPECT_DOUBLE_EQ(p.iteration_seconds, 6.5);
}

TEST(TimeModelTest, LowerLayersGoFirstWhenSeveralWait) {
  // Layer 2 synced 1..11; layers 1 and 0 both wait; priority sends 0 (11..12), then 1 (12..13).
  // Next forward from 3: layer 0 at 12..13, layer 1 at 13..14, layer 2 at 14..15. In arrival
  // order (1 before 0) it would end at 16.
  const IterationPrediction p = PredictIteration({{1, 1, 1}, {1, 1, 1}, {1, 1, 10}});
  EXPECT_DOUBLE_EQ(p.iteration_seconds, 15);
}

TEST(TimeModelTest, AnUrgentLayerWaitsForOnePieceOnly) {
  // Layer 1 (ready at 1) is sent as 10 pieces of 1 s; layer 0 becomes ready at 2 and goes after
  // the piece in flight (2..3); layer 1 finishes 3..12. Forward: layer 0 3..4, layer 1 12..13.
  // As one piece, layer 1 would hold the link until 11 and the iteration would end at 14.
  EXPECT_DOUBLE_EQ(PredictIteration({{1, 1, 1, 1}, {1, 1, 10, 10}}).iteration_seconds, 13);
  EXPECT_DOUBLE_EQ(PredictIteration({{1, 1, 1, 1}, {1, 1, 10, 1}}).iteration_seconds, 14);
  EXPECT_DOUBLE_EQ(PredictIteration({{1, 1, 1, 0}, {1, 1, 10, 1}}).iteration_seconds, 14);
}

TEST(TimeModelTest, EmptyModel) {
  const IterationPrediction p = PredictIteration({});
  EXPECT_DOUBLE_EQ(p.iteration_seconds, 0);
}

}  // namespace
}  // namespace poseidon::planner
