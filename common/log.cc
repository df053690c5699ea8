#include "common/log.h"

#include <mutex>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "spdlog/sinks/stdout_sinks.h"

namespace poseidon {
namespace {

std::shared_ptr<spdlog::logger> MakeLogger() {
  auto logger = std::make_shared<spdlog::logger>("poseidon",
                                                 std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [poseidon] %v");
  logger->set_level(spdlog::level::info);
  return logger;
}

std::shared_ptr<spdlog::logger>& LoggerSlot() {
  static std::shared_ptr<spdlog::logger> logger = MakeLogger();
  return logger;
}

}  // namespace

spdlog::logger& Logger() {
  return *LoggerSlot();
}

absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "trace") return spdlog::level::trace;
  if (lower == "debug") return spdlog::level::debug;
  if (lower == "info") return spdlog::level::info;
  if (lower == "warn" || lower == "warning") return spdlog::level::warn;
  if (lower == "error") return spdlog::level::err;
  if (lower == "critical") return spdlog::level::critical;
  if (lower == "off") return spdlog::level::off;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown log level '", name, "' (expected trace, debug, info, warn, error, critical, off)"));
}

void InitLogging(absl::string_view process_name, spdlog::level::level_enum level) {
  auto& logger = Logger();
  logger.set_pattern(absl::StrCat("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [", process_name, "] %v"));
  logger.set_level(level);
}

}  // namespace poseidon
