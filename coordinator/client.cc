#include "coordinator/client.h"

#include <algorithm>
#include <chrono>
#include <iterator>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/auth.h"
#include "coordinator/grpc_status.h"
#include "grpcpp/create_channel.h"

namespace poseidon::coordinator {
namespace {

namespace v1 = ::poseidon::v1;

// Status of a call, with which call failed for context.
absl::Status CallStatus(const grpc::Status& status, absl::string_view method) {
  if (status.ok()) return absl::OkStatus();
  absl::Status converted = FromGrpcStatus(status);
  if (status.error_message().empty()) {
    return absl::Status(converted.code(), absl::StrCat(method, " failed"));
  }
  return converted;
}

}  // namespace

v1::Endpoint MakeEndpoint(v1::TransportKind transport, absl::string_view address) {
  v1::Endpoint endpoint;
  endpoint.set_transport(transport);
  endpoint.set_address(std::string(address));
  return endpoint;
}

absl::StatusOr<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Connect(
    CoordinatorClientOptions options) {
  if (options.address.empty()) {
    return absl::InvalidArgumentError("coordinator address is empty");
  }
  RouteGrpcLogs();
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   MakeChannelCredentials(options.tls));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  if (options.tls.enabled && !options.tls.server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls.server_name);
  }
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(options.address, credentials, args);
  auto stub = v1::Coordinator::NewStub(channel);
  return std::unique_ptr<CoordinatorClient>(
      new CoordinatorClient(std::move(options), std::move(stub)));
}

absl::StatusOr<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Connect(
    absl::string_view address, absl::string_view job_id, absl::string_view token,
    const ClientTlsOptions& tls) {
  CoordinatorClientOptions options;
  options.address = std::string(address);
  options.job_id = std::string(job_id);
  options.token = std::string(token);
  options.tls = tls;
  return Connect(std::move(options));
}

CoordinatorClient::CoordinatorClient(CoordinatorClientOptions options,
                                     std::unique_ptr<v1::Coordinator::Stub> stub)
    : options_(std::move(options)), stub_(std::move(stub)) {}

void CoordinatorClient::FillHeader(v1::RequestHeader* header) const {
  std::lock_guard<std::mutex> lock(mu_);
  header->set_job_id(options_.job_id);
  header->set_token(options_.token);
  header->set_epoch(membership_epoch_);
  header->set_node_id(node_id_);
}

void CoordinatorClient::Observe(const v1::ResponseHeader& header) {
  std::lock_guard<std::mutex> lock(mu_);
  membership_epoch_ = std::max(membership_epoch_, header.epoch());
  plan_epoch_ = std::max(plan_epoch_, header.plan_epoch());
}

void CoordinatorClient::Prepare(grpc::ClientContext* context, absl::Duration timeout) const {
  context->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoNanoseconds(std::max(timeout, absl::ZeroDuration())));
  context->AddMetadata(kJobMetadata, options_.job_id);
  context->AddMetadata(kTokenMetadata, options_.token);
}

absl::StatusOr<v1::RegisterAgentResponse> CoordinatorClient::RegisterAgent(
    const AgentRegistration& agent) {
  v1::RegisterAgentRequest request;
  request.set_host(agent.host);
  request.set_gpu_index(agent.gpu_index);
  for (const v1::Endpoint& endpoint : agent.endpoints) *request.add_endpoints() = endpoint;
  request.set_world_size(agent.world_size);
  if (agent.requested_rank.has_value()) request.set_requested_rank(*agent.requested_rank);
  return SendRegistration(std::move(request));
}

absl::StatusOr<v1::RegisterAgentResponse> CoordinatorClient::SendRegistration(
    v1::RegisterAgentRequest request) {
  FillHeader(request.mutable_header());
  v1::RegisterAgentResponse response;
  grpc::ClientContext context;
  Prepare(&context, options_.call_timeout);
  RETURN_IF_ERROR(CallStatus(stub_->RegisterAgent(&context, request, &response), "RegisterAgent"));
  Observe(response.header());
  std::lock_guard<std::mutex> lock(mu_);
  node_id_ = response.node_id();
  role_ = v1::NODE_ROLE_AGENT;
  agent_registration_ = std::move(request);
  server_registration_.reset();
  if (response.heartbeat_interval_ms() > 0) {
    heartbeat_interval_ = absl::Milliseconds(response.heartbeat_interval_ms());
  }
  return response;
}

