#include "coordinator/service.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/grpc_status.h"
#include "coordinator/validate.h"

namespace poseidon::coordinator {
namespace {

namespace v1 = ::poseidon::v1;

// A random tag for this coordinator run's node ids, so ids from a previous run never collide.
std::string NewIncarnation() {
  std::random_device random;
  return absl::StrFormat("%08x", static_cast<uint32_t>(random()));
}

std::string Waited(absl::Duration d) {
  return absl::FormatDuration(absl::Trunc(d, absl::Milliseconds(1)));
}

// Runs `body`, turning an escaping exception (a bug, or std::bad_alloc) into INTERNAL.
template <typename Body>
absl::Status Guarded(Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    PSD_LOG_ERROR("coordinator call failed with an exception: {}", e.what());
    return absl::InternalError(absl::StrCat("internal error: ", e.what()));
  } catch (...) {
    PSD_LOG_ERROR("coordinator call failed with an unknown exception");
    return absl::InternalError("internal error");
  }
}

}  // namespace

absl::Time MonotonicNow() {
  return absl::UnixEpoch() + absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
}

// A parked call's reactor. gRPC calls OnCancel (client gone, deadline passed, server shutting
// down) only after the handler returned, and OnDone last, after Finish; it deletes itself there.
class CoordinatorService::WaitReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit WaitReactor(CoordinatorService* service) : service_(service) {}
  void OnCancel() override { service_->OnWaitCancelled(this); }
  void OnDone() override { delete this; }

 private:
  CoordinatorService* const service_;
};

CoordinatorService::CoordinatorService(TokenStore tokens, CoordinatorServiceOptions options)
    : tokens_(std::move(tokens)),
      options_(std::move(options)),
      metrics_(options_.metrics),
      registry_(options_.registry, NewIncarnation()) {}

CoordinatorService::~CoordinatorService() {
  Shutdown();
}

void CoordinatorService::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (housekeeper_.joinable() || stopping_) return;
  housekeeper_ = std::thread([this] { Housekeep(); });
}

void CoordinatorService::Shutdown() {
  std::vector<Completion> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    const absl::Time now = MonotonicNow();
    for (auto& [reactor, waiter] : waiters_) {
      registry_.EndWait(waiter.node_id, now);
      done.push_back(Completion{
          reactor, waiter.method,
          grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down")});
    }
    waiters_.clear();
  }
  wake_.notify_all();
  Complete(done);
  if (housekeeper_.joinable() && housekeeper_.get_id() != std::this_thread::get_id()) {
    housekeeper_.join();
  }
}

size_t CoordinatorService::parked_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiters_.size();
}

absl::Duration CoordinatorService::HousekeepingInterval() const {
  if (options_.housekeeping_interval > absl::ZeroDuration()) return options_.housekeeping_interval;
  return std::clamp(options_.registry.lease / 10, absl::Milliseconds(5), absl::Seconds(1));
}

absl::Time CoordinatorService::WaitDeadline(const grpc::CallbackServerContext& context,
                                            absl::Duration bound, absl::Time now) {
  absl::Duration left = bound;
  const std::chrono::system_clock::time_point deadline = context.deadline();
  const std::chrono::system_clock::time_point wall = std::chrono::system_clock::now();
  if (deadline < wall + absl::ToChronoSeconds(bound + absl::Seconds(1))) {
    const absl::Duration remaining = absl::FromChrono(deadline - wall);
    const absl::Duration margin = std::min(absl::Milliseconds(200), remaining / 5);
    left = std::min(left, remaining - margin);
  }
  return now + std::max(left, absl::ZeroDuration());
}

template <typename Request>
absl::StatusOr<Caller> CoordinatorService::Admit(const Request& request) const {
  RETURN_IF_ERROR(ValidateHeader(request.header()));
  RETURN_IF_ERROR(tokens_.Check(request.header().job_id(), request.header().token()));
  RETURN_IF_ERROR(ValidateRequest(request));
  return Caller{request.header().job_id()};
}

