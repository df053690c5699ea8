#include "common/config.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <system_error>

#include "absl/numeric/int128.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status.h"

namespace poseidon {
namespace {

constexpr uint64_t kMaxConfigFileBytes = 1 << 20;

bool IsDigit(char c) {
  return c >= '0' && c <= '9';
}

// The text in an error message: printable, one line.
std::string Quoted(absl::string_view text) {
  return absl::StrCat("'", absl::CHexEscape(text), "'");
}

// A non-negative decimal "123" or "1.25" at the start of `text`; `rest` gets what follows.
struct Decimal {
  absl::string_view integer;   // at least one digit
  absl::string_view fraction;  // digits after '.', possibly empty
  absl::string_view all;       // integer[.fraction]
};

std::optional<Decimal> ConsumeDecimal(absl::string_view text, absl::string_view* rest) {
  size_t i = 0;
  while (i < text.size() && IsDigit(text[i])) ++i;
  if (i == 0) return std::nullopt;
  Decimal d;
  d.integer = text.substr(0, i);
  if (i < text.size() && text[i] == '.') {
    size_t j = i + 1;
    while (j < text.size() && IsDigit(text[j])) ++j;
    if (j == i + 1) return std::nullopt;  // "1." is not a number
    d.fraction = text.substr(i + 1, j - i - 1);
    i = j;
  }
  d.all = text.substr(0, i);
  *rest = text.substr(i);
  return d;
}

size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// " (did you mean 'port'?)" when one field name is close to `name`, else "".
std::string Suggest(const std::vector<config_internal::FieldSpec>& fields, absl::string_view name,
                    absl::string_view prefix, absl::string_view quote) {
  size_t best = std::max<size_t>(2, name.size() / 3) + 1;
  const config_internal::FieldSpec* match = nullptr;
  for (const auto& field : fields) {
    const size_t d = EditDistance(name, field.name);
    if (d < best) {
      best = d;
      match = &field;
    }
  }
  if (match == nullptr) return "";
  return absl::StrCat(" (did you mean ", quote, prefix, match->name, quote, "?)");
}

std::string NormalizeName(absl::string_view name) {
  std::string out(name);
  std::replace(out.begin(), out.end(), '-', '_');
  return out;
}

std::optional<size_t> FindField(const std::vector<config_internal::FieldSpec>& fields,
                                absl::string_view name) {
  for (size_t i = 0; i < fields.size(); ++i) {
    if (fields[i].name == name) return i;
  }
  return std::nullopt;
}

// A secret field's `<name>_file` (flag or environment): the field whose value that file holds.
std::optional<size_t> SecretFileField(const std::vector<config_internal::FieldSpec>& fields,
                                      absl::string_view name) {
  if (!absl::ConsumeSuffix(&name, "_file")) return std::nullopt;
  const std::optional<size_t> field = FindField(fields, name);
  if (!field || !fields[*field].secret) return std::nullopt;
  return field;
}

// The secret a `<name>_file` setting names: the file's text without its trailing newline. The
// file must be readable by its owner only (mode 0600 or 0400), so that the secret is no easier
// to read on disk than in the daemon's environment.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path, absl::string_view source) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(
        absl::StrCat(source, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  if (st.st_size > (off_t{1} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", path, " holds more than 1 MiB"));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: %s is readable by others (mode %04o): a secret's file must be mode 0600", source,
        path, st.st_mode & 07777));
  }
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  if (!in && !in.eof()) {
    return absl::NotFoundError(absl::StrCat(source, ": cannot read ", path));
  }
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  return text;
}

// Parses one line of a config file into key and value. Returns nullopt for blank and comment lines.
absl::StatusOr<std::optional<std::pair<std::string, std::string>>> ParseConfigLine(
    absl::string_view line) {
  line = absl::StripAsciiWhitespace(line);
  if (line.empty() || line.front() == '#') return std::nullopt;
  const size_t eq = line.find('=');
  if (eq == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("expected 'key = value', got ", Quoted(line)));
  }
  const absl::string_view key = absl::StripAsciiWhitespace(line.substr(0, eq));
  absl::string_view raw = absl::StripAsciiWhitespace(line.substr(eq + 1));
  if (key.empty()) return absl::InvalidArgumentError("missing key before '='");
  std::string value;
  if (!raw.empty() && raw.front() == '"') {
    size_t i = 1;
    bool closed = false;
    for (; i < raw.size(); ++i) {
      const char c = raw[i];
      if (c == '\\' && i + 1 < raw.size() && (raw[i + 1] == '"' || raw[i + 1] == '\\')) {
        value.push_back(raw[++i]);
      } else if (c == '"') {
        closed = true;
        ++i;
        break;
      } else {
        value.push_back(c);
      }
    }
    if (!closed) {
      return absl::InvalidArgumentError(absl::StrCat("unterminated quote in value of '", key, "'"));
    }
    const absl::string_view tail = absl::StripAsciiWhitespace(raw.substr(i));
    if (!tail.empty() && tail.front() != '#') {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected text after quoted value of '", key, "': ", Quoted(tail)));
    }
  } else {
    // '#' starts a comment at the start of the value or after whitespace.
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '#' &&
          (i == 0 || absl::ascii_isspace(static_cast<unsigned char>(raw[i - 1])))) {
        raw = absl::StripAsciiWhitespace(raw.substr(0, i));
        break;
      }
    }
    value = std::string(raw);
  }
  return std::make_optional(std::make_pair(std::string(key), std::move(value)));
}

