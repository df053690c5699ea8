#include "server/update_rules.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"

namespace poseidon::server {
namespace {

bool Finite(double x) {
  return std::isfinite(x);
}

class Sgd final : public Optimizer {
 public:
  Sgd(const UpdateHyperParams& hp, size_t elements, bool with_momentum)
      : hp_(hp), with_momentum_(with_momentum) {
    if (with_momentum_) buf_.assign(elements, 0.0f);
  }

  // torch.optim.SGD (maximize=False):
  //   g = grad + weight_decay * p
  //   momentum: buf = g on the first step, else buf = momentum * buf + (1 - dampening) * g;
  //             g = g + momentum * buf (nesterov) or g = buf
  //   p = p - lr * g
  void Step(std::span<float> p, std::span<float> g) override {
    const auto wd = static_cast<float>(hp_.weight_decay);
    const auto lr = static_cast<float>(hp_.learning_rate);
    const auto mu = static_cast<float>(hp_.momentum);
    const auto damp = 1.0f - static_cast<float>(hp_.dampening);
    const size_t n = p.size();
    if (wd != 0.0f) {
      for (size_t i = 0; i < n; ++i) g[i] += wd * p[i];
    }
    if (with_momentum_ && mu != 0.0f) {
      if (steps_ == 0) {
        for (size_t i = 0; i < n; ++i) buf_[i] = g[i];
      } else {
        for (size_t i = 0; i < n; ++i) buf_[i] = mu * buf_[i] + damp * g[i];
      }
      if (hp_.nesterov) {
        for (size_t i = 0; i < n; ++i) g[i] += mu * buf_[i];
      } else {
        for (size_t i = 0; i < n; ++i) g[i] = buf_[i];
      }
    }
    for (size_t i = 0; i < n; ++i) p[i] += -lr * g[i];
    ++steps_;
  }

  std::span<float> State(int) override { return buf_; }
  int StateCount() const override { return with_momentum_ ? 1 : 0; }
  uint64_t steps() const override { return steps_; }
  void set_steps(uint64_t s) override { steps_ = s; }

 private:
  UpdateHyperParams hp_;
  bool with_momentum_;
  std::vector<float> buf_;
  uint64_t steps_ = 0;
};

class Adam final : public Optimizer {
 public:
  Adam(const UpdateHyperParams& hp, size_t elements)
      : hp_(hp), m_(elements, 0.0f), v_(elements, 0.0f) {}

  // torch.optim.Adam 1.13 (amsgrad=False, maximize=False), single-tensor path:
  //   g = grad + weight_decay * p
  //   m = m * beta1 + (1 - beta1) * g          (torch 2.x writes exp_avg.lerp_(g, 1 - beta1):
  //                                             the same value up to float rounding)
  //   v = v * beta2 + (1 - beta2) * g * g
  //   bc1 = 1 - beta1^t, bc2 = 1 - beta2^t
  //   denom = sqrt(v) / sqrt(bc2) + eps
  //   p = p - (lr / bc1) * m / denom
  void Step(std::span<float> p, std::span<float> g) override {
    ++steps_;
    const auto wd = static_cast<float>(hp_.weight_decay);
    const auto b1 = static_cast<float>(hp_.beta1);
    const auto b2 = static_cast<float>(hp_.beta2);
    const auto eps = static_cast<float>(hp_.epsilon);
    const double bc1 = 1.0 - std::pow(hp_.beta1, static_cast<double>(steps_));
    const double bc2 = 1.0 - std::pow(hp_.beta2, static_cast<double>(steps_));
    const auto step_size = static_cast<float>(hp_.learning_rate / bc1);
    const auto bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const size_t n = p.size();
    for (size_t i = 0; i < n; ++i) {
      float gi = g[i];
      if (wd != 0.0f) gi += wd * p[i];
      m_[i] = m_[i] * b1 + (1.0f - b1) * gi;
      v_[i] = v_[i] * b2 + (1.0f - b2) * gi * gi;
      const float denom = std::sqrt(v_[i]) / bc2_sqrt + eps;
      p[i] += -step_size * (m_[i] / denom);
    }
  }

