// Logging for every Poseidon binary and library, on spdlog. Libraries log through
// poseidon::Logger(); binaries call InitLogging once at start to choose level and format.
// Thread-safety: spdlog loggers are thread-safe; InitLogging must run before other threads log.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

namespace poseidon {

// The process-wide logger ("poseidon"); created on first use with level info on stderr.
spdlog::logger& Logger();

// Parses a level name: trace, debug, info, warn, error, critical, off.
absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view name);

// Names the process in every line ("[poseidon-server] ...") and sets the level.
void InitLogging(absl::string_view process_name, spdlog::level::level_enum level);

}  // namespace poseidon

// Debian's Abseil has its own string_view type (not std::string_view): teach fmt to print it and
// absl::Status, so log lines can take status.message() and statuses directly.
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<fmt::string_view> {
  template <typename FormatContext>
  auto format(absl::string_view s, FormatContext& ctx) const {
    return fmt::formatter<fmt::string_view>::format(fmt::string_view(s.data(), s.size()), ctx);
  }
};

template <>
struct fmt::formatter<absl::Status> : fmt::formatter<fmt::string_view> {
  template <typename FormatContext>
  auto format(const absl::Status& s, FormatContext& ctx) const {
    const std::string text = s.ToString();
    return fmt::formatter<fmt::string_view>::format(fmt::string_view(text), ctx);
  }
};

#define PSD_LOG_TRACE(...) SPDLOG_LOGGER_TRACE(&::poseidon::Logger(), __VA_ARGS__)
#define PSD_LOG_DEBUG(...) SPDLOG_LOGGER_DEBUG(&::poseidon::Logger(), __VA_ARGS__)
#define PSD_LOG_INFO(...) ::poseidon::Logger().info(__VA_ARGS__)
#define PSD_LOG_WARN(...) ::poseidon::Logger().warn(__VA_ARGS__)
#define PSD_LOG_ERROR(...) ::poseidon::Logger().error(__VA_ARGS__)
