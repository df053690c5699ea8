#include "coordinator/model_diff.h"

#include "coordinator/test_util.h"

namespace poseidon::coordinator::testing {
namespace {

using ::testing::Optional;

TEST(ModelDiffTest, EqualModelsAgreeIgnoringNamesAndMeasurements) {
  v1::ModelSpec a = TinyModel();
  v1::ModelSpec b = TinyModel();
  b.set_name("renamed");
  b.set_description("elsewhere");
  b.mutable_layers(0)->set_forward_time_ns(123);
  b.mutable_layers(2)->set_forward_flops(99);
  b.mutable_layers(1)->set_element_type(v1::ELEMENT_TYPE_UNSPECIFIED);  // = f32
  EXPECT_EQ(FirstModelDifference(a, b), std::nullopt);
}

TEST(ModelDiffTest, NamesTheFirstDifferingLayerAndWhatDiffers) {
  const v1::ModelSpec job = TinyModel(32);
  v1::ModelSpec other = TinyModel(64);
  other.mutable_layers(3)->set_name("renamed.bias");  // a later difference is not reported
  EXPECT_THAT(FirstModelDifference(job, other),
              Optional(std::string("layer 2 'fc.weight': shape is [10, 64] here, [10, 32] in "
                                   "the job's model")));

  other = TinyModel();
  other.mutable_layers(1)->set_name("conv.b");
  EXPECT_THAT(FirstModelDifference(job, other),
              Optional(std::string("layer 1: name is 'conv.b' here, 'conv.bias' in the job's "
                                   "model")));

  other = TinyModel();
  other.mutable_layers(0)->set_kind(v1::LAYER_KIND_OTHER);
  EXPECT_THAT(FirstModelDifference(job, other),
              Optional(std::string("layer 0 'conv.weight': kind is LAYER_KIND_OTHER here, "
                                   "LAYER_KIND_CONV in the job's model")));

  other = TinyModel();
  other.mutable_layers(3)->set_element_type(v1::ELEMENT_TYPE_F16);
  EXPECT_THAT(FirstModelDifference(job, other),
              Optional(std::string("layer 3 'fc.bias': element_type is ELEMENT_TYPE_F16 here, "
                                   "ELEMENT_TYPE_F32 in the job's model")));

  other = TinyModel();
  other.mutable_layers(2)->set_batch_per_worker(64);
  EXPECT_THAT(FirstModelDifference(job, other),
              Optional(std::string("layer 2 'fc.weight': batch_per_worker is 64 here, 32 in the "
                                   "job's model")));
}

TEST(ModelDiffTest, DifferentLayerCountsNameTheFirstMissingLayer) {
  const v1::ModelSpec job = TinyModel();
  v1::ModelSpec shorter = TinyModel();
  shorter.mutable_layers()->RemoveLast();
  EXPECT_THAT(FirstModelDifference(job, shorter),
              Optional(std::string("layer 3: the job's model has 'fc.bias' (4 layers), this "
                                   "model ends after 3 layers")));
  EXPECT_THAT(FirstModelDifference(shorter, job),
              Optional(std::string("layer 3: this model has 'fc.bias' (4 layers), the job's "
                                   "model ends after 3 layers")));
}

TEST(ModelDiffTest, UpdateRuleAndConsistency) {
  v1::UpdateRuleSpec a;
  a.set_rule(v1::UPDATE_RULE_MOMENTUM);
  a.set_learning_rate(0.01);
  v1::UpdateRuleSpec b = a;
  EXPECT_EQ(FirstUpdateRuleDifference(a, b), std::nullopt);
  b.set_learning_rate(0.1);
  EXPECT_THAT(FirstUpdateRuleDifference(a, b),
              Optional(std::string("update_rule.learning_rate is 0.1 here, 0.01 in the job's")));
  b = a;
  b.set_nesterov(true);
  EXPECT_THAT(FirstUpdateRuleDifference(a, b),
              Optional(std::string("update_rule.nesterov is true here, false in the job's")));

  v1::ConsistencySpec bsp;
  v1::ConsistencySpec explicit_bsp;
  explicit_bsp.set_model(v1::CONSISTENCY_MODEL_BSP);
  EXPECT_EQ(FirstConsistencyDifference(bsp, explicit_bsp), std::nullopt);
  v1::ConsistencySpec ssp;
  ssp.set_model(v1::CONSISTENCY_MODEL_SSP);
  EXPECT_THAT(FirstConsistencyDifference(bsp, ssp),
              Optional(std::string("consistency.model is CONSISTENCY_MODEL_SSP here, "
                                   "CONSISTENCY_MODEL_BSP in the job's")));
}

}  // namespace
}  // namespace poseidon::coordinator::testing