template <typename Request, typename Body>
grpc::ServerUnaryReactor* CoordinatorService::Answer(grpc::CallbackServerContext* context,
                                                     Method method, const Request& request,
                                                     Body body) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  std::vector<Completion> done;
  const absl::Status status = Guarded([&]() -> absl::Status {
    ASSIGN_OR_RETURN(const Caller caller, Admit(request));
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
    const absl::Time now = MonotonicNow();
    const absl::Status result = body(caller, now);
    PollWaitersLocked(now, done);
    return result;
  });
  Complete(done);
  const grpc::Status answer = ToGrpcStatus(status);
  metrics_.CountRpc(method, answer.error_code());
  reactor->Finish(answer);
  return reactor;
}

void CoordinatorService::StartWaitLocked(WaitReactor* reactor, Waiter waiter, absl::Time now,
                                         std::vector<Completion>& done) {
  if (stopping_) {
    done.push_back(Completion{
        reactor, waiter.method,
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down")});
    return;
  }
  const absl::StatusOr<bool> ready = waiter.poll(now);
  if (!ready.ok() || *ready) {
    done.push_back(Completion{reactor, waiter.method, ToGrpcStatus(ready.status())});
    return;
  }
  if (waiter.deadline <= now) {
    done.push_back(Completion{reactor, waiter.method, ToGrpcStatus(waiter.expire(now))});
    return;
  }
  registry_.BeginWait(waiter.node_id, now);
  waiters_.emplace(reactor, std::move(waiter));
  kicked_ = true;
  wake_.notify_one();
}

void CoordinatorService::PollWaitersLocked(absl::Time now, std::vector<Completion>& done) {
  if (registry_.version() == polled_version_) return;
  polled_version_ = registry_.version();
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    Waiter& waiter = it->second;
    absl::StatusOr<bool> ready = false;
    const absl::Status guard = Guarded([&] {
      ready = waiter.poll(now);
      return absl::OkStatus();
    });
    if (!guard.ok()) ready = guard;
    if (ready.ok() && !*ready) {
      ++it;
      continue;
    }
    registry_.EndWait(waiter.node_id, now);
    done.push_back(Completion{it->first, waiter.method, ToGrpcStatus(ready.status())});
    it = waiters_.erase(it);
  }
}

void CoordinatorService::ExpireWaitersLocked(absl::Time now, std::vector<Completion>& done) {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    Waiter& waiter = it->second;
    if (waiter.deadline > now) {
      ++it;
      continue;
    }
    const absl::Status status = Guarded([&] { return waiter.expire(now); });
    if (!status.ok() && waiter.method != Method::kGetPlan && !waiter.poll_only) {
      PSD_LOG_WARN("{} of node {}: {}", MethodName(waiter.method), waiter.node_id,
                   status.message());
    } else if (!status.ok() && waiter.poll_only) {
      PSD_LOG_DEBUG("{} of node {}: {}", MethodName(waiter.method), waiter.node_id,
                    status.message());
    }
    registry_.EndWait(waiter.node_id, now);
    done.push_back(Completion{it->first, waiter.method, ToGrpcStatus(status)});
    it = waiters_.erase(it);
  }
}

void CoordinatorService::Complete(std::vector<Completion>& done) {
  for (Completion& completion : done) {
    metrics_.CountRpc(completion.method, completion.status.error_code());
    completion.reactor->Finish(completion.status);
  }
  done.clear();
}

void CoordinatorService::OnWaitCancelled(WaitReactor* reactor) {
  std::vector<Completion> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = waiters_.find(reactor);
    if (it == waiters_.end()) return;  // already answered
    registry_.EndWait(it->second.node_id, MonotonicNow());
    done.push_back(Completion{reactor, it->second.method,
                              grpc::Status(grpc::StatusCode::CANCELLED,
                                           "the call was cancelled or its deadline passed")});
    waiters_.erase(it);
  }
  Complete(done);
}

