// Server-side update rules (DESIGN.md "Processes"): how a KV server turns the aggregated gradient
// of a clock into the value workers pull. Each matches torch.optim's definition step for step
// (docs/server.md lists the formulas and the one difference: state is kept in float32).
// Thread-safety: an UpdateRule object belongs to the one engine worker thread that owns its key.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "poseidon/v1/model.pb.h"

namespace poseidon::server {

struct UpdateHyperParams {
  double learning_rate = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double epsilon = 1e-8;
  double weight_decay = 0.0;
};

// Validates and converts the wire form (ranges, rule known, Nesterov needs momentum > 0 and
// dampening 0, as torch requires).
absl::StatusOr<UpdateHyperParams> HyperParamsFromSpec(const v1::UpdateRuleSpec& spec);

// The per-key optimizer state and step.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // params <- update(params, grad); grad may be modified (weight decay is folded into it).
  virtual void Step(std::span<float> params, std::span<float> grad) = 0;
  // The state tensors (momentum buffer; Adam's m and v) for checkpoints, and the step count.
  virtual std::span<float> State(int index) = 0;
  virtual int StateCount() const = 0;
  virtual uint64_t steps() const = 0;
  virtual void set_steps(uint64_t steps) = 0;
};

// The optimizer for a server-side rule (sgd, momentum, adam) over `elements` parameters;
// nullptr for the sum rule (nothing to apply).
std::unique_ptr<Optimizer> MakeOptimizer(v1::UpdateRule rule, const UpdateHyperParams& hp,
                                         size_t elements);

// dst[i] += src[i] (vectorized). The hot loop of aggregation.
void AddInto(std::span<float> dst, std::span<const float> src);
// dst[i] *= scale.
void Scale(std::span<float> dst, float scale);

}  // namespace poseidon::server
