// The gRPC Coordinator service (coordinator.proto) on gRPC's callback API: validation, tokens, the
// Registry, calls that wait parked without a thread, and a housekeeping thread for liveness.
// Thread-safety: gRPC threads call it; one mutex guards all state (docs/thread_model.md).

// Calls that wait (Rendezvous, RegisterModel, GetPlan with min_plan_epoch, StoreGet) are completed
// when the state they wait for arrives, or, when their bound passes, with a message naming what is
// missing. The mutex is never held while a call is finished.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "coordinator/auth.h"
#include "coordinator/registry.h"
#include "coordinator/service_metrics.h"
#include "poseidon/v1/coordinator.grpc.pb.h"

namespace poseidon::coordinator {

struct CoordinatorServiceOptions {
  RegistryOptions registry;
  // Rendezvous, RegisterModel and StoreGet wait at most this long (and never past the call's
  // deadline; StoreGet never past its timeout_ms either).
  absl::Duration rendezvous_timeout = absl::Minutes(5);
  // GetPlan with min_plan_epoch waits at most this long; then it answers the current plan.
  absl::Duration plan_wait_timeout = absl::Seconds(60);
  // How often the housekeeping thread looks for silent nodes; zero: lease / 10 in [5ms, 1s].
  absl::Duration housekeeping_interval = absl::ZeroDuration();
  // Where to report metrics; null: nowhere. Not owned; must outlive the service.
  const MetricsRegistry* metrics = nullptr;
};

// The monotonic clock the coordinator judges time by (steady_clock as an absl::Time).
absl::Time MonotonicNow();

class CoordinatorService final : public poseidon::v1::Coordinator::CallbackService {
 public:
  CoordinatorService(TokenStore tokens, CoordinatorServiceOptions options);
  // Shuts down. The grpc::Server using this service must have been shut down before.
  ~CoordinatorService() override;
  CoordinatorService(const CoordinatorService&) = delete;
  CoordinatorService& operator=(const CoordinatorService&) = delete;

  // Starts the housekeeping thread.
  void Start();
  // Answers every parked call UNAVAILABLE, refuses new calls, stops the housekeeping thread.
  // Idempotent. Call it before grpc::Server::Shutdown, so that waits on parked calls end at once.
  void Shutdown();

  // Calls parked right now (for tests and metrics).
  size_t parked_calls() const;

