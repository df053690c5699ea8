// The TCP transport on Boost.Asio: TCP_NODELAY, large socket buffers, gather writes straight
// from tensor memory and reads straight into the caller's buffer; optionally TLS on every
// connection (TcpOptions::tls, Boost.Asio's OpenSSL stream).
// Thread model: a pool of I/O threads (TcpOptions::io_threads) runs one io_context; each
// connection serializes its work on its own strand (its TLS stream too). See
// docs/thread_model.md.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace poseidon::transport {

// TLS on the data plane (docs/wire.md, "TLS"). Every daemon of a job must agree: a TLS end and
// a plaintext end refuse each other with an error that says so. The job's HMAC handshake runs
// inside TLS as it runs in the clear, so a peer still proves its job; TLS adds confidentiality,
// integrity of every byte and the listener's identity.
struct TlsOptions {
  bool enabled = false;
  std::string cert_file;    // this end's PEM certificate chain: needed to listen
  std::string key_file;     // its PEM private key
  std::string ca_file;      // PEM CA peers' certificates are verified against (empty: system roots)
  std::string server_name;  // the name verified in a listener's certificate (empty: the host
                            // of the address connected to; an IP address needs an IP SAN)
  bool verify_clients = false;  // a listener requires a client certificate signed by ca_file
};

struct TcpOptions : ContextOptions {
  int io_threads = 1;
  // SO_SNDBUF / SO_RCVBUF; 0 leaves the kernel's autotuning in charge.
  int socket_buffer_bytes = 0;
  bool no_delay = true;
  TlsOptions tls;
};

// Starts the I/O threads. Errors: InvalidArgument for a bad option (a TLS file that cannot be
// loaded, a key that does not match its certificate, a certificate without a key, client
// verification without a CA). With TLS, Listen fails (FailedPrecondition) without a certificate.
absl::StatusOr<std::shared_ptr<Context>> CreateTcpContext(const TcpOptions& options);

}  // namespace poseidon::transport