absl::Status ReadConfigFile(const std::vector<config_internal::FieldSpec>& fields,
                            const std::string& path, absl::string_view named_by,
                            std::vector<config_internal::RawValue>* out) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file '", path, "' (", named_by, ") is a directory"));
  }
  std::ifstream file(path, std::ios::in | std::ios::binary);
  if (!file) {
    return absl::NotFoundError(absl::StrCat("cannot open config file '", path, "' (", named_by,
                                            "): ", std::strerror(errno)));
  }
  std::map<size_t, int> first_line;  // field -> line that set it
  std::string line;
  uint64_t total = 0;
  for (int line_no = 1; std::getline(file, line); ++line_no) {
    total += line.size() + 1;
    const std::string where = absl::StrCat(path, ":", line_no);
    if (total > kMaxConfigFileBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": config file is larger than ", kMaxConfigFileBytes, " bytes"));
    }
    absl::StatusOr<std::optional<std::pair<std::string, std::string>>> parsed =
        ParseConfigLine(line);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", parsed.status().message()));
    }
    if (!parsed->has_value()) continue;
    const auto& [key, value] = **parsed;
    const std::string name = NormalizeName(key);
    const std::optional<size_t> field = FindField(fields, name);
    if (!field) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": unknown key ", Quoted(key), Suggest(fields, name, "", "'")));
    }
    if (auto [it, inserted] = first_line.emplace(*field, line_no); !inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": duplicate key '", name, "' (first set at line ", it->second, ")"));
    }
    out->push_back(config_internal::RawValue{*field, value, where});
  }
  if (file.bad()) {
    return absl::DataLossError(absl::StrCat("error reading config file '", path, "'"));
  }
  return absl::OkStatus();
}

struct ByteUnit {
  absl::string_view name;  // lower case
  uint64_t multiplier;
};

constexpr uint64_t kKi = 1024;
constexpr ByteUnit kByteUnits[] = {
    {"", 1},
    {"b", 1},
    {"kb", 1000},
    {"mb", 1000 * 1000},
    {"gb", 1000ULL * 1000 * 1000},
    {"tb", 1000ULL * 1000 * 1000 * 1000},
    {"pb", 1000ULL * 1000 * 1000 * 1000 * 1000},
    {"kib", kKi},
    {"mib", kKi* kKi},
    {"gib", kKi* kKi* kKi},
    {"tib", kKi* kKi* kKi* kKi},
    {"pib", kKi* kKi* kKi* kKi* kKi},
};

}  // namespace

