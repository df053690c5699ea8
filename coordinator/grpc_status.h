// Conversions between absl::Status (inside the coordinator and its client) and grpc::Status (on
// the wire). The two code enums share their numbers; the message travels unchanged.
// Thread-safety: pure functions, safe from any thread.
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace poseidon::coordinator {

// The same code and message; a code outside gRPC's range becomes UNKNOWN.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The same code and message; a code outside Abseil's range becomes kUnknown.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace poseidon::coordinator
