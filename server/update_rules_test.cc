#include "server/update_rules.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace poseidon::server {
namespace {

// Double-precision references written from torch.optim's documented algorithms.
struct RefState {
  std::vector<double> p, buf, m, v;
  int t = 0;
};

void RefSgd(RefState& s, const std::vector<double>& grad, const UpdateHyperParams& hp,
            bool momentum) {
  for (size_t i = 0; i < s.p.size(); ++i) {
    double g = grad[i] + hp.weight_decay * s.p[i];
    if (momentum && hp.momentum != 0) {
      s.buf[i] = s.t == 0 ? g : hp.momentum * s.buf[i] + (1 - hp.dampening) * g;
      g = hp.nesterov ? g + hp.momentum * s.buf[i] : s.buf[i];
    }
    s.p[i] -= hp.learning_rate * g;
  }
  ++s.t;
}

void RefAdam(RefState& s, const std::vector<double>& grad, const UpdateHyperParams& hp) {
  ++s.t;
  for (size_t i = 0; i < s.p.size(); ++i) {
    const double g = grad[i] + hp.weight_decay * s.p[i];
    s.m[i] = hp.beta1 * s.m[i] + (1 - hp.beta1) * g;
    s.v[i] = hp.beta2 * s.v[i] + (1 - hp.beta2) * g * g;
    const double mhat = s.m[i] / (1 - std::pow(hp.beta1, s.t));
    const double vhat = s.v[i] / (1 - std::pow(hp.beta2, s.t));
    s.p[i] -= hp.learning_rate * mhat / (std::sqrt(vhat) + hp.epsilon);
  }
}

enum class Rule { kSgd, kMomentum, kNesterov, kAdam };

void Check(Rule rule, UpdateHyperParams hp) {
  constexpr size_t kN = 257;
  std::mt19937 rng(5);
  std::normal_distribution<double> normal;
  RefState ref;
  ref.p.resize(kN);
  for (auto& x : ref.p) x = normal(rng);
  ref.buf.assign(kN, 0);
  ref.m.assign(kN, 0);
  ref.v.assign(kN, 0);
  std::vector<float> p(ref.p.begin(), ref.p.end());
  const v1::UpdateRule wire = rule == Rule::kAdam  ? v1::UPDATE_RULE_ADAM
                              : rule == Rule::kSgd ? v1::UPDATE_RULE_SGD
                                                   : v1::UPDATE_RULE_MOMENTUM;
  if (rule == Rule::kNesterov) hp.nesterov = true;
  auto opt = MakeOptimizer(wire, hp, kN);
  ASSERT_NE(opt, nullptr);
  for (int step = 0; step < 20; ++step) {
    std::vector<double> grad(kN);
    for (auto& g : grad) g = normal(rng);
    std::vector<float> g32(grad.begin(), grad.end());
    // The reference sees the same float-rounded gradient the server gets.
    for (size_t i = 0; i < kN; ++i) grad[i] = g32[i];
    opt->Step(p, g32);
    if (rule == Rule::kAdam) {
      RefAdam(ref, grad, hp);
    } else {
      RefSgd(ref, grad, hp, rule != Rule::kSgd);
    }
  }
  double worst = 0;
  for (size_t i = 0; i < kN; ++i) {
    worst = std::max(worst, std::abs(p[i] - ref.p[i]) / std::max(1.0, std::abs(ref.p[i])));
  }
  EXPECT_LT(worst, 2e-5) << "float32 server state against the float64 reference";
  EXPECT_EQ(opt->steps(), 20u);
}

TEST(UpdateRulesTest, SgdMatchesTheReference) {
  Check(Rule::kSgd, {.learning_rate = 0.1, .weight_decay = 0.01});
}
TEST(UpdateRulesTest, MomentumMatchesTheReference) {
  Check(Rule::kMomentum,
        {.learning_rate = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.001});
}
TEST(UpdateRulesTest, NesterovMatchesTheReference) {
  Check(Rule::kNesterov, {.learning_rate = 0.05, .momentum = 0.9, .weight_decay = 0.001});
}
TEST(UpdateRulesTest, AdamMatchesTheReference) {
  Check(
      Rule::kAdam,
      {.learning_rate = 0.01, .beta1 = 0.9, .beta2 = 0.999, .epsilon = 1e-8, .weight_decay = 0.01});
}

TEST(UpdateRulesTest, BadHyperParametersAreRefused) {
  v1::UpdateRuleSpec spec;
  spec.set_rule(v1::UPDATE_RULE_MOMENTUM);
  spec.set_learning_rate(0.1);
  spec.set_nesterov(true);
  EXPECT_FALSE(HyperParamsFromSpec(spec).ok()) << "Nesterov without momentum";
  spec.set_momentum(0.9);
  EXPECT_TRUE(HyperParamsFromSpec(spec).ok());
  spec.set_learning_rate(-1);
  EXPECT_FALSE(HyperParamsFromSpec(spec).ok());
  spec.set_learning_rate(NAN);
  EXPECT_FALSE(HyperParamsFromSpec(spec).ok());
  v1::UpdateRuleSpec adam;
  adam.set_rule(v1::UPDATE_RULE_ADAM);
  adam.set_beta1(1.0);
  EXPECT_FALSE(HyperParamsFromSpec(adam).ok());
  v1::UpdateRuleSpec unknown;
  unknown.set_rule(static_cast<v1::UpdateRule>(99));
  EXPECT_FALSE(HyperParamsFromSpec(unknown).ok());
}

TEST(UpdateRulesTest, AddIntoSumsExactly) {
  std::vector<float> a(1000), b(1000);
  for (int i = 0; i < 1000; ++i) {
    a[i] = static_cast<float>(i);
    b[i] = static_cast<float>(2 * i);
  }
  AddInto(a, b);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(a[i], static_cast<float>(3 * i));
}

}  // namespace
}  // namespace poseidon::server