// ---- Parsers ------------------------------------------------------------------------------------

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  const absl::string_view s = absl::StripAsciiWhitespace(text);
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("invalid byte size ", Quoted(text), ": ", why));
  };
  if (s.empty()) return bad("empty");
  if (s.front() == '-') return bad("must not be negative");
  absl::string_view rest;
  const std::optional<Decimal> number = ConsumeDecimal(s, &rest);
  if (!number) return bad("expected a number with an optional unit, e.g. 4MiB, 64KiB, 1000");
  const std::string unit = absl::AsciiStrToLower(absl::StripLeadingAsciiWhitespace(rest));
  const ByteUnit* found = nullptr;
  for (const ByteUnit& u : kByteUnits) {
    if (u.name == unit) found = &u;
  }
  if (found == nullptr) {
    return bad(absl::StrCat("unknown unit ", Quoted(absl::StripLeadingAsciiWhitespace(rest)),
                            " (expected B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB)"));
  }
  constexpr absl::uint128 kMax = std::numeric_limits<uint64_t>::max();
  absl::uint128 whole = 0;
  for (const char c : number->integer) {
    whole = whole * 10 + static_cast<uint64_t>(c - '0');
    if (whole > kMax) return bad("out of range (more than 2^64-1 bytes)");
  }
  absl::uint128 total = whole * found->multiplier;
  if (!number->fraction.empty()) {
    if (number->fraction.size() > 18) return bad("too many decimal digits");
    absl::uint128 numerator = 0;
    absl::uint128 denominator = 1;
    for (const char c : number->fraction) {
      numerator = numerator * 10 + static_cast<uint64_t>(c - '0');
      denominator *= 10;
    }
    const absl::uint128 scaled = numerator * found->multiplier;
    if (scaled % denominator != 0) return bad("not a whole number of bytes");
    total += scaled / denominator;
  }
  if (total > kMax) return bad("out of range (more than 2^64-1 bytes)");
  return absl::Uint128Low64(total);
}

absl::StatusOr<absl::Duration> ParseDuration(absl::string_view text) {
  const absl::string_view s = absl::StripAsciiWhitespace(text);
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("invalid duration ", Quoted(text), ": ", why));
  };
  if (s.empty()) return bad("empty");
  if (s.front() == '-') return bad("must not be negative");
  if (s == "0") return absl::ZeroDuration();
  absl::string_view rest = s;
  absl::Duration total = absl::ZeroDuration();
  while (!rest.empty()) {
    const std::optional<Decimal> number = ConsumeDecimal(rest, &rest);
    if (!number) return bad("expected a number and a unit, e.g. 500ms, 15s, 2m, 1h30m");
    size_t n = 0;
    while (n < rest.size() && absl::ascii_isalpha(static_cast<unsigned char>(rest[n]))) ++n;
    const absl::string_view unit_name = rest.substr(0, n);
    rest = rest.substr(n);
    absl::Duration unit;
    if (unit_name == "ns") {
      unit = absl::Nanoseconds(1);
    } else if (unit_name == "us") {
      unit = absl::Microseconds(1);
    } else if (unit_name == "ms") {
      unit = absl::Milliseconds(1);
    } else if (unit_name == "s") {
      unit = absl::Seconds(1);
    } else if (unit_name == "m") {
      unit = absl::Minutes(1);
    } else if (unit_name == "h") {
      unit = absl::Hours(1);
    } else if (unit_name.empty()) {
      return bad("missing unit (expected ns, us, ms, s, m or h)");
    } else {
      return bad(
          absl::StrCat("unknown unit ", Quoted(unit_name), " (expected ns, us, ms, s, m or h)"));
    }
    int64_t whole = 0;
    if (!absl::SimpleAtoi(number->integer, &whole)) return bad("out of range");
    absl::Duration term = unit * whole;
    if (!number->fraction.empty()) {
      double fraction = 0;
      if (!absl::SimpleAtod(absl::StrCat("0.", number->fraction), &fraction)) {
        return bad("invalid fraction");
      }
      term += unit * fraction;
    }
    total += term;
    if (term == absl::InfiniteDuration() || total == absl::InfiniteDuration()) {
      return bad("out of range");
    }
  }
  return total;
}

