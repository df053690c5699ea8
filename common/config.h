// Typed configuration for Poseidon binaries: each binary describes its one plain config struct once
// with a ConfigSchema<T>, filled from flags > environment > config file > the struct's defaults.
// Thread-safety: a schema is built once, then only read (Parse/Load/Usage are const, reentrant).
#pragma once

// How to use it
// -------------
//   struct ServerConfig {
//     std::string listen = "0.0.0.0:7100";
//     int64_t threads = 4;
//     uint64_t max_frame_bytes = 64 << 20;
//     absl::Duration heartbeat = absl::Seconds(5);
//   };
//   ConfigSchema<ServerConfig> ServerConfigSchema() {
//     ConfigSchema<ServerConfig> schema("poseidon-server");
//     schema.Field("listen", &ServerConfig::listen, "data-plane listen address", NonEmpty())
//         .Field("threads", &ServerConfig::threads, "worker threads", InRange(1, 256))
//         .ByteSizeField("max_frame_bytes", &ServerConfig::max_frame_bytes, "largest frame")
//         .Field("heartbeat", &ServerConfig::heartbeat, "heartbeat interval");
//     return schema;
//   }
//   int main(int argc, char** argv) {
//     const ServerConfig config = LoadOrExit(ServerConfigSchema(), argc, argv);
//   }
// Tests and tools that need more (foreign flags, a fake environment, the source of each value for
// the startup log) call schema.Parse(ConfigInput{...}) and schema.Describe(loaded).
//
// Sources, highest precedence first (every value from every source is parsed and validated, even
// one a higher source overrides, so a typo never hides):
//   1. Command line: `--name=value`, `--name value`; a bool also `--name`, `--noname`, `--no-name`.
//      Dashes and underscores in names are interchangeable (`--max-frame-bytes`); one leading dash
//      works too. A repeated flag: the last one wins. `--` ends flag parsing.
//   2. Environment: <prefix><NAME> (default prefix "POSEIDON_": POSEIDON_MAX_FRAME_BYTES). A set
//      but empty variable counts as set (an empty string, or an error for a number).
//   3. Config file: `key = value` lines; blank lines and `#` comments (at line start, or after
//      whitespace) are ignored; a value may be double-quoted ("a # b", with \" and \\ escapes).
//      An unknown or repeated key is an error naming file:line. The file is `--config=PATH`, else
//      <prefix>CONFIG, else ConfigInput::default_config_file (a missing default file is skipped;
//      a missing file named by flag or environment is an error).
//   4. The struct's own default member values. A validator also runs on a default that nothing
//      overrode, so an empty-string default with NonEmpty() makes a field required.
//
// Why the schema reads argv itself instead of declaring absl flags: absl flags are static globals
// (one ABSL_FLAG per field, a second declaration of every field) and Abseil 20220623 has no public
// "was this flag given on the command line". Parsing our own fields keeps one declaration per field
// and exact precedence. Flags that are not the schema's can be left for absl::ParseCommandLine:
// set ConfigInput::allow_unknown_flags and pass LoadedConfig::unparsed_args on.
//
// Errors are one line: "<source>: <key>: <reason>", the source being "flag --port",
// "env POSEIDON_PORT", "/etc/poseidon/server.conf:12" or "default".

#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace poseidon {

// ---- Value parsers (also usable on their own) ---------------------------------------------------

// "4MiB", "64KiB", "1GiB", "1000", "10GB", "1.5MiB", "512 B" -> bytes. Binary units KiB..PiB
// (1024^n) and decimal units KB..PB (1000^n), case-insensitive; no unit means bytes. The result
// must be a whole number of bytes that fits in uint64. Negative, empty, unknown unit: an error.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// "15s", "500ms", "2m", "1h30m", "1.5s", "100us", "0" -> a non-negative finite duration. Units: ns,
// us, ms, s, m, h; a number other than 0 needs a unit.
absl::StatusOr<absl::Duration> ParseDuration(absl::string_view text);

