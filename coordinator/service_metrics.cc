#include "coordinator/service_metrics.h"

#include "absl/strings/ascii.h"

namespace poseidon::coordinator {
namespace {

namespace v1 = ::poseidon::v1;

std::string Lower(const std::string& name, absl::string_view prefix) {
  absl::string_view text = name;
  if (text.substr(0, prefix.size()) == prefix) text.remove_prefix(prefix.size());
  return absl::AsciiStrToLower(text);
}

}  // namespace

const char* MethodName(Method method) {
  switch (method) {
    case Method::kRegisterServer:
      return "RegisterServer";
    case Method::kRegisterAgent:
      return "RegisterAgent";
    case Method::kRendezvous:
      return "Rendezvous";
    case Method::kRegisterModel:
      return "RegisterModel";
    case Method::kGetPlan:
      return "GetPlan";
    case Method::kReportTelemetry:
      return "ReportTelemetry";
    case Method::kHeartbeat:
      return "Heartbeat";
    case Method::kDeregister:
      return "Deregister";
    case Method::kGetClusterStatus:
      return "GetClusterStatus";
    case Method::kSetLayerSchemes:
      return "SetLayerSchemes";
    case Method::kStoreSet:
      return "StoreSet";
    case Method::kStoreGet:
      return "StoreGet";
  }
  return "unknown";
}

const char* StatusCodeName(grpc::StatusCode code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  const int index = static_cast<int>(code);
  return index >= 0 && index < 17 ? kNames[index] : "UNKNOWN";
}

ServiceMetrics::ServiceMetrics(const MetricsRegistry* registry) : registry_(registry) {}

void ServiceMetrics::CountRpc(Method method, grpc::StatusCode code) {
  if (registry_ == nullptr) return;
  int index = static_cast<int>(code);
  if (index < 0 || index >= 17) index = static_cast<int>(grpc::StatusCode::UNKNOWN);
  prometheus::Counter* counter = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    prometheus::Counter*& slot = rpcs_[static_cast<size_t>(method)][static_cast<size_t>(index)];
    if (slot == nullptr) {
      auto created =
          registry_->GetCounter("poseidon_coordinator_rpcs_total",
                                "Coordinator calls answered, by method and status code",
                                {{"method", MethodName(method)},
                                 {"code", StatusCodeName(static_cast<grpc::StatusCode>(index))}});
      if (!created.ok()) return;
      slot = *created;
    }
    counter = slot;
  }
  counter->Increment();
}

void ServiceMetrics::Update(const Registry& registry, absl::Time now, size_t parked_calls) {
  if (registry_ == nullptr) return;
  for (const Registry::NodeCount& count : registry.CountNodes(now)) {
    auto gauge = registry_->GetGauge(
        "poseidon_coordinator_nodes", "Registered nodes by role and liveness state",
        {{"role", Lower(v1::NodeRole_Name(count.role), "NODE_ROLE_")},
         {"state", Lower(v1::NodeState_Name(count.state), "NODE_STATE_")}});
    if (gauge.ok()) (*gauge)->Set(static_cast<double>(count.count));
  }
  if (auto gauge = registry_->GetGauge("poseidon_coordinator_membership_epoch",
                                       "Membership epoch (increases on every join, leave, death)");
      gauge.ok()) {
    (*gauge)->Set(static_cast<double>(registry.membership_epoch()));
  }
  if (auto gauge =
          registry_->GetGauge("poseidon_coordinator_parked_calls",
                              "Calls waiting (Rendezvous, RegisterModel, GetPlan, StoreGet)");
      gauge.ok()) {
    (*gauge)->Set(static_cast<double>(parked_calls));
  }
  for (const auto& [job, epoch] : registry.PlanEpochs()) {
    prometheus::Gauge*& gauge = plan_epoch_[job];
    if (gauge == nullptr) {
      auto created = registry_->GetGauge("poseidon_coordinator_plan_epoch",
                                         "The newest plan epoch of each job", {{"job", job}});
      if (!created.ok()) continue;
      gauge = *created;
    }
    gauge->Set(static_cast<double>(epoch));
  }
  if (auto counter = registry_->GetCounter("poseidon_coordinator_plans_total",
                                           "Plans installed (first plans and re-plans)");
      counter.ok()) {
    const uint64_t installed = registry.plans_installed();
    (*counter)->Increment(static_cast<double>(installed - plans_reported_));
    plans_reported_ = installed;
  }
}

}  // namespace poseidon::coordinator
