#include "agent/wire_guard.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace poseidon::agent {
namespace {

std::vector<float> Gradient(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> g(n);
  for (float& v : g) v = d(rng);
  return g;
}

std::vector<uint16_t> Encode(WireType type, const std::vector<float>& g) {
  std::vector<float> residual(g.size(), 0.0f);
  std::vector<uint16_t> out(g.size());
  EncodeWithFeedback(type, g, residual, out);
  return out;
}

TEST(WireGuardTest, AHealthyWireIsFarBelowTheLimit) {
  const WireGuardOptions options;
  for (WireType type : {WireType::kBf16, WireType::kF16}) {
    const std::vector<float> g = Gradient(4096, 1e-2f, 3);
    const double error = RelativeWireError(type, g, Encode(type, g));
    EXPECT_GT(error, 0) << WireName(type) << ": rounding is not free";
    EXPECT_LT(error, type == WireType::kBf16 ? 4e-3 : 5e-4) << WireName(type);
    EXPECT_FALSE(WireDiverged(options, error)) << WireName(type);
  }
}

TEST(WireGuardTest, AGradientFp16CannotCarryDiverges) {
  const WireGuardOptions options;
  // Beyond ±65504: fp16 saturates.
  const std::vector<float> large = Gradient(1024, 1e6f, 5);
  const double saturated = RelativeWireError(WireType::kF16, large, Encode(WireType::kF16, large));
  EXPECT_TRUE(WireDiverged(options, saturated)) << saturated;
  // The same gradient in bfloat16 (float32's range) is fine.
  EXPECT_FALSE(WireDiverged(
      options, RelativeWireError(WireType::kBf16, large, Encode(WireType::kBf16, large))));
  // Below fp16's subnormals (2^-25): everything rounds to zero, the whole gradient is lost.
  const std::vector<float> tiny = Gradient(1024, 1e-9f, 7);
  const double flushed = RelativeWireError(WireType::kF16, tiny, Encode(WireType::kF16, tiny));
  EXPECT_NEAR(flushed, 1.0, 1e-9);
  EXPECT_TRUE(WireDiverged(options, flushed));
}

// The forged bad compressor: encodings that do not carry the gradient are caught.
TEST(WireGuardTest, AForgedBadCompressorIsCaught) {
  const WireGuardOptions options;
  const std::vector<float> g = Gradient(2048, 1.0f, 11);
  for (WireType type : {WireType::kBf16, WireType::kF16}) {
    std::vector<uint16_t> zeros(g.size(), 0);
    EXPECT_TRUE(WireDiverged(options, RelativeWireError(type, g, zeros))) << WireName(type);
    std::vector<uint16_t> flipped = Encode(type, g);
    for (uint16_t& h : flipped) h ^= 0x8000;  // every sign wrong
    EXPECT_NEAR(RelativeWireError(type, g, flipped), 2.0, 0.01) << WireName(type);
    std::vector<uint16_t> shifted = Encode(type, g);  // off by one element
    std::rotate(shifted.begin(), shifted.begin() + 1, shifted.end());
    EXPECT_TRUE(WireDiverged(options, RelativeWireError(type, g, shifted))) << WireName(type);
    std::vector<uint16_t> one_nan = Encode(type, g);
    one_nan[17] = type == WireType::kBf16 ? 0x7fc0 : 0x7e00;
    EXPECT_TRUE(std::isinf(RelativeWireError(type, g, one_nan))) << WireName(type);
  }
  // Only a zero gradient sent as zeros is no error at all.
  const std::vector<float> zero(8, 0.0f);
  EXPECT_EQ(RelativeWireError(WireType::kBf16, zero, std::vector<uint16_t>(8, 0)), 0.0);
  std::vector<uint16_t> noise(8, 0);
  noise[3] = 0x3f80;  // 1.0
  EXPECT_TRUE(std::isinf(RelativeWireError(WireType::kBf16, zero, noise)));
  EXPECT_TRUE(WireDiverged(options, std::numeric_limits<double>::quiet_NaN()));
}

TEST(WireGuardTest, ClocksAreSampledFromTheFirst) {
  WireGuardOptions options;
  options.check_every = 50;
  EXPECT_FALSE(ShouldCheckWire(options, 0));
  EXPECT_TRUE(ShouldCheckWire(options, 1));
  EXPECT_FALSE(ShouldCheckWire(options, 2));
  EXPECT_FALSE(ShouldCheckWire(options, 50));
  EXPECT_TRUE(ShouldCheckWire(options, 51));
  EXPECT_TRUE(ShouldCheckWire(options, 101));
  options.check_every = 1;
  EXPECT_TRUE(ShouldCheckWire(options, 7));
  options.check_every = 0;
  EXPECT_FALSE(ShouldCheckWire(options, 1));
}

}  // namespace
}  // namespace poseidon::agent
