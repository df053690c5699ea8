// libFuzzer target: the JSON model spec parser (coordinator/planner/model_spec.h,
// ParseModelSpecJson) on fuzz bytes as the file's text. A spec it accepts must still validate,
// read back the same from its own JSON form (MessageToJsonString), and plan on small clusters of
// every shape (bytes and time rules, every scheme's cost row), as request_fuzzer does for the
// models a RegisterModel carries. A crash, a sanitizer report, or an abort below is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "coordinator/planner/model_spec.h"
#include "coordinator/planner/planner.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/json_util.h"

namespace {

using namespace poseidon;  // NOLINT: a fuzzer's one translation unit

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      std::fprintf(stderr, "model_spec_fuzzer: CHECK failed: %s\n", #cond); \
      std::abort();                                                      \
    }                                                                    \
  } while (0)

// As request_fuzzer's Plan: a model the parser accepted must plan.
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
    if (!plan.ok()) {
      std::fprintf(stderr, "model_spec_fuzzer: an accepted spec does not plan: %s\n",
                   std::string(plan.status().message()).c_str());
      std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Strings that are not UTF-8 fail to parse, each with a log line: silence them.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view json(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<v1::ModelSpec> spec = planner::ParseModelSpecJson(json, "fuzz.json");
  if (!spec.ok()) return 0;
  CHECK(planner::ValidateModelSpec(*spec).ok());
  std::string text;
  CHECK(google::protobuf::util::MessageToJsonString(*spec, &text).ok());
  const absl::StatusOr<v1::ModelSpec> again = planner::ParseModelSpecJson(text, "again.json");
  CHECK(again.ok());
  CHECK(again->SerializeAsString() == spec->SerializeAsString());
  Plan(*spec);
  return 0;
}
