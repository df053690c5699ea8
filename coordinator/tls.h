// TLS for the coordinator's gRPC channel: server and client credentials from PEM files (mutual TLS
// with a client CA), insecure when no certificate is configured.
// Thread-safety: pure functions that read files, safe from any thread.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/config.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace poseidon::coordinator {

// The coordinator's side.
struct ServerTlsFiles {
  std::string cert_file;       // PEM certificate chain; empty: insecure (loopback / development)
  std::string key_file;        // PEM private key of cert_file
  std::string client_ca_file;  // when set, clients must present a certificate signed by this CA
  bool enabled() const { return !cert_file.empty(); }
};

// Insecure credentials without a certificate; TLS with one (and client verification with a CA).
// Errors: a key without a certificate or the reverse, a CA without a certificate, a file that
// cannot be read or is not PEM.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsFiles& files);

// A client's side.
struct ClientTlsOptions {
  bool enabled = false;     // false: insecure channel
  std::string ca_file;      // PEM roots for the coordinator's certificate; empty: system roots
  std::string cert_file;    // client certificate chain, for coordinators that require one
  std::string key_file;     // its private key
  std::string server_name;  // the name to verify in the certificate, if not the address's host
};

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTlsOptions& options);

// The settings of a daemon's TLS client to the coordinator, the same in every daemon that calls
// it (poseidon-server, poseidon-agent): coordinator_tls, coordinator_tls_ca, coordinator_tls_cert,
// coordinator_tls_key, coordinator_tls_server_name (env POSEIDON_COORDINATOR_TLS_CA, ...). T has
// members of those names (bool, then strings).
template <typename T>
void AddCoordinatorTlsFields(ConfigSchema<T>& s) {
  s.Field("coordinator_tls", &T::coordinator_tls,
          "reach the coordinator over TLS (implied by coordinator_tls_ca)")
      .Field("coordinator_tls_ca", &T::coordinator_tls_ca,
             "PEM CA of the coordinator's certificate (empty: the system's roots)")
      .Field("coordinator_tls_cert", &T::coordinator_tls_cert,
             "client certificate, for a coordinator that requires one (mutual TLS)")
      .Field("coordinator_tls_key", &T::coordinator_tls_key, "the client certificate's key")
      .Field("coordinator_tls_server_name", &T::coordinator_tls_server_name,
             "the name to verify in the coordinator's certificate, if not its address's host");
}

template <typename T>
ClientTlsOptions CoordinatorTls(const T& c) {
  ClientTlsOptions tls;
  tls.enabled = c.coordinator_tls || !c.coordinator_tls_ca.empty();
  tls.ca_file = c.coordinator_tls_ca;
  tls.cert_file = c.coordinator_tls_cert;
  tls.key_file = c.coordinator_tls_key;
  tls.server_name = c.coordinator_tls_server_name;
  return tls;
}

}  // namespace poseidon::coordinator
