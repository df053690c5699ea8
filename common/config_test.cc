#include "common/config.h"

#include <sys/stat.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace poseidon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// ---- Parsers ------------------------------------------------------------------------------------

TEST(ParseByteSize, AcceptsBinaryDecimalAndPlainForms) {
  EXPECT_EQ(*ParseByteSize("4MiB"), 4ULL << 20);
  EXPECT_EQ(*ParseByteSize("64KiB"), 64ULL << 10);
  EXPECT_EQ(*ParseByteSize("1GiB"), 1ULL << 30);
  EXPECT_EQ(*ParseByteSize("1000"), 1000u);
  EXPECT_EQ(*ParseByteSize("10GB"), 10'000'000'000ULL);
  EXPECT_EQ(*ParseByteSize("1.5MiB"), 1572864u);
  EXPECT_EQ(*ParseByteSize(" 512 B "), 512u);
  EXPECT_EQ(*ParseByteSize("4mib"), 4ULL << 20);
  EXPECT_EQ(*ParseByteSize("2TiB"), 2ULL << 40);
  EXPECT_EQ(*ParseByteSize("0"), 0u);
  EXPECT_EQ(*ParseByteSize("18446744073709551615"), UINT64_MAX);
  EXPECT_EQ(*ParseByteSize("16383PiB"), 16383ULL << 50);
}

TEST(ParseByteSize, RejectsBadInput) {
  for (const char* bad :
       {"", "   ", "-1", "-4MiB", "4XB", "MiB", "4 M iB", "1.", ".5KiB", "0x10", "1.3B",
        "18446744073709551616", "16384PiB", "99999999999999999999999KiB", "1e3", "4MiBs"}) {
    EXPECT_FALSE(ParseByteSize(bad).ok()) << "'" << bad << "'";
  }
  EXPECT_THAT(std::string(ParseByteSize("-1").status().message()), HasSubstr("negative"));
  EXPECT_THAT(std::string(ParseByteSize("").status().message()), HasSubstr("empty"));
  EXPECT_THAT(std::string(ParseByteSize("4XB").status().message()), HasSubstr("unknown unit 'XB'"));
  EXPECT_THAT(std::string(ParseByteSize("18446744073709551616").status().message()),
              HasSubstr("out of range"));
  EXPECT_THAT(std::string(ParseByteSize("16384PiB").status().message()), HasSubstr("out of range"));
  EXPECT_THAT(std::string(ParseByteSize("1.3B").status().message()), HasSubstr("whole number"));
}

TEST(ParseDuration, AcceptsUnitsAndCompounds) {
  EXPECT_EQ(*ParseDuration("15s"), absl::Seconds(15));
  EXPECT_EQ(*ParseDuration("500ms"), absl::Milliseconds(500));
  EXPECT_EQ(*ParseDuration("2m"), absl::Minutes(2));
  EXPECT_EQ(*ParseDuration("1h30m"), absl::Minutes(90));
  EXPECT_EQ(*ParseDuration("1.5s"), absl::Milliseconds(1500));
  EXPECT_EQ(*ParseDuration("100us"), absl::Microseconds(100));
  EXPECT_EQ(*ParseDuration("10ns"), absl::Nanoseconds(10));
  EXPECT_EQ(*ParseDuration(" 0 "), absl::ZeroDuration());
  // What FormatDuration prints reads back.
  for (absl::Duration d : {absl::Milliseconds(1500), absl::Minutes(61), absl::Microseconds(3)}) {
    EXPECT_EQ(*ParseDuration(absl::FormatDuration(d)), d);
  }
}

TEST(ParseDuration, RejectsBadInput) {
  for (const char* bad : {"", "-1s", "15", "5x", "s", "1.s", "15 s", "1h-5m",
                          "99999999999999999999h", "9223372036854775807h", "inf"}) {
    EXPECT_FALSE(ParseDuration(bad).ok()) << "'" << bad << "'";
  }
  EXPECT_THAT(std::string(ParseDuration("15").status().message()), HasSubstr("missing unit"));
  EXPECT_THAT(std::string(ParseDuration("5x").status().message()), HasSubstr("unknown unit 'x'"));
  EXPECT_THAT(std::string(ParseDuration("-1s").status().message()), HasSubstr("negative"));
  EXPECT_THAT(std::string(ParseDuration("9223372036854775807h").status().message()),
              HasSubstr("out of range"));
}

TEST(ParseBandwidth, ConvertsBitsAndBytesToBytesPerSecond) {
  EXPECT_DOUBLE_EQ(*ParseBandwidth("10Gbit"), 1.25e9);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("156Mbit"), 19.5e6);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("1.25GB/s"), 1.25e9);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("10Gbps"), 1.25e9);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("10Gb/s"), 1.25e9);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("100MiB/s"), 100.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("25 Gbit/s"), 25e9 / 8);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("8bit"), 1.0);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("800kbit"), 1e5);
}

