#include "transport/checksum.h"

#include <gtest/gtest.h>

#include <vector>

#include "absl/strings/string_view.h"

namespace poseidon::transport {
namespace {

std::span<const std::byte> Bytes(absl::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

TEST(Crc32cTest, MatchesPublishedCheckValue) {
  // The CRC-32C check value (RFC 3720, appendix B.4): "123456789" -> 0xE3069283.
  EXPECT_EQ(Crc32c(0, Bytes("123456789")), 0xE3069283u);
  EXPECT_EQ(Crc32c(0, Bytes("")), 0u);
}

TEST(Crc32cTest, ThirtyTwoBytesOfZerosMatchRfc3720) {
  std::vector<std::byte> zeros(32, std::byte{0});
  EXPECT_EQ(Crc32c(0, zeros), 0x8A9136AAu);
  std::vector<std::byte> ones(32, std::byte{0xFF});
  EXPECT_EQ(Crc32c(0, ones), 0x62A8AB43u);
}

TEST(Crc32cTest, ExtendsAcrossPieces) {
  const absl::string_view text = "the quick brown fox jumps over the lazy dog, 0123456789";
  const uint32_t whole = Crc32c(0, Bytes(text));
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    EXPECT_EQ(Crc32c(Crc32c(0, Bytes(text.substr(0, cut))), Bytes(text.substr(cut))), whole)
        << "cut at " << cut;
  }
}

}  // namespace
}  // namespace poseidon::transport
