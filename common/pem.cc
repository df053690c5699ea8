#include "common/pem.h"

#include <fstream>

#include "absl/strings/str_cat.h"

namespace poseidon {
namespace {

constexpr size_t kMaxPemBytes = size_t{1} << 20;

}  // namespace

absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " ", path));
  std::string text;
  char buffer[4096];
  while (in.read(buffer, sizeof(buffer)) || in.gcount() > 0) {
    text.append(buffer, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxPemBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " ", path, " is larger than ", kMaxPemBytes, " bytes"));
    }
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", what, " ", path));
  if (text.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is not a PEM file"));
  }
  return text;
}

}  // namespace poseidon
