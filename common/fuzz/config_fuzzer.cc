// libFuzzer target: the typed configuration (common/config.h). The first byte picks what the rest
// is. Even: one value, through every value parser (ParseByteSize, ParseDuration, ParseBandwidth,
// ParseBool, ParseInt64, ParseUint64, ParseDouble) and the formatters' promises: FormatByteSize
// reads back exactly, FormatBandwidth to within its printing precision (6 significant digits),
// FormatDouble to the same double; a parsed duration is finite and not negative. Odd: a config
// file (with bit 1: command-line arguments first, one a line, up to a NUL byte) read by a schema
// with a field of every kind; an accepted configuration's Describe() lines, read back as a config
// file, give the same values. A crash, a sanitizer report or a CHECK below is a finding.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/config.h"

namespace {

using namespace poseidon;  // NOLINT: a fuzzer's one translation unit

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "config_fuzzer: CHECK failed: %s\n", #cond); \
      std::abort();                                                   \
    }                                                                 \
  } while (0)

// Within FormatBandwidth's 6 significant digits (half a unit of the 6th: 5e-6 relative), or
// equal (0), with room for the last bits of the double arithmetic and of subnormals.
bool CloseBandwidth(double a, double b) {
  return std::fabs(a - b) <= 1e-5 * std::fabs(b) + 1e-300;
}

void CheckValue(absl::string_view text) {
  if (const absl::StatusOr<uint64_t> bytes = ParseByteSize(text); bytes.ok()) {
    const absl::StatusOr<uint64_t> back = ParseByteSize(FormatByteSize(*bytes));
    CHECK(back.ok() && *back == *bytes);
  }
  if (text.size() >= 8) {  // FormatByteSize of any 64-bit number is exact
    uint64_t any = 0;
    std::memcpy(&any, text.data(), 8);
    const absl::StatusOr<uint64_t> back = ParseByteSize(FormatByteSize(any));
    CHECK(back.ok() && *back == any);
    double bandwidth = 0;
    std::memcpy(&bandwidth, text.data(), 8);
    if (std::isfinite(bandwidth) && !std::signbit(bandwidth)) {  // -0 is no parsed bandwidth
      const absl::StatusOr<double> read = ParseBandwidth(FormatBandwidth(bandwidth));
      if (!read.ok()) {
        std::fprintf(stderr, "config_fuzzer: FormatBandwidth(%.17g) = '%s' does not parse\n",
                     bandwidth, FormatBandwidth(bandwidth).c_str());
      }
      CHECK(read.ok() && CloseBandwidth(*read, bandwidth));
    }
  }
  if (const absl::StatusOr<absl::Duration> d = ParseDuration(text); d.ok()) {
    CHECK(*d >= absl::ZeroDuration() && *d != absl::InfiniteDuration());
  }
  if (const absl::StatusOr<double> bandwidth = ParseBandwidth(text); bandwidth.ok()) {
    CHECK(std::isfinite(*bandwidth) && *bandwidth >= 0);
    const std::string formatted = FormatBandwidth(*bandwidth);
    const absl::StatusOr<double> back = ParseBandwidth(formatted);
    if (!back.ok()) {
      std::fprintf(stderr, "config_fuzzer: FormatBandwidth(%.17g) = '%s' does not parse\n",
                   *bandwidth, formatted.c_str());
    }
    CHECK(back.ok() && CloseBandwidth(*back, *bandwidth));
  }
  (void)ParseBool(text);
  const absl::StatusOr<int64_t> i = ParseInt64(text);
  if (i.ok()) CHECK(ParseInt64(absl::StrCat(*i)).value_or(~*i) == *i);
  if (const absl::StatusOr<uint64_t> u = ParseUint64(text); u.ok()) {
    CHECK(ParseUint64(absl::StrCat(*u)).value_or(~*u) == *u);
    // The same text as a signed number, where it fits.
    if (*u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      CHECK(i.ok() && static_cast<uint64_t>(*i) == *u);
    }
  }
  if (const absl::StatusOr<double> d = ParseDouble(text); d.ok()) {
    CHECK(std::isfinite(*d));
    const absl::StatusOr<double> back = ParseDouble(FormatDouble(*d));
    CHECK(back.ok() && std::memcmp(&*back, &*d, sizeof(double)) == 0);
  }
}

// A field of every kind the schema has.
struct FuzzConfig {
  std::string listen = "0.0.0.0:7100";
  int64_t threads = 4;
  uint32_t port = 7100;
  int8_t small = 0;
  bool verbose = false;
  double ratio = 0.5;
  float gain = 1;
  uint64_t max_frame_bytes = 64 << 20;
  int32_t signed_bytes = 0;
  double bandwidth = 1.25e9;
  absl::Duration heartbeat = absl::Seconds(5);
  std::chrono::milliseconds lease{1000};
  std::chrono::seconds period{1};
  std::string mode = "a";
  std::string token;
};