absl::StatusOr<double> ParseBandwidth(absl::string_view text) {
  const absl::string_view s = absl::StripAsciiWhitespace(text);
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("invalid bandwidth ", Quoted(text), ": ", why));
  };
  constexpr absl::string_view kExpected =
      "expected e.g. 10Gbit, 156Mbit, 10Gbps, 1.25GB/s, 100MiB/s";
  if (s.empty()) return bad("empty");
  if (s.front() == '-') return bad("must not be negative");
  absl::string_view rest;
  const std::optional<Decimal> number = ConsumeDecimal(s, &rest);
  if (!number) return bad(kExpected);
  absl::string_view unit = absl::StripLeadingAsciiWhitespace(rest);
  if (unit.empty()) return bad(absl::StrCat("missing unit; ", kExpected));
  const absl::string_view unit_text = unit;
  // Suffix: "/s" or "ps".
  if (!absl::ConsumeSuffix(&unit, "/s")) absl::ConsumeSuffix(&unit, "ps");
  // Base: bits or bytes.
  double base = 0;
  if (absl::ConsumeSuffix(&unit, "bits") || absl::ConsumeSuffix(&unit, "bit") ||
      absl::ConsumeSuffix(&unit, "b")) {
    base = 1.0 / 8;
  } else if (absl::ConsumeSuffix(&unit, "B")) {
    base = 1;
  } else {
    return bad(absl::StrCat("unknown unit ", Quoted(unit_text), "; ", kExpected));
  }
  // Prefix.
  const std::string prefix = absl::AsciiStrToLower(unit);
  double scale = 0;
  if (prefix.empty()) {
    scale = 1;
  } else if (prefix == "k") {
    scale = 1e3;
  } else if (prefix == "m") {
    scale = 1e6;
  } else if (prefix == "g") {
    scale = 1e9;
  } else if (prefix == "t") {
    scale = 1e12;
  } else if (prefix == "ki") {
    scale = 1024.0;
  } else if (prefix == "mi") {
    scale = 1024.0 * 1024;
  } else if (prefix == "gi") {
    scale = 1024.0 * 1024 * 1024;
  } else if (prefix == "ti") {
    scale = 1024.0 * 1024 * 1024 * 1024;
  } else {
    return bad(absl::StrCat("unknown unit ", Quoted(unit_text), "; ", kExpected));
  }
  double value = 0;
  if (!absl::SimpleAtod(number->all, &value)) return bad("invalid number");
  // scale * base is exact; bits would overflow first for the largest byte rates.
  const double result = value * (scale * base);
  if (!std::isfinite(result)) return bad("out of range");
  return result;
}

absl::StatusOr<bool> ParseBool(absl::string_view text) {
  const std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  if (s == "true" || s == "1" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "0" || s == "no" || s == "off") return false;
  return absl::InvalidArgumentError(
      absl::StrCat("invalid bool ", Quoted(text), " (expected true/false, 1/0, yes/no, on/off)"));
}

absl::StatusOr<int64_t> ParseInt64(absl::string_view text) {
  absl::string_view s = absl::StripAsciiWhitespace(text);
  absl::string_view digits = s;
  if (!digits.empty() && (digits.front() == '-' || digits.front() == '+')) digits.remove_prefix(1);
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), IsDigit)) {
    return absl::InvalidArgumentError(absl::StrCat("invalid integer ", Quoted(text)));
  }
  int64_t value = 0;
  if (!absl::SimpleAtoi(s, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("integer ", Quoted(text), " is out of range [-2^63, 2^63-1]"));
  }
  return value;
}

absl::StatusOr<uint64_t> ParseUint64(absl::string_view text) {
  absl::string_view s = absl::StripAsciiWhitespace(text);
  if (!s.empty() && s.front() == '-') {
    return absl::InvalidArgumentError(
        absl::StrCat("integer ", Quoted(text), " must not be negative"));
  }
  absl::string_view digits = s;
  if (!digits.empty() && digits.front() == '+') digits.remove_prefix(1);
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), IsDigit)) {
    return absl::InvalidArgumentError(absl::StrCat("invalid integer ", Quoted(text)));
  }
  uint64_t value = 0;
  if (!absl::SimpleAtoi(s, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("integer ", Quoted(text), " is out of range [0, 2^64-1]"));
  }
  return value;
}

