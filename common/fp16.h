// IEEE 754 binary16 (fp16) on the wire (issue 15, "Wire precision"): 5 exponent bits, 10
// mantissa bits, rounded to nearest even. Unlike bfloat16 its range is small (largest finite
// 65504, smallest subnormal 2^-24): a finite float32 beyond the largest finite half saturates to
// ±65504 instead of becoming infinite (with error feedback, what saturation cuts off is sent in
// later iterations, and the divergence guard (agent/wire_guard.h) sees a gradient the format
// cannot carry); values below half the smallest subnormal round to zero. Infinities stay
// infinite and NaN stays (quiet) NaN. Thread-safety: pure functions.
#pragma once

#include <bit>
#include <cstdint>

namespace poseidon {

inline uint16_t ToF16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);
  // 65520 and above would round to infinity: saturate to the largest finite half.
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7bffu);
  if (abs >= 0x38800000u) {  // a normal half (|value| >= 2^-14): re-bias 127 -> 15, drop 13 bits
    uint32_t r = abs - (112u << 23);
    r += 0xfffu + ((r >> 13) & 1u);  // to nearest, ties to even (a carry moves the exponent up)
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  // A subnormal half, in units of 2^-24: mantissa (with its implicit bit) shifted right by
  // 126 - exponent, rounded to nearest even; below 2^-25 (shift > 24) it is zero.
  const uint32_t exponent = abs >> 23;
  if (exponent < 102) return sign;
  const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exponent;
  uint32_t q = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (q & 1u) != 0)) ++q;  // 0x400 is the smallest normal
  return static_cast<uint16_t>(sign | q);
}

inline float FromF16(uint16_t value) {
  const uint32_t sign = static_cast<uint32_t>(value & 0x8000u) << 16;
  const uint32_t exponent = (value >> 10) & 0x1fu;
  const uint32_t mantissa = value & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa · 2^-24, exact in float32
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign != 0 ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

}  // namespace poseidon
