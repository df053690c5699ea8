#include "coordinator/auth.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status.h"
#include "coordinator/validate.h"

namespace poseidon::coordinator {
namespace {

// Equal contents, in time that depends only on the lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = static_cast<unsigned char>(diff | (x ^ y));
  }
  return diff == 0;
}

absl::Status CheckToken(absl::string_view token) {
  if (token.empty()) return absl::InvalidArgumentError("token must not be empty");
  if (token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("token is ", token.size(), " bytes; at most ", kMaxTokenBytes, " allowed"));
  }
  for (const char c : token) {
    if (static_cast<unsigned char>(c) <= ' ' || static_cast<unsigned char>(c) >= 0x7f) {
      return absl::InvalidArgumentError("token must be printable ASCII without spaces");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status TokenStore::AddJob(absl::string_view job_id, absl::string_view token) {
  RETURN_IF_ERROR(ValidateId("job id", job_id));
  RETURN_IF_ERROR(Annotate(CheckToken(token), absl::StrCat("job '", job_id, "'")));
  auto [it, inserted] = tokens_.emplace(std::string(job_id), std::string(token));
  if (!inserted && it->second != token) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", job_id, "' is configured twice with different tokens"));
  }
  return absl::OkStatus();
}

absl::Status TokenStore::SetClusterToken(absl::string_view token) {
  if (token.empty()) {
    cluster_token_.clear();
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(Annotate(CheckToken(token), "cluster token"));
  cluster_token_ = std::string(token);
  return absl::OkStatus();
}

absl::Status TokenStore::LoadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read tokens file ", path));
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    const std::vector<absl::string_view> parts =
        absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (parts.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", number, ": expected '<job id> <token>'"));
    }
    RETURN_IF_ERROR(Annotate(AddJob(parts[0], parts[1]), absl::StrCat(path, ":", number)));
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading tokens file ", path));
  return absl::OkStatus();
}

absl::Status TokenStore::Check(absl::string_view job_id, absl::string_view token) const {
  if (job_id.empty()) {
    if (cluster_token_.empty()) {
      return absl::PermissionDeniedError(
          "cluster-wide calls (empty header.job_id) need the cluster token, and this "
          "coordinator has none configured; send a job id");
    }
    if (token.empty()) {
      return absl::UnauthenticatedError(
          "header.token is empty: cluster-wide calls need the cluster token");
    }
    if (!ConstantTimeEquals(token, cluster_token_)) {
      return absl::UnauthenticatedError("wrong cluster token (empty header.job_id)");
    }
    return absl::OkStatus();
  }
  const auto it = tokens_.find(job_id);
  if (it == tokens_.end()) {
    return absl::NotFoundError(
        absl::StrCat("job '", job_id, "' is not configured on this coordinator"));
  }
  if (token.empty()) {
    return absl::UnauthenticatedError(
        absl::StrCat("header.token is empty: job '", job_id, "' needs its token"));
  }
  if (!ConstantTimeEquals(token, it->second)) {
    return absl::UnauthenticatedError(absl::StrCat("wrong token for job '", job_id, "'"));
  }
  return absl::OkStatus();
}

bool TokenStore::HasJob(absl::string_view job_id) const {
  return tokens_.find(job_id) != tokens_.end();
}

std::vector<std::string> TokenStore::JobIds() const {
  std::vector<std::string> ids;
  ids.reserve(tokens_.size());
  for (const auto& [id, token] : tokens_) ids.push_back(id);
  return ids;
}

absl::Status CheckCallMetadata(const TokenStore& tokens,
                               const std::multimap<std::string, std::string>& metadata) {
  const auto job = metadata.find(kJobMetadata);
  const auto token = metadata.find(kTokenMetadata);
  if (token == metadata.end()) {
    return absl::UnauthenticatedError(absl::StrCat(
        "the call carries no ", kTokenMetadata,
        " metadata (a client older than this coordinator?): refused before reading its request"));
  }
  if (metadata.count(kJobMetadata) > 1 || metadata.count(kTokenMetadata) > 1) {
    return absl::UnauthenticatedError("the call's job or token metadata is given twice");
  }
  const absl::Status s =
      tokens.Check(job == metadata.end() ? absl::string_view() : job->second, token->second);
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(s.message(), " (refused before reading the request)"));
}

}  // namespace poseidon::coordinator
