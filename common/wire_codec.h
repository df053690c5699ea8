// What a PS push or pull carries (issue 15, "Wire precision"): float32 (exact), or a lossy
// 16-bit type, bfloat16 (common/bf16.h: float32's range, 8 mantissa bits) or fp16 (common/fp16.h:
// 11 mantissa bits, range ±65504). The lossy types are encoded with error feedback: the rounding
// error of one iteration (the residual) is added to the next iteration's values before they are
// rounded, so the sum over iterations of what was sent stays within one rounding of the sum of
// the exact values. Accumulation is always in float32 (the server decodes every push into a
// float32 sum). Thread-safety: pure functions; a residual belongs to one caller.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>

#include "common/bf16.h"
#include "common/fp16.h"

namespace poseidon {

enum class WireType : uint8_t { kF32 = 0, kBf16 = 1, kF16 = 2 };

inline bool IsLossy(WireType type) { return type != WireType::kF32; }

// Bytes per element on the wire.
inline size_t WireElementBytes(WireType type) { return IsLossy(type) ? 2 : sizeof(float); }

// "fp32", "bf16", "fp16": the names flags and `poseidon plan` use.
inline const char* WireName(WireType type) {
  switch (type) {
    case WireType::kBf16:
      return "bf16";
    case WireType::kF16:
      return "fp16";
    case WireType::kF32:
      break;
  }
  return "fp32";
}

inline std::optional<WireType> ParseWireName(std::string_view name) {
  if (name == "fp32") return WireType::kF32;
  if (name == "bf16") return WireType::kBf16;
  if (name == "fp16") return WireType::kF16;
  return std::nullopt;
}

// One element of a lossy type to and from float32 (kF32 is not a 16-bit type: not here).
inline uint16_t ToWire16(WireType type, float value) {
  return type == WireType::kF16 ? ToF16(value) : ToBf16(value);
}
inline float FromWire16(WireType type, uint16_t value) {
  return type == WireType::kF16 ? FromF16(value) : FromBf16(value);
}

// out = round(in + residual); residual = (in + residual) - out. The sizes must match; `type` is
// lossy.
inline void EncodeWithFeedback(WireType type, std::span<const float> in, std::span<float> residual,
                               std::span<uint16_t> out) {
  if (type == WireType::kF16) {
    for (size_t i = 0; i < in.size(); ++i) {
      const float v = in[i] + residual[i];
      out[i] = ToF16(v);
      residual[i] = v - FromF16(out[i]);
    }
  } else {
    EncodeBf16WithFeedback(in, residual, out);
  }
}

// out = round(in), without feedback (a restored checkpoint's last result).
inline void EncodeWire16(WireType type, std::span<const float> in, std::span<uint16_t> out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = ToWire16(type, in[i]);
}

inline void DecodeWire16(WireType type, std::span<const uint16_t> in, std::span<float> out) {
  if (type == WireType::kF16) {
    for (size_t i = 0; i < in.size(); ++i) out[i] = FromF16(in[i]);
  } else {
    DecodeBf16(in, out);
  }
}

// The 16-bit values stored at the start of `values`' bytes (an answer of values.size() · 2 bytes
// read into a float32 buffer), decoded into `values` in place: from the last element down, each
// float is written over 16-bit values already decoded (element i's 4 bytes cover the 16-bit
// elements 2i and 2i + 1, both >= i).
inline void DecodeWire16InPlace(WireType type, std::span<float> values) {
  std::byte* bytes = reinterpret_cast<std::byte*>(values.data());
  for (size_t i = values.size(); i-- > 0;) {
    uint16_t h = 0;
    std::memcpy(&h, bytes + 2 * i, sizeof(h));
    const float f = FromWire16(type, h);
    std::memcpy(bytes + 4 * i, &f, sizeof(f));
  }
}

// acc += decode(in), in float32.
inline void AddWire16Into(WireType type, std::span<float> acc, std::span<const uint16_t> in) {
  if (type == WireType::kF16) {
    for (size_t i = 0; i < in.size(); ++i) acc[i] += FromF16(in[i]);
  } else {
    AddBf16Into(acc, in);
  }
}

// A shard owner's step of a lossy all-reduce (agent/allreduce_syncer.cc): `received` holds the
// W contributions to a shard of `sum.size()` elements one after another (rank 0's first), each
// encoded by its rank with feedback; their float32 sum, in that order, goes to `sum` and out
// encoded with the owner's feedback (`residual`). Sizes: received W · m, sum, residual and out m.
inline void SumShardWithFeedback(WireType type, std::span<const uint16_t> received,
                                 std::span<float> sum, std::span<float> residual,
                                 std::span<uint16_t> out) {
  const size_t m = sum.size();
  std::fill(sum.begin(), sum.end(), 0.0f);
  for (size_t at = 0; m > 0 && at + m <= received.size(); at += m) {
    AddWire16Into(type, sum, received.subspan(at, m));
  }
  EncodeWithFeedback(type, sum, residual, out);
}

}  // namespace poseidon
