// Logging for every Poseidon binary and library, on spdlog. Libraries log through
// poseidon::Logger(); binaries call InitLogging once at start to choose level and format.
// Thread-safety: spdlog loggers are thread-safe; InitLogging must run before other threads log.
#pragma once

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "spdlog/spdlog.h"

namespace poseidon {

// The process-wide logger ("poseidon"); created on first use with level info on stderr.
spdlog::logger& Logger();

// Parses a level name: trace, debug, info, warn, error, critical, off.
absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(std::string_view name);

// Names the process in every line ("[poseidon-server] ...") and sets the level.
void InitLogging(std::string_view process_name, spdlog::level::level_enum level);

}  // namespace poseidon

#define PSD_LOG_TRACE(...) SPDLOG_LOGGER_TRACE(&::poseidon::Logger(), __VA_ARGS__)
#define PSD_LOG_DEBUG(...) SPDLOG_LOGGER_DEBUG(&::poseidon::Logger(), __VA_ARGS__)
#define PSD_LOG_INFO(...) ::poseidon::Logger().info(__VA_ARGS__)
#define PSD_LOG_WARN(...) ::poseidon::Logger().warn(__VA_ARGS__)
#define PSD_LOG_ERROR(...) ::poseidon::Logger().error(__VA_ARGS__)
