// What every `poseidon` subcommand that talks to a running coordinator shares (status, plan's
// live form): the --job short form, the TLS flags, the client options from the parsed flags, the
// parse-or-exit step, and the one-line errors. Flag structs name their members coordinator,
// job_id, token, timeout, tls, tls_ca, tls_cert, tls_key, tls_server_name.
// Thread-safety: pure functions of their arguments (Fail writes to stderr).
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/config.h"
#include "coordinator/client.h"
#include "coordinator/tls.h"

namespace poseidon::tools {

// "--job J" and "--job=J" as "--job_id=J" (the coordinator's and the launchers' name).
std::vector<std::string> NormalizeJobFlag(const std::vector<std::string>& args);

// "<command>: <message>" on stderr; returns 2 (the CLI's "bad flags or coordinator" code).
int Fail(absl::string_view command, absl::string_view message);

// A failed call, as one line: "coordinator A unreachable: ..." for UNAVAILABLE and
// DEADLINE_EXCEEDED, else "coordinator A: CODE: message".
std::string CoordinatorError(absl::string_view address, const absl::Status& status);

// The daemons' client settings, with the same names and environment variables
// (coordinator_tls, coordinator_tls_ca, ..._cert, ..._key, ..._server_name: an operator's
// POSEIDON_COORDINATOR_TLS_CA serves the CLI too), and the CLI's older short names (--tls,
// --tls_ca, ...), which give way to them.
template <typename T>
void AddTlsFlags(ConfigSchema<T>& schema) {
  coordinator::AddCoordinatorTlsFields(schema);
  schema.Field("tls", &T::tls, "the same as coordinator_tls")
      .Field("tls_ca", &T::tls_ca, "the same as coordinator_tls_ca")
      .Field("tls_cert", &T::tls_cert, "the same as coordinator_tls_cert")
      .Field("tls_key", &T::tls_key, "the same as coordinator_tls_key")
      .Field("tls_server_name", &T::tls_server_name, "the same as coordinator_tls_server_name");
}

// The members both name sets need in a flags struct.
#define POSEIDON_CLI_TLS_FIELDS                                                       \
  bool coordinator_tls = false;                                                       \
  std::string coordinator_tls_ca, coordinator_tls_cert, coordinator_tls_key,          \
      coordinator_tls_server_name;                                                    \
  bool tls = false;                                                                   \
  std::string tls_ca, tls_cert, tls_key, tls_server_name

template <typename T>
coordinator::CoordinatorClientOptions ClientOptions(const T& flags) {
  coordinator::CoordinatorClientOptions options;
  options.address = flags.coordinator;
  options.job_id = flags.job_id;
  options.token = flags.token;
  options.call_timeout = flags.timeout;
  auto pick = [](const std::string& name, const std::string& short_name) {
    return name.empty() ? short_name : name;
  };
  options.tls.ca_file = pick(flags.coordinator_tls_ca, flags.tls_ca);
  options.tls.cert_file = pick(flags.coordinator_tls_cert, flags.tls_cert);
  options.tls.key_file = pick(flags.coordinator_tls_key, flags.tls_key);
  options.tls.server_name = pick(flags.coordinator_tls_server_name, flags.tls_server_name);
  options.tls.enabled = flags.coordinator_tls || flags.tls || !options.tls.ca_file.empty();
  return options;
}

// Parses `args` (already normalized). nullopt and `loaded` set: go on; otherwise the exit code
// (0 after --help's usage, 2 after a one-line error).
template <typename T>
std::optional<int> ParseOrExit(absl::string_view command, const ConfigSchema<T>& schema,
                               const std::vector<std::string>& args, LoadedConfig<T>* loaded) {
  ConfigInput input;
  input.args = args;
  absl::StatusOr<LoadedConfig<T>> parsed = schema.Parse(input);
  if (!parsed.ok()) return Fail(command, parsed.status().message());
  if (parsed->help_requested) {
    std::fputs(schema.Usage().c_str(), stdout);
    return 0;
  }
  for (const std::string& arg : parsed->unparsed_args) {
    if (arg != "--") return Fail(command, absl::StrCat("unexpected argument '", arg, "'"));
  }
  *loaded = *std::move(parsed);
  return std::nullopt;
}

}  // namespace poseidon::tools
