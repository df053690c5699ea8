#include "coordinator/planner/cost_model.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace poseidon::planner {
namespace {

using poseidon::v1::LayerSpec;

LayerSpec Layer(poseidon::v1::LayerKind kind, std::initializer_list<uint64_t> shape) {
  LayerSpec layer;
  layer.set_name("layer");
  layer.set_kind(kind);
  for (const uint64_t d : shape) layer.add_shape(d);
  return layer;
}

ClusterShape Colocated(uint32_t p, uint32_t k) {
  return ClusterShape{p, p, k, true};
}

TEST(CostModelTest, PsElementsFollowTheTable) {
  // S = 1000, P1 = 4, P2 = 2: per worker 2S, per server 2·P1·S/P2, per machine 2S(P1+P2−2)/P2.
  const SchemeVolume v = PsElements(1000, ClusterShape{4, 2, 8, true});
  EXPECT_DOUBLE_EQ(v.per_worker, 2000);
  EXPECT_DOUBLE_EQ(v.per_server, 4000);
  EXPECT_DOUBLE_EQ(v.per_machine, 4000);
  // P1 = P2 = 1: nothing leaves a colocated machine.
  EXPECT_DOUBLE_EQ(PsElements(1000, ClusterShape{1, 1, 8, true}).per_machine, 0);
  // Fractions are kept: 2·3·10/4 = 15.
  EXPECT_DOUBLE_EQ(PsElements(10, ClusterShape{3, 4, 1, false}).per_server, 15);
}

TEST(CostModelTest, SfbElementsFollowTheTable) {
  // fc7 of VGG: 2·K·(P1−1)·(M+N) = 2·32·15·8192.
  const SchemeVolume v = SfbElements(4096, 4096, Colocated(16, 32));
  EXPECT_DOUBLE_EQ(v.per_worker, 7864320);
  EXPECT_DOUBLE_EQ(v.per_machine, 7864320);
  EXPECT_DOUBLE_EQ(v.per_server, 0);
  EXPECT_DOUBLE_EQ(SfbElements(4096, 4096, Colocated(1, 32)).per_worker, 0);
}

TEST(CostModelTest, Fc7IsSfbUpTo128WorkersAndPsBeyond) {
  // P1 = P2 = P colocated, K = 32: P <= 2·4096·4096/(32·8192) = 128; equality at 128.
  for (uint32_t p = 1; p <= 300; ++p) {
    EXPECT_EQ(SfbNoCostlierThanPs(4096, 4096, Colocated(p, 32)), p <= 128) << "P = " << p;
  }
  const LayerSpec fc7 = Layer(poseidon::v1::LAYER_KIND_FC, {4096, 4096});
  EXPECT_EQ(CostOfLayer(fc7, 4, Colocated(128, 32)).scheme, poseidon::v1::SYNC_SCHEME_SFB);
  EXPECT_EQ(CostOfLayer(fc7, 4, Colocated(129, 32)).scheme, poseidon::v1::SYNC_SCHEME_PS);
}

TEST(CostModelTest, ColocatedSymmetricRuleReducesToTheClosedForm) {
  // P1 = P2 = P colocated: SFB iff P <= 2MN/(K(M+N)), i.e. P·K·(M+N) <= 2MN.
  const uint64_t shapes[][2] = {{4096, 4096}, {4096, 25088}, {21841, 4096}, {1000, 4096},
                                {1000, 2048}, {10, 10},      {1, 1},        {512, 3}};
  for (const auto& [m, n] : shapes) {
    for (const uint32_t k : {1u, 8u, 32u, 128u, 256u}) {
      for (uint32_t p = 2; p <= 400; p += 7) {
        const bool closed_form = uint64_t{p} * k * (m + n) <= 2 * m * n;
        EXPECT_EQ(SfbNoCostlierThanPs(m, n, Colocated(p, k)), closed_form)
            << m << "x" << n << " K=" << k << " P=" << p;
      }
    }
  }
}

TEST(CostModelTest, NotColocatedComparesPerWorkerBytes) {
  // 2K(P1−1)(M+N) <= 2MN: fc7 at K = 32 is SFB while P1 − 1 <= 64, whatever P2 is.
  for (uint32_t p1 = 1; p1 <= 100; ++p1) {
    for (const uint32_t p2 : {1u, 4u, 16u, 64u}) {
      EXPECT_EQ(SfbNoCostlierThanPs(4096, 4096, ClusterShape{p1, p2, 32, false}), p1 <= 65)
          << "P1 = " << p1 << " P2 = " << p2;
    }
  }
}

TEST(CostModelTest, ColocatedWithUnequalCounts) {
  // P1 = 8, P2 = 4: SFB iff K·7·(M+N)·4 <= M·N·10. M = N = 100, K = 3: 16800 <= 100000: SFB;
  // K = 18: 100800 > 100000: PS.
  EXPECT_TRUE(SfbNoCostlierThanPs(100, 100, ClusterShape{8, 4, 3, true}));
  EXPECT_FALSE(SfbNoCostlierThanPs(100, 100, ClusterShape{8, 4, 18, true}));
  EXPECT_TRUE(SfbNoCostlierThanPs(100, 100, ClusterShape{8, 4, 17, true}));
}

TEST(CostModelTest, ByteCountsOfVgg19_22kLayersAt16Machines) {
  const ClusterShape cluster = Colocated(16, 32);
  // fc6: 4096 × 25088, f32. PS per worker 2·S·4, per server 2·16·S/16·4, per machine 2·S·30/16·4.
  const LayerCost fc6 = CostOfLayer(Layer(poseidon::v1::LAYER_KIND_FC, {4096, 25088}), 4, cluster);
  EXPECT_EQ(fc6.parameters, 102760448u);
  EXPECT_DOUBLE_EQ(fc6.ps_bytes.per_worker, 822083584);
  EXPECT_DOUBLE_EQ(fc6.ps_bytes.per_server, 822083584);
  EXPECT_DOUBLE_EQ(fc6.ps_bytes.per_machine, 1541406720);
  ASSERT_TRUE(fc6.sfb_bytes.has_value());
  EXPECT_DOUBLE_EQ(fc6.sfb_bytes->per_worker, 112066560);  // 2·32·15·29184·4
  EXPECT_EQ(fc6.scheme, poseidon::v1::SYNC_SCHEME_SFB);

  // fc8: 21841 × 4096.
  const LayerCost fc8 = CostOfLayer(Layer(poseidon::v1::LAYER_KIND_FC, {21841, 4096}), 4, cluster);
  EXPECT_DOUBLE_EQ(fc8.ps_bytes.per_worker, 715685888);
  EXPECT_DOUBLE_EQ(fc8.ps_bytes.per_machine, 1341911040);
  EXPECT_DOUBLE_EQ(fc8.sfb_bytes->per_worker, 99598080);  // 2·32·15·25937·4
  EXPECT_EQ(fc8.scheme, poseidon::v1::SYNC_SCHEME_SFB);

  // conv5_4: 512 × 512 × 3 × 3 = 2,359,296 parameters; always PS, no SFB column.
  const LayerCost conv =
      CostOfLayer(Layer(poseidon::v1::LAYER_KIND_CONV, {512, 512, 3, 3}), 4, cluster);
  EXPECT_EQ(conv.parameters, 2359296u);
  EXPECT_DOUBLE_EQ(conv.ps_bytes.per_worker, 18874368);
  EXPECT_DOUBLE_EQ(conv.ps_bytes.per_server, 18874368);
  EXPECT_DOUBLE_EQ(conv.ps_bytes.per_machine, 35389440);
  EXPECT_FALSE(conv.sfb_bytes.has_value());
  EXPECT_EQ(conv.scheme, poseidon::v1::SYNC_SCHEME_PS);

  // A bias in f16: 2 bytes per element.
  const LayerCost bias = CostOfLayer(Layer(poseidon::v1::LAYER_KIND_BIAS, {4096}), 2, cluster);
  EXPECT_DOUBLE_EQ(bias.ps_bytes.per_worker, 16384);
  EXPECT_EQ(bias.scheme, poseidon::v1::SYNC_SCHEME_PS);
}

TEST(CostModelTest, OnlyFcLayersEverUseSfb) {
  // A tiny non-FC layer would be cheaper on SFB by the formula; only FC layers may use it.
  for (const auto kind : {poseidon::v1::LAYER_KIND_CONV, poseidon::v1::LAYER_KIND_BIAS,
                          poseidon::v1::LAYER_KIND_OTHER}) {
    const LayerCost cost = CostOfLayer(Layer(kind, {4096, 4096}), 4, Colocated(2, 1));
    EXPECT_EQ(cost.scheme, poseidon::v1::SYNC_SCHEME_PS);
    EXPECT_FALSE(cost.sfb_bytes.has_value());
  }
}

TEST(CostModelTest, OneWorkerPicksSfbBecauseItMovesNothing) {
  EXPECT_TRUE(SfbNoCostlierThanPs(4096, 4096, ClusterShape{1, 1, 32, true}));
  EXPECT_TRUE(SfbNoCostlierThanPs(4096, 4096, ClusterShape{1, 4, 32, false}));
}

TEST(CostModelTest, ComparedVolumeDependsOnColocation) {
  const SchemeVolume v{1, 2, 3};
  EXPECT_EQ(ComparedVolume(v, true), 3);
  EXPECT_EQ(ComparedVolume(v, false), 1);
}

TEST(CostModelTest, AllreduceElementsFollowTheTable) {
  // Ring all-reduce: 2·(P1−1) steps of S/P1 out and S/P1 in, no server.
  const SchemeVolume v = AllreduceElements(1000, {4, 2, 1, false});
  EXPECT_DOUBLE_EQ(v.per_worker, 4.0 * 1000 * 3 / 4);
  EXPECT_DOUBLE_EQ(v.per_server, 0);
  EXPECT_DOUBLE_EQ(v.per_machine, v.per_worker);
  // Colocated with P2 = P1 = P: the same bytes as PS per machine.
  EXPECT_DOUBLE_EQ(AllreduceElements(1000, {8, 8, 1, true}).per_worker,
                   PsElements(1000, {8, 8, 1, true}).per_machine);
}

}  // namespace
}  // namespace poseidon::planner