TEST(ParseBandwidth, RejectsBadInput) {
  for (const char* bad :
       {"", "-1Gbit", "10", "10Gfoo", "10Xbit", "Gbit", "10ps", "1e3Gbit", "inf", "nan"}) {
    EXPECT_FALSE(ParseBandwidth(bad).ok()) << "'" << bad << "'";
  }
  const std::string huge = std::string("1") + std::string(400, '0') + "Gbit";
  EXPECT_FALSE(ParseBandwidth(huge).ok());
  EXPECT_THAT(std::string(ParseBandwidth("10").status().message()), HasSubstr("missing unit"));
  EXPECT_THAT(std::string(ParseBandwidth("-1Gbit").status().message()), HasSubstr("negative"));
}

TEST(ParseScalars, BoolIntegersDoubles) {
  EXPECT_TRUE(*ParseBool("yes"));
  EXPECT_TRUE(*ParseBool("ON"));
  EXPECT_FALSE(*ParseBool("0"));
  EXPECT_FALSE(ParseBool("maybe").ok());
  EXPECT_EQ(*ParseInt64("-12"), -12);
  EXPECT_EQ(*ParseInt64("+7"), 7);
  EXPECT_EQ(*ParseInt64("-9223372036854775808"), INT64_MIN);
  EXPECT_FALSE(ParseInt64("9223372036854775808").ok());
  EXPECT_FALSE(ParseInt64("12abc").ok());
  EXPECT_FALSE(ParseInt64("").ok());
  EXPECT_EQ(*ParseUint64("18446744073709551615"), UINT64_MAX);
  EXPECT_THAT(std::string(ParseUint64("-1").status().message()), HasSubstr("negative"));
  EXPECT_DOUBLE_EQ(*ParseDouble("1e-3"), 0.001);
  EXPECT_FALSE(ParseDouble("inf").ok());
  EXPECT_FALSE(ParseDouble("1e999").ok());
  EXPECT_FALSE(ParseDouble("0x1p3").ok());
}