  grpc::ServerUnaryReactor* RegisterServer(grpc::CallbackServerContext* context,
                                           const poseidon::v1::RegisterServerRequest* request,
                                           poseidon::v1::RegisterServerResponse* response) override;
  grpc::ServerUnaryReactor* RegisterAgent(grpc::CallbackServerContext* context,
                                          const poseidon::v1::RegisterAgentRequest* request,
                                          poseidon::v1::RegisterAgentResponse* response) override;
  grpc::ServerUnaryReactor* Rendezvous(grpc::CallbackServerContext* context,
                                       const poseidon::v1::RendezvousRequest* request,
                                       poseidon::v1::RendezvousResponse* response) override;
  grpc::ServerUnaryReactor* RegisterModel(grpc::CallbackServerContext* context,
                                          const poseidon::v1::RegisterModelRequest* request,
                                          poseidon::v1::RegisterModelResponse* response) override;
  grpc::ServerUnaryReactor* GetPlan(grpc::CallbackServerContext* context,
                                    const poseidon::v1::GetPlanRequest* request,
                                    poseidon::v1::GetPlanResponse* response) override;
  grpc::ServerUnaryReactor* ReportTelemetry(
      grpc::CallbackServerContext* context, const poseidon::v1::ReportTelemetryRequest* request,
      poseidon::v1::ReportTelemetryResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const poseidon::v1::HeartbeatRequest* request,
                                      poseidon::v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* Deregister(grpc::CallbackServerContext* context,
                                       const poseidon::v1::DeregisterRequest* request,
                                       poseidon::v1::DeregisterResponse* response) override;
  grpc::ServerUnaryReactor* GetClusterStatus(
      grpc::CallbackServerContext* context, const poseidon::v1::GetClusterStatusRequest* request,
      poseidon::v1::GetClusterStatusResponse* response) override;
  grpc::ServerUnaryReactor* SetLayerSchemes(
      grpc::CallbackServerContext* context, const poseidon::v1::SetLayerSchemesRequest* request,
      poseidon::v1::SetLayerSchemesResponse* response) override;
  grpc::ServerUnaryReactor* StoreSet(grpc::CallbackServerContext* context,
                                     const poseidon::v1::StoreSetRequest* request,
                                     poseidon::v1::StoreSetResponse* response) override;
  grpc::ServerUnaryReactor* StoreGet(grpc::CallbackServerContext* context,
                                     const poseidon::v1::StoreGetRequest* request,
                                     poseidon::v1::StoreGetResponse* response) override;

 private:
  class WaitReactor;
  // A parked call. `poll` runs under mu_ whenever the registry changed: true (answer filled) or an
  // error completes the call. `expire` runs at `deadline` and gives the final status.
  struct Waiter {
    Method method = Method::kRendezvous;
    std::string node_id;  // the waiting node, kept alive while it waits; may be empty
    absl::Time deadline;
    absl::AnyInvocable<absl::StatusOr<bool>(absl::Time now)> poll;
    absl::AnyInvocable<absl::Status(absl::Time now)> expire;
    // A short wait (a store poll, under a second: an agent checking for a key now and then)
    // that ends unanswered is no news: logged at debug, not as a warning.
    bool poll_only = false;
  };
  // A call to finish once mu_ is released.
  struct Completion {
    grpc::ServerUnaryReactor* reactor = nullptr;
    Method method = Method::kRendezvous;
    grpc::Status status;
  };

  // Validates the header, authenticates, validates the rest; UNAVAILABLE once shutting down.
  template <typename Request>
  absl::StatusOr<Caller> Admit(const Request& request) const;
  // Runs `body` under mu_ for a call answered at once, then finishes it.
  template <typename Request, typename Body>
  grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, Method method,
                                   const Request& request, Body body);
  // A call that may wait: admit, lock, `prepare` (under mu_; an error answers at once), then
  // `make` fills the waiter's poll and expire, which is polled once and parked until it is
  // answered, fails or reaches min(`bound`, the call's own deadline).
  template <typename Request, typename Prepare, typename Make>
  grpc::ServerUnaryReactor* Park(grpc::CallbackServerContext* context, Method method,
                                 const Request& request, absl::Duration bound, Prepare prepare,
                                 Make make);
  // Polls `waiter` once and parks it when it has to wait (under mu_).
  void StartWaitLocked(WaitReactor* reactor, Waiter waiter, absl::Time now,
                       std::vector<Completion>& done);
  // Completes parked calls whose state arrived (when the registry changed) or whose deadline
  // passed (under mu_).
  void PollWaitersLocked(absl::Time now, std::vector<Completion>& done);
  void ExpireWaitersLocked(absl::Time now, std::vector<Completion>& done);
  void Complete(std::vector<Completion>& done);
  void OnWaitCancelled(WaitReactor* reactor);
  void Housekeep();
  absl::Duration HousekeepingInterval() const;
  // When a parked call must be answered: the configured bound, and a little before the call's
  // own deadline, so the caller gets our message rather than a bare DEADLINE_EXCEEDED.
  static absl::Time WaitDeadline(const grpc::CallbackServerContext& context, absl::Duration bound,
                                 absl::Time now);

  const TokenStore tokens_;
  const CoordinatorServiceOptions options_;
  ServiceMetrics metrics_;

  mutable std::mutex mu_;
  std::condition_variable wake_;                      // the housekeeper's: stop, or a new deadline
  bool stopping_ = false;                             // guarded by mu_
  bool kicked_ = false;                               // guarded by mu_
  Registry registry_;                                 // guarded by mu_
  std::unordered_map<WaitReactor*, Waiter> waiters_;  // guarded by mu_
  uint64_t polled_version_ = 0;                       // guarded by mu_
  std::thread housekeeper_;
};

}  // namespace poseidon::coordinator
