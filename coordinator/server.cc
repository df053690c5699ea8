#include "coordinator/server.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "coordinator/grpc_status.h"
#include "coordinator/validate.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/support/server_interceptor.h"
#include "grpcpp/server_builder.h"

namespace poseidon::coordinator {
namespace {

// Checks each call's job and token metadata (auth.h) before gRPC reads its request.
class TokenMetadataProcessor : public grpc::AuthMetadataProcessor {
 public:
  explicit TokenMetadataProcessor(TokenStore tokens) : tokens_(std::move(tokens)) {}
  bool IsBlocking() const override { return false; }  // a map lookup: inline
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* /*context*/,
                       OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) override {
    std::multimap<std::string, std::string> metadata;
    for (const auto& [key, value] : auth_metadata) {
      const absl::string_view k(key.data(), key.size());
      if (k == kJobMetadata || k == kTokenMetadata) {
        metadata.emplace(std::string(k), std::string(value.data(), value.size()));
      }
    }
    const absl::Status s = CheckCallMetadata(tokens_, metadata);
    if (s.ok()) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(s.message()));
  }

 private:
  const TokenStore tokens_;
};

// gRPC answers a request that does not parse as its method's message with UNIMPLEMENTED and no
// message (the callback API's handler never sees it). Every method of ours is implemented, so
// that status on one of them means exactly that: say so.
class MalformedRequestInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit MalformedRequestInterceptor(std::string method) : method_(std::move(method)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status sent = methods->GetSendStatus();
      if (sent.error_code() == grpc::StatusCode::UNIMPLEMENTED && sent.error_message().empty()) {
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat(method_, ": the request does not parse as this method's protobuf "
                                  "message (wrong message, truncated or corrupt bytes)")));
      }
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
};

class MalformedRequestInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const absl::string_view method = info->method();
    if (!absl::StartsWith(method, "/poseidon.v1.Coordinator/")) return nullptr;
    return new MalformedRequestInterceptor(std::string(method));
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    TokenStore tokens, CoordinatorServerOptions options) {
  if (absl::Status valid = ValidateHostPort("listen", options.listen); !valid.ok()) {
    // Port 0 is fine here (a free port); ValidateHostPort wants 1..65535.
    const size_t colon = options.listen.rfind(':');
    if (colon == std::string::npos || options.listen.substr(colon + 1) != "0") return valid;
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();

  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer());
  server->tls_ = options.tls.enabled();
  if (server->tls_) {
    (*credentials)->SetAuthMetadataProcessor(std::make_shared<TokenMetadataProcessor>(tokens));
  }
  server->service_ =
      std::make_unique<CoordinatorService>(std::move(tokens), std::move(options.service));

  RouteGrpcLogs();
  server->options_ = options;
  server->credentials_ = *credentials;
  server->server_ = server->BuildGrpcServer(options.listen, &server->port_);
  if (server->server_ == nullptr || server->port_ == 0) {
    if (server->server_ != nullptr) server->server_->Shutdown();
    server->server_.reset();
    server->service_->Shutdown();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen, " (address in use or not local?)"));
  }
  const size_t colon = options.listen.rfind(':');
  server->address_ = absl::StrCat(options.listen.substr(0, colon), ":", server->port_);
  server->service_->Start();
  server->accept_failures_ = GrpcAcceptFailures();
  server->watchdog_ = std::thread([raw = server.get()] { raw->WatchListener(); });
  return server;
}

std::unique_ptr<grpc::Server> CoordinatorServer::BuildGrpcServer(const std::string& listen,
                                                                 int* port) {
  grpc::ServerBuilder builder;
  // Two coordinators must not share a port silently.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Unauthenticated connections are cheap to open: none may idle in its handshake or afterwards
  // for long (docs/operations.md, "Limits").
  builder.AddChannelArgument(
      GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
      static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(options_.handshake_timeout),
                                           1, INT32_MAX)));
  builder.AddChannelArgument(
      GRPC_ARG_MAX_CONNECTION_IDLE_MS,
      static_cast<int>(std::clamp<int64_t>(
          absl::ToInt64Milliseconds(options_.max_connection_idle), 1, INT32_MAX)));
  builder.SetMaxReceiveMessageSize(options_.max_message_bytes);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<MalformedRequestInterceptorFactory>());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.AddListeningPort(listen, credentials_, port);
  builder.RegisterService(service_.get());
  return builder.BuildAndStart();
}

// gRPC 1.51's listener stops for good after one accept fails with EMFILE (grpc/grpc#20418: it
// does not re-arm the listening socket), so a burst of connections beyond the descriptor limit
// would leave the coordinator deaf to every new client until restarted. Once the failure is seen
// (GrpcAcceptFailures) and descriptors are free again, the gRPC server is rebuilt on the same
// port around the same service: registry, plans and leases stay; calls in flight are cancelled
// (clients retry), connected clients reconnect on their next call.
void CoordinatorServer::WatchListener() {
  std::unique_lock<std::mutex> lock(mu_);
  bool waiting_logged = false;
  while (!watchdog_cv_.wait_for(lock, std::chrono::milliseconds(500), [&] { return shut_down_; })) {
    if (GrpcAcceptFailures() == accept_failures_) continue;
    // Descriptors free again? A margin for the new listener and the clients that come back.
    std::vector<int> probes;
    for (int i = 0; i < 32; ++i) {
      const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (fd < 0) break;
      probes.push_back(fd);
    }
    const bool free = probes.size() == 32;
    for (int fd : probes) ::close(fd);
    if (!free) {
      if (!waiting_logged) {
        PSD_LOG_WARN("gRPC's listener stopped accepting (out of file descriptors); it is "
                     "restarted once descriptors are free");
        waiting_logged = true;
      }
      continue;
    }
    accept_failures_ = GrpcAcceptFailures();
    waiting_logged = false;
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_->Wait();
    server_.reset();
    int port = 0;
    const std::string listen = absl::StrCat(address_.substr(0, address_.rfind(':')), ":", port_);
    server_ = BuildGrpcServer(listen, &port);
    if (server_ == nullptr || port != port_) {
      PSD_LOG_ERROR("gRPC's listener stopped accepting (grpc#20418) and restarting it on {} "
                    "failed; the coordinator exits",
                    listen);
      std::_Exit(5);
    }
    PSD_LOG_WARN("gRPC's listener stopped accepting after running out of file descriptors "
                 "(grpc#20418); restarted it on {} (the registry and plans are kept)",
                 address_);
  }
}

CoordinatorServer::~CoordinatorServer() {
  Shutdown();
}

void CoordinatorServer::Shutdown(absl::Duration grace) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  watchdog_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (service_ != nullptr) service_->Shutdown();
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(grace));
    server_->Wait();
  }
}

}  // namespace poseidon::coordinator