TEST(FormatValues, ByteSizesAndBandwidthsReadBack) {
  EXPECT_EQ(FormatByteSize(4ULL << 20), "4MiB");
  EXPECT_EQ(FormatByteSize(10'000'000'000ULL), "10GB");
  EXPECT_EQ(FormatByteSize(1001), "1001");
  EXPECT_EQ(FormatByteSize(0), "0");
  for (uint64_t v : std::vector<uint64_t>{1, 1000, 1536, UINT64_MAX, 3ULL << 40}) {
    EXPECT_EQ(*ParseByteSize(FormatByteSize(v)), v);
  }
  EXPECT_EQ(FormatBandwidth(1.25e9), "10Gbit");
  EXPECT_EQ(FormatBandwidth(19.5e6), "156Mbit");
  EXPECT_DOUBLE_EQ(*ParseBandwidth(FormatBandwidth(1.25e9)), 1.25e9);
  EXPECT_EQ(FormatDouble(0.1), "0.1");
}

// Found by config_fuzzer: %g's exponent form ("1e+06Tbit", "1e-05bit"), which ParseBandwidth
// refuses, for bandwidths it accepts from 1e6 Tbit on and below 1e-4 bit/s; and "infTbit" above
// DBL_MAX / 8 bytes/s, where the bits overflowed (in FormatBandwidth, and in ParseBandwidth).
TEST(FormatValues, LargeAndSmallBandwidthsReadBack) {
  EXPECT_EQ(FormatBandwidth(*ParseBandwidth("1000000Tbit")), "1000000Tbit");
  EXPECT_EQ(FormatBandwidth(*ParseBandwidth("1234567Tbit")), "1234570Tbit");
  EXPECT_EQ(FormatBandwidth(*ParseBandwidth("0.00001bit")), "0.00001bit");
  EXPECT_EQ(FormatBandwidth(*ParseBandwidth("0.0000123456789bit")), "0.0000123457bit");
  for (const double bytes_per_second : {1.25e17, 1e300, 1.7e308, 1.25e-6, 5e-324, 0.0, 1.25e9, 999.9}) {
    const absl::StatusOr<double> back = ParseBandwidth(FormatBandwidth(bytes_per_second));
    ASSERT_TRUE(back.ok()) << FormatBandwidth(bytes_per_second) << ": " << back.status();
    EXPECT_NEAR(*back, bytes_per_second, 1e-5 * bytes_per_second + 1e-300)
        << FormatBandwidth(bytes_per_second);
  }
}

// ---- Schema -------------------------------------------------------------------------------------

struct TestConfig {
  std::string listen = "0.0.0.0:7100";
  int64_t threads = 4;
  uint16_t port = 7100;
  uint64_t chunk_bytes = 4ULL << 20;
  double link_bandwidth = 1.25e9;
  double ratio = 0.5;
  bool verbose = false;
  absl::Duration heartbeat = absl::Seconds(5);
  std::chrono::milliseconds timeout{1500};
  std::string mode = "sum";
  std::string token = "s3cret";
};

ConfigSchema<TestConfig> Schema() {
  ConfigSchema<TestConfig> schema("poseidon-test");
  schema.Field("listen", &TestConfig::listen, "listen address", NonEmpty())
      .Field("threads", &TestConfig::threads, "worker threads", InRange(1, 256))
      .Field("port", &TestConfig::port, "port", AtLeast(1))
      .ByteSizeField("chunk_bytes", &TestConfig::chunk_bytes, "chunk size",
                     InRange(uint64_t{4096}, uint64_t{1} << 30))
      .BandwidthField("link_bandwidth", &TestConfig::link_bandwidth, "link bandwidth")
      .Field("ratio", &TestConfig::ratio, "a ratio", InRange(0.0, 1.0))
      .Field("verbose", &TestConfig::verbose, "log more")
      .Field("heartbeat", &TestConfig::heartbeat, "heartbeat interval",
             InRange(absl::Milliseconds(10), absl::Minutes(1)))
      .Field("timeout", &TestConfig::timeout, "rpc timeout",
             InRange(std::chrono::milliseconds(1), std::chrono::milliseconds(60000)))
      .Field("mode", &TestConfig::mode, "update rule", OneOf({"sum", "sgd", "adam"}))
      .SecretField("token", &TestConfig::token, "job token");
  return schema;
}

ConfigInput Input(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
  ConfigInput input;
  input.args = std::move(args);
  input.getenv = [env = std::move(env)](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  return input;
}

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

std::string ErrorOf(const ConfigInput& input) {
  absl::StatusOr<LoadedConfig<TestConfig>> loaded = Schema().Parse(input);
  EXPECT_FALSE(loaded.ok());
  return loaded.ok() ? "" : std::string(loaded.status().message());
}

TEST(ConfigSchema, DefaultsWhenNothingIsGiven) {
  absl::StatusOr<LoadedConfig<TestConfig>> loaded = Schema().Parse(Input({}));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->value.threads, 4);
  EXPECT_EQ(loaded->value.chunk_bytes, 4u << 20);
  EXPECT_EQ(loaded->value.heartbeat, absl::Seconds(5));
  EXPECT_EQ(loaded->origins.size(), 11u);
  for (const std::string& origin : loaded->origins) EXPECT_EQ(origin, "default");
  EXPECT_TRUE(loaded->config_file.empty());
}

TEST(ConfigSchema, FlagsInAllForms) {
  absl::StatusOr<LoadedConfig<TestConfig>> loaded = Schema().Parse(
      Input({"--threads=8", "--port", "9000", "--chunk-bytes=64KiB", "--link_bandwidth", "156Mbit",
             "--verbose", "-heartbeat=250ms", "--timeout=2s", "--mode=adam", "--ratio=0.25",
             "--listen=a:1", "--listen=[::1]:1", "--token=t"}));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const TestConfig& c = loaded->value;
  EXPECT_EQ(c.threads, 8);
  EXPECT_EQ(c.port, 9000);
  EXPECT_EQ(c.chunk_bytes, 64u << 10);
  EXPECT_DOUBLE_EQ(c.link_bandwidth, 19.5e6);
  EXPECT_TRUE(c.verbose);
  EXPECT_EQ(c.heartbeat, absl::Milliseconds(250));
  EXPECT_EQ(c.timeout, std::chrono::seconds(2));
  EXPECT_EQ(c.mode, "adam");
  EXPECT_DOUBLE_EQ(c.ratio, 0.25);
  EXPECT_EQ(c.listen, "[::1]:1");  // the last one wins
  EXPECT_EQ(loaded->origins[1], "flag --threads");
  EXPECT_EQ(loaded->origins[3], "flag --chunk-bytes");
}

TEST(ConfigSchema, BoolFlagForms) {
  EXPECT_TRUE(Schema().Parse(Input({"--verbose"}))->value.verbose);
  EXPECT_FALSE(Schema().Parse(Input({"--verbose", "--noverbose"}))->value.verbose);
  EXPECT_FALSE(Schema().Parse(Input({"--verbose=false"}))->value.verbose);
  EXPECT_FALSE(Schema().Parse(Input({"--verbose", "--no-verbose"}))->value.verbose);
  EXPECT_TRUE(Schema().Parse(Input({"--verbose=yes"}))->value.verbose);
  // A bool flag does not swallow the next argument.
  absl::StatusOr<LoadedConfig<TestConfig>> loaded = Schema().Parse(Input({"--verbose", "false"}));
  ASSERT_TRUE(loaded.ok());
  EXPECT_TRUE(loaded->value.verbose);
  EXPECT_THAT(loaded->unparsed_args, ElementsAre("false"));
}

TEST(ConfigSchema, PrecedenceFlagOverEnvOverFileOverDefault) {
  const std::string path = WriteFile("precedence.conf",
                                     "# a comment\n"
                                     "threads = 2\n"
                                     "port = 1111\n"
                                     "chunk_bytes = 1MiB   # trailing comment\n"
                                     "\n"
                                     "mode = sgd\n");
  absl::StatusOr<LoadedConfig<TestConfig>> loaded = Schema().Parse(
      Input({"--config", path, "--threads=16"},
            {{"POSEIDON_THREADS", "8"}, {"POSEIDON_PORT", "2222"}, {"OTHER_PORT", "1"}}));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->value.threads, 16);            // flag
  EXPECT_EQ(loaded->value.port, 2222);             // env
  EXPECT_EQ(loaded->value.chunk_bytes, 1u << 20);  // file
  EXPECT_EQ(loaded->value.mode, "sgd");            // file
  EXPECT_EQ(loaded->value.ratio, 0.5);             // default
  EXPECT_EQ(loaded->config_file, path);
  EXPECT_EQ(loaded->origins[1], "flag --threads");
  EXPECT_EQ(loaded->origins[2], "env POSEIDON_PORT");
  EXPECT_EQ(loaded->origins[3], path + ":4");
  EXPECT_EQ(loaded->origins[5], "default");
}

TEST(ConfigSchema, ConfigFileFromEnvironmentAndDefaultPath) {
  const std::string path = WriteFile("from_env.conf", "threads = 3\n");
  EXPECT_EQ(Schema().Parse(Input({}, {{"POSEIDON_CONFIG", path}}))->value.threads, 3);

  ConfigInput input = Input({});
  input.default_config_file = path;
  EXPECT_EQ(Schema().Parse(input)->value.threads, 3);

  // A missing default file is fine; a missing file someone named is not.
  input.default_config_file = testing::TempDir() + "/does-not-exist.conf";
  EXPECT_TRUE(Schema().Parse(input).ok());
  absl::StatusOr<LoadedConfig<TestConfig>> missing =
      Schema().Parse(Input({"--config=" + testing::TempDir() + "/does-not-exist.conf"}));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("flag --config"));
  EXPECT_THAT(ErrorOf(Input({"--config="})), HasSubstr("empty config file path"));
  EXPECT_THAT(ErrorOf(Input({"--config", testing::TempDir()})), HasSubstr("is a directory"));
}

