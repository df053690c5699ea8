#include "agent/timeline.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace poseidon::agent {

absl::StatusOr<std::unique_ptr<Timeline>> Timeline::Open(const std::string& path, uint32_t rank) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot write timeline ", path, ": ", std::strerror(errno)));
  }
  std::fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
  std::fprintf(f,
               "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %u, \"args\": {\"name\": "
               "\"rank %u\"}}",
               rank, rank);
  return std::unique_ptr<Timeline>(new Timeline(f, rank));
}

Timeline::~Timeline() {
  std::fprintf(file_, "\n]}\n");
  std::fclose(file_);
}

std::string Timeline::Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out.push_back('\\');
    if (static_cast<unsigned char>(c) >= 0x20) out.push_back(c);
  }
  return out;
}

void Timeline::Span(const char* name, uint32_t layer, const std::string& layer_name,
                    uint64_t iteration, absl::Time start, absl::Time end) {
  const int64_t ts = absl::ToUnixMicros(start);
  const int64_t dur = std::max<int64_t>(0, absl::ToInt64Microseconds(end - start));
  std::lock_guard<std::mutex> lock(mu_);
  std::fprintf(file_,
               ",\n{\"name\": \"%s\", \"ph\": \"X\", \"ts\": %lld, \"dur\": %lld, \"pid\": %u, "
               "\"tid\": %u, \"args\": {\"layer\": \"%s\", \"iteration\": %llu}}",
               name, static_cast<long long>(ts), static_cast<long long>(dur), rank_, layer,
               Escape(layer_name).c_str(), static_cast<unsigned long long>(iteration));
}

void Timeline::Instant(const char* name, uint32_t layer, uint64_t iteration, absl::Time at) {
  std::lock_guard<std::mutex> lock(mu_);
  std::fprintf(file_,
               ",\n{\"name\": \"%s\", \"ph\": \"i\", \"s\": \"t\", \"ts\": %lld, \"pid\": %u, "
               "\"tid\": %u, \"args\": {\"iteration\": %llu}}",
               name, static_cast<long long>(absl::ToUnixMicros(at)), rank_, layer,
               static_cast<unsigned long long>(iteration));
}

}  // namespace poseidon::agent