// "10Gbit", "156Mbit", "1.25GB/s", "10Gbps", "100MiB/s" -> bytes per second. Bits are "bit" or "b"
// (10Gb/s), bytes are "B"; prefixes k, M, G, T (1000^n) and Ki, Mi, Gi, Ti (1024^n); "/s" or "ps"
// optional. A unit is required. Negative, empty, non-finite, unknown unit: an error.
absl::StatusOr<double> ParseBandwidth(absl::string_view text);

// true/false, 1/0, yes/no, on/off (case-insensitive).
absl::StatusOr<bool> ParseBool(absl::string_view text);

// Signed / unsigned decimal integers ("-12", "+7", "4096"); overflow is an error, not a clamp.
absl::StatusOr<int64_t> ParseInt64(absl::string_view text);
absl::StatusOr<uint64_t> ParseUint64(absl::string_view text);

// A finite decimal floating-point number ("0.5", "1e-3").
absl::StatusOr<double> ParseDouble(absl::string_view text);

// Inverse of ParseByteSize, exact: "4MiB", "10GB", "1000" (bytes with no whole-unit form).
std::string FormatByteSize(uint64_t bytes);

// Human form of a bandwidth in bits per second ("10Gbit", "156Mbit"); ParseBandwidth reads it back
// to within printing precision (6 significant digits).
std::string FormatBandwidth(double bytes_per_second);

// Shortest decimal form that reads back to the same double.
std::string FormatDouble(double value);

// ---- Validators ---------------------------------------------------------------------------------

// A validator returns OK or an error whose message is the reason ("must be in [1, 65535], got 0");
// the schema adds the key and the source.
template <typename V>
using Validator = std::function<absl::Status(const V&)>;

namespace config_internal {

template <typename V>
struct IsChronoDuration : std::false_type {};
template <typename R, typename P>
struct IsChronoDuration<std::chrono::duration<R, P>> : std::bool_constant<std::is_integral_v<R>> {};

template <typename A, typename B>
bool Less(const A& a, const B& b) {
  if constexpr (std::is_integral_v<A> && std::is_integral_v<B> && !std::is_same_v<A, bool> &&
                !std::is_same_v<B, bool>) {
    return std::cmp_less(a, b);
  } else {
    return a < b;
  }
}

template <typename V>
std::string Show(const V& v) {
  if constexpr (std::is_same_v<V, absl::Duration>) {
    return absl::FormatDuration(v);
  } else if constexpr (IsChronoDuration<V>::value) {
    return absl::FormatDuration(
        absl::FromChrono(std::chrono::duration_cast<std::chrono::nanoseconds>(v)));
  } else if constexpr (std::is_floating_point_v<V>) {
    return FormatDouble(static_cast<double>(v));
  } else if constexpr (std::is_convertible_v<V, absl::string_view>) {
    return absl::StrCat("'", absl::string_view(v), "'");
  } else {
    return absl::StrCat(v);
  }
}

}  // namespace config_internal

// InRange(1, 65535), InRange(absl::Milliseconds(1), absl::Seconds(60)): lo <= value <= hi.
// Integer comparisons are exact across signedness (std::cmp_less).
template <typename B>
class InRange {
 public:
  InRange(B lo, B hi) : lo_(std::move(lo)), hi_(std::move(hi)) {}
  template <typename V>
  absl::Status operator()(const V& value) const {
    if (config_internal::Less(value, lo_) || config_internal::Less(hi_, value)) {
      return absl::InvalidArgumentError(absl::StrCat("must be in [", config_internal::Show(lo_),
                                                     ", ", config_internal::Show(hi_), "], got ",
                                                     config_internal::Show(value)));
    }
    return absl::OkStatus();
  }

 private:
  B lo_;
  B hi_;
};

// AtLeast(1): lo <= value.
template <typename B>
class AtLeast {
 public:
  explicit AtLeast(B lo) : lo_(std::move(lo)) {}
  template <typename V>
  absl::Status operator()(const V& value) const {
    if (config_internal::Less(value, lo_)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "must be at least ", config_internal::Show(lo_), ", got ", config_internal::Show(value)));
    }
    return absl::OkStatus();
  }

 private:
  B lo_;
};