void CoordinatorService::Housekeep() {
  const absl::Duration interval = HousekeepingInterval();
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    kicked_ = false;
    std::vector<Completion> done;
    const absl::Time now = MonotonicNow();
    registry_.Expire(now);
    registry_.ReplanDue(now);  // re-plans replan_min_interval held back
    PollWaitersLocked(now, done);
    ExpireWaitersLocked(now, done);
    metrics_.Update(registry_, now, waiters_.size());
    absl::Time wake = now + interval;
    for (const auto& [reactor, waiter] : waiters_) wake = std::min(wake, waiter.deadline);
    if (!done.empty()) {
      lock.unlock();
      Complete(done);
      lock.lock();
    }
    const absl::Duration sleep = std::max(wake - MonotonicNow(), absl::ZeroDuration());
    wake_.wait_for(lock, absl::ToChronoNanoseconds(sleep), [this] { return stopping_ || kicked_; });
  }
}

// ---- Calls answered at once
// ----------------------------------------------------------------------

grpc::ServerUnaryReactor* CoordinatorService::RegisterServer(
    grpc::CallbackServerContext* context, const v1::RegisterServerRequest* request,
    v1::RegisterServerResponse* response) {
  return Answer(context, Method::kRegisterServer, *request,
                [&](const Caller& caller, absl::Time now) {
                  return registry_.RegisterServer(caller, *request, now, response);
                });
}

grpc::ServerUnaryReactor* CoordinatorService::RegisterAgent(grpc::CallbackServerContext* context,
                                                            const v1::RegisterAgentRequest* request,
                                                            v1::RegisterAgentResponse* response) {
  return Answer(context, Method::kRegisterAgent, *request,
                [&](const Caller& caller, absl::Time now) {
                  return registry_.RegisterAgent(caller, *request, now, response);
                });
}

grpc::ServerUnaryReactor* CoordinatorService::ReportTelemetry(
    grpc::CallbackServerContext* context, const v1::ReportTelemetryRequest* request,
    v1::ReportTelemetryResponse* response) {
  return Answer(context, Method::kReportTelemetry, *request,
                [&](const Caller& caller, absl::Time now) {
                  RETURN_IF_ERROR(registry_.ReportTelemetry(caller, *request, now));
                  registry_.FillHeader(caller.job_id, response->mutable_header());
                  return absl::OkStatus();
                });
}

grpc::ServerUnaryReactor* CoordinatorService::Heartbeat(grpc::CallbackServerContext* context,
                                                        const v1::HeartbeatRequest* request,
                                                        v1::HeartbeatResponse* response) {
  return Answer(context, Method::kHeartbeat, *request, [&](const Caller& caller, absl::Time now) {
    return registry_.Heartbeat(caller, *request, now, response);
  });
}