absl::StatusOr<v1::RegisterServerResponse> CoordinatorClient::RegisterServer(
    const ServerRegistration& server) {
  v1::RegisterServerRequest request;
  request.set_host(server.host);
  for (const v1::Endpoint& endpoint : server.endpoints) *request.add_endpoints() = endpoint;
  *request.mutable_capacity() = server.capacity;
  request.set_previous_node_id(server.previous_node_id);
  for (const std::string& job : server.jobs) request.add_jobs(job);
  return SendRegistration(std::move(request));
}

absl::StatusOr<v1::RegisterServerResponse> CoordinatorClient::SendRegistration(
    v1::RegisterServerRequest request) {
  FillHeader(request.mutable_header());
  v1::RegisterServerResponse response;
  grpc::ClientContext context;
  Prepare(&context, options_.call_timeout);
  RETURN_IF_ERROR(
      CallStatus(stub_->RegisterServer(&context, request, &response), "RegisterServer"));
  Observe(response.header());
  std::lock_guard<std::mutex> lock(mu_);
  node_id_ = response.node_id();
  role_ = v1::NODE_ROLE_SERVER;
  server_registration_ = std::move(request);
  agent_registration_.reset();
  if (response.heartbeat_interval_ms() > 0) {
    heartbeat_interval_ = absl::Milliseconds(response.heartbeat_interval_ms());
  }
  return response;
}

absl::Status CoordinatorClient::RegisterAgain() {
  std::optional<v1::RegisterAgentRequest> agent;
  std::optional<v1::RegisterServerRequest> server;
  {
    std::lock_guard<std::mutex> lock(mu_);
    agent = agent_registration_;
    server = server_registration_;
    if (server) server->set_previous_node_id(node_id_);  // the same node, not a new one
  }
  if (agent) return SendRegistration(std::move(*agent)).status();
  if (server) return SendRegistration(std::move(*server)).status();
  return absl::FailedPreconditionError("not registered yet: nothing to register again");
}

absl::StatusOr<World> CoordinatorClient::Rendezvous(absl::Duration timeout) {
  v1::RendezvousRequest request;
  FillHeader(request.mutable_header());
  v1::RendezvousResponse response;
  grpc::ClientContext context;
  Prepare(&context, timeout);
  RETURN_IF_ERROR(CallStatus(stub_->Rendezvous(&context, request, &response), "Rendezvous"));
  Observe(response.header());
  World world;
  world.rank = response.rank();
  world.world_size = response.world_size();
  world.peers.assign(response.peers().begin(), response.peers().end());
  world.servers.assign(response.servers().begin(), response.servers().end());
  world.membership_epoch = response.header().epoch();
  return world;
}

absl::StatusOr<World> CoordinatorClient::RegisterAgentAndRendezvous(const AgentRegistration& agent,
                                                                    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  RETURN_IF_ERROR(RegisterAgent(agent).status());
  return Rendezvous(deadline - absl::Now());
}

absl::StatusOr<v1::Plan> CoordinatorClient::RegisterModel(
    const v1::ModelSpec& model, const v1::UpdateRuleSpec& update_rule,
    const v1::ConsistencySpec& consistency, absl::Duration timeout, bool allreduce,
    std::optional<uint64_t> allreduce_bucket_bytes, absl::Duration allreduce_step) {
  v1::RegisterModelRequest request;
  FillHeader(request.mutable_header());
  *request.mutable_model() = model;
  *request.mutable_update_rule() = update_rule;
  *request.mutable_consistency() = consistency;
  request.set_allreduce_unavailable(!allreduce);
  if (allreduce_bucket_bytes.has_value()) {
    request.set_allreduce_bucket_bytes(*allreduce_bucket_bytes);
  }
  if (allreduce_step > absl::ZeroDuration()) {
    request.set_allreduce_step_ns(
        std::max<uint64_t>(1, static_cast<uint64_t>(absl::ToInt64Nanoseconds(allreduce_step))));
  }
  v1::RegisterModelResponse response;
  grpc::ClientContext context;
  Prepare(&context, timeout);
  RETURN_IF_ERROR(CallStatus(stub_->RegisterModel(&context, request, &response), "RegisterModel"));
  Observe(response.header());
  {
    std::lock_guard<std::mutex> lock(mu_);
    model_registration_ = std::move(request);
  }
  return std::move(*response.mutable_plan());
}

