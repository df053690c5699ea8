// Shared by the multi-process KV tests and their client program: the table spec and the
// deterministic gradients every rank pushes, so a test can compute the expected result.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "poseidon/v1/kv.pb.h"

namespace poseidon::testing {

inline v1::UpdateRule RuleFromName(const std::string& name) {
  if (name == "sgd") return v1::UPDATE_RULE_SGD;
  if (name == "momentum") return v1::UPDATE_RULE_MOMENTUM;
  if (name == "adam") return v1::UPDATE_RULE_ADAM;
  return v1::UPDATE_RULE_SUM;
}

inline v1::RegisterTablesRequest KvSpec(uint32_t workers, const std::string& rule, int keys,
                                        uint64_t elements) {
  v1::RegisterTablesRequest r;
  r.set_num_workers(workers);
  r.set_average_gradients(rule != "sum");
  auto* t = r.add_tables();
  t->set_name("weights");
  auto* u = t->mutable_update_rule();
  u->set_rule(RuleFromName(rule));
  u->set_learning_rate(rule == "adam" ? 0.01 : 0.1);
  u->set_momentum(0.9);
  u->set_weight_decay(0.001);
  if (rule != "sum") t->set_initial_value(v1::INITIAL_VALUE_PUSHED_BY_RANK0);
  for (int k = 0; k < keys; ++k) {
    auto* key = t->add_keys();
    key->set_key(static_cast<uint64_t>(k));
    key->set_elements(elements);
  }
  return r;
}

// Integer-valued (exact sums in float whatever the order), different per rank, clock and key.
inline std::vector<float> KvGrad(uint32_t rank, uint64_t clock, uint64_t key, size_t n) {
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = static_cast<float>(static_cast<int64_t>((rank + 1) * 3 + clock * 5 + key * 7 + i % 13) -
                              40);
  }
  return g;
}

inline std::vector<float> KvInit(uint64_t key, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.001f * static_cast<float>((i + key) % 101);
  return v;
}

}  // namespace poseidon::testing
