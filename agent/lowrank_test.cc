#include "agent/lowrank.h"

#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <random>
#include <vector>

namespace poseidon::agent {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double Norm(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s);
}

// W ranks' LowRankLayers and one step of the all-reduce among them, the sums of P and Q taken
// here in rank order (what the agents' Gloo all-reduces compute).
struct Ranks {
  Ranks(uint32_t world, LowRankShape shape, uint32_t rank, uint64_t seed) {
    for (uint32_t i = 0; i < world; ++i) layers.emplace_back(shape, rank, seed);
  }
  // Every rank's result of the step (each from its own copy of the summed P and Q).
  std::vector<std::vector<float>> Step(const std::vector<std::vector<float>>& grads) {
    const size_t world = layers.size();
    const size_t np = layers[0].p_size(), nq = layers[0].q_size();
    std::vector<std::vector<float>> p(world, std::vector<float>(np)), q(world,
                                                                         std::vector<float>(nq));
    std::vector<float> psum(np, 0.0f), qsum(nq, 0.0f);
    for (size_t i = 0; i < world; ++i) {
      layers[i].Project(grads[i], p[i]);
      for (size_t k = 0; k < np; ++k) psum[k] += p[i][k];
    }
    for (size_t i = 0; i < world; ++i) {
      p[i] = psum;
      layers[i].ProjectBack(p[i], q[i]);
      for (size_t k = 0; k < nq; ++k) qsum[k] += q[i][k];
    }
    std::vector<std::vector<float>> out(world, std::vector<float>(grads[0].size()));
    for (size_t i = 0; i < world; ++i) {
      layers[i].Reconstruct(p[i], qsum, static_cast<uint32_t>(world), out[i]);
    }
    return out;
  }
  std::vector<LowRankLayer> layers;
};

TEST(LowRankTest, OnlyMatricesItShrinksAreCompressed) {
  LowRankShape view;
  EXPECT_TRUE(LowRankPays({64, 20}, 4, &view));
  EXPECT_EQ(view.rows, 64u);
  EXPECT_EQ(view.cols, 20u);
  EXPECT_TRUE(LowRankPays({64, 3, 3, 3}, 4, &view)) << "a conv weight: out x in*kh*kw";
  EXPECT_EQ(view.cols, 27u);
  EXPECT_FALSE(LowRankPays({64}, 4, &view)) << "a bias";
  EXPECT_TRUE(LowRankPays({5, 64}, 4, &view)) << "(5 + 64) 4 < 5 * 64";
  EXPECT_FALSE(LowRankPays({6, 6}, 4, &view)) << "(6 + 6) 4 > 6 * 6";
  EXPECT_FALSE(LowRankPays({4, 64}, 4, &view)) << "rank >= rows";
  EXPECT_FALSE(LowRankPays({8, 8}, 4, &view)) << "(8 + 8) 4 = 8 * 8";
  EXPECT_FALSE(LowRankPays({64, 20}, 0, &view));
  EXPECT_FALSE(LowRankPays({64, 0}, 4, &view));
  EXPECT_FALSE(LowRankPays({uint64_t{1} << 32, 64}, 4, &view)) << "beyond BLAS's int";
}

TEST(LowRankTest, OrthogonalizeGivesOrthonormalColumnsAndZeroForDegenerateOnes) {
  const uint64_t rows = 50;
  const uint32_t rank = 4;
  std::vector<float> p = Random(rows * rank, 1);
  for (uint64_t r = 0; r < rows; ++r) {
    p[r * rank + 2] = 3 * p[r * rank + 0] - p[r * rank + 1];  // dependent on columns 0 and 1
  }
  Orthogonalize(p, rows, rank);
  for (uint32_t a = 0; a < rank; ++a) {
    for (uint32_t b = 0; b < rank; ++b) {
      double dot = 0;
      for (uint64_t r = 0; r < rows; ++r) dot += static_cast<double>(p[r * rank + a]) * p[r * rank + b];
      const double want = a == b && a != 2 ? 1.0 : 0.0;
      EXPECT_NEAR(dot, want, 1e-5) << "columns " << a << ", " << b;
    }
  }
  std::vector<float> zero(rows * rank, 0.0f);
  Orthogonalize(zero, rows, rank);
  for (float v : zero) EXPECT_EQ(v, 0.0f);
}

