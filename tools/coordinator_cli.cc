#include "tools/coordinator_cli.h"

#include "absl/strings/match.h"

namespace poseidon::tools {

std::vector<std::string> NormalizeJobFlag(const std::vector<std::string>& args) {
  std::vector<std::string> normalized;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--job" && i + 1 < args.size()) {
      normalized.push_back(absl::StrCat("--job_id=", args[++i]));
    } else if (absl::StartsWith(args[i], "--job=")) {
      normalized.push_back(absl::StrCat("--job_id=", args[i].substr(6)));
    } else {
      normalized.push_back(args[i]);
    }
  }
  return normalized;
}

int Fail(absl::string_view command, absl::string_view message) {
  std::fprintf(stderr, "%s: %s\n", std::string(command).c_str(), std::string(message).c_str());
  return 2;
}

std::string CoordinatorError(absl::string_view address, const absl::Status& status) {
  if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) {
    return absl::StrCat("coordinator ", address, " unreachable: ", status.message());
  }
  return absl::StrCat("coordinator ", address, ": ", absl::StatusCodeToString(status.code()), ": ",
                      status.message());
}

}  // namespace poseidon::tools