  std::span<float> State(int index) override { return index == 0 ? std::span(m_) : std::span(v_); }
  int StateCount() const override { return 2; }
  uint64_t steps() const override { return steps_; }
  void set_steps(uint64_t s) override { steps_ = s; }

 private:
  UpdateHyperParams hp_;
  std::vector<float> m_, v_;
  uint64_t steps_ = 0;
};

}  // namespace

absl::StatusOr<UpdateHyperParams> HyperParamsFromSpec(const v1::UpdateRuleSpec& spec) {
  UpdateHyperParams hp;
  switch (spec.rule()) {
    case v1::UPDATE_RULE_SUM:
      return hp;
    case v1::UPDATE_RULE_SGD:
    case v1::UPDATE_RULE_MOMENTUM:
    case v1::UPDATE_RULE_ADAM:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("update rule ", static_cast<int>(spec.rule()), " is not known"));
  }
  hp.learning_rate = spec.learning_rate();
  hp.momentum = spec.momentum();
  hp.dampening = spec.dampening();
  hp.nesterov = spec.nesterov();
  hp.weight_decay = spec.weight_decay();
  if (spec.rule() == v1::UPDATE_RULE_ADAM) {
    hp.beta1 = spec.beta1() == 0.0 ? 0.9 : spec.beta1();
    hp.beta2 = spec.beta2() == 0.0 ? 0.999 : spec.beta2();
    hp.epsilon = spec.epsilon() == 0.0 ? 1e-8 : spec.epsilon();
  }
  for (double x : {hp.learning_rate, hp.momentum, hp.dampening, hp.weight_decay, hp.beta1, hp.beta2,
                   hp.epsilon}) {
    if (!Finite(x)) return absl::InvalidArgumentError("update rule hyperparameters must be finite");
  }
  if (hp.learning_rate < 0) return absl::InvalidArgumentError("learning_rate must be >= 0");
  if (hp.weight_decay < 0) return absl::InvalidArgumentError("weight_decay must be >= 0");
  if (spec.rule() == v1::UPDATE_RULE_MOMENTUM) {
    if (hp.momentum < 0) return absl::InvalidArgumentError("momentum must be >= 0");
    if (hp.nesterov && (hp.momentum <= 0 || hp.dampening != 0)) {
      return absl::InvalidArgumentError("Nesterov momentum requires momentum > 0 and dampening 0");
    }
  }
  if (spec.rule() == v1::UPDATE_RULE_ADAM) {
    if (hp.beta1 < 0 || hp.beta1 >= 1 || hp.beta2 < 0 || hp.beta2 >= 1) {
      return absl::InvalidArgumentError("Adam betas must be in [0, 1)");
    }
    if (hp.epsilon <= 0) return absl::InvalidArgumentError("Adam epsilon must be > 0");
  }
  return hp;
}

std::unique_ptr<Optimizer> MakeOptimizer(v1::UpdateRule rule, const UpdateHyperParams& hp,
                                         size_t elements) {
  switch (rule) {
    case v1::UPDATE_RULE_SGD:
      return std::make_unique<Sgd>(hp, elements, false);
    case v1::UPDATE_RULE_MOMENTUM:
      return std::make_unique<Sgd>(hp, elements, true);
    case v1::UPDATE_RULE_ADAM:
      return std::make_unique<Adam>(hp, elements);
    default:
      return nullptr;
  }
}

void AddInto(std::span<float> dst, std::span<const float> src) {
  float* __restrict d = dst.data();
  const float* __restrict s = src.data();
  const size_t n = dst.size();

  for (size_t i = 0; i < n; ++i) d[i] += s[i];
}

void Scale(std::span<float> dst, float scale) {
  for (float& x : dst) x *= scale;
}

}  // namespace poseidon::server