ConfigSchema<FuzzConfig> Schema() {
  ConfigSchema<FuzzConfig> schema("config_fuzzer");
  schema.Field("listen", &FuzzConfig::listen, "address", NonEmpty())
      .Field("threads", &FuzzConfig::threads, "threads", InRange(1, 256))
      .Field("port", &FuzzConfig::port, "port", InRange(1, 65535))
      .Field("small", &FuzzConfig::small, "an 8-bit number")
      .Field("verbose", &FuzzConfig::verbose, "a bool")
      .Field("ratio", &FuzzConfig::ratio, "a double", InRange(0.0, 1.0))
      .Field("gain", &FuzzConfig::gain, "a float")
      .ByteSizeField("max_frame_bytes", &FuzzConfig::max_frame_bytes, "bytes", AtLeast(1))
      .ByteSizeField("signed_bytes", &FuzzConfig::signed_bytes, "bytes in an int32")
      .BandwidthField("bandwidth", &FuzzConfig::bandwidth, "bandwidth")
      .Field("heartbeat", &FuzzConfig::heartbeat, "a duration")
      .Field("lease", &FuzzConfig::lease, "milliseconds", AtLeast(std::chrono::milliseconds(1)))
      .Field("period", &FuzzConfig::period, "seconds")
      .Field("mode", &FuzzConfig::mode, "a or b", OneOf({"a", "b"}))
      .SecretField("token", &FuzzConfig::token, "a secret");
  return schema;
}

const ConfigSchema<FuzzConfig>* schema = nullptr;
std::string dir, file_path, again_path;

void WriteFile(const std::string& path, absl::string_view bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

absl::StatusOr<LoadedConfig<FuzzConfig>> Parse(std::vector<std::string> args) {
  ConfigInput input;
  input.args = std::move(args);
  input.getenv = [](const std::string&) { return std::optional<std::string>(); };
  return schema->Parse(input);
}

bool SameFloat(double a, double b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0;
}

void CheckConfig(absl::string_view body, bool with_args) {
  std::vector<std::string> args = {"--config=" + file_path};
  if (with_args) {
    const size_t nul = body.find('\0');
    const absl::string_view flags = body.substr(0, nul);
    body = nul == absl::string_view::npos ? absl::string_view() : body.substr(nul + 1);
    for (absl::string_view arg : absl::StrSplit(flags, '\n')) args.emplace_back(arg);
  }
  WriteFile(file_path, body);
  const absl::StatusOr<LoadedConfig<FuzzConfig>> loaded = Parse(args);
  if (!loaded.ok() || loaded->help_requested) return;
  // The effective configuration as config-file lines (the secret is redacted: left out).
  std::string lines;
  for (absl::string_view line : absl::StrSplit(schema->Describe(*loaded), '\n')) {
    if (!absl::StartsWith(line, "token = ")) absl::StrAppend(&lines, line, "\n");
  }
  WriteFile(again_path, lines);
  const absl::StatusOr<LoadedConfig<FuzzConfig>> again = Parse({"--config=" + again_path});
  if (!again.ok()) {
    std::fprintf(stderr, "config_fuzzer: Describe's lines do not read back: %s\n%s",
                 std::string(again.status().message()).c_str(), lines.c_str());
  }
  CHECK(again.ok());
  const FuzzConfig& a = loaded->value;
  const FuzzConfig& b = again->value;
  CHECK(a.listen == b.listen && a.threads == b.threads && a.port == b.port && a.small == b.small);
  CHECK(a.verbose == b.verbose && SameFloat(a.ratio, b.ratio) && SameFloat(a.gain, b.gain));
  CHECK(a.max_frame_bytes == b.max_frame_bytes && a.signed_bytes == b.signed_bytes);
  CHECK(CloseBandwidth(b.bandwidth, a.bandwidth));
  CHECK(a.heartbeat == b.heartbeat && a.lease == b.lease && a.period == b.period);
  CHECK(a.mode == b.mode);
}

// Removes what runs that crashed (no atexit) left: /dev/shm/<prefix><pid> of processes gone.
void RemoveStaleDirs(const std::string& prefix) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const long pid = std::atol(name.c_str() + prefix.size());
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::filesystem::remove_all(entry.path(), ec);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  static const ConfigSchema<FuzzConfig> the_schema = Schema();
  schema = &the_schema;
  RemoveStaleDirs("psd-cfgfuzz-");
  dir = "/dev/shm/psd-cfgfuzz-" + std::to_string(::getpid());
  if (::mkdir(dir.c_str(), 0700) != 0) std::abort();
  file_path = dir + "/fuzz.conf";
  again_path = dir + "/again.conf";
  std::atexit([] {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  });
  (void)schema->Usage();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const absl::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    CheckValue(body);
  } else {
    CheckConfig(body, (data[0] & 2) != 0);
  }
  return 0;
}