TEST(ConfigSchema, ConfigFileQuotingAndComments) {
  const std::string path = WriteFile("quoting.conf",
                                     "  listen = \"host # not a comment\"  # a comment\n"
                                     "token=\"say \\\"hi\\\"\"\n"
                                     "mode = sum#not-a-comment-without-space\r\n");
  ConfigSchema<TestConfig> schema("t");
  schema.Field("listen", &TestConfig::listen, "")
      .Field("token", &TestConfig::token, "")
      .Field("mode", &TestConfig::mode, "");
  absl::StatusOr<LoadedConfig<TestConfig>> loaded = schema.Parse(Input({"--config", path}));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->value.listen, "host # not a comment");
  EXPECT_EQ(loaded->value.token, "say \"hi\"");
  EXPECT_EQ(loaded->value.mode, "sum#not-a-comment-without-space");
}

TEST(ConfigSchema, ConfigFileErrorsNameFileAndLine) {
  const std::string unknown = WriteFile("unknown.conf", "threads = 2\n\nthreds = 3\n");
  EXPECT_EQ(ErrorOf(Input({"--config", unknown})),
            unknown + ":3: unknown key 'threds' (did you mean 'threads'?)");
  const std::string duplicate = WriteFile("duplicate.conf", "port = 1\nport = 2\n");
  EXPECT_EQ(ErrorOf(Input({"--config", duplicate})),
            duplicate + ":2: duplicate key 'port' (first set at line 1)");
  const std::string no_equals = WriteFile("noeq.conf", "# ok\nport 7\n");
  EXPECT_THAT(ErrorOf(Input({"--config", no_equals})),
              HasSubstr(no_equals + ":2: expected 'key = value'"));
  const std::string bad_value = WriteFile("badvalue.conf", "\n\nchunk_bytes = -4MiB\n");
  EXPECT_EQ(ErrorOf(Input({"--config", bad_value})),
            bad_value + ":3: chunk_bytes: invalid byte size '-4MiB': must not be negative");
  const std::string unterminated = WriteFile("unterminated.conf", "listen = \"abc\n");
  EXPECT_THAT(ErrorOf(Input({"--config", unterminated})),
              HasSubstr(unterminated + ":1: unterminated quote"));
}

