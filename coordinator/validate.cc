#include "coordinator/validate.h"

#include <cmath>
#include <map>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "coordinator/planner/model_spec.h"

namespace poseidon::coordinator {
namespace {

namespace v1 = ::poseidon::v1;

absl::Status Invalid(absl::string_view field, absl::string_view reason) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", reason));
}

absl::Status CheckLength(absl::string_view field, absl::string_view value, size_t max) {
  if (value.size() > max) {
    return Invalid(field, absl::StrCat("is ", value.size(), " bytes; at most ", max, " allowed"));
  }
  return absl::OkStatus();
}

// Non-empty printable ASCII without spaces, at most `max` bytes.
absl::Status CheckPrintable(absl::string_view field, absl::string_view value, size_t max) {
  if (value.empty()) return Invalid(field, "must not be empty");
  RETURN_IF_ERROR(CheckLength(field, value, max));
  for (const char c : value) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= ' ' || u >= 0x7f) {
      return Invalid(field, "must be printable ASCII without spaces");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckFinite(absl::string_view field, double value, double min) {
  if (!std::isfinite(value) || value < min) {
    return Invalid(field, absl::StrCat("must be a finite number >= ", min, ", got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckNodeId(const v1::RequestHeader& header) {
  if (header.node_id().empty()) {
    return Invalid("header.node_id", "must be set (the node id registration returned)");
  }
  return absl::OkStatus();
}

bool IsHostChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_';
}

absl::Status ValidateEndpoints(const google::protobuf::RepeatedPtrField<v1::Endpoint>& endpoints) {
  if (endpoints.empty()) {
    return Invalid("endpoints", "at least one data-plane endpoint is required");
  }
  if (endpoints.size() > kMaxEndpoints) {
    return Invalid("endpoints",
                   absl::StrCat(endpoints.size(), " entries; at most ", kMaxEndpoints, " allowed"));
  }
  for (int i = 0; i < endpoints.size(); ++i) {
    const v1::Endpoint& endpoint = endpoints[i];
    const std::string field = absl::StrCat("endpoints[", i, "]");
    switch (endpoint.transport()) {
      case v1::TRANSPORT_KIND_TCP:
      case v1::TRANSPORT_KIND_RDMA:
        RETURN_IF_ERROR(ValidateHostPort(absl::StrCat(field, ".address"), endpoint.address()));
        break;
      case v1::TRANSPORT_KIND_INPROC:
        RETURN_IF_ERROR(
            CheckPrintable(absl::StrCat(field, ".address"), endpoint.address(), kMaxAddressBytes));
        break;
      default:
        return Invalid(absl::StrCat(field, ".transport"),
                       absl::StrCat("must be TRANSPORT_KIND_TCP, _RDMA or _INPROC, got ",
                                    static_cast<int>(endpoint.transport())));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateUpdateRule(const v1::UpdateRuleSpec& rule) {
  if (!v1::UpdateRule_IsValid(rule.rule())) {
    return Invalid("update_rule.rule",
                   absl::StrCat(static_cast<int>(rule.rule()), " is not a known UpdateRule"));
  }
  RETURN_IF_ERROR(CheckFinite("update_rule.learning_rate", rule.learning_rate(), 0));
  RETURN_IF_ERROR(CheckFinite("update_rule.momentum", rule.momentum(), 0));
  RETURN_IF_ERROR(CheckFinite("update_rule.beta1", rule.beta1(), 0));
  RETURN_IF_ERROR(CheckFinite("update_rule.beta2", rule.beta2(), 0));
  RETURN_IF_ERROR(CheckFinite("update_rule.epsilon", rule.epsilon(), 0));
  RETURN_IF_ERROR(CheckFinite("update_rule.weight_decay", rule.weight_decay(), 0));
  RETURN_IF_ERROR(CheckFinite("update_rule.dampening", rule.dampening(), 0));
  if (rule.beta1() >= 1) return Invalid("update_rule.beta1", "must be below 1");
  if (rule.beta2() >= 1) return Invalid("update_rule.beta2", "must be below 1");
  return absl::OkStatus();
}

absl::Status ValidateConsistency(const v1::ConsistencySpec& consistency,
                                 const v1::UpdateRuleSpec& rule) {
  if (!v1::ConsistencyModel_IsValid(consistency.model())) {
    return Invalid("consistency.model", absl::StrCat(static_cast<int>(consistency.model()),
                                                     " is not a known ConsistencyModel"));
  }
  if (consistency.staleness() > kMaxStaleness) {
    return Invalid("consistency.staleness", absl::StrCat("must be at most ", kMaxStaleness,
                                                         ", got ", consistency.staleness()));
  }
  if (consistency.model() == v1::CONSISTENCY_MODEL_SSP &&
      (rule.rule() == v1::UPDATE_RULE_SUM || rule.rule() == v1::UPDATE_RULE_UNSPECIFIED)) {
    return Invalid("consistency.model",
                   "CONSISTENCY_MODEL_SSP needs a server-side update rule (sgd, momentum, adam), "
                   "not the summation service");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateId(absl::string_view what, absl::string_view id) {
  if (id.empty()) return Invalid(what, "must not be empty");
  RETURN_IF_ERROR(CheckLength(what, id, kMaxIdBytes));
  for (const char c : id) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-' &&
        c != ':') {
      return Invalid(what, "may contain only letters, digits and . _ - :");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateHostPort(absl::string_view what, absl::string_view address) {
  if (address.empty()) return Invalid(what, "must not be empty");
  RETURN_IF_ERROR(CheckLength(what, address, kMaxAddressBytes));
  absl::string_view host;
  absl::string_view port;
  if (address.front() == '[') {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || close + 1 >= address.size() ||
        address[close + 1] != ':') {
      return Invalid(what, absl::StrCat("'", address, "' is not [address]:port"));
    }
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
    for (const char c : host) {
      if (!absl::ascii_isxdigit(static_cast<unsigned char>(c)) && c != ':' && c != '.' &&
          c != '%') {
        return Invalid(what, absl::StrCat("'", address, "' has a malformed IPv6 address"));
      }
    }
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) {
      return Invalid(what, absl::StrCat("'", address, "' is not host:port"));
    }
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
    for (const char c : host) {
      if (!IsHostChar(c)) {
        return Invalid(what, absl::StrCat("'", address, "' has a malformed host"));
      }
    }
  }
  if (host.empty()) return Invalid(what, absl::StrCat("'", address, "' has no host"));
  uint32_t number = 0;
  if (port.empty() || port.size() > 5 || !absl::SimpleAtoi(port, &number) || number < 1 ||
      number > 65535 || !absl::ascii_isdigit(static_cast<unsigned char>(port.front()))) {
    return Invalid(what, absl::StrCat("'", address, "' needs a port in [1, 65535]"));
  }
  return absl::OkStatus();
}

absl::Status ValidateHeader(const v1::RequestHeader& header) {
  if (!header.job_id().empty()) RETURN_IF_ERROR(ValidateId("header.job_id", header.job_id()));
  RETURN_IF_ERROR(CheckLength("header.token", header.token(), kMaxTokenBytes));
  if (!header.node_id().empty()) RETURN_IF_ERROR(ValidateId("header.node_id", header.node_id()));
  RETURN_IF_ERROR(CheckLength("header.request_id", header.request_id(), kMaxIdBytes));
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::RegisterServerRequest& request) {
  RETURN_IF_ERROR(CheckPrintable("host", request.host(), kMaxHostBytes));
  RETURN_IF_ERROR(ValidateEndpoints(request.endpoints()));
  RETURN_IF_ERROR(CheckFinite("capacity.network_bytes_per_second",
                              request.capacity().network_bytes_per_second(), 0));
  if (request.capacity().worker_threads() > 65536) {
    return Invalid("capacity.worker_threads", absl::StrCat("must be at most 65536, got ",
                                                           request.capacity().worker_threads()));
  }
  if (!request.previous_node_id().empty()) {
    RETURN_IF_ERROR(ValidateId("previous_node_id", request.previous_node_id()));
  }
  if (request.jobs_size() > 1024) {
    return Invalid("jobs", absl::StrCat("at most 1024 job ids, got ", request.jobs_size()));
  }
  for (const std::string& job : request.jobs()) RETURN_IF_ERROR(ValidateId("jobs", job));
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::RegisterAgentRequest& request) {
  RETURN_IF_ERROR(CheckPrintable("host", request.host(), kMaxHostBytes));
  if (request.gpu_index() > kMaxGpuIndex) {
    return Invalid("gpu_index",
                   absl::StrCat("must be at most ", kMaxGpuIndex, ", got ", request.gpu_index()));
  }
  RETURN_IF_ERROR(ValidateEndpoints(request.endpoints()));
  if (request.world_size() < 1 || request.world_size() > kMaxWorldSize) {
    return Invalid("world_size",
                   absl::StrCat("must be in [1, ", kMaxWorldSize, "], got ", request.world_size()));
  }
  if (request.has_requested_rank() && request.requested_rank() >= request.world_size()) {
    return Invalid(
        "requested_rank",
        absl::StrCat(request.requested_rank(), " is not below world_size ", request.world_size()));
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::RendezvousRequest& request) {
  return CheckNodeId(request.header());
}

absl::Status ValidateModel(const v1::ModelSpec& model) {
  RETURN_IF_ERROR(CheckLength("model.name", model.name(), kMaxModelNameBytes));
  RETURN_IF_ERROR(CheckLength("model.description", model.description(), kMaxDescriptionBytes));
  if (model.layers().empty()) return Invalid("model.layers", "the model has no layers");
  if (model.layers_size() > kMaxLayers) {
    return Invalid("model.layers",
                   absl::StrCat(model.layers_size(), " layers; at most ", kMaxLayers, " allowed"));
  }
  for (int i = 0; i < model.layers_size(); ++i) {
    const v1::LayerSpec& layer = model.layers(i);
    const std::string field = absl::StrCat("model.layers[", i, "]");
    RETURN_IF_ERROR(CheckLength(absl::StrCat(field, ".name"), layer.name(), kMaxLayerNameBytes));
    if (layer.shape_size() > kMaxShapeRank) {
      return Invalid(
          absl::StrCat(field, ".shape"),
          absl::StrCat(layer.shape_size(), " dimensions; at most ", kMaxShapeRank, " allowed"));
    }
  }
  if (absl::Status valid = planner::ValidateModelSpec(model); !valid.ok()) {
    return Invalid("model", valid.message());
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::RegisterModelRequest& request) {
  RETURN_IF_ERROR(CheckNodeId(request.header()));
  if (!request.has_model()) return Invalid("model", "must be set");
  RETURN_IF_ERROR(ValidateModel(request.model()));
  RETURN_IF_ERROR(ValidateUpdateRule(request.update_rule()));
  RETURN_IF_ERROR(ValidateConsistency(request.consistency(), request.update_rule()));
  for (const auto* ids : {&request.joined_servers(), &request.lost_servers()}) {
    const char* what = ids == &request.joined_servers() ? "joined_servers" : "lost_servers";
    if (ids->size() > kMaxPlanServers) {
      return Invalid(what, absl::StrCat(ids->size(), " entries; at most ", kMaxPlanServers,
                                        " allowed"));
    }
    for (int i = 0; i < ids->size(); ++i) {
      RETURN_IF_ERROR(ValidateId(absl::StrCat(what, "[", i, "]"), ids->Get(i)));
    }
  }
  if (!request.has_running_plan()) return absl::OkStatus();
  // The plan an agent runs, from before a coordinator restart: it must fit the model it comes
  // with, and its chunks its servers.
  const v1::Plan& plan = request.running_plan();
  if (plan.plan_epoch() == 0) return Invalid("running_plan.plan_epoch", "must be at least 1");
  if (plan.layers_size() != request.model().layers_size()) {
    return Invalid("running_plan.layers",
                   absl::StrCat(plan.layers_size(), " layers; the model has ",
                                request.model().layers_size()));
  }
  if (plan.servers_size() < 1 || plan.servers_size() > kMaxPlanServers) {
    return Invalid("running_plan.servers",
                   absl::StrCat(plan.servers_size(), " servers; 1 to ", kMaxPlanServers,
                                " allowed"));
  }
  for (int i = 0; i < plan.servers_size(); ++i) {
    RETURN_IF_ERROR(ValidateId(absl::StrCat("running_plan.servers[", i, "].node_id"),
                               plan.servers(i).node_id()));
  }
  for (int l = 0; l < plan.layers_size(); ++l) {
    const v1::LayerPlan& layer = plan.layers(l);
    if (!v1::SyncScheme_IsValid(layer.scheme())) {
      return Invalid(absl::StrCat("running_plan.layers[", l, "].scheme"),
                     absl::StrCat("unknown scheme ", layer.scheme()));
    }
    for (int c = 0; c < layer.chunks_size(); ++c) {
      if (layer.chunks(c).server_index() >= static_cast<uint32_t>(plan.servers_size())) {
        return Invalid(absl::StrCat("running_plan.layers[", l, "].chunks[", c, "].server_index"),
                       absl::StrCat(layer.chunks(c).server_index(), "; the plan has ",
                                    plan.servers_size(), " servers"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::GetPlanRequest& /*request*/) {
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::ReportTelemetryRequest& request) {
  RETURN_IF_ERROR(CheckNodeId(request.header()));
  if (request.replication_size() > kMaxLinks) {
    return Invalid("replication", absl::StrCat(request.replication_size(), " entries; at most ",
                                               kMaxLinks, " allowed"));
  }
  for (int i = 0; i < request.replication_size(); ++i) {
    const v1::ReplicationTelemetry& r = request.replication(i);
    RETURN_IF_ERROR(ValidateId(absl::StrCat("replication[", i, "].job_id"), r.job_id()));
    if (r.degraded_keys() > r.primary_keys() || r.replicating_keys() > r.primary_keys()) {
      return Invalid(absl::StrCat("replication[", i, "]"),
                     "degraded_keys and replicating_keys count primary keys: at most "
                     "primary_keys");
    }
  }
  if (request.links_size() > kMaxLinks) {
    return Invalid("links",
                   absl::StrCat(request.links_size(), " entries; at most ", kMaxLinks, " allowed"));
  }
  for (int i = 0; i < request.links_size(); ++i) {
    const v1::LinkTelemetry& link = request.links(i);
    const std::string field = absl::StrCat("links[", i, "]");
    // A peer by node id, or (servers) by job and rank: exactly one of the two.
    if (!link.peer_node_id().empty() || link.peer_job_id().empty()) {
      RETURN_IF_ERROR(ValidateId(absl::StrCat(field, ".peer_node_id"), link.peer_node_id()));
      if (!link.peer_job_id().empty()) {
        return Invalid(absl::StrCat(field, ".peer_job_id"),
                       "name the peer by peer_node_id or by peer_job_id and peer_rank, not both");
      }
    } else {
      RETURN_IF_ERROR(ValidateId(absl::StrCat(field, ".peer_job_id"), link.peer_job_id()));
      if (link.peer_rank() >= kMaxWorldSize) {
        return Invalid(absl::StrCat(field, ".peer_rank"),
                       absl::StrCat("must be below ", kMaxWorldSize, ", got ", link.peer_rank()));
      }
    }
    if (!v1::TransportKind_IsValid(link.transport())) {
      return Invalid(
          absl::StrCat(field, ".transport"),
          absl::StrCat(static_cast<int>(link.transport()), " is not a known TransportKind"));
    }
    RETURN_IF_ERROR(
        CheckFinite(absl::StrCat(field, ".bytes_per_second"), link.bytes_per_second(), 0));
    RETURN_IF_ERROR(CheckFinite(absl::StrCat(field, ".capacity_bytes_per_second"),
                                link.capacity_bytes_per_second(), 0));
    if (link.latency_ns() > kMaxLatencyNs) {
      return Invalid(
          absl::StrCat(field, ".latency_ns"),
          absl::StrCat("must be at most ", kMaxLatencyNs, " (an hour), got ", link.latency_ns()));
    }
  }
  if (request.layers_size() > kMaxLayers) {
    return Invalid("layers", absl::StrCat(request.layers_size(), " entries; at most ", kMaxLayers,
                                          " allowed"));
  }
  for (int i = 0; i < request.layers_size(); ++i) {
    const v1::LayerTelemetry& layer = request.layers(i);
    const std::string field = absl::StrCat("layers[", i, "]");
    if (layer.index() >= static_cast<uint32_t>(kMaxLayers)) {
      return Invalid(absl::StrCat(field, ".index"),
                     absl::StrCat("must be below ", kMaxLayers, ", got ", layer.index()));
    }
    RETURN_IF_ERROR(CheckLength(absl::StrCat(field, ".name"), layer.name(), kMaxLayerNameBytes));
    RETURN_IF_ERROR(
        CheckFinite(absl::StrCat(field, ".mean_sync_seconds"), layer.mean_sync_seconds(), 0));
    RETURN_IF_ERROR(
        CheckFinite(absl::StrCat(field, ".max_sync_seconds"), layer.max_sync_seconds(), 0));
    RETURN_IF_ERROR(
        CheckFinite(absl::StrCat(field, ".waiting_seconds"), layer.waiting_seconds(), 0));
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::HeartbeatRequest& request) {
  RETURN_IF_ERROR(CheckNodeId(request.header()));
  if (request.role() != v1::NODE_ROLE_SERVER && request.role() != v1::NODE_ROLE_AGENT) {
    return Invalid("role", absl::StrCat("must be NODE_ROLE_SERVER or NODE_ROLE_AGENT, got ",
                                        static_cast<int>(request.role())));
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::DeregisterRequest& request) {
  RETURN_IF_ERROR(CheckNodeId(request.header()));
  return CheckLength("reason", request.reason(), kMaxReasonBytes);
}

absl::Status ValidateRequest(const v1::GetClusterStatusRequest& /*request*/) {
  return absl::OkStatus();
}

absl::Status ValidateRequest(const v1::SetLayerSchemesRequest& request) {
  if (request.header().job_id().empty() || !request.job_id().empty()) {
    if (request.job_id().empty()) {
      return Invalid("job_id",
                     "must name the job when the cluster token is used (empty "
                     "header.job_id)");
    }
    RETURN_IF_ERROR(ValidateId("job_id", request.job_id()));
  }
  if (request.schemes().empty()) {
    return Invalid("schemes", "at least one layer -> scheme entry is required");
  }
  if (request.schemes_size() > kMaxLayers) {
    return Invalid("schemes", absl::StrCat(request.schemes_size(), " entries; at most ", kMaxLayers,
                                           " allowed"));
  }
  // In name order, so the error is the same for the same request.
  const std::map<std::string, int> schemes(request.schemes().begin(), request.schemes().end());
  for (const auto& [name, scheme] : schemes) {
    const std::string field = absl::StrCat("schemes['", name.substr(0, 64), "']");
    if (name.empty()) return Invalid("schemes", "a layer name is empty");
    RETURN_IF_ERROR(CheckLength(field, name, kMaxLayerNameBytes));
    if (!v1::SyncScheme_IsValid(scheme)) {
      return Invalid(field, absl::StrCat(scheme, " is not a known SyncScheme"));
    }
  }
  return CheckLength("reason", request.reason(), kMaxReasonBytes);
}

namespace {

absl::Status CheckStoreCaller(const v1::RequestHeader& header) {
  if (header.job_id().empty()) {
    return Invalid("header.job_id",
                   "must name the job: the store is a job's (send the job's id and token)");
  }
  return CheckNodeId(header);
}

absl::Status CheckStoreKey(absl::string_view field, absl::string_view key) {
  if (key.empty()) return Invalid(field, "must not be empty");
  return CheckLength(field, key, kMaxStoreKeyBytes);
}

}  // namespace

absl::Status ValidateRequest(const v1::StoreSetRequest& request) {
  RETURN_IF_ERROR(CheckStoreCaller(request.header()));
  RETURN_IF_ERROR(CheckStoreKey("key", request.key()));
  return CheckLength("value", request.value(), kMaxStoreValueBytes);
}

absl::Status ValidateRequest(const v1::StoreGetRequest& request) {
  RETURN_IF_ERROR(CheckStoreCaller(request.header()));
  if (request.keys().empty()) return Invalid("keys", "at least one key is required");
  if (static_cast<size_t>(request.keys_size()) > kMaxStoreGetKeys) {
    return Invalid("keys", absl::StrCat(request.keys_size(), " entries; at most ", kMaxStoreGetKeys,
                                        " allowed"));
  }
  for (int i = 0; i < request.keys_size(); ++i) {
    RETURN_IF_ERROR(CheckStoreKey(absl::StrCat("keys[", i, "]"), request.keys(i)));
  }
  return absl::OkStatus();
}

}  // namespace poseidon::coordinator
