// libFuzzer target: the frame header decoder. Any 64 bytes must decode to a header that
// re-encodes to the same bytes, or be rejected; never crash, never accept a length above the
// limit. Run: build-fuzz/transport/fuzz/frame_decoder_fuzzer transport/fuzz/corpus/frame
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "transport/frame.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace poseidon::transport;
  // The first 8 bytes choose the limit, the rest is the header (zero-padded if short).
  uint64_t limit = 1 << 20;
  if (size >= 8) {
    std::memcpy(&limit, data, 8);
    data += 8;
    size -= 8;
  }
  EncodedHeader bytes{};
  std::memcpy(bytes.data(), data, size < bytes.size() ? size : bytes.size());
  const FrameLimits limits{.max_payload_bytes = limit};
  auto header = DecodeHeader(bytes, limits);
  if (!header.ok()) return 0;
  if (header->payload_length > limit) std::abort();
  if (EncodeHeader(*header) != bytes) std::abort();
  (void)DescribeHeader(*header);
  return 0;
}