TEST(ConfigSchema, ErrorsNameKeyAndSource) {
  EXPECT_EQ(ErrorOf(Input({"--threads=abc"})), "flag --threads: threads: invalid integer 'abc'");
  EXPECT_EQ(ErrorOf(Input({"--threads=0"})), "flag --threads: threads: must be in [1, 256], got 0");
  EXPECT_EQ(ErrorOf(Input({}, {{"POSEIDON_PORT", "70000"}})),
            "env POSEIDON_PORT: port: '70000' is out of range [0, 65535]");
  EXPECT_EQ(ErrorOf(Input({"--port=-1"})), "flag --port: port: integer '-1' must not be negative");
  EXPECT_EQ(ErrorOf(Input({"--port=0"})), "flag --port: port: must be at least 1, got 0");
  EXPECT_THAT(ErrorOf(Input({"--chunk_bytes=2GiB"})),
              HasSubstr("flag --chunk_bytes: chunk_bytes: must be in [4096, 1073741824]"));
  EXPECT_THAT(ErrorOf(Input({"--chunk_bytes=4XB"})), HasSubstr("unknown unit 'XB'"));
  EXPECT_THAT(ErrorOf(Input({"--heartbeat=5ms"})),
              HasSubstr("flag --heartbeat: heartbeat: must be in [10ms, 1m], got 5ms"));
  EXPECT_THAT(ErrorOf(Input({"--heartbeat=5"})), HasSubstr("missing unit"));
  EXPECT_THAT(ErrorOf(Input({"--timeout=1500us"})), HasSubstr("resolution (1ms)"));
  EXPECT_THAT(ErrorOf(Input({"--timeout=2m"})), HasSubstr("must be in [1ms, 1m], got 2m"));
  EXPECT_THAT(ErrorOf(Input({"--link_bandwidth=10"})), HasSubstr("missing unit"));
  EXPECT_THAT(ErrorOf(Input({"--ratio=1.5"})), HasSubstr("must be in [0, 1], got 1.5"));
  EXPECT_THAT(ErrorOf(Input({"--mode=fancy"})),
              HasSubstr("flag --mode: mode: must be one of sum, sgd, adam; got 'fancy'"));
  EXPECT_THAT(ErrorOf(Input({"--verbose=maybe"})), HasSubstr("invalid bool 'maybe'"));
  EXPECT_EQ(ErrorOf(Input({"--threads"})), "flag --threads: threads: missing value");
  EXPECT_EQ(ErrorOf(Input({"--thread=3"})), "unknown flag '--thread=3' (did you mean --threads?)");
  EXPECT_EQ(ErrorOf(Input({"--zzzzzzzz"})), "unknown flag '--zzzzzzzz'");
}

