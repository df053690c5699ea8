// Reading PEM files (certificates, keys, CAs) for the TLS settings of every module: the
// coordinator's gRPC credentials and the data plane's TLS contexts.
// Thread-safety: a pure function that reads a file, safe from any thread.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace poseidon {

// The contents of a PEM file (at most 1 MiB, must contain "-----BEGIN "); `what` names it in
// errors ("cannot read <what> <path>", "<what> <path> is not a PEM file").
absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view what);

}  // namespace poseidon
