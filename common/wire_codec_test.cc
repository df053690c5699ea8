#include "common/wire_codec.h"

#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace poseidon {
namespace {

bool IsNan16(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

TEST(Fp16Test, EveryHalfDecodesAndEncodesBackToItself) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto half = static_cast<uint16_t>(h);
    const float f = FromF16(half);
    if (IsNan16(half)) {
      EXPECT_TRUE(std::isnan(f)) << h;
      EXPECT_TRUE(IsNan16(ToF16(f))) << h;
      continue;
    }
    EXPECT_EQ(ToF16(f), half) << std::hex << h << " decoded as " << f;
  }
  EXPECT_EQ(FromF16(0x3c00), 1.0f);
  EXPECT_EQ(FromF16(0x7bff), 65504.0f);
  EXPECT_EQ(FromF16(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(FromF16(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(FromF16(0xc000), -2.0f);
}

// The half nearest to v by exhaustive search over the finite halves, ties to the even one.
uint16_t NearestHalf(float v) {
  const double x = v;
  uint16_t best = 0;
  double best_error = std::numeric_limits<double>::infinity();
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto half = static_cast<uint16_t>(h);
    if ((half & 0x7c00u) == 0x7c00u) continue;  // infinities and NaN
    const double error = std::abs(static_cast<double>(FromF16(half)) - x);
    if (error < best_error || (error == best_error && (half & 1u) == 0 && (best & 1u) != 0)) {
      best = half;
      best_error = error;
    }
  }
  return best;
}

TEST(Fp16Test, FloatsRoundToTheNearestHalfTiesToEven) {
  std::mt19937 rng(11);
  // Random bit patterns across the half's range (2^-26 .. 65504), both signs.
  std::uniform_real_distribution<float> exponent(-26.0f, 15.99f);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  for (int i = 0; i < 300; ++i) {
    float v = std::ldexp(mantissa(rng), static_cast<int>(std::floor(exponent(rng))));
    if (v > 65504.0f) v = 65504.0f;
    if (i % 2 == 1) v = -v;
    const uint16_t want = static_cast<uint16_t>(NearestHalf(std::abs(v)) | (v < 0 ? 0x8000u : 0));
    EXPECT_EQ(ToF16(v), want) << v;
  }
  // Exact midpoints go to the even neighbour: 1 + 2^-11 is between 1 and 1 + 2^-10.
  EXPECT_EQ(ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Subnormal midpoints: 2^-25 rounds to zero (even), 3·2^-25 to 2·2^-24.
  EXPECT_EQ(ToF16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(ToF16(3 * std::ldexp(1.0f, -25)), 0x0002);
  EXPECT_EQ(ToF16(std::ldexp(1.0f, -25) * 1.0001f), 0x0001);
  // A carry out of the subnormals gives the smallest normal.
  EXPECT_EQ(ToF16(std::ldexp(1023.75f, -24)), 0x0400);
}

TEST(Fp16Test, OutOfRangeSaturatesAndSpecialValuesStay) {
  EXPECT_EQ(ToF16(65519.0f), 0x7bff) << "rounds down to the largest finite half";
  EXPECT_EQ(ToF16(65520.0f), 0x7bff) << "would round to infinity: saturates";
  EXPECT_EQ(ToF16(1e30f), 0x7bff);
  EXPECT_EQ(ToF16(-1e30f), 0xfbff);
  EXPECT_EQ(ToF16(std::numeric_limits<float>::max()), 0x7bff);
  EXPECT_EQ(ToF16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(ToF16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(IsNan16(ToF16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(IsNan16(ToF16(std::bit_cast<float>(0x7f800001u)))) << "signalling NaN stays NaN";
  EXPECT_EQ(ToF16(-0.0f), 0x8000);
  EXPECT_EQ(ToF16(std::numeric_limits<float>::denorm_min()), 0x0000);
}

TEST(WireCodecTest, NamesParseBackAndOnlyFloat32IsExact) {
  for (WireType t : {WireType::kF32, WireType::kBf16, WireType::kF16}) {
    EXPECT_EQ(ParseWireName(WireName(t)), t);
  }
  EXPECT_FALSE(ParseWireName("fp8").has_value());
  EXPECT_FALSE(IsLossy(WireType::kF32));
  EXPECT_TRUE(IsLossy(WireType::kBf16));
  EXPECT_TRUE(IsLossy(WireType::kF16));
  EXPECT_EQ(WireElementBytes(WireType::kF32), 4u);
  EXPECT_EQ(WireElementBytes(WireType::kF16), 2u);
}

// The test: over 1,000 iterations of random gradients the accumulated error (the
// residual, what was not yet sent) stays bounded by one rounding, and what was sent plus the
// residual is the exact sum.
class FeedbackTest : public ::testing::TestWithParam<WireType> {};

TEST_P(FeedbackTest, TheAccumulatedErrorStaysBoundedOverAThousandIterations) {
  const WireType type = GetParam();
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 1.0f);
  constexpr size_t n = 256;
  std::vector<float> residual(n, 0.0f);
  std::vector<uint16_t> out(n);
  std::vector<double> in_total(n, 0), sent_total(n, 0);
  // Bounded by half a unit of the largest value sent (|v| < 8·scale here: 8 units relative to
  // the scale, 2^-8 for bf16, 2^-11 for fp16), plus fp16's absolute half unit of its subnormals
  // (2^-25) where the values are that small, and never growing with t.
  const double unit = type == WireType::kBf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double floor = type == WireType::kF16 ? std::ldexp(1.0, -25) : 0.0;
  int over_bound = 0;
  for (int t = 0; t < 1000; ++t) {
    std::vector<float> in(n);
    // Magnitudes over six decades, as gradients of different layers have.
    for (size_t i = 0; i < n; ++i) in[i] = d(rng) * std::ldexp(1.0f, -static_cast<int>(i % 20));
    EncodeWithFeedback(type, in, residual, out);
    for (size_t i = 0; i < n; ++i) {
      in_total[i] += in[i];
      sent_total[i] += FromWire16(type, out[i]);
      const double scale = std::ldexp(1.0, -static_cast<int>(i % 20));
      if (std::abs(residual[i]) > 8 * unit * scale + floor) ++over_bound;
    }
  }
  EXPECT_EQ(over_bound, 0);
  for (size_t i = 0; i < n; ++i) {
    const double scale = std::ldexp(1.0, -static_cast<int>(i % 20));
    EXPECT_NEAR((sent_total[i] + residual[i]) / scale, in_total[i] / scale, 1e-3) << i;
  }
  std::vector<float> decoded(n), acc(n, 1.0f);
  DecodeWire16(type, out, decoded);
  AddWire16Into(type, acc, out);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(acc[i], 1.0f + decoded[i]);
}

INSTANTIATE_TEST_SUITE_P(Lossy, FeedbackTest, ::testing::Values(WireType::kBf16, WireType::kF16),
                         [](const auto& info) { return std::string(WireName(info.param)); });

// A lossy all-reduce's two roundings (agent/allreduce_syncer.cc): 4 ranks encode with feedback,
// the shard's owner sums their 16-bit contributions in float32 and encodes the sum with its own.
// Over 1,000 iterations of random gradients, the sum of the results is the sum of the exact sums
// but for what the five residuals hold now: bounded (a few units of the largest value), never
// growing with t.
TEST_P(FeedbackTest, AShardOwnersSumOfRoundedContributionsStaysWithinTheResiduals) {
  const WireType type = GetParam();
  constexpr size_t kRanks = 4, m = 64;
  std::mt19937 rng(9);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<std::vector<float>> residual(kRanks, std::vector<float>(m, 0.0f));
  std::vector<float> owner_residual(m, 0.0f), sum(m);
  std::vector<uint16_t> received(kRanks * m), out(m);
  std::vector<double> exact_total(m, 0), result_total(m, 0);
  const double unit = type == WireType::kBf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  double worst = 0;  // |results - exact| / scale over every t and element
  for (int t = 0; t < 1000; ++t) {
    for (size_t r = 0; r < kRanks; ++r) {
      std::vector<float> g(m);
      for (size_t i = 0; i < m; ++i) {
        g[i] = d(rng) * std::ldexp(1.0f, -static_cast<int>(i % 10));
        exact_total[i] += g[i];
      }
      EncodeWithFeedback(type, g, residual[r], std::span(received).subspan(r * m, m));
    }
    SumShardWithFeedback(type, received, sum, owner_residual, out);
    for (size_t i = 0; i < m; ++i) {
      result_total[i] += FromWire16(type, out[i]);
      const double scale = std::ldexp(1.0, -static_cast<int>(i % 10));
      worst = std::max(worst, std::abs(result_total[i] - exact_total[i]) / scale);
    }
  }
  // Each residual is at most half a unit of what it rounded (|g| < 8 scale, a sum < 32 scale).
  EXPECT_LE(worst, (kRanks * 8 + 32) * unit) << WireName(type);
  EXPECT_GT(worst, 0) << "the wire is lossy";
  // And the sum is the owner's: the contributions decoded and added in rank order.
  std::vector<float> want(m, 0.0f);
  for (size_t r = 0; r < kRanks; ++r) AddWire16Into(type, want, std::span(received).subspan(r * m, m));
  EXPECT_EQ(sum, want);
}

TEST(WireCodecTest, A16BitAnswerInAFloatBufferDecodesInPlace) {
  for (WireType type : {WireType::kBf16, WireType::kF16}) {
    std::vector<float> want(999);
    std::vector<uint16_t> wire(want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      wire[i] = ToWire16(type, static_cast<float>(i) * 0.37f - 100.0f);
      want[i] = FromWire16(type, wire[i]);
    }
    std::vector<float> buffer(want.size(), -1.0f);
    std::memcpy(buffer.data(), wire.data(), wire.size() * sizeof(uint16_t));
    DecodeWire16InPlace(type, buffer);
    EXPECT_EQ(buffer, want) << WireName(type);
  }
}

TEST(WireCodecTest, Fp16SaturationIsSentLaterByErrorFeedback) {
  // 100000 does not fit a half: 65504 goes now, the rest stays in the residual and goes next.
  std::vector<float> residual(1, 0.0f);
  std::vector<uint16_t> out(1);
  const std::vector<float> big{100000.0f}, zero{0.0f};
  EncodeWithFeedback(WireType::kF16, big, residual, out);
  EXPECT_EQ(FromF16(out[0]), 65504.0f);
  EXPECT_EQ(residual[0], 100000.0f - 65504.0f);
  EncodeWithFeedback(WireType::kF16, zero, residual, out);
  EXPECT_NEAR(FromF16(out[0]), 34496.0f, 16.0f);
}

}  // namespace
}  // namespace poseidon
