#include "coordinator/tls.h"


#include "absl/strings/str_cat.h"
#include "common/pem.h"
#include "common/status.h"

namespace poseidon::coordinator {
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsFiles& files) {
  if (!files.enabled()) {
    if (!files.key_file.empty()) {
      return absl::InvalidArgumentError("tls_key is set but tls_cert is not");
    }
    if (!files.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "tls_client_ca is set but tls_cert is not (client certificates need TLS)");
    }
    return grpc::InsecureServerCredentials();
  }
  if (files.key_file.empty()) {
    return absl::InvalidArgumentError("tls_cert is set but tls_key is not");
  }
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, ReadPemFile(files.cert_file, "tls_cert"));
  ASSIGN_OR_RETURN(pair.private_key, ReadPemFile(files.key_file, "tls_key"));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!files.client_ca_file.empty()) {
    ASSIGN_OR_RETURN(options.pem_root_certs, ReadPemFile(files.client_ca_file, "tls_client_ca"));
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ClientTlsOptions& options) {
  if (!options.enabled) return grpc::InsecureChannelCredentials();
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError(
        "a client certificate needs both its certificate and its key file");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPemFile(options.ca_file, "CA file"));
  }
  if (!options.cert_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPemFile(options.cert_file, "client certificate"));
    ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPemFile(options.key_file, "client key"));
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace poseidon::coordinator
