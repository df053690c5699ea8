// The TCP transport on Boost.Asio: TCP_NODELAY, large socket buffers, gather writes straight
// from tensor memory and reads straight into the caller's buffer.
// Thread model: a pool of I/O threads (TcpOptions::io_threads) runs one io_context; each
// connection serializes its work on its own strand. See docs/thread_model.md.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace poseidon::transport {

struct TcpOptions : ContextOptions {
  int io_threads = 1;
  // SO_SNDBUF / SO_RCVBUF; 0 leaves the kernel's autotuning in charge.
  int socket_buffer_bytes = 0;
  bool no_delay = true;
};

// Starts the I/O threads. Errors: InvalidArgument for a bad option.
absl::StatusOr<std::shared_ptr<Context>> CreateTcpContext(const TcpOptions& options);

}  // namespace poseidon::transport
