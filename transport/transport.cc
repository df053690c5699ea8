#include "transport/transport.h"

#include "absl/strings/str_cat.h"
#include "transport/checksum.h"

namespace poseidon::transport {
namespace {

class PlainMemoryRegion final : public MemoryRegion {
 public:
  explicit PlainMemoryRegion(MutableBuffer buffer) : buffer_(buffer) {}
  MutableBuffer Buffer() const override { return buffer_; }

 private:
  MutableBuffer buffer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MemoryRegion>> Context::RegisterMemory(MutableBuffer buffer) {
  return std::make_unique<PlainMemoryRegion>(buffer);
}

size_t TotalSize(std::span<const ConstBuffer> buffers) {
  size_t total = 0;
  for (const auto& b : buffers) total += b.size();
  return total;
}

absl::Status PrepareSend(FrameHeader& header, std::span<const ConstBuffer> payload,
                         const ContextOptions& options) {
  const size_t total = TotalSize(payload);
  if (total != header.payload_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload buffers hold ", total, " bytes but the header declares ", header.payload_length));
  }
  if (header.payload_length > options.limits.max_payload_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("payload of ", header.payload_length,
                                                     " bytes exceeds the maximum of ",
                                                     options.limits.max_payload_bytes));
  }
  if (options.payload_checksums) {
    uint32_t crc = 0;
    for (const auto& b : payload) crc = Crc32c(crc, b);
    header.flags |= kFlagPayloadChecksum;
    header.payload_checksum = crc;
  }
  return absl::OkStatus();
}

ConnectionStats ConnectionCounters::Snapshot() const {
  ConnectionStats s;
  s.frames_sent = frames_sent.load(std::memory_order_relaxed);
  s.frames_received = frames_received.load(std::memory_order_relaxed);
  s.bytes_sent = bytes_sent.load(std::memory_order_relaxed);
  s.bytes_received = bytes_received.load(std::memory_order_relaxed);
  return s;
}

}  // namespace poseidon::transport
