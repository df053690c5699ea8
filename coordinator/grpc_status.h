// Conversions between absl::Status (inside the coordinator and its client) and grpc::Status (on
// the wire). The two code enums share their numbers; the message travels unchanged.
// Thread-safety: pure functions, safe from any thread.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace poseidon::coordinator {

// The same code and message; a code outside gRPC's range becomes UNKNOWN.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The same code and message; a code outside Abseil's range becomes kUnknown.
absl::Status FromGrpcStatus(const grpc::Status& status);

// gRPC's own log lines (its C core writes them to stderr) go to this process's log at debug
// level instead: every failure a daemon reports is one line of its own, with gRPC's reason in
// it. Idempotent; called by the coordinator client and server before they create a channel.
void RouteGrpcLogs();

// How many times gRPC's listener failed to accept a connection for want of file descriptors
// ("Failed accept4: Too many open files", seen by the log hook above; logged as a warning).
// gRPC 1.51 never listens again after that (grpc/grpc#20418): CoordinatorServer's watchdog
// restarts the listener when this count moves.
uint64_t GrpcAcceptFailures();

}  // namespace poseidon::coordinator
