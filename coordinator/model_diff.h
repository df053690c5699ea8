// Compares the model a rank registers with the model its job already has, and describes the first
// difference in one line, so a rank started with the wrong model is told exactly what is wrong.
// Thread-safety: pure functions, safe from any thread.
#pragma once

#include <optional>
#include <string>

#include "poseidon/v1/model.pb.h"

namespace poseidon::coordinator {

// What must agree between the ranks of a job: the number of layers and, per layer, its name,
// kind, shape, element type (unset = f32) and per-worker batch K. Not compared: the model's name
// and description, and the per-layer compute times and FLOPs, which are measurements and hints
// that may legitimately differ between ranks.
//
// nullopt when `candidate` agrees with `reference`; otherwise the first difference, naming the
// layer index and name and both values, e.g.
//   "layer 5 'conv3.weight': shape is [256, 256, 3, 3] here, [256, 128, 3, 3] in the job's model"
//   "layer 37: the job's model has 'fc8.bias' (38 layers), this model ends after 37 layers"
std::optional<std::string> FirstModelDifference(const poseidon::v1::ModelSpec& reference,
                                                const poseidon::v1::ModelSpec& candidate);

// The same for the update rule and consistency model ("update_rule.learning_rate is 0.1 here,
// 0.01 in the job's").
std::optional<std::string> FirstUpdateRuleDifference(const poseidon::v1::UpdateRuleSpec& reference,
                                                     const poseidon::v1::UpdateRuleSpec& candidate);
std::optional<std::string> FirstConsistencyDifference(
    const poseidon::v1::ConsistencySpec& reference, const poseidon::v1::ConsistencySpec& candidate);

}  // namespace poseidon::coordinator