absl::Status CoordinatorClient::RegisterModelAgain(const v1::Plan& running,
                                                   const std::vector<std::string>& joined_servers,
                                                   const std::vector<std::string>& lost_servers) {
  std::optional<v1::RegisterModelRequest> request;
  {
    std::lock_guard<std::mutex> lock(mu_);
    request = model_registration_;
  }
  if (!request) {
    return absl::FailedPreconditionError("no model registered yet: nothing to register again");
  }
  FillHeader(request->mutable_header());  // this node's id now
  *request->mutable_running_plan() = running;
  request->clear_joined_servers();
  for (const std::string& id : joined_servers) request->add_joined_servers(id);
  request->clear_lost_servers();
  for (const std::string& id : lost_servers) request->add_lost_servers(id);
  v1::RegisterModelResponse response;
  grpc::ClientContext context;
  Prepare(&context, options_.call_timeout);
  RETURN_IF_ERROR(
      CallStatus(stub_->RegisterModel(&context, *request, &response), "RegisterModel"));
  Observe(response.header());
  return absl::OkStatus();
}

absl::StatusOr<v1::Plan> CoordinatorClient::GetPlan() {
  v1::GetPlanRequest request;
  FillHeader(request.mutable_header());
  v1::GetPlanResponse response;
  grpc::ClientContext context;
  Prepare(&context, options_.call_timeout);
  RETURN_IF_ERROR(CallStatus(stub_->GetPlan(&context, request, &response), "GetPlan"));
  Observe(response.header());
  return std::move(*response.mutable_plan());
}

absl::StatusOr<v1::Plan> CoordinatorClient::WaitForPlan(uint64_t min_plan_epoch,
                                                        absl::Duration timeout) {
  v1::GetPlanRequest request;
  FillHeader(request.mutable_header());
  request.set_min_plan_epoch(min_plan_epoch);
  v1::GetPlanResponse response;
  grpc::ClientContext context;
  Prepare(&context, timeout);
  RETURN_IF_ERROR(CallStatus(stub_->GetPlan(&context, request, &response), "GetPlan"));
  Observe(response.header());
  return std::move(*response.mutable_plan());
}

absl::Status CoordinatorClient::ReportTelemetry(const std::vector<v1::LinkTelemetry>& links,
                                                uint64_t iteration) {
  v1::ReportTelemetryRequest request;
  for (const v1::LinkTelemetry& link : links) *request.add_links() = link;
  request.set_iteration(iteration);
  return ReportTelemetry(std::move(request), options_.call_timeout);
}

absl::Status CoordinatorClient::ReportTelemetry(v1::ReportTelemetryRequest request,
                                                absl::Duration timeout) {
  FillHeader(request.mutable_header());
  v1::ReportTelemetryResponse response;
  grpc::ClientContext context;
  Prepare(&context, timeout);
  RETURN_IF_ERROR(
      CallStatus(stub_->ReportTelemetry(&context, request, &response), "ReportTelemetry"));
  Observe(response.header());
  return absl::OkStatus();
}

absl::StatusOr<v1::HeartbeatResponse> CoordinatorClient::Heartbeat(
    const HeartbeatReport& report) {
  v1::HeartbeatRequest request;
  FillHeader(request.mutable_header());
  request.set_role(role());
  request.set_iteration(report.iteration);
  request.set_plan_epoch(report.plan_epoch);
  request.set_live_world(report.world.first);
  request.set_world_generation(report.world.second);
  request.set_took_up_at(report.took_up_at);
  for (uint32_t rank : report.peers_gone) request.add_peers_gone(rank);
  for (const auto& [job, ranks] : report.ranks_gone) {
    v1::RanksGone* gone = request.add_ranks_gone();
    gone->set_job_id(absl::StrCat(job));
    for (uint32_t rank : ranks) gone->add_ranks(rank);
  }
  v1::HeartbeatResponse response;
  grpc::ClientContext context;
  Prepare(&context, options_.call_timeout);
  RETURN_IF_ERROR(CallStatus(stub_->Heartbeat(&context, request, &response), "Heartbeat"));
  Observe(response.header());
  return response;
}

