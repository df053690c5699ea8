#include "coordinator/server.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
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
  grpc::ServerBuilder builder;
  // Two coordinators must not share a port silently.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Unauthenticated connections are cheap to open: none may idle in its handshake or afterwards
  // for long (docs/operations.md, "Limits").
  builder.AddChannelArgument(
      GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
      static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(options.handshake_timeout),
                                           1, INT32_MAX)));
  builder.AddChannelArgument(
      GRPC_ARG_MAX_CONNECTION_IDLE_MS,
      static_cast<int>(std::clamp<int64_t>(
          absl::ToInt64Milliseconds(options.max_connection_idle), 1, INT32_MAX)));
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<MalformedRequestInterceptorFactory>());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  builder.AddListeningPort(options.listen, *credentials, &server->port_);
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
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
  return server;
}

CoordinatorServer::~CoordinatorServer() {
  Shutdown();
}

void CoordinatorServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  if (service_ != nullptr) service_->Shutdown();
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(grace));
    server_->Wait();
  }
}

}  // namespace poseidon::coordinator
