// libFuzzer target: the coordinator's request validation (coordinator/validate.h) on every request
// type, and the planner (every scheme's cost row, partitioning) on the models validation accepts.
// The first byte picks the request type, the rest is its protobuf encoding. A crash, a sanitizer
// report or a planner error on a model that validation accepted (CHECK below) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string_view>

#include "coordinator/planner/model_spec.h"
#include "coordinator/planner/planner.h"
#include "coordinator/validate.h"
#include "google/protobuf/stubs/logging.h"
#include "poseidon/v1/coordinator.pb.h"

namespace {

using namespace poseidon;  // NOLINT: a fuzzer's one translation unit

template <typename Request>
bool Validated(std::string_view body, Request& request) {
  if (!request.ParseFromArray(body.data(), static_cast<int>(body.size()))) return false;
  const bool header = coordinator::ValidateHeader(request.header()).ok();
  return coordinator::ValidateRequest(request).ok() && header;
}

// A model validation accepted must plan on small clusters of every shape (a planner error is a
// finding: the coordinator would have accepted a model it cannot plan).
void Plan(const v1::ModelSpec& model) {
  // Bounded work: at most 2^28 parameters (1 GiB of f32: 256 chunks of 4 MiB a layer at most).
  if (planner::ParameterCount(model) > (uint64_t{1} << 28)) return;
  for (const uint32_t workers : {1u, 2u, 5u}) {
    planner::PlannerConfig config;
    config.workers = workers;
    config.servers = workers == 5 ? 3 : 1;
    config.colocated = workers == 5;
    config.batch_per_worker = 8;
    config.bandwidth_bytes_per_second = 1.25e9;
    config.scheme_rule = workers == 2 ? planner::SchemeRule::kBytes : planner::SchemeRule::kTime;
    config.allreduce_step_seconds = 20e-6;
    const absl::StatusOr<planner::PlanResult> plan = planner::BuildPlan(model, config);
    if (!plan.ok()) std::abort();
  }
}

template <typename Request>
void Check(std::string_view body) {
  Request request;
  Validated(body, request);
}

void CheckModel(std::string_view body) {
  v1::RegisterModelRequest request;
  if (Validated(body, request)) Plan(request.model());
}

// One entry per request type; the input's first byte picks one.
constexpr void (*kChecks[])(std::string_view) = {
    &Check<v1::RegisterServerRequest>,  &Check<v1::RegisterAgentRequest>,
    &Check<v1::RendezvousRequest>,      &CheckModel,
    &Check<v1::GetPlanRequest>,         &Check<v1::ReportTelemetryRequest>,
    &Check<v1::HeartbeatRequest>,       &Check<v1::DeregisterRequest>,
    &Check<v1::GetClusterStatusRequest>, &Check<v1::SetLayerSchemesRequest>,
    &Check<v1::StoreSetRequest>,        &Check<v1::StoreGetRequest>,
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Strings that are not UTF-8 fail to parse, each with a log line: silence them.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  kChecks[data[0] % std::size(kChecks)](body);
  return 0;
}