absl::StatusOr<double> ParseDouble(absl::string_view text) {
  const absl::string_view s = absl::StripAsciiWhitespace(text);
  double value = 0;
  // SimpleAtod also takes "inf", "nan" and hex floats; a config wants plain decimals.
  const bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return IsDigit(c) || c == '.' || c == '-' || c == '+' || c == 'e' || c == 'E';
  });
  if (!plain || !absl::SimpleAtod(s, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("invalid number ", Quoted(text)));
  }
  if (!std::isfinite(value)) {
    return absl::InvalidArgumentError(absl::StrCat("number ", Quoted(text), " is out of range"));
  }
  return value;
}

std::string FormatByteSize(uint64_t bytes) {
  if (bytes == 0) return "0";
  static constexpr std::pair<absl::string_view, uint64_t> kUnits[] = {
      {"PiB", kKi * kKi * kKi * kKi * kKi},
      {"TiB", kKi * kKi * kKi * kKi},
      {"GiB", kKi * kKi * kKi},
      {"MiB", kKi * kKi},
      {"KiB", kKi},
      {"PB", 1000ULL * 1000 * 1000 * 1000 * 1000},
      {"TB", 1000ULL * 1000 * 1000 * 1000},
      {"GB", 1000ULL * 1000 * 1000},
      {"MB", 1000ULL * 1000},
      {"KB", 1000},
  };
  // The exact form with the smallest number: 10GB rather than 9765625KiB.
  std::string best = absl::StrCat(bytes);
  uint64_t best_count = bytes;
  for (const auto& [name, size] : kUnits) {
    if (bytes % size == 0 && bytes / size < best_count) {
      best_count = bytes / size;
      best = absl::StrCat(best_count, name);
    }
  }
  return best;
}

namespace {

// %g (6 significant digits) without its exponent form, which it takes from 1e6 on and below 1e-4
// and which ParseBandwidth does not read: 1e6 Tbit prints 1000000Tbit, not 1e+06Tbit.
std::string SixDigits(double v) {
  const std::string g = absl::StrFormat("%g", v);
  if (g.find('e') == std::string::npos) return g;
  const std::string e = absl::StrFormat("%.5e", v);  // d.ddddde[+-]x: v to 6 digits
  const int exponent = std::atoi(e.c_str() + e.find('e') + 1);
  std::string fixed =
      absl::StrFormat("%.*f", std::max(0, 5 - exponent), std::strtod(e.c_str(), nullptr));
  if (fixed.find('.') != std::string::npos) {
    fixed.erase(fixed.find_last_not_of('0') + 1);
    if (fixed.back() == '.') fixed.pop_back();
  }
  return fixed;
}

}  // namespace

std::string FormatBandwidth(double bytes_per_second) {
  static constexpr std::pair<absl::string_view, double> kUnits[] = {
      {"Tbit", 1e12}, {"Gbit", 1e9}, {"Mbit", 1e6}, {"kbit", 1e3}};
  // In bytes, then to bits: bytes_per_second * 8 overflows above DBL_MAX / 8.
  for (const auto& [name, size] : kUnits) {
    if (bytes_per_second >= size / 8) {
      return absl::StrCat(SixDigits(bytes_per_second / size * 8), name);
    }
  }
  return absl::StrCat(SixDigits(bytes_per_second * 8), "bit");
}

std::string FormatDouble(double value) {
  char buffer[64];
  const std::to_chars_result result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  if (result.ec != std::errc()) return absl::StrCat(value);
  return std::string(buffer, result.ptr);
}

Validator<std::string> NonEmpty() {
  return [](const std::string& value) {
    return value.empty() ? absl::InvalidArgumentError("must not be empty") : absl::OkStatus();
  };
}

Validator<std::string> OneOf(std::vector<std::string> allowed) {
  return [allowed = std::move(allowed)](const std::string& value) {
    if (std::find(allowed.begin(), allowed.end(), value) != allowed.end()) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(
        absl::StrCat("must be one of ", absl::StrJoin(allowed, ", "), "; got ", Quoted(value)));
  };
}

// ---- Schema machinery ---------------------------------------------------------------------------