// A string that must not be empty (with an empty default: a required setting).
Validator<std::string> NonEmpty();

// A string that must be one of `allowed` (exact match).
Validator<std::string> OneOf(std::vector<std::string> allowed);

// ---- The schema ---------------------------------------------------------------------------------

// Where the values come from, besides the schema. Defaults suit a real process.
struct ConfigInput {
  // Command-line arguments without the program name (argv[1..]).
  std::vector<std::string> args;
  // Looks up an environment variable; null means the process environment (std::getenv).
  std::function<std::optional<std::string>(const std::string& name)> getenv;
  // Read when neither --config nor <prefix>CONFIG names a file; skipped if it does not exist.
  std::string default_config_file;
  // Leave flags the schema does not know in LoadedConfig::unparsed_args instead of failing.
  bool allow_unknown_flags = false;
};

// The result of ConfigSchema<T>::Parse.
template <typename T>
struct LoadedConfig {
  T value{};
  // Positional arguments, everything after "--" (with the "--"), and unknown flags when
  // ConfigInput::allow_unknown_flags is set, in their original order.
  std::vector<std::string> unparsed_args;
  // --help, -h or -help was given; `value` then holds the defaults and nothing else was read.
  bool help_requested = false;
  // The config file that was read, or empty.
  std::string config_file;
  // For every field in declaration order: the source of its final value ("default",
  // "flag --port", "env POSEIDON_PORT", "file.conf:3").
  std::vector<std::string> origins;
};

namespace config_internal {

// How a field reads its text.
enum class Unit { kPlain, kByteSize, kBandwidth };

// The part of a field the untyped machinery (argv, env, file) needs.
struct FieldSpec {
  std::string name;
  std::string help;
  std::string type_name;
  bool is_bool = false;
  bool secret = false;
};

// One raw textual value for a field, with where it came from.
struct RawValue {
  size_t field = 0;
  std::string text;
  std::string source;
};

// Everything read from argv, environment and file, in increasing precedence (file, env, flags).
struct Gathered {
  std::vector<RawValue> values;
  std::vector<std::string> unparsed_args;
  bool help_requested = false;
  std::string config_file;
};

absl::StatusOr<Gathered> Gather(const std::vector<FieldSpec>& fields, absl::string_view env_prefix,
                                const ConfigInput& input);
absl::Status CheckFieldName(const std::vector<FieldSpec>& fields, absl::string_view name);
std::string EnvName(absl::string_view env_prefix, absl::string_view field);
std::string UsageText(absl::string_view program, absl::string_view env_prefix,
                      const std::vector<FieldSpec>& fields,
                      const std::vector<std::string>& defaults);
std::string DescribeText(const std::vector<FieldSpec>& fields,
                         const std::vector<std::string>& values,
                         const std::vector<std::string>& origins);
std::string QuoteIfNeeded(absl::string_view value);

template <typename V>
constexpr bool kIsInteger =
    std::is_integral_v<V> && !std::is_same_v<V, bool> && !std::is_same_v<V, char> &&
    !std::is_same_v<V, char8_t> && !std::is_same_v<V, char16_t> && !std::is_same_v<V, char32_t> &&
    !std::is_same_v<V, wchar_t>;

template <typename V>
constexpr bool kSupported = std::is_same_v<V, bool> || kIsInteger<V> ||
                            std::is_floating_point_v<V> || std::is_same_v<V, std::string> ||
                            std::is_same_v<V, absl::Duration> || IsChronoDuration<V>::value;

template <typename V>
std::string TypeName() {
  if constexpr (std::is_same_v<V, bool>) {
    return "bool";
  } else if constexpr (kIsInteger<V> && std::is_signed_v<V>) {
    return "int";
  } else if constexpr (kIsInteger<V>) {
    return "uint";
  } else if constexpr (std::is_floating_point_v<V>) {
    return "float";
  } else if constexpr (std::is_same_v<V, std::string>) {
    return "string";
  } else {
    return "duration";
  }
}

// Narrows a parsed 64-bit integer to the field's type, or says the type's range.
template <typename V, typename W>
absl::StatusOr<V> Narrow(W wide, absl::string_view text) {
  if (!std::in_range<V>(wide)) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is out of range [",
                                                   std::numeric_limits<V>::min(), ", ",
                                                   std::numeric_limits<V>::max(), "]"));
  }
  return static_cast<V>(wide);
}

