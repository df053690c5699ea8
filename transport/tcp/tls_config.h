// The data-plane TLS settings of a daemon (poseidon-server, poseidon-agent), the same names in
// each: data_tls, data_tls_cert, data_tls_key, data_tls_ca, data_tls_server_name,
// data_tls_verify_clients (env POSEIDON_DATA_TLS_CERT, ...). docs/wire.md, "TLS".
// Thread-safety: used while a daemon reads its configuration.
#pragma once

#include "common/config.h"
#include "transport/tcp/tcp_context.h"

namespace poseidon::transport {

// T has members of those names (bool, four strings, bool).
template <typename T>
void AddDataTlsFields(ConfigSchema<T>& s) {
  s.Field("data_tls", &T::data_tls,
          "TLS on every data-plane (TCP) connection, implied by data_tls_cert or data_tls_ca; "
          "every server and agent of a job the same")
      .Field("data_tls_cert", &T::data_tls_cert,
             "PEM certificate chain this daemon presents (every server and agent listens, so "
             "each needs one with TLS)")
      .Field("data_tls_key", &T::data_tls_key, "the data_tls_cert's private key")
      .Field("data_tls_ca", &T::data_tls_ca,
             "PEM CA the peers' certificates are verified against (empty: the system's roots)")
      .Field("data_tls_server_name", &T::data_tls_server_name,
             "the name verified in every listener's certificate, if not the host of its address")
      .Field("data_tls_verify_clients", &T::data_tls_verify_clients,
             "also require a client certificate signed by data_tls_ca (mutual TLS)");
}

template <typename T>
TlsOptions DataTls(const T& c) {
  TlsOptions tls;
  tls.enabled = c.data_tls || !c.data_tls_cert.empty() || !c.data_tls_ca.empty();
  tls.cert_file = c.data_tls_cert;
  tls.key_file = c.data_tls_key;
  tls.ca_file = c.data_tls_ca;
  tls.server_name = c.data_tls_server_name;
  tls.verify_clients = c.data_tls_verify_clients;
  return tls;
}

}  // namespace poseidon::transport