// When the ranks' summed gradient has rank <= r, one step recovers it (up to float rounding),
// on every rank with the same bits, and nothing is held back.
TEST(LowRankTest, ASumOfRankAtMostRIsCarriedExactlyWithTheSameBitsEverywhere) {
  const uint64_t rows = 40, cols = 30;
  const uint32_t world = 3, rank = 4;
  const std::vector<float> u = Random(rows * 3, 2), v = Random(cols * 3, 3);
  std::vector<std::vector<float>> grads(world, std::vector<float>(rows * cols, 0.0f));
  std::vector<float> exact(rows * cols, 0.0f);
  for (uint32_t i = 0; i < world; ++i) {  // rank i's gradient: the outer product of u_i, v_i
    for (uint64_t r = 0; r < rows; ++r) {
      for (uint64_t c = 0; c < cols; ++c) {
        grads[i][r * cols + c] = u[r * 3 + i] * v[c * 3 + i];
        exact[r * cols + c] += grads[i][r * cols + c];
      }
    }
  }
  Ranks ranks(world, {rows, cols}, rank, 7);
  const auto out = ranks.Step(grads);
  std::vector<float> diff(exact.size());
  for (size_t k = 0; k < exact.size(); ++k) diff[k] = out[0][k] - exact[k];
  EXPECT_LT(Norm(diff), 1e-5 * Norm(exact));
  for (uint32_t i = 1; i < world; ++i) EXPECT_EQ(out[i], out[0]) << "rank " << i;
  std::vector<float> held(rows * cols, 0.0f);
  for (uint32_t i = 0; i < world; ++i) {
    for (size_t k = 0; k < held.size(); ++k) held[k] += ranks.layers[i].residual()[k];
  }
  EXPECT_LT(Norm(held), 1e-5 * Norm(exact));
}

// Error feedback over 1,000 steps of random (incompressible) gradients: what was sent plus what
// is held back equals what was given, and the held-back error stays bounded (it does not grow
// with the steps).
TEST(LowRankTest, ErrorFeedbackStaysBoundedOverAThousandSteps) {
  const uint64_t rows = 32, cols = 24;
  const uint32_t world = 2, rank = 2;
  Ranks ranks(world, {rows, cols}, rank, 11);
  std::vector<double> given(rows * cols, 0.0), sent(rows * cols, 0.0);
  std::vector<double> held_norm;
  double worst_ratio = 0;
  for (int t = 0; t < 1000; ++t) {
    std::vector<std::vector<float>> grads;
    for (uint32_t i = 0; i < world; ++i) grads.push_back(Random(rows * cols, 100 + t * world + i));
    const auto out = ranks.Step(grads);
    ASSERT_EQ(out[1], out[0]) << "step " << t;
    std::vector<float> held(rows * cols, 0.0f);
    for (size_t k = 0; k < held.size(); ++k) {
      for (uint32_t i = 0; i < world; ++i) {
        given[k] += grads[i][k];
        held[k] += ranks.layers[i].residual()[k];
      }
      sent[k] += out[0][k];
    }
    held_norm.push_back(Norm(held));
    std::vector<float> grad_sum(rows * cols);
    for (size_t k = 0; k < grad_sum.size(); ++k) grad_sum[k] = grads[0][k] + grads[1][k];
    worst_ratio = std::max(worst_ratio, HeldBackRatio(held, grad_sum));
  }
  // Σ_t A_t + Σ_i e_i = Σ_t Σ_i G_i (float rounding of 1,000 steps aside).
  const auto& last = ranks.layers;
  double err = 0, scale = 0;
  for (size_t k = 0; k < given.size(); ++k) {
    const double held = static_cast<double>(last[0].residual()[k]) + last[1].residual()[k];
    err += (sent[k] + held - given[k]) * (sent[k] + held - given[k]);
    scale += given[k] * given[k];
  }
  EXPECT_LT(std::sqrt(err), 1e-4 * std::sqrt(scale));
  double early = 0, late = 0;
  for (int t = 400; t < 500; ++t) early = std::max(early, held_norm[t]);
  for (int t = 900; t < 1000; ++t) late = std::max(late, held_norm[t]);
  EXPECT_LT(late, 1.5 * early) << "the held-back error grows: " << early << " then " << late;
  // The divergence guard's default limit (AgentConfig::lowrank_max_held, 8) is above a healthy
  // compressor's ratio even on incompressible data.
  EXPECT_LT(worst_ratio, 4.0);
  std::cout << "held-back norm at 500: " << held_norm[499] << ", at 1000: " << held_norm[999]
            << "; worst ||e|| / ||G||: " << worst_ratio << "\n";
}