absl::StatusOr<int64_t> DurationToNanos(absl::Duration d, absl::string_view text);

template <typename V>
absl::StatusOr<V> ParseAs(absl::string_view text, Unit unit) {
  if constexpr (std::is_same_v<V, bool>) {
    return ParseBool(text);
  } else if constexpr (kIsInteger<V>) {
    if (unit == Unit::kByteSize) {
      absl::StatusOr<uint64_t> bytes = ParseByteSize(text);
      if (!bytes.ok()) return bytes.status();
      return Narrow<V>(*bytes, text);
    }
    if constexpr (std::is_signed_v<V>) {
      absl::StatusOr<int64_t> wide = ParseInt64(text);
      if (!wide.ok()) return wide.status();
      return Narrow<V>(*wide, text);
    } else {
      absl::StatusOr<uint64_t> wide = ParseUint64(text);
      if (!wide.ok()) return wide.status();
      return Narrow<V>(*wide, text);
    }
  } else if constexpr (std::is_floating_point_v<V>) {
    absl::StatusOr<double> wide =
        unit == Unit::kBandwidth ? ParseBandwidth(text) : ParseDouble(text);
    if (!wide.ok()) return wide.status();
    if (*wide > static_cast<double>(std::numeric_limits<V>::max()) ||
        *wide < static_cast<double>(std::numeric_limits<V>::lowest())) {
      return absl::InvalidArgumentError(absl::StrCat("'", text, "' is out of range"));
    }
    return static_cast<V>(*wide);
  } else if constexpr (std::is_same_v<V, std::string>) {
    return std::string(text);
  } else if constexpr (std::is_same_v<V, absl::Duration>) {
    return ParseDuration(text);
  } else {
    static_assert(IsChronoDuration<V>::value);
    absl::StatusOr<absl::Duration> d = ParseDuration(text);
    if (!d.ok()) return d.status();
    absl::StatusOr<int64_t> ns = DurationToNanos(*d, text);
    if (!ns.ok()) return ns.status();
    using Ns = std::chrono::duration<int64_t, std::nano>;
    // Compare as long double ticks so an out-of-range Rep is caught rather than wrapped.
    const long double ticks = static_cast<long double>(*ns) * Ns::period::num * V::period::den /
                              (static_cast<long double>(Ns::period::den) * V::period::num);
    if (ticks > static_cast<long double>(std::numeric_limits<typename V::rep>::max())) {
      return absl::InvalidArgumentError(absl::StrCat("duration '", text, "' is out of range"));
    }
    const V value = std::chrono::duration_cast<V>(Ns(*ns));
    if (std::chrono::duration_cast<Ns>(value) != Ns(*ns)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "duration '", text, "' is finer than this setting's resolution (",
          absl::FormatDuration(absl::FromChrono(std::chrono::duration_cast<Ns>(V(1)))), ")"));
    }
    return value;
  }
}

template <typename V>
std::string Format(const V& value, Unit unit) {
  if constexpr (std::is_same_v<V, bool>) {
    return value ? "true" : "false";
  } else if constexpr (kIsInteger<V>) {
    if (unit == Unit::kByteSize && !Less(value, 0))
      return FormatByteSize(static_cast<uint64_t>(value));
    return absl::StrCat(value);
  } else if constexpr (std::is_floating_point_v<V>) {
    if (unit == Unit::kBandwidth) return FormatBandwidth(static_cast<double>(value));
    return FormatDouble(static_cast<double>(value));
  } else if constexpr (std::is_same_v<V, std::string>) {
    return value;
  } else if constexpr (std::is_same_v<V, absl::Duration>) {
    return absl::FormatDuration(value);
  } else {
    return absl::FormatDuration(
        absl::FromChrono(std::chrono::duration_cast<std::chrono::nanoseconds>(value)));
  }
}

}  // namespace config_internal

