// Per-job tokens (the jobs this coordinator serves, each with the secret its callers send) and an
// optional cluster token for cluster-wide callers (servers of every job, status of all jobs).
// Thread-safety: filled once at start, then only read; const methods are safe from any thread.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace poseidon::coordinator {

class TokenStore {
 public:
  // Adds a job and its token. Errors: an empty or malformed job id (validate.h's id rules), an
  // empty or over-long token, or the job already present with another token.
  absl::Status AddJob(absl::string_view job_id, absl::string_view token);

  // The token of cluster-wide calls (an empty header.job_id). Empty: such calls are refused.
  absl::Status SetClusterToken(absl::string_view token);

  // Reads '<job id> <token>' lines; blank lines and lines starting with '#' are skipped. Errors
  // name the file and line.
  absl::Status LoadFile(const std::string& path);

  // Whether the header may act for `job_id`:
  //   - empty job id: the cluster token (PERMISSION_DENIED when none is configured);
  //   - a job this store does not know: NOT_FOUND naming it;
  //   - an empty token: UNAUTHENTICATED "header.token is empty ...";
  //   - a wrong token: UNAUTHENTICATED "wrong token for job ...".
  // Tokens are compared in time independent of where they differ.
  absl::Status Check(absl::string_view job_id, absl::string_view token) const;

  bool HasJob(absl::string_view job_id) const;
  std::vector<std::string> JobIds() const;
  size_t job_count() const { return tokens_.size(); }
  bool has_cluster_token() const { return !cluster_token_.empty(); }

 private:
  std::map<std::string, std::string, std::less<>> tokens_;
  std::string cluster_token_;
};

// Every call's job and token also travel as metadata (CoordinatorClient sends them), so that a
// coordinator with TLS checks them before the request's body is read or parsed (gRPC runs an
// AuthMetadataProcessor on the initial metadata; the insecure credentials cannot take one). The
// service checks the request header's token as before; this refuses unauthenticated callers
// before they can make it parse up to max_message_bytes.
inline constexpr char kJobMetadata[] = "poseidon-job-bin";
inline constexpr char kTokenMetadata[] = "poseidon-token-bin";

// The check itself, on the metadata as gRPC hands it over: an error refuses the call.
absl::Status CheckCallMetadata(const TokenStore& tokens,
                               const std::multimap<std::string, std::string>& metadata);

}  // namespace poseidon::coordinator