// A broken compressor (a forged zero Q: nothing captured) lets the residual grow without bound:
// the ratio the divergence guard watches passes its limit within a few dozen steps.
TEST(LowRankTest, ABrokenCompressorsResidualOutgrowsTheGuardsLimit) {
  const uint64_t rows = 32, cols = 24;
  Ranks ranks(2, {rows, cols}, 2, 5);
  for (LowRankLayer& l : ranks.layers) l.ZeroQForTest();
  int steps = 0;
  double ratio = 0;
  while (ratio <= 8.0 && steps < 1000) {
    std::vector<std::vector<float>> grads;
    for (uint32_t i = 0; i < 2; ++i) grads.push_back(Random(rows * cols, 300 + steps * 2 + i));
    const auto out = ranks.Step(grads);
    for (float v : out[0]) ASSERT_EQ(v, 0.0f) << "a zero Q sends nothing";
    std::vector<float> held(rows * cols), grad_sum(rows * cols);
    for (size_t k = 0; k < held.size(); ++k) {
      held[k] = ranks.layers[0].residual()[k] + ranks.layers[1].residual()[k];
      grad_sum[k] = grads[0][k] + grads[1][k];
    }
    ratio = HeldBackRatio(held, grad_sum);
    ++steps;
  }
  EXPECT_GT(ratio, 8.0) << "after " << steps << " steps";
  EXPECT_LT(steps, 200);
}

// The guard's sketches: the sketch of a sum is the sum of the sketches, and the ratio they
// estimate is within 25 % of the exact one (the estimate's error is about 9 % per norm), for
// healthy and diverged ratios alike; a NaN makes it infinite.
TEST(LowRankTest, SketchesSumAcrossRanksAndEstimateTheRatio) {
  const size_t n = 100000;
  for (uint32_t seed = 0; seed < 6; ++seed) {
    const float scale = seed < 3 ? 0.5f : 20.0f;  // held back: half the gradient, or 20 times
    const std::vector<float> g0 = Random(n, seed * 4 + 1), g1 = Random(n, seed * 4 + 2);
    const std::vector<float> e0 = Random(n, seed * 4 + 3, scale), e1 = Random(n, seed * 4 + 4, scale);
    std::vector<float> grad_sketch(kSketchSlots, 0.0f), held_sketch(kSketchSlots, 0.0f);
    std::vector<float> sum_sketch(kSketchSlots, 0.0f);
    std::vector<float> g(n), e(n);
    for (size_t i = 0; i < n; ++i) {
      g[i] = g0[i] + g1[i];
      e[i] = e0[i] + e1[i];
    }
    // Rank 0's and rank 1's sketches, summed as the all-reduce does; two members at offsets.
    for (const auto* v : {&g0, &g1}) {
      AddToSketch({v->data(), n / 2}, 0, grad_sketch);
      AddToSketch({v->data() + n / 2, n - n / 2}, n / 2, grad_sketch);
    }
    for (const auto* v : {&e0, &e1}) AddToSketch(*v, 0, held_sketch);
    AddToSketch(g, 0, sum_sketch);
    for (size_t k = 0; k < kSketchSlots; ++k) {
      EXPECT_NEAR(grad_sketch[k], sum_sketch[k], 1e-2) << "slot " << k;
    }
    const double exact = HeldBackRatio(e, g);
    const double estimate = SketchedHeldBackRatio(held_sketch, grad_sketch);
    EXPECT_NEAR(estimate / exact, 1.0, 0.25) << "seed " << seed << ": " << estimate << " vs "
                                             << exact;
  }
  std::vector<float> sketch(kSketchSlots, 0.0f), nan(kSketchSlots, 0.0f);
  AddToSketch(Random(1000, 9), 0, sketch);
  nan[3] = std::nanf("");
  EXPECT_TRUE(std::isinf(SketchedHeldBackRatio(nan, sketch)));
  EXPECT_EQ(SketchedHeldBackRatio(std::vector<float>(kSketchSlots, 0.0f),
                                  std::vector<float>(kSketchSlots, 0.0f)), 0.0);
}

TEST(LowRankTest, HeldBackRatioOfNonFiniteOrZeroGradients) {
  const std::vector<float> zero(4, 0.0f), one = {1, 0, 0, 0}, two = {0, 2, 0, 0};
  EXPECT_EQ(HeldBackRatio(zero, zero), 0.0);
  EXPECT_DOUBLE_EQ(HeldBackRatio(two, one), 2.0);
  EXPECT_TRUE(std::isinf(HeldBackRatio(one, zero)));
  const std::vector<float> nan = {std::nanf(""), 0, 0, 0};
  EXPECT_TRUE(std::isinf(HeldBackRatio(nan, one)));
  EXPECT_TRUE(std::isinf(HeldBackRatio(one, nan)));
}

}  // namespace
}  // namespace poseidon::agent