// Describes the fields of config struct T (default-constructible, copyable; its default member
// values are the defaults). Declaration mistakes (a bad or repeated name) are reported by Load /
// Parse as an Internal error, so a schema can be built in one chained expression.
template <typename T>
class ConfigSchema {
 public:
  // `program` names the binary in Usage(); `env_prefix` is prepended to upper-cased field names.
  explicit ConfigSchema(std::string program, std::string env_prefix = "POSEIDON_")
      : program_(std::move(program)), env_prefix_(std::move(env_prefix)) {}

  // A field of type bool, any integer, float/double, std::string, absl::Duration or an integral
  // std::chrono::duration. Names are lower_snake_case; "config" and "help" are taken.
  template <typename V>
  ConfigSchema& Field(absl::string_view name, V T::*member, absl::string_view help,
                      std::type_identity_t<Validator<V>> validate = nullptr) {
    static_assert(config_internal::kSupported<V>, "unsupported config field type");
    return Add(name, help, config_internal::TypeName<V>(), config_internal::Unit::kPlain,
               /*secret=*/false, member, std::move(validate));
  }

  // An integer field written as a byte size ("4MiB", "64KiB", "1000").
  template <typename V>
  requires config_internal::kIsInteger<V> ConfigSchema& ByteSizeField(
      absl::string_view name, V T::*member, absl::string_view help,
      std::type_identity_t<Validator<V>> validate = nullptr) {
    return Add(name, help, "bytes", config_internal::Unit::kByteSize, /*secret=*/false, member,
               std::move(validate));
  }

  // A bandwidth field in bytes per second, written "10Gbit", "1.25GB/s".
  template <typename V>
  requires std::floating_point<V> ConfigSchema& BandwidthField(
      absl::string_view name, V T::*member, absl::string_view help,
      std::type_identity_t<Validator<V>> validate = nullptr) {
    return Add(name, help, "bandwidth", config_internal::Unit::kBandwidth, /*secret=*/false, member,
               std::move(validate));
  }

  // A string whose value Usage() and Describe() never print (tokens, secrets).
  ConfigSchema& SecretField(absl::string_view name, std::string T::*member, absl::string_view help,
                            Validator<std::string> validate = nullptr) {
    return Add(name, help, "string", config_internal::Unit::kPlain, /*secret=*/true, member,
               std::move(validate));
  }

