// CoordinatorServer: the Coordinator service on a gRPC server (port 0 picks a free port), insecure
// or TLS; the poseidon-coordinator daemon runs one, tests run one in-process.
// Thread-safety: Start and Shutdown from one owner thread; the accessors from any thread.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/auth.h"
#include "coordinator/service.h"
#include "coordinator/tls.h"
#include "grpcpp/server.h"

namespace poseidon::coordinator {

struct CoordinatorServerOptions {
  // "host:port" or "[v6]:port"; port 0 picks a free port.
  std::string listen = "127.0.0.1:0";
  ServerTlsFiles tls;
  CoordinatorServiceOptions service;
  // Largest request read, in bytes (--max_message_bytes; a model spec is the largest message).
  int max_message_bytes = 16 << 20;
  // A connection that has not completed its TLS and HTTP/2 handshake (the client's SETTINGS)
  // within this is closed: a client that connects and sends nothing holds a slot no longer.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // A connection without a call for this long is closed (clients reconnect when they call).
  absl::Duration max_connection_idle = absl::Minutes(5);
};

class CoordinatorServer {
 public:
  // Binds, starts serving and starts the service's housekeeping. Errors: bad TLS files, an
  // address that cannot be bound (in use, malformed).
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(TokenStore tokens,
                                                                  CoordinatorServerOptions options);
  // Shuts down (with the default grace) if Shutdown was not called.
  ~CoordinatorServer();
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  // Answers parked calls UNAVAILABLE, lets calls in flight finish for up to `grace`, cancels the
  // rest and stops. Idempotent.
  void Shutdown(absl::Duration grace = absl::Seconds(5));

  // The bound address ("127.0.0.1:41234") and port.
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  bool tls() const { return tls_; }
  CoordinatorService& service() { return *service_; }

 private:
  CoordinatorServer() = default;
  std::unique_ptr<grpc::Server> BuildGrpcServer(const std::string& listen, int* port);
  void WatchListener();  // the watchdog thread (server.cc)

  CoordinatorServerOptions options_;
  std::shared_ptr<grpc::ServerCredentials> credentials_;
  // Declared before server_: the service must outlive the grpc::Server that calls it.
  std::unique_ptr<CoordinatorService> service_;
  // mu_ guards server_ once the watchdog runs (it may rebuild it) and shut_down_.
  std::mutex mu_;
  std::condition_variable watchdog_cv_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  int port_ = 0;
  bool tls_ = false;
  bool shut_down_ = false;
  uint64_t accept_failures_ = 0;  // GrpcAcceptFailures() when the listener was last (re)built
  std::thread watchdog_;
};

}  // namespace poseidon::coordinator
