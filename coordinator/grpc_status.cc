#include "coordinator/grpc_status.h"

#include <grpc/support/log.h>

#include <atomic>
#include <mutex>
#include <string>

#include "absl/strings/match.h"
#include "common/log.h"

namespace poseidon::coordinator {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  const grpc::StatusCode grpc_code =
      code > 0 && code <= static_cast<int>(grpc::StatusCode::UNAUTHENTICATED)
          ? static_cast<grpc::StatusCode>(code)
          : grpc::StatusCode::UNKNOWN;
  return grpc::Status(grpc_code, std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  const absl::StatusCode absl_code =
      code > 0 && code <= static_cast<int>(absl::StatusCode::kUnauthenticated)
          ? static_cast<absl::StatusCode>(code)
          : absl::StatusCode::kUnknown;
  return absl::Status(absl_code, status.error_message());
}

namespace {
std::atomic<uint64_t> accept_failures{0};
}  // namespace

uint64_t GrpcAcceptFailures() { return accept_failures.load(); }

void RouteGrpcLogs() {
  static std::once_flag once;
  std::call_once(once, [] {
    gpr_set_log_function([](gpr_log_func_args* args) {
      if (args->message != nullptr && absl::StartsWith(args->message, "Failed accept4")) {
        if (accept_failures.fetch_add(1) == 0) {
          ::poseidon::Logger().warn("gRPC's listener: {}", args->message);
        }
      }
      (void)args;  // PSD_LOG_DEBUG compiles to nothing below SPDLOG_ACTIVE_LEVEL (-Werror builds)
      // Logger().debug, not PSD_LOG_DEBUG (compiled out below spdlog's active level): shown
      // with --log_level=debug.
      ::poseidon::Logger().debug("grpc {}:{}: {}", args->file ? args->file : "?", args->line,
                                 args->message ? args->message : "");
    });
  });
}

}  // namespace poseidon::coordinator