grpc::ServerUnaryReactor* CoordinatorService::Deregister(grpc::CallbackServerContext* context,
                                                         const v1::DeregisterRequest* request,
                                                         v1::DeregisterResponse* response) {
  return Answer(context, Method::kDeregister, *request, [&](const Caller& caller, absl::Time now) {
    RETURN_IF_ERROR(registry_.Deregister(caller, *request, now));
    registry_.FillHeader(caller.job_id, response->mutable_header());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CoordinatorService::GetClusterStatus(
    grpc::CallbackServerContext* context, const v1::GetClusterStatusRequest* request,
    v1::GetClusterStatusResponse* response) {
  return Answer(context, Method::kGetClusterStatus, *request,
                [&](const Caller& caller, absl::Time now) {
                  return registry_.ClusterStatus(caller, now, response);
                });
}

grpc::ServerUnaryReactor* CoordinatorService::SetLayerSchemes(
    grpc::CallbackServerContext* context, const v1::SetLayerSchemesRequest* request,
    v1::SetLayerSchemesResponse* response) {
  return Answer(context, Method::kSetLayerSchemes, *request,
                [&](const Caller& caller, absl::Time now) {
                  return registry_.SetLayerSchemes(caller, *request, now, response);
                });
}

grpc::ServerUnaryReactor* CoordinatorService::StoreSet(grpc::CallbackServerContext* context,
                                                       const v1::StoreSetRequest* request,
                                                       v1::StoreSetResponse* response) {
  // Answer polls the parked calls afterwards: a StoreGet waiting for this key completes now.
  return Answer(context, Method::kStoreSet, *request, [&](const Caller& caller, absl::Time now) {
    RETURN_IF_ERROR(registry_.StoreSet(caller, *request, now));
    registry_.FillHeader(caller.job_id, response->mutable_header());
    return absl::OkStatus();
  });
}

// ---- Calls that may wait ---------------------------------------------------------------------

template <typename Request, typename Prepare, typename Make>
grpc::ServerUnaryReactor* CoordinatorService::Park(grpc::CallbackServerContext* context,
                                                   Method method, const Request& request,
                                                   absl::Duration bound, Prepare prepare,
                                                   Make make) {
  auto* reactor = new WaitReactor(this);
  std::vector<Completion> done;
  const absl::Status admitted = Guarded([&]() -> absl::Status {
    ASSIGN_OR_RETURN(const Caller caller, Admit(request));
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
    const absl::Time now = MonotonicNow();
    RETURN_IF_ERROR(prepare(caller, now, done));
    Waiter waiter;
    waiter.method = method;
    waiter.node_id = request.header().node_id();
    waiter.deadline = WaitDeadline(*context, bound, now);
    make(caller, waiter.node_id, now, waiter);
    StartWaitLocked(reactor, std::move(waiter), now, done);
    return absl::OkStatus();
  });
  if (!admitted.ok()) done.push_back(Completion{reactor, method, ToGrpcStatus(admitted)});
  Complete(done);
  return reactor;
}

namespace {
// For calls that only wait (nothing to register first).
constexpr auto kNothingFirst = [](const Caller&, absl::Time, auto&) { return absl::OkStatus(); };
}  // namespace

grpc::ServerUnaryReactor* CoordinatorService::Rendezvous(grpc::CallbackServerContext* context,
                                                         const v1::RendezvousRequest* request,
                                                         v1::RendezvousResponse* response) {
  return Park(
      context, Method::kRendezvous, *request, options_.rendezvous_timeout, kNothingFirst,
      [this, response](const Caller& caller, const std::string& node_id, absl::Time now,
                       Waiter& waiter) {
        waiter.poll = [this, caller, node_id, response](absl::Time at) {
          return registry_.TryRendezvous(caller, node_id, at, response);
        };
        waiter.expire = [this, caller, started = now](absl::Time at) {
          return absl::DeadlineExceededError(absl::StrCat(
              "rendezvous of job '", caller.job_id, "' incomplete after ", Waited(at - started),
              ": ", registry_.DescribeIncompleteWorld(caller.job_id, at)));
        };
      });
}

grpc::ServerUnaryReactor* CoordinatorService::RegisterModel(grpc::CallbackServerContext* context,
                                                            const v1::RegisterModelRequest* request,
                                                            v1::RegisterModelResponse* response) {
  return Park(
      context, Method::kRegisterModel, *request, options_.rendezvous_timeout,
      [this, request](const Caller& caller, absl::Time now, std::vector<Completion>& done) {
        const absl::Status registered = registry_.RegisterModel(caller, *request, now);
        PollWaitersLocked(now, done);  // other ranks may have waited for this one
        return registered;
      },
      [this, request, response](const Caller& caller, const std::string& node_id,
                                absl::Time now, Waiter& waiter) {
        // A running job's agent after a restart (running_plan) is answered at once: it runs its
        // plan already, and waits for the next epoch as before.
        const bool running = request->has_running_plan();
        waiter.poll = [this, caller, node_id, response,
                       running](absl::Time at) -> absl::StatusOr<bool> {
          ASSIGN_OR_RETURN(const bool ready,
                           registry_.TryModelPlan(caller, node_id, at, response->mutable_plan()));
          if (ready || running) registry_.FillHeader(caller.job_id, response->mutable_header());
          return ready || running;
        };
        waiter.expire = [this, caller, started = now](absl::Time at) {
          return absl::DeadlineExceededError(
              absl::StrCat("job '", caller.job_id, "' has no plan after ", Waited(at - started),
                           ": ", registry_.DescribeMissingPlan(caller.job_id, at)));
        };
      });
}

grpc::ServerUnaryReactor* CoordinatorService::GetPlan(grpc::CallbackServerContext* context,
                                                      const v1::GetPlanRequest* request,
                                                      v1::GetPlanResponse* response) {
  std::optional<uint64_t> min_epoch;
  if (request->has_min_plan_epoch()) min_epoch = request->min_plan_epoch();
  return Park(
      context, Method::kGetPlan, *request, options_.plan_wait_timeout, kNothingFirst,
      [this, response, min_epoch](const Caller& caller, const std::string& node_id, absl::Time now,
                                  Waiter& waiter) {
        waiter.poll = [this, caller, node_id, min_epoch,
                       response](absl::Time at) -> absl::StatusOr<bool> {
          ASSIGN_OR_RETURN(const bool ready, registry_.TryGetPlan(caller, node_id, min_epoch, at,
                                                                  response->mutable_plan()));
          if (ready) registry_.FillHeader(caller.job_id, response->mutable_header());
          return ready;
        };
        // A long poll that sees no newer plan in time answers the current one, if there is one.
        waiter.expire = [this, caller, response, started = now](absl::Time at) -> absl::Status {
          if (const v1::Plan* plan = registry_.CurrentPlan(caller.job_id)) {
            *response->mutable_plan() = *plan;
            registry_.FillHeader(caller.job_id, response->mutable_header());
            return absl::OkStatus();
          }
          return absl::DeadlineExceededError(
              absl::StrCat("job '", caller.job_id, "' has no plan after ", Waited(at - started),
                           ": ", registry_.DescribeMissingPlan(caller.job_id, at)));
        };
      });
}

// A server-side wait: the call is parked (no thread waits) and polled whenever the registry
// changes, so a StoreSet of the last missing key answers it at once. It waits at most timeout_ms,
// rendezvous_timeout and until a little before the call's deadline; then DEADLINE_EXCEEDED names
// the keys still missing. The request and response outlive the parked call (gRPC keeps them until
// the reactor is done).
grpc::ServerUnaryReactor* CoordinatorService::StoreGet(grpc::CallbackServerContext* context,
                                                       const v1::StoreGetRequest* request,
                                                       v1::StoreGetResponse* response) {
  constexpr uint64_t kMaxTimeoutMs = uint64_t{24} * 3600 * 1000;  // absl::Milliseconds' int64
  const absl::Duration wait = std::min(
      options_.rendezvous_timeout,
      absl::Milliseconds(static_cast<int64_t>(std::min(request->timeout_ms(), kMaxTimeoutMs))));
  return Park(context, Method::kStoreGet, *request, wait, kNothingFirst,
              [this, request, response, wait](const Caller& caller,
                                              const std::string& /*node_id*/, absl::Time now,
                                              Waiter& waiter) {
                waiter.poll_only = wait < absl::Seconds(1);
                waiter.poll = [this, caller, request, response](absl::Time at) {
                  return registry_.TryStoreGet(caller, *request, at, response);
                };
                waiter.expire = [this, caller, request, started = now](absl::Time at) {
                  return absl::DeadlineExceededError(absl::StrCat(
                      "StoreGet of job '", caller.job_id, "': after ", Waited(at - started), ", ",
                      registry_.DescribeMissingKeys(caller.job_id, request->keys())));
                };
              });
}

}  // namespace poseidon::coordinator