TEST(ConfigSchema, EveryValueIsValidatedEvenWhenOverridden) {
  EXPECT_THAT(ErrorOf(Input({"--threads=8"}, {{"POSEIDON_THREADS", "many"}})),
              HasSubstr("env POSEIDON_THREADS: threads: invalid integer 'many'"));
  EXPECT_THAT(ErrorOf(Input({"--listen=", "--listen=a:1"})),
              HasSubstr("flag --listen: listen: must not be empty"));
}

TEST(ConfigSchema, InvalidDefaultMakesAFieldRequired) {
  struct Required {
    std::string coordinator;
  };
  ConfigSchema<Required> schema("agent");
  schema.Field("coordinator", &Required::coordinator, "coordinator address", NonEmpty());
  absl::StatusOr<LoadedConfig<Required>> missing = schema.Parse(Input({}));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(),
            "default: coordinator: must not be empty (set --coordinator, POSEIDON_COORDINATOR or "
            "'coordinator' in the config file)");
  EXPECT_EQ(schema.Parse(Input({}, {{"POSEIDON_COORDINATOR", "c:1"}}))->value.coordinator, "c:1");
}

TEST(ConfigSchema, UnknownFlagsAndPositionalArguments) {
  ConfigInput input = Input({"--threads=2", "--log_level", "debug", "file.txt", "--", "--port=1"});
  EXPECT_THAT(ErrorOf(input), HasSubstr("unknown flag '--log_level'"));
  input.allow_unknown_flags = true;
  absl::StatusOr<LoadedConfig<TestConfig>> loaded = Schema().Parse(input);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->value.threads, 2);
  EXPECT_EQ(loaded->value.port, 7100);  // after "--": not a flag
  EXPECT_THAT(loaded->unparsed_args,
              ElementsAre("--log_level", "debug", "file.txt", "--", "--port=1"));
}

TEST(ConfigSchema, LoadFromArgv) {
  const char* argv[] = {"prog", "--threads=9"};
  absl::StatusOr<TestConfig> config = Schema().Load(2, argv);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->threads, 9);

  // main()'s char** converts.
  char arg0[] = "prog";
  char arg1[] = "--port=81";
  char* mutable_argv[] = {arg0, arg1, nullptr};
  char** main_argv = mutable_argv;
  EXPECT_EQ(Schema().Load(2, main_argv)->port, 81);

  const char* positional[] = {"prog", "extra"};
  EXPECT_THAT(std::string(Schema().Load(2, positional).status().message()),
              HasSubstr("unexpected argument 'extra'"));

  const char* help[] = {"prog", "--threads=oops", "--no-such-flag", "--help"};
  absl::StatusOr<TestConfig> usage = Schema().Load(4, help);
  ASSERT_TRUE(absl::IsCancelled(usage.status()));
  const std::string text(usage.status().message());
  EXPECT_THAT(text, HasSubstr("Usage: poseidon-test [flags]"));
  EXPECT_THAT(text, HasSubstr("--chunk_bytes=<bytes>  (env POSEIDON_CHUNK_BYTES, default 4MiB)"));
  EXPECT_THAT(text, HasSubstr("--heartbeat=<duration>  (env POSEIDON_HEARTBEAT, default 5s)"));
  EXPECT_THAT(text, HasSubstr("--link_bandwidth=<bandwidth>  (env POSEIDON_LINK_BANDWIDTH, "
                              "default 10Gbit)"));
  EXPECT_THAT(text, HasSubstr("--config=<path>"));
  EXPECT_THAT(text, Not(HasSubstr("s3cret")));
}

