// TLS for the coordinator's gRPC channel: server and client credentials from PEM files (mutual TLS
// with a client CA), insecure when no certificate is configured.
// Thread-safety: pure functions that read files, safe from any thread.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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

// The contents of a PEM file (at most 1 MiB, must contain "-----BEGIN "); `what` names it in
// errors.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view what);

}  // namespace poseidon::coordinator
