// Prometheus metrics of the coordinator service: calls by method and code, nodes by role and
// state, epochs, parked calls, plans. Label sets are bounded (12 x 17, 2 x 4, configured jobs).
// Thread-safety: safe from any thread (CountRpc locks its own cache; metrics are atomic).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/time/time.h"
#include "common/metrics.h"
#include "coordinator/registry.h"
#include "grpcpp/support/status.h"

namespace poseidon::coordinator {

// The rpcs of service Coordinator, for per-method metrics.
enum class Method {
  kRegisterServer,
  kRegisterAgent,
  kRendezvous,
  kRegisterModel,
  kGetPlan,
  kReportTelemetry,
  kHeartbeat,
  kDeregister,
  kGetClusterStatus,
  kSetLayerSchemes,
  kStoreSet,
  kStoreGet,
};
inline constexpr size_t kMethodCount = 12;
const char* MethodName(Method method);
const char* StatusCodeName(grpc::StatusCode code);

class ServiceMetrics {
 public:
  // `registry` may be null: every call is then a no-op. Not owned; must outlive this object.
  explicit ServiceMetrics(const MetricsRegistry* registry);

  // poseidon_coordinator_rpcs_total{method, code}.
  void CountRpc(Method method, grpc::StatusCode code);

  // The gauges, from the registry's state (call under the registry's lock).
  void Update(const Registry& registry, absl::Time now, size_t parked_calls);

 private:
  const MetricsRegistry* registry_;
  std::mutex mu_;  // guards rpcs_
  std::array<std::array<prometheus::Counter*, 17>, kMethodCount> rpcs_{};
  std::map<std::string, prometheus::Gauge*> plan_epoch_;  // only touched by Update
  uint64_t plans_reported_ = 0;
};

}  // namespace poseidon::coordinator
