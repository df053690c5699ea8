#include "common/bf16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace poseidon {
namespace {

TEST(Bf16Test, RoundsToNearestEvenAndKeepsSpecialValues) {
  EXPECT_EQ(FromBf16(ToBf16(1.0f)), 1.0f);
  EXPECT_EQ(FromBf16(ToBf16(-2.5f)), -2.5f);
  // Between 1 and 1 + 2^-7 (the next bfloat16): below the middle down, above up, the middle to
  // the even one (1.0).
  EXPECT_EQ(FromBf16(ToBf16(1.0f + std::ldexp(1.0f, -9))), 1.0f);
  EXPECT_EQ(FromBf16(ToBf16(1.0f + 3 * std::ldexp(1.0f, -9))), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(FromBf16(ToBf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_EQ(FromBf16(ToBf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + 2 * std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(FromBf16(ToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(FromBf16(ToBf16(std::bit_cast<float>(0x7f800001u))))) << "signalling";
  EXPECT_EQ(FromBf16(ToBf16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
  EXPECT_EQ(FromBf16(ToBf16(-0.0f)), 0.0f);
  EXPECT_TRUE(std::signbit(FromBf16(ToBf16(-0.0f))));
}

TEST(Bf16Test, AnyValueIsWithinHalfAUnitOfItsRounding) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> d(-1000.0f, 1000.0f);
  for (int i = 0; i < 100000; ++i) {
    const float v = d(rng);
    const float r = FromBf16(ToBf16(v));
    int exponent = 0;
    std::frexp(v, &exponent);  // |v| in [2^(e-1), 2^e): a bfloat16 unit there is 2^(e-8)
    EXPECT_LE(std::abs(r - v), std::ldexp(1.0f, exponent - 9)) << v;
  }
}

TEST(Bf16Test, ErrorFeedbackSendsOverTimeWhatRoundingLoses) {
  // What is sent over T steps telescopes to the sum of the inputs minus the last residual.
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  constexpr size_t n = 64;
  std::vector<float> residual(n, 0.0f);
  std::vector<uint16_t> out(n);
  std::vector<double> in_total(n, 0), sent_total(n, 0);
  for (int t = 0; t < 1000; ++t) {
    std::vector<float> in(n);
    for (float& v : in) v = 1.0f + 1.0f / 1024 + 0.01f * d(rng);
    EncodeBf16WithFeedback(in, residual, out);
    for (size_t i = 0; i < n; ++i) {
      in_total[i] += in[i];
      sent_total[i] += FromBf16(out[i]);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(sent_total[i] + residual[i], in_total[i], 1e-3) << i;
    EXPECT_LE(std::abs(residual[i]), std::ldexp(1.0f, -7)) << "one unit near 1 at most";
  }
  std::vector<float> decoded(n), acc(n, 1.0f);
  DecodeBf16(out, decoded);
  AddBf16Into(acc, out);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(acc[i], 1.0f + decoded[i]);
}

}  // namespace
}  // namespace poseidon