absl::Status CoordinatorClient::Deregister(absl::string_view reason, bool failed) {
  v1::DeregisterRequest request;
  FillHeader(request.mutable_header());
  request.set_reason(std::string(reason));
  request.set_failed(failed);
  v1::DeregisterResponse response;
  grpc::ClientContext context;
  Prepare(&context, options_.call_timeout);
  RETURN_IF_ERROR(CallStatus(stub_->Deregister(&context, request, &response), "Deregister"));
  Observe(response.header());
  return absl::OkStatus();
}

absl::StatusOr<v1::GetClusterStatusResponse> CoordinatorClient::GetClusterStatus() {
  v1::GetClusterStatusRequest request;
  FillHeader(request.mutable_header());
  v1::GetClusterStatusResponse response;
  grpc::ClientContext context;
  Prepare(&context, options_.call_timeout);
  RETURN_IF_ERROR(
      CallStatus(stub_->GetClusterStatus(&context, request, &response), "GetClusterStatus"));
  Observe(response.header());
  return response;
}

absl::StatusOr<v1::Plan> CoordinatorClient::SetLayerSchemes(
    const std::map<std::string, v1::SyncScheme>& schemes) {
  ASSIGN_OR_RETURN(v1::SetLayerSchemesResponse response, SetLayerSchemes(schemes, "", ""));
  return std::move(*response.mutable_plan());
}

absl::StatusOr<v1::SetLayerSchemesResponse> CoordinatorClient::SetLayerSchemes(
    const std::map<std::string, v1::SyncScheme>& schemes, absl::string_view job_id,
    absl::string_view reason) {
  v1::SetLayerSchemesRequest request;
  FillHeader(request.mutable_header());
  request.set_job_id(std::string(job_id));
  for (const auto& [name, scheme] : schemes) (*request.mutable_schemes())[name] = scheme;
  request.set_reason(std::string(reason));
  v1::SetLayerSchemesResponse response;
  grpc::ClientContext context;
  Prepare(&context, options_.call_timeout);
  RETURN_IF_ERROR(
      CallStatus(stub_->SetLayerSchemes(&context, request, &response), "SetLayerSchemes"));
  Observe(response.header());
  return response;
}

absl::Status CoordinatorClient::StoreSet(absl::string_view key, absl::string_view value) {
  // The coordinator checks the limits (store_limits.h) and answers with the field.
  v1::StoreSetRequest request;
  FillHeader(request.mutable_header());
  request.set_key(std::string(key));
  request.set_value(std::string(value));
  v1::StoreSetResponse response;
  grpc::ClientContext context;
  Prepare(&context, options_.call_timeout);
  RETURN_IF_ERROR(CallStatus(stub_->StoreSet(&context, request, &response), "StoreSet"));
  Observe(response.header());
  return absl::OkStatus();
}

// The wait is the coordinator's (a parked call that a StoreSet of the last missing key answers),
// not a poll: each call asks it to wait for the time left (timeout_ms) under a gRPC deadline a
// call_timeout later, so the coordinator answers first, naming the missing keys. It bounds one
// call's wait by its rendezvous_timeout; a longer `timeout` takes several calls.
absl::StatusOr<std::vector<std::string>> CoordinatorClient::StoreGet(
    const std::vector<std::string>& keys, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + std::max(timeout, absl::ZeroDuration());
  v1::StoreGetRequest request;
  for (const std::string& key : keys) request.add_keys(key);
  while (true) {
    FillHeader(request.mutable_header());
    const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
    request.set_timeout_ms(
        static_cast<uint64_t>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)))));
    v1::StoreGetResponse response;
    grpc::ClientContext context;
    Prepare(&context, left + options_.call_timeout);
    const grpc::Status status = stub_->StoreGet(&context, request, &response);
    if (status.ok()) {
      Observe(response.header());
      if (static_cast<size_t>(response.values_size()) != keys.size()) {
        return absl::InternalError(absl::StrCat("StoreGet: the coordinator answered ",
                                                response.values_size(), " values for ", keys.size(),
                                                " keys"));
      }
      return std::vector<std::string>(std::make_move_iterator(response.mutable_values()->begin()),
                                      std::make_move_iterator(response.mutable_values()->end()));
    }
    if (status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return CallStatus(status, "StoreGet");
    }
    // The coordinator's own answer names the missing keys; it may have stopped at its bound
    // before our timeout, then ask again for the rest.
    const bool answered = absl::StartsWith(status.error_message(), "StoreGet of job");
    if (answered && absl::Now() < deadline) continue;
    if (answered) return CallStatus(status, "StoreGet");
    std::vector<std::string> named;
    for (size_t i = 0; i < keys.size() && i < 8; ++i) {
      named.push_back(
          absl::StrCat("'", absl::CHexEscape(absl::string_view(keys[i]).substr(0, 64)), "'"));
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "StoreGet: no answer from the coordinator within ", absl::FormatDuration(timeout),
        " (+ call_timeout) for ", keys.size(), " keys: ", absl::StrJoin(named, ", "),
        keys.size() > named.size() ? ", ..." : ""));
  }
}