namespace config_internal {

std::string EnvName(absl::string_view env_prefix, absl::string_view field) {
  return absl::StrCat(env_prefix, absl::AsciiStrToUpper(field));
}

absl::Status CheckFieldName(const std::vector<FieldSpec>& fields, absl::string_view name) {
  const bool valid =
      !name.empty() && absl::ascii_islower(static_cast<unsigned char>(name[0])) &&
      std::all_of(name.begin(), name.end(), [](char c) {
        return absl::ascii_islower(static_cast<unsigned char>(c)) || IsDigit(c) || c == '_';
      });
  if (!valid) {
    return absl::InternalError(
        absl::StrCat("config schema: field name ", Quoted(name), " is not lower_snake_case"));
  }
  if (name == "config" || name == "help") {
    return absl::InternalError(absl::StrCat("config schema: field name '", name, "' is reserved"));
  }
  if (FindField(fields, name)) {
    return absl::InternalError(absl::StrCat("config schema: field '", name, "' declared twice"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> DurationToNanos(absl::Duration d, absl::string_view text) {
  if (d > absl::Nanoseconds(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("duration ", Quoted(text), " is out of range"));
  }
  return absl::ToInt64Nanoseconds(d);
}

absl::StatusOr<Gathered> Gather(const std::vector<FieldSpec>& fields, absl::string_view env_prefix,
                                const ConfigInput& input) {
  Gathered out;
  std::vector<RawValue> flag_values;
  std::optional<std::pair<std::string, std::string>> config_flag;  // path, source
  const std::vector<std::string>& args = input.args;
  // --help wins over any mistake elsewhere on the command line.
  for (const std::string& arg : args) {
    if (arg == "--") break;
    if (arg == "-h" || arg == "--help" || arg == "-help") {
      out.help_requested = true;
      return out;
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      out.unparsed_args.insert(out.unparsed_args.end(), args.begin() + static_cast<ptrdiff_t>(i),
                               args.end());
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      out.unparsed_args.push_back(arg);
      continue;
    }
    absl::string_view body = arg;
    body.remove_prefix(absl::StartsWith(body, "--") ? 2 : 1);
    const size_t eq = body.find('=');
    const absl::string_view typed_name = body.substr(0, eq);
    std::optional<std::string> value;
    if (eq != absl::string_view::npos) value = std::string(body.substr(eq + 1));
    const std::string name = NormalizeName(typed_name);
    const std::string source = absl::StrCat("flag --", typed_name);

    if (name == "config") {
      if (!value) {
        if (i + 1 >= args.size()) {
          return absl::InvalidArgumentError(absl::StrCat(source, ": missing value"));
        }
        value = args[++i];
      }
      config_flag = std::make_pair(*value, source);
      continue;
    }
    std::optional<size_t> field = FindField(fields, name);
    if (!field && !value && absl::StartsWith(name, "no")) {
      // --noverbose and --no-verbose.
      const std::optional<size_t> negated =
          FindField(fields, name.substr(absl::StartsWith(name, "no_") ? 3 : 2));
      if (negated && fields[*negated].is_bool) {
        flag_values.push_back(RawValue{*negated, "false", source});
        continue;
      }
    }
    if (!field) {
      if (const std::optional<size_t> secret = SecretFileField(fields, name)) {
        if (!value) {
          if (i + 1 >= args.size()) {
            return absl::InvalidArgumentError(absl::StrCat(source, ": missing value"));
          }
          value = args[++i];
        }
        ASSIGN_OR_RETURN(std::string text, ReadSecretFile(*value, source));
        flag_values.push_back(RawValue{*secret, std::move(text), source});
        continue;
      }
      if (input.allow_unknown_flags) {
        out.unparsed_args.push_back(arg);
        continue;
      }
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag ", Quoted(arg), Suggest(fields, name, "--", "")));
    }
    if (!value) {
      if (fields[*field].is_bool) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": ", fields[*field].name, ": missing value"));
      }
    }
    flag_values.push_back(RawValue{*field, std::move(*value), source});
  }

  const auto getenv = [&input](const std::string& name) -> std::optional<std::string> {
    if (input.getenv) return input.getenv(name);
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };

  // Config file: flag, then environment, then the binary's default.
  std::string config_path;
  std::string config_named_by;
  bool must_exist = true;
  const std::string config_env = EnvName(env_prefix, "config");
  if (config_flag) {
    config_path = config_flag->first;
    config_named_by = config_flag->second;
  } else if (std::optional<std::string> env = getenv(config_env)) {
    config_path = *env;
    config_named_by = absl::StrCat("env ", config_env);
  } else if (!input.default_config_file.empty()) {
    config_path = input.default_config_file;
    config_named_by = "default config file";
    must_exist = false;
  }
  if (!config_path.empty()) {
    std::error_code ec;
    if (must_exist || std::filesystem::exists(config_path, ec)) {
      absl::Status s = ReadConfigFile(fields, config_path, config_named_by, &out.values);
      if (!s.ok()) return s;
      out.config_file = config_path;
    }
  } else if (config_flag || getenv(config_env)) {
    return absl::InvalidArgumentError(absl::StrCat(config_named_by, ": empty config file path"));
  }

  for (size_t i = 0; i < fields.size(); ++i) {
    const std::string env_name = EnvName(env_prefix, fields[i].name);
    if (fields[i].secret) {  // <PREFIX><NAME>_FILE: a file holding it (the value itself wins)
      const std::string file_env = EnvName(env_prefix, absl::StrCat(fields[i].name, "_file"));
      if (std::optional<std::string> path = getenv(file_env)) {
        ASSIGN_OR_RETURN(std::string text, ReadSecretFile(*path, absl::StrCat("env ", file_env)));
        out.values.push_back(RawValue{i, std::move(text), absl::StrCat("env ", file_env)});
      }
    }
    if (std::optional<std::string> value = getenv(env_name)) {
      out.values.push_back(RawValue{i, std::move(*value), absl::StrCat("env ", env_name)});
    }
  }
  for (RawValue& value : flag_values) out.values.push_back(std::move(value));
  return out;
}

std::string QuoteIfNeeded(absl::string_view value) {
  const bool plain =
      !value.empty() && value.front() != '"' && absl::StripAsciiWhitespace(value) == value &&
      value.find('#') == absl::string_view::npos && value.find('\n') == absl::string_view::npos;
  if (plain) return std::string(value);
  std::string out = "\"";
  for (const char c : value) {
    if (c == '"' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  out.push_back('"');
  return out;
}

std::string UsageText(absl::string_view program, absl::string_view env_prefix,
                      const std::vector<FieldSpec>& fields,
                      const std::vector<std::string>& defaults) {
  std::string out = absl::StrCat("Usage: ", program, " [flags]\n\n",
                                 "Each setting comes from, highest precedence first: --flag, the "
                                 "environment variable, the config file, the default. A secret "
                                 "setting also takes --<name>_file=PATH or the variable "
                                 "<NAME>_FILE: a file (mode 0600) holding it.\n\n");
  for (size_t i = 0; i < fields.size(); ++i) {
    const FieldSpec& f = fields[i];
    const std::string value =
        f.secret ? (defaults[i].empty() ? "" : "<redacted>") : QuoteIfNeeded(defaults[i]);
    absl::StrAppend(&out, "  --", f.name, "=<", f.type_name, ">  (env ",
                    EnvName(env_prefix, f.name), ", default ", value.empty() ? "\"\"" : value,
                    ")\n      ", f.help, "\n");
  }
  absl::StrAppend(&out, "  --config=<path>  (env ", EnvName(env_prefix, "config"),
                  ")\n      config file of 'key = value' lines, keys as the flag names\n",
                  "  --help\n      print this help and exit\n");
  return out;
}

std::string DescribeText(const std::vector<FieldSpec>& fields,
                         const std::vector<std::string>& values,
                         const std::vector<std::string>& origins) {
  std::string out;
  for (size_t i = 0; i < fields.size(); ++i) {
    const std::string value = fields[i].secret ? "<redacted>" : QuoteIfNeeded(values[i]);
    absl::StrAppend(&out, fields[i].name, " = ", value.empty() ? "\"\"" : value, "  # ",
                    i < origins.size() ? origins[i] : "default", "\n");
  }
  return out;
}

}  // namespace config_internal
}  // namespace poseidon
