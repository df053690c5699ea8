#include "transport/frame.h"

#include <gtest/gtest.h>

#include <random>

#include "transport/checksum.h"
#include "transport/error_frame.h"

namespace poseidon::transport {
namespace {

FrameHeader SampleHeader() {
  FrameHeader h;
  h.type = FrameType::kPush;
  h.flags = kFlagLast;
  h.job_id = 0x0102030405060708ull;
  h.epoch = 3;
  h.sender_rank = 15;
  h.sequence = 99;
  h.key = 0xDEADBEEFull;
  h.clock = 42;
  h.payload_length = 4096;
  return h;
}

TEST(FrameTest, RoundTripsEveryField) {
  const FrameHeader h = SampleHeader();
  const EncodedHeader bytes = EncodeHeader(h);
  auto decoded = DecodeHeader(bytes, FrameLimits{});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, h);
}

TEST(FrameTest, WireLayoutIsLittleEndianWithMagicFirst) {
  const EncodedHeader bytes = EncodeHeader(SampleHeader());
  EXPECT_EQ(std::to_integer<char>(bytes[0]), 'P');
  EXPECT_EQ(std::to_integer<char>(bytes[1]), 'S');
  EXPECT_EQ(std::to_integer<char>(bytes[2]), 'D');
  EXPECT_EQ(std::to_integer<char>(bytes[3]), 'N');
  EXPECT_EQ(std::to_integer<int>(bytes[4]), kFrameVersion);
  EXPECT_EQ(std::to_integer<int>(bytes[6]), static_cast<int>(FrameType::kPush));
  EXPECT_EQ(std::to_integer<int>(bytes[8]), 0x08);  // job id, least significant byte first
  EXPECT_EQ(std::to_integer<int>(bytes[15]), 0x01);
}

TEST(FrameTest, RejectsEverySingleBitFlip) {
  const EncodedHeader good = EncodeHeader(SampleHeader());
  for (size_t bit = 0; bit < kFrameHeaderSize * 8; ++bit) {
    EncodedHeader bad = good;
    bad[bit / 8] ^= std::byte{static_cast<unsigned char>(1u << (bit % 8))};
    EXPECT_FALSE(DecodeHeader(bad, FrameLimits{}).ok()) << "bit " << bit;
  }
}

TEST(FrameTest, RejectsOversizedLengthsBeforeAnythingElse) {
  for (uint64_t len : {uint64_t{1} << 31, uint64_t{1} << 63, ~uint64_t{0}}) {
    FrameHeader h = SampleHeader();
    h.payload_length = len;
    auto decoded = DecodeHeader(EncodeHeader(h), FrameLimits{.max_payload_bytes = 1 << 20});
    ASSERT_FALSE(decoded.ok());
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(decoded.status().message().find("exceeds the maximum"), std::string::npos);
  }
  FrameHeader h = SampleHeader();
  h.payload_length = 1 << 20;
  EXPECT_TRUE(DecodeHeader(EncodeHeader(h), FrameLimits{.max_payload_bytes = 1 << 20}).ok());
}

// Rewrites the header checksum so that a deliberately bad field is what the decoder sees.
void Reseal(EncodedHeader& bytes) {
  const uint32_t crc = Crc32c(0, std::span<const std::byte>(bytes.data(), 60));
  for (int i = 0; i < 4; ++i) bytes[60 + i] = std::byte{static_cast<unsigned char>(crc >> (8 * i))};
}

TEST(FrameTest, RejectsUnknownTypeFlagsVersionAndMagicWithReasons) {
  struct Case {
    size_t offset;
    uint8_t value;
    const char* reason;
  };
  for (const Case& c : {Case{0, 'X', "magic"}, Case{4, 9, "version"}, Case{6, 200, "type"},
                        Case{6, 0, "type"}, Case{7, 0x80, "flags"}}) {
    EncodedHeader bytes = EncodeHeader(SampleHeader());
    bytes[c.offset] = std::byte{c.value};
    Reseal(bytes);
    auto decoded = DecodeHeader(bytes, FrameLimits{});
    ASSERT_FALSE(decoded.ok());
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(decoded.status().message().find(c.reason), std::string::npos) << decoded.status();
  }
  EncodedHeader bytes = EncodeHeader(SampleHeader());
  bytes[20] ^= std::byte{1};  // rank changed, checksum not updated
  auto decoded = DecodeHeader(bytes, FrameLimits{});
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("checksum"), std::string::npos);
}

TEST(FrameTest, ChecksumFieldWithoutFlagIsRejected) {
  FrameHeader h = SampleHeader();
  h.payload_checksum = 1234;
  EXPECT_FALSE(DecodeHeader(EncodeHeader(h), FrameLimits{}).ok());
  h.flags |= kFlagPayloadChecksum;
  EXPECT_TRUE(DecodeHeader(EncodeHeader(h), FrameLimits{}).ok());
}

TEST(FrameTest, RandomBytesNeverDecode) {
  std::mt19937_64 rng(7);
  int accepted = 0;
  for (int i = 0; i < 100000; ++i) {
    EncodedHeader bytes;
    for (auto& b : bytes) b = std::byte{static_cast<unsigned char>(rng())};
    if (DecodeHeader(bytes, FrameLimits{}).ok()) ++accepted;
  }
  EXPECT_EQ(accepted, 0);
}

TEST(ErrorFrameTest, CarriesCodeAndTruncatedMessage) {
  const std::string long_message(5000, 'x');
  ErrorFrame f = MakeErrorFrame(9, absl::PermissionDeniedError(long_message));
  EXPECT_EQ(f.header.type, FrameType::kError);
  EXPECT_EQ(f.message.size(), kMaxErrorMessageBytes);
  auto status = ParseErrorFrame(f.header, std::as_bytes(std::span(f.message)));
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  FrameHeader bad = f.header;
  bad.key = 999;
  EXPECT_EQ(ParseErrorFrame(bad, {}).code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace poseidon::transport
