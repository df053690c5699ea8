#include "coordinator/model_diff.h"

#include <algorithm>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace poseidon::coordinator {
namespace {

namespace v1 = ::poseidon::v1;

std::string Shape(const v1::LayerSpec& layer) {
  return absl::StrCat("[", absl::StrJoin(layer.shape(), ", "), "]");
}

v1::ElementType Effective(v1::ElementType type) {
  return type == v1::ELEMENT_TYPE_UNSPECIFIED ? v1::ELEMENT_TYPE_F32 : type;
}

std::string KindName(v1::LayerKind kind) {
  const std::string& name = v1::LayerKind_Name(kind);
  return name.empty() ? absl::StrCat(static_cast<int>(kind)) : name;
}

std::string TypeName(v1::ElementType type) {
  const std::string& name = v1::ElementType_Name(type);
  return name.empty() ? absl::StrCat(static_cast<int>(type)) : name;
}

std::string Differs(int index, const v1::LayerSpec& theirs, absl::string_view what,
                    absl::string_view here, absl::string_view there) {
  return absl::StrCat("layer ", index, " '", theirs.name(), "': ", what, " is ", here, " here, ",
                      there, " in the job's model");
}

template <typename T>
std::string Show(const T& value) {
  if constexpr (std::is_same_v<T, bool>) {
    return value ? "true" : "false";
  } else {
    return absl::StrCat(value);
  }
}

template <typename T>
std::optional<std::string> Field(absl::string_view name, const T& reference, const T& candidate) {
  if (reference == candidate) return std::nullopt;
  return absl::StrCat(name, " is ", Show(candidate), " here, ", Show(reference), " in the job's");
}

}  // namespace

std::optional<std::string> FirstModelDifference(const v1::ModelSpec& reference,
                                                const v1::ModelSpec& candidate) {
  const int common = std::min(reference.layers_size(), candidate.layers_size());
  for (int i = 0; i < common; ++i) {
    const v1::LayerSpec& want = reference.layers(i);
    const v1::LayerSpec& have = candidate.layers(i);
    if (want.name() != have.name()) {
      return absl::StrCat("layer ", i, ": name is '", have.name(), "' here, '", want.name(),
                          "' in the job's model");
    }
    if (want.kind() != have.kind()) {
      return Differs(i, want, "kind", KindName(have.kind()), KindName(want.kind()));
    }
    if (want.shape_size() != have.shape_size() ||
        !std::equal(want.shape().begin(), want.shape().end(), have.shape().begin())) {
      return Differs(i, want, "shape", Shape(have), Shape(want));
    }
    if (Effective(want.element_type()) != Effective(have.element_type())) {
      return Differs(i, want, "element_type", TypeName(Effective(have.element_type())),
                     TypeName(Effective(want.element_type())));
    }
    if (want.batch_per_worker() != have.batch_per_worker()) {
      return Differs(i, want, "batch_per_worker", absl::StrCat(have.batch_per_worker()),
                     absl::StrCat(want.batch_per_worker()));
    }
  }
  if (reference.layers_size() > common) {
    return absl::StrCat("layer ", common, ": the job's model has '",
                        reference.layers(common).name(), "' (", reference.layers_size(),
                        " layers), this model ends after ", candidate.layers_size(), " layers");
  }
  if (candidate.layers_size() > common) {
    return absl::StrCat("layer ", common, ": this model has '", candidate.layers(common).name(),
                        "' (", candidate.layers_size(), " layers), the job's model ends after ",
                        reference.layers_size(), " layers");
  }
  return std::nullopt;
}

std::optional<std::string> FirstUpdateRuleDifference(const v1::UpdateRuleSpec& reference,
                                                     const v1::UpdateRuleSpec& candidate) {
  if (reference.rule() != candidate.rule()) {
    return absl::StrCat("update_rule.rule is ", v1::UpdateRule_Name(candidate.rule()), " here, ",
                        v1::UpdateRule_Name(reference.rule()), " in the job's");
  }
  if (auto d = Field("update_rule.learning_rate", reference.learning_rate(),
                     candidate.learning_rate())) {
    return d;
  }
  if (auto d = Field("update_rule.momentum", reference.momentum(), candidate.momentum())) return d;
  if (auto d = Field("update_rule.beta1", reference.beta1(), candidate.beta1())) return d;
  if (auto d = Field("update_rule.beta2", reference.beta2(), candidate.beta2())) return d;
  if (auto d = Field("update_rule.epsilon", reference.epsilon(), candidate.epsilon())) return d;
  if (auto d =
          Field("update_rule.weight_decay", reference.weight_decay(), candidate.weight_decay())) {
    return d;
  }
  if (auto d = Field("update_rule.nesterov", reference.nesterov(), candidate.nesterov())) return d;
  if (auto d = Field("update_rule.dampening", reference.dampening(), candidate.dampening())) {
    return d;
  }
  return std::nullopt;
}

std::optional<std::string> FirstConsistencyDifference(const v1::ConsistencySpec& reference,
                                                      const v1::ConsistencySpec& candidate) {
  // Unspecified is BSP.
  auto model = [](v1::ConsistencyModel m) {
    return m == v1::CONSISTENCY_MODEL_UNSPECIFIED ? v1::CONSISTENCY_MODEL_BSP : m;
  };
  if (model(reference.model()) != model(candidate.model())) {
    return absl::StrCat("consistency.model is ",
                        v1::ConsistencyModel_Name(model(candidate.model())), " here, ",
                        v1::ConsistencyModel_Name(model(reference.model())), " in the job's");
  }
  return Field("consistency.staleness", reference.staleness(), candidate.staleness());
}

}  // namespace poseidon::coordinator
