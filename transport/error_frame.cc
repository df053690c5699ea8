#include "transport/error_frame.h"

#include "absl/strings/str_cat.h"

namespace poseidon::transport {

ErrorFrame MakeErrorFrame(uint64_t job_id, const absl::Status& status) {
  ErrorFrame frame;
  frame.message = std::string(status.message().substr(0, kMaxErrorMessageBytes));
  frame.header.type = FrameType::kError;
  frame.header.job_id = job_id;
  frame.header.key = static_cast<uint64_t>(status.code());
  frame.header.payload_length = frame.message.size();
  return frame;
}

absl::Status ParseErrorFrame(const FrameHeader& header, std::span<const std::byte> payload) {
  if (header.type != FrameType::kError) {
    return absl::InternalError("not an error frame");
  }
  if (payload.size() > kMaxErrorMessageBytes) {
    return absl::InternalError(absl::StrCat("peer sent an error message of ", payload.size(),
                                            " bytes (max ", kMaxErrorMessageBytes, ")"));
  }
  if (header.key == 0 || header.key > static_cast<uint64_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InternalError(absl::StrCat("peer sent an error with unknown code ", header.key));
  }
  std::string message(reinterpret_cast<const char*>(payload.data()), payload.size());
  return absl::Status(static_cast<absl::StatusCode>(header.key), absl::StrCat("peer: ", message));
}

}  // namespace poseidon::transport