std::unique_ptr<HeartbeatLoop> CoordinatorClient::StartHeartbeats(HeartbeatOptions options) {
  return std::make_unique<HeartbeatLoop>(this, std::move(options));
}

std::string CoordinatorClient::node_id() const {
  std::lock_guard<std::mutex> lock(mu_);
  return node_id_;
}

v1::NodeRole CoordinatorClient::role() const {
  std::lock_guard<std::mutex> lock(mu_);
  return role_;
}

absl::Duration CoordinatorClient::heartbeat_interval() const {
  std::lock_guard<std::mutex> lock(mu_);
  return heartbeat_interval_;
}

uint64_t CoordinatorClient::membership_epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return membership_epoch_;
}

uint64_t CoordinatorClient::plan_epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plan_epoch_;
}

// ---- HeartbeatLoop -----------------------------------------------------------------------------

void LogHeartbeatResult(const std::string& node_id,
                        const absl::StatusOr<v1::HeartbeatResponse>& result) {
  if (!result.ok()) {
    PSD_LOG_WARN("heartbeat of {} failed: {}", node_id, result.status().message());
  } else if (result->shutdown()) {
    PSD_LOG_WARN("the coordinator asks {} to shut down (declared dead or replaced)", node_id);
  }
}

HeartbeatLoop::HeartbeatLoop(CoordinatorClient* client, CoordinatorClient::HeartbeatOptions options)
    : client_(client), options_(std::move(options)), thread_([this] { Run(); }) {}

HeartbeatLoop::~HeartbeatLoop() {
  Stop();
}

void HeartbeatLoop::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void HeartbeatLoop::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    CoordinatorClient::HeartbeatReport report;
    if (options_.iteration) report.iteration = options_.iteration();
    report.plan_epoch = options_.plan_epoch ? options_.plan_epoch() : client_->plan_epoch();
    if (options_.world) report.world = options_.world();
    if (options_.took_up_at) report.took_up_at = options_.took_up_at();
    if (options_.peers_gone) report.peers_gone = options_.peers_gone();
    if (options_.ranks_gone) report.ranks_gone = options_.ranks_gone();
    const absl::StatusOr<v1::HeartbeatResponse> result = client_->Heartbeat(report);
    if (options_.on_result) {
      options_.on_result(result);
    } else {
      LogHeartbeatResult(client_->node_id(), result);
    }
    if (!result.ok() && absl::IsNotFound(result.status()) && options_.register_again) {
      const std::string was = client_->node_id();
      if (absl::Status again = client_->RegisterAgain(); again.ok()) {
        PSD_LOG_WARN("registered again with the coordinator as {} (it did not know {}: restarted?)",
                     client_->node_id(), was);
        if (options_.on_registered_again) options_.on_registered_again();
      } else {
        PSD_LOG_WARN("registering again with the coordinator failed (it did not know {}: "
                     "restarted?): {}",
                     was, again.message());
      }
    }
    const absl::Duration interval = options_.interval > absl::ZeroDuration()
                                        ? options_.interval
                                        : client_->heartbeat_interval();
    lock.lock();
    wake_.wait_for(lock, absl::ToChronoNanoseconds(interval), [this] { return stop_ || now_; });
    now_ = false;
  }
}

void HeartbeatLoop::BeatNow() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    now_ = true;
  }
  wake_.notify_all();
}

}  // namespace poseidon::coordinator
