// The data-plane frame (DESIGN.md, "Wire"): a fixed 64-byte little-endian header, then
// payload_length raw bytes. DecodeHeader validates every field before anyone allocates or reads
// the payload. Thread-safety: pure functions and value types, safe from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace poseidon::transport {

inline constexpr uint32_t kFrameMagic = 0x4E445350u;  // bytes "PSDN" on the wire
inline constexpr uint16_t kFrameVersion = 1;
inline constexpr size_t kFrameHeaderSize = 64;

// Frame types. Values are wire format: never renumber, only add.
enum class FrameType : uint8_t {
  // Handshake (transport/handshake.h), before any data frame.
  kHello = 1,
  kChallenge = 2,
  kAuth = 3,
  kAuthOk = 4,
  // The peer is told why its request failed or why it is being disconnected; payload is a
  // UTF-8 message, key the absl::StatusCode, sequence the failed request's.
  kError = 5,
  // KV server control: table registration (payload: poseidon.v1.RegisterTablesRequest) and
  // checkpoint requests, each answered by its ack or an ERROR.
  kRegisterTables = 6,
  kRegisterTablesAck = 7,
  kCheckpoint = 8,
  kCheckpointAck = 9,
  // Parameter-server data plane (push gradients, pull results).
  kPush = 16,
  kPushAck = 17,
  kPull = 18,
  kPullResponse = 19,
  // Sufficient-factor broadcasting between agents.
  kFactors = 20,
  // Replication between KV servers (DESIGN.md, "Faults"): a key's primary sends each completed
  // clock's state (the sum rule's result, or the parameters and optimizer state) to its
  // backups, which acknowledge it before the primary answers that clock's pulls. Only a
  // connection authenticated as a server (ServerRank) may send them.
  kReplicate = 22,
  kReplicateAck = 23,
  // Liveness and latency probes.
  kPing = 32,
  kPong = 33,
  // Generic data (tests, benchmarks).
  kData = 48,
};

bool IsKnownFrameType(uint8_t value);
absl::string_view FrameTypeName(FrameType type);

// Flag bits. Unknown bits are rejected so that a future meaning is never silently ignored.
enum FrameFlag : uint8_t {
  kFlagPayloadChecksum = 1u << 0,  // payload_checksum holds the CRC-32C of the payload
  kFlagLast = 1u << 1,             // last chunk of a tensor (application-defined use)
  kFlagInit = 1u << 2,             // a push that sets a key's initial value (rank 0, once)
  // A push re-sent after its server was lost while the answer of its clock was arriving (so its
  // payload may be overwritten): the new server must already hold that clock, and only
  // acknowledges it; otherwise it refuses it (DataLoss) rather than sum the payload.
  kFlagReplay = 1u << 3,
  // A key on a lossy wire (bfloat16/fp16) falling back to float32 (docs/server.md, "Lossy
  // wires"): on a PUSH, the payload is float32 (a rank's divergence guard found the 16-bit
  // encoding too far from the gradient); on a PULL, the puller accepts a float32 answer; on a
  // PULL_RESPONSE or a REPLICATE, the key is on float32 from this clock on.
  kFlagExactWire = 1u << 4,
  // A FACTORS frame about a rank removed from the job (--min_workers), which `sequence` names:
  // with a payload, that rank's factors of `clock`, passed on by an agent that received them
  // (the rank may have died while sending them); without, the highest clock of its factors the
  // sender holds (0: none). docs/wire.md (flags) and docs/operations.md, "The world shrinks".
  kFlagRelayed = 1u << 5,
  // A FACTORS frame without a payload about a removed rank coming back (docs/operations.md, "The
  // world grows again"): `sequence` 0, from that rank, asks where the receiver's SFB layers are;
  // `sequence` 1, the answer, gives in `clock` the highest iteration of which the sender sent
  // SFB factors (0: none), and the sender's SFB layers wait for the rank from the next iteration
  // on until its PING names the iteration it counts again from.
  kFlagReturn = 1u << 6,
};
inline constexpr uint8_t kKnownFrameFlags = kFlagPayloadChecksum | kFlagLast | kFlagInit |
                                            kFlagReplay | kFlagExactWire | kFlagRelayed |
                                            kFlagReturn;

// The rank a KV server authenticates as towards another server of the job (replication):
// above every worker rank, and its RankKey is derived from the job's secret, which agents never
// hold, so no agent can speak as a server.
inline constexpr uint32_t kServerRankBase = 0x80000000u;
inline constexpr uint32_t ServerRank(uint32_t server_index) { return kServerRankBase + server_index; }
inline constexpr bool IsServerRank(uint32_t rank) { return rank >= kServerRankBase; }

struct FrameHeader {
  FrameType type = FrameType::kData;
  uint8_t flags = 0;
  uint64_t job_id = 0;
  uint32_t epoch = 0;
  uint32_t sender_rank = 0;
  uint64_t sequence = 0;
  uint64_t key = 0;
  uint64_t clock = 0;
  uint64_t payload_length = 0;
  uint32_t payload_checksum = 0;

  bool operator==(const FrameHeader&) const = default;
};

// What a receiver accepts. A header declaring more than max_payload_bytes is refused before any
// buffer is chosen for it.
struct FrameLimits {
  uint64_t max_payload_bytes = uint64_t{1} << 30;  // 1 GiB
};

using EncodedHeader = std::array<std::byte, kFrameHeaderSize>;

// Serializes `header` and fills in the header checksum.
EncodedHeader EncodeHeader(const FrameHeader& header);

// Parses and validates a received header: magic, version, type, flags, header checksum and the
// payload length against `limits`. Errors are InvalidArgument (malformed) or
// ResourceExhausted (too large), with a message that names the field.
absl::StatusOr<FrameHeader> DecodeHeader(std::span<const std::byte, kFrameHeaderSize> bytes,
                                         const FrameLimits& limits);

// A short human-readable description for logs: "push job=3 rank=1 key=7 clock=2 len=4096".
std::string DescribeHeader(const FrameHeader& header);

}  // namespace poseidon::transport
