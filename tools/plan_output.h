// Renders the result of the HybComm planner for `poseidon plan`: a table for people and JSON for
// programs, with the same content (per-layer bytes and time under PS and SFB, totals, speed-up).
// Thread-safety: pure functions, safe from any thread.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "coordinator/planner/planner.h"
#include "poseidon/v1/model.pb.h"

namespace poseidon::tools {

// The per-layer table and the totals, ready to print (ends with a newline).
std::string FormatPlanTable(const poseidon::v1::ModelSpec& model,
                            const planner::PlannerConfig& config,
                            const planner::PlanResult& result);

// One JSON object: "model", "cluster", "layers", "totals" and "plan" (the poseidon.v1.Plan in
// protobuf's JSON mapping). docs/planner.md lists the fields.
absl::StatusOr<std::string> FormatPlanJson(const poseidon::v1::ModelSpec& model,
                                           const planner::PlannerConfig& config,
                                           const planner::PlanResult& result);

}  // namespace poseidon::tools