  // Reads every source; see the file comment for precedence and formats.
  absl::StatusOr<LoadedConfig<T>> Parse(const ConfigInput& input) const {
    if (!schema_error_.ok()) return schema_error_;
    absl::StatusOr<config_internal::Gathered> gathered =
        config_internal::Gather(specs_, env_prefix_, input);
    if (!gathered.ok()) return gathered.status();
    LoadedConfig<T> out;
    out.unparsed_args = std::move(gathered->unparsed_args);
    out.help_requested = gathered->help_requested;
    out.config_file = std::move(gathered->config_file);
    out.origins.assign(fields_.size(), "default");
    if (out.help_requested) return out;
    for (const config_internal::RawValue& raw : gathered->values) {
      const TypedField& field = fields_[raw.field];
      if (absl::Status s = field.set(out.value, raw.text); !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(raw.source, ": ", specs_[raw.field].name, ": ", s.message()));
      }
      out.origins[raw.field] = raw.source;
    }
    for (size_t i = 0; i < fields_.size(); ++i) {
      if (out.origins[i] != "default") continue;
      if (absl::Status s = fields_[i].check(out.value); !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("default: ", specs_[i].name, ": ", s.message(), " (set --", specs_[i].name,
                         ", ", config_internal::EnvName(env_prefix_, specs_[i].name), " or '",
                         specs_[i].name, "' in the config file)"));
      }
    }
    return out;
  }

  // For main(): the process environment, no default config file, no foreign flags and no
  // positional arguments. --help yields a Cancelled status whose message is Usage().
  absl::StatusOr<T> Load(int argc, const char* const* argv,
                         std::string default_config_file = "") const {
    ConfigInput input;
    for (int i = 1; i < argc; ++i) input.args.emplace_back(argv[i]);
    input.default_config_file = std::move(default_config_file);
    absl::StatusOr<LoadedConfig<T>> loaded = Parse(input);
    if (!loaded.ok()) return loaded.status();
    if (loaded->help_requested) return absl::CancelledError(Usage());
    for (const std::string& arg : loaded->unparsed_args) {
      if (arg != "--") {
        return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
      }
    }
    return std::move(loaded->value);
  }

  // Help text: every flag, its environment variable, type, default and help.
  std::string Usage() const {
    const T defaults{};
    std::vector<std::string> values;
    values.reserve(fields_.size());
    for (const TypedField& field : fields_) values.push_back(field.format(defaults));
    return config_internal::UsageText(program_, env_prefix_, specs_, values);
  }

  // The effective configuration as config-file lines with their sources as comments, for the
  // startup log: "port = 7100  # flag --port". Secret fields print as <redacted>.
  std::string Describe(const LoadedConfig<T>& loaded) const {
    std::vector<std::string> values;
    values.reserve(fields_.size());
    for (const TypedField& field : fields_) values.push_back(field.format(loaded.value));
    return config_internal::DescribeText(specs_, values, loaded.origins);
  }

  const std::string& program() const { return program_; }
  const std::string& env_prefix() const { return env_prefix_; }

 private:
  struct TypedField {
    std::function<absl::Status(T&, absl::string_view)> set;  // parse, validate, assign
    std::function<absl::Status(const T&)> check;             // validate the current value
    std::function<std::string(const T&)> format;
  };

  template <typename V>
  ConfigSchema& Add(absl::string_view name, absl::string_view help, std::string type_name,
                    config_internal::Unit unit, bool secret, V T::*member, Validator<V> validate) {
    if (schema_error_.ok()) schema_error_ = config_internal::CheckFieldName(specs_, name);
    specs_.push_back(config_internal::FieldSpec{std::string(name), std::string(help),
                                                std::move(type_name), std::is_same_v<V, bool>,
                                                secret});
    TypedField field;
    field.set = [member, unit, validate](T& config, absl::string_view text) -> absl::Status {
      absl::StatusOr<V> value = config_internal::ParseAs<V>(text, unit);
      if (!value.ok()) return value.status();
      if (validate) {
        if (absl::Status s = validate(*value); !s.ok()) return s;
      }
      config.*member = std::move(*value);
      return absl::OkStatus();
    };
    field.check = [member, validate](const T& config) -> absl::Status {
      return validate ? validate(config.*member) : absl::OkStatus();
    };
    field.format = [member, unit](const T& config) {
      return config_internal::Format<V>(config.*member, unit);
    };
    fields_.push_back(std::move(field));
    return *this;
  }

  std::string program_;
  std::string env_prefix_;
  std::vector<config_internal::FieldSpec> specs_;
  std::vector<TypedField> fields_;
  absl::Status schema_error_;
};

// For main(): returns the config, or prints the usage (--help; exit 0) or the error (exit 2).
template <typename T>
T LoadOrExit(const ConfigSchema<T>& schema, int argc, const char* const* argv,
             std::string default_config_file = "") {
  absl::StatusOr<T> config = schema.Load(argc, argv, std::move(default_config_file));
  if (config.ok()) return *std::move(config);
  if (absl::IsCancelled(config.status())) {
    std::fputs(std::string(config.status().message()).c_str(), stdout);
    std::exit(0);
  }
  std::fprintf(stderr, "%s: %s\n", schema.program().c_str(),
               std::string(config.status().message()).c_str());
  std::exit(2);
}

}  // namespace poseidon
