#include "transport/transport.h"

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

}  // namespace poseidon::transport
