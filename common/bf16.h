// bfloat16 on the wire (issue 15, "Wire precision"): the upper 16 bits of an IEEE float32,
// rounded to nearest even; a lossy encoding that halves the bytes of a push or pull. Encoding
// with error feedback adds the previous rounding error (the residual) before rounding and keeps
// the new one, so that what is lost in one iteration is sent in the next: the sum over
// iterations of what was sent stays within one rounding of the sum of the exact values.
// Thread-safety: pure functions; a residual belongs to one caller.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <span>

namespace poseidon {

inline uint16_t ToBf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // a NaN stays a (quiet) NaN
  }
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit, then truncate.
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

inline float FromBf16(uint16_t value) {
  return std::bit_cast<float>(static_cast<uint32_t>(value) << 16);
}

inline void EncodeBf16(std::span<const float> in, std::span<uint16_t> out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = ToBf16(in[i]);
}

// out = bf16(in + residual); residual = (in + residual) - out. The sizes must match.
inline void EncodeBf16WithFeedback(std::span<const float> in, std::span<float> residual,
                                   std::span<uint16_t> out) {
  for (size_t i = 0; i < in.size(); ++i) {
    const float v = in[i] + residual[i];
    out[i] = ToBf16(v);
    residual[i] = v - FromBf16(out[i]);
  }
}

inline void DecodeBf16(std::span<const uint16_t> in, std::span<float> out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = FromBf16(in[i]);
}

// acc += decode(in), in float32.
inline void AddBf16Into(std::span<float> acc, std::span<const uint16_t> in) {
  for (size_t i = 0; i < in.size(); ++i) acc[i] += FromBf16(in[i]);
}

// A payload of bf16 values as read off the wire (any alignment).
inline void CopyBf16(std::span<const std::byte> bytes, std::span<uint16_t> out) {
  std::memcpy(out.data(), bytes.data(), out.size_bytes());
}

}  // namespace poseidon