// Secrets from 0600 files (issue 21: secrets never on command lines): --<name>_file and
// <NAME>_FILE name a file holding the value; a file others may read is refused.
TEST(ConfigSchema, ASecretComesFromAFileOnlyItsOwnerCanRead) {
  const std::string path = WriteFile("token.secret", "from-a-file\n");
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  absl::StatusOr<LoadedConfig<TestConfig>> flag = Schema().Parse(Input({"--token_file=" + path}));
  ASSERT_TRUE(flag.ok()) << flag.status();
  EXPECT_EQ(flag->value.token, "from-a-file");
  absl::StatusOr<LoadedConfig<TestConfig>> env =
      Schema().Parse(Input({}, {{"POSEIDON_TOKEN_FILE", path}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->value.token, "from-a-file");
  // The value itself, in the same place, wins over the file.
  EXPECT_EQ(Schema()
                .Parse(Input({}, {{"POSEIDON_TOKEN_FILE", path}, {"POSEIDON_TOKEN", "direct"}}))
                ->value.token,
            "direct");
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  EXPECT_THAT(ErrorOf(Input({"--token_file=" + path})),
              HasSubstr("is readable by others (mode 0644): a secret's file must be mode 0600"));
  EXPECT_THAT(ErrorOf(Input({"--token_file=/no/such/file"})), HasSubstr("cannot read"));
  // Only secrets take a file: --threads_file is an unknown flag.
  EXPECT_THAT(ErrorOf(Input({"--threads_file=" + path})), HasSubstr("unknown flag"));
}

TEST(ConfigSchema, DescribeListsValuesAndSourcesAndHidesSecrets) {
  absl::StatusOr<LoadedConfig<TestConfig>> loaded =
      Schema().Parse(Input({"--threads=8", "--token=hunter2"}, {{"POSEIDON_HEARTBEAT", "45s"}}));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const std::string text = Schema().Describe(*loaded);
  EXPECT_THAT(text, HasSubstr("threads = 8  # flag --threads\n"));
  EXPECT_THAT(text, HasSubstr("heartbeat = 45s  # env POSEIDON_HEARTBEAT\n"));
  EXPECT_THAT(text, HasSubstr("chunk_bytes = 4MiB  # default\n"));
  EXPECT_THAT(text, HasSubstr("token = <redacted>  # flag --token\n"));
  EXPECT_THAT(text, Not(HasSubstr("hunter2")));

  // Describe's output, minus secrets, is a valid config file that reproduces the values.
  ConfigSchema<TestConfig> no_secret("t");
  no_secret.Field("threads", &TestConfig::threads, "")
      .Field("heartbeat", &TestConfig::heartbeat, "")
      .ByteSizeField("chunk_bytes", &TestConfig::chunk_bytes, "")
      .Field("listen", &TestConfig::listen, "");
  absl::StatusOr<LoadedConfig<TestConfig>> first =
      no_secret.Parse(Input({"--threads=8", "--listen= a # b", "--chunk_bytes=3KB"}));
  ASSERT_TRUE(first.ok());
  const std::string path = WriteFile("described.conf", no_secret.Describe(*first));
  absl::StatusOr<LoadedConfig<TestConfig>> second = no_secret.Parse(Input({"--config", path}));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->value.threads, 8);
  EXPECT_EQ(second->value.listen, " a # b");
  EXPECT_EQ(second->value.chunk_bytes, 3000u);
}

TEST(ConfigSchema, DeclarationMistakesAreInternalErrors) {
  ConfigSchema<TestConfig> twice("t");
  twice.Field("threads", &TestConfig::threads, "").Field("threads", &TestConfig::threads, "");
  EXPECT_EQ(twice.Parse(Input({})).status().code(), absl::StatusCode::kInternal);
  ConfigSchema<TestConfig> bad_name("t");
  bad_name.Field("Threads", &TestConfig::threads, "");
  EXPECT_EQ(bad_name.Parse(Input({})).status().code(), absl::StatusCode::kInternal);
  ConfigSchema<TestConfig> reserved("t");
  reserved.Field("config", &TestConfig::listen, "");
  EXPECT_EQ(reserved.Parse(Input({})).status().code(), absl::StatusCode::kInternal);
}

TEST(ConfigSchema, CustomEnvPrefix) {
  ConfigSchema<TestConfig> schema("t", "PSD_TEST_");
  schema.Field("threads", &TestConfig::threads, "");
  EXPECT_EQ(schema.Parse(Input({}, {{"PSD_TEST_THREADS", "5"}, {"POSEIDON_THREADS", "6"}}))
                ->value.threads,
            5);
}

}  // namespace
}  // namespace poseidon
