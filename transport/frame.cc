#include "transport/frame.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "transport/checksum.h"

namespace poseidon::transport {
namespace {

// Byte offsets of the fields in the 64-byte header.
constexpr size_t kOffMagic = 0;
constexpr size_t kOffVersion = 4;
constexpr size_t kOffType = 6;
constexpr size_t kOffFlags = 7;
constexpr size_t kOffJob = 8;
constexpr size_t kOffEpoch = 16;
constexpr size_t kOffRank = 20;
constexpr size_t kOffSequence = 24;
constexpr size_t kOffKey = 32;
constexpr size_t kOffClock = 40;
constexpr size_t kOffLength = 48;
constexpr size_t kOffPayloadCrc = 56;
constexpr size_t kOffHeaderCrc = 60;

template <typename T>
void Put(std::byte* out, size_t offset, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out[offset + i] = static_cast<std::byte>((static_cast<uint64_t>(value) >> (8 * i)) & 0xFFu);
  }
}

template <typename T>
T Get(const std::byte* in, size_t offset) {
  uint64_t value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    value |= static_cast<uint64_t>(std::to_integer<uint8_t>(in[offset + i])) << (8 * i);
  }
  return static_cast<T>(value);
}

}  // namespace

bool IsKnownFrameType(uint8_t value) {
  switch (static_cast<FrameType>(value)) {
    case FrameType::kHello:
    case FrameType::kChallenge:
    case FrameType::kAuth:
    case FrameType::kAuthOk:
    case FrameType::kError:
    case FrameType::kRegisterTables:
    case FrameType::kRegisterTablesAck:
    case FrameType::kCheckpoint:
    case FrameType::kCheckpointAck:
    case FrameType::kPush:
    case FrameType::kPushAck:
    case FrameType::kPull:
    case FrameType::kPullResponse:
    case FrameType::kFactors:
    case FrameType::kReplicate:
    case FrameType::kReplicateAck:
    case FrameType::kPing:
    case FrameType::kPong:
    case FrameType::kData:
      return true;
  }
  return false;
}

absl::string_view FrameTypeName(FrameType type) {
  switch (type) {
    case FrameType::kHello:
      return "hello";
    case FrameType::kChallenge:
      return "challenge";
    case FrameType::kAuth:
      return "auth";
    case FrameType::kAuthOk:
      return "auth-ok";
    case FrameType::kError:
      return "error";
    case FrameType::kRegisterTables:
      return "register-tables";
    case FrameType::kRegisterTablesAck:
      return "register-tables-ack";
    case FrameType::kCheckpoint:
      return "checkpoint";
    case FrameType::kCheckpointAck:
      return "checkpoint-ack";
    case FrameType::kPush:
      return "push";
    case FrameType::kPushAck:
      return "push-ack";
    case FrameType::kPull:
      return "pull";
    case FrameType::kPullResponse:
      return "pull-response";
    case FrameType::kFactors:
      return "factors";
    case FrameType::kReplicate:
      return "replicate";
    case FrameType::kReplicateAck:
      return "replicate-ack";
    case FrameType::kPing:
      return "ping";
    case FrameType::kPong:
      return "pong";
    case FrameType::kData:
      return "data";
  }
  return "unknown";
}

EncodedHeader EncodeHeader(const FrameHeader& header) {
  EncodedHeader out{};
  std::byte* p = out.data();
  Put<uint32_t>(p, kOffMagic, kFrameMagic);
  Put<uint16_t>(p, kOffVersion, kFrameVersion);
  Put<uint8_t>(p, kOffType, static_cast<uint8_t>(header.type));
  Put<uint8_t>(p, kOffFlags, header.flags);
  Put<uint64_t>(p, kOffJob, header.job_id);
  Put<uint32_t>(p, kOffEpoch, header.epoch);
  Put<uint32_t>(p, kOffRank, header.sender_rank);
  Put<uint64_t>(p, kOffSequence, header.sequence);
  Put<uint64_t>(p, kOffKey, header.key);
  Put<uint64_t>(p, kOffClock, header.clock);
  Put<uint64_t>(p, kOffLength, header.payload_length);
  Put<uint32_t>(p, kOffPayloadCrc, header.payload_checksum);
  Put<uint32_t>(p, kOffHeaderCrc, Crc32c(0, std::span<const std::byte>(p, kOffHeaderCrc)));
  return out;
}

absl::StatusOr<FrameHeader> DecodeHeader(std::span<const std::byte, kFrameHeaderSize> bytes,
                                         const FrameLimits& limits) {
  const std::byte* p = bytes.data();
  const auto magic = Get<uint32_t>(p, kOffMagic);
  if (magic != kFrameMagic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bad frame magic 0x%08x (expected 0x%08x)", magic, kFrameMagic));
  }
  const auto version = Get<uint16_t>(p, kOffVersion);
  if (version != kFrameVersion) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported frame version ", version,
                                                   " (this build speaks ", kFrameVersion, ")"));
  }
  const auto stored_crc = Get<uint32_t>(p, kOffHeaderCrc);
  const uint32_t crc = Crc32c(0, bytes.first(kOffHeaderCrc));
  if (stored_crc != crc) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "frame header checksum mismatch (got 0x%08x, computed 0x%08x)", stored_crc, crc));
  }
  const auto type = Get<uint8_t>(p, kOffType);
  if (!IsKnownFrameType(type)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown frame type ", type));
  }
  const auto flags = Get<uint8_t>(p, kOffFlags);
  if ((flags & ~kKnownFrameFlags) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("unknown frame flags 0x%02x", flags));
  }
  FrameHeader h;
  h.type = static_cast<FrameType>(type);
  h.flags = flags;
  h.job_id = Get<uint64_t>(p, kOffJob);
  h.epoch = Get<uint32_t>(p, kOffEpoch);
  h.sender_rank = Get<uint32_t>(p, kOffRank);
  h.sequence = Get<uint64_t>(p, kOffSequence);
  h.key = Get<uint64_t>(p, kOffKey);
  h.clock = Get<uint64_t>(p, kOffClock);
  h.payload_length = Get<uint64_t>(p, kOffLength);
  h.payload_checksum = Get<uint32_t>(p, kOffPayloadCrc);
  if (h.payload_length > limits.max_payload_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("frame payload length ", h.payload_length,
                                                     " exceeds the maximum of ",
                                                     limits.max_payload_bytes, " bytes"));
  }
  if ((h.flags & kFlagPayloadChecksum) == 0 && h.payload_checksum != 0) {
    return absl::InvalidArgumentError("payload checksum set without the checksum flag");
  }
  return h;
}

std::string DescribeHeader(const FrameHeader& h) {
  return absl::StrCat(FrameTypeName(h.type), " job=", h.job_id, " epoch=", h.epoch,
                      " rank=", h.sender_rank, " seq=", h.sequence, " key=", h.key,
                      " clock=", h.clock, " len=", h.payload_length);
}

}  // namespace poseidon::transport
