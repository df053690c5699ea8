// The wire types (common/wire_codec.h's WireType) as the protos carry them (ElementType in
// KvTableSpec.wire_type and LayerPlan.wire_type): the one mapping the server, the agent and the
// planner share. Thread-safety: pure functions.
#pragma once

#include <optional>

#include "common/wire_codec.h"
#include "poseidon/v1/model.pb.h"

namespace poseidon {

// UNSPECIFIED and F32 are float32; BF16 and F16 the 16-bit types; anything else is no wire type.
inline std::optional<WireType> WireFromProto(v1::ElementType type) {
  switch (type) {
    case v1::ELEMENT_TYPE_UNSPECIFIED:
    case v1::ELEMENT_TYPE_F32:
      return WireType::kF32;
    case v1::ELEMENT_TYPE_BF16:
      return WireType::kBf16;
    case v1::ELEMENT_TYPE_F16:
      return WireType::kF16;
    default:
      return std::nullopt;
  }
}

inline v1::ElementType WireToProto(WireType type) {
  switch (type) {
    case WireType::kBf16:
      return v1::ELEMENT_TYPE_BF16;
    case WireType::kF16:
      return v1::ELEMENT_TYPE_F16;
    case WireType::kF32:
      break;
  }
  return v1::ELEMENT_TYPE_F32;
}

}  // namespace poseidon
