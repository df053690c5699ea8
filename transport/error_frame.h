// ERROR frames: how a peer is told why its request failed or why it is being disconnected.
// The status code travels in the header's key field, the message (at most 1 KiB) as payload.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "transport/frame.h"

namespace poseidon::transport {

inline constexpr size_t kMaxErrorMessageBytes = 1024;

// The header and payload of an ERROR frame for `status` (message truncated to the maximum).
struct ErrorFrame {
  FrameHeader header;
  std::string message;
};
ErrorFrame MakeErrorFrame(uint64_t job_id, const absl::Status& status);

// Rebuilds the status an ERROR frame carries. A malformed one (unknown code, message too long)
// gives an Internal error saying so.
absl::Status ParseErrorFrame(const FrameHeader& header, std::span<const std::byte> payload);

}  // namespace poseidon::transport
