#include "coordinator/planner/model_spec.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

#include "gtest/gtest.h"

namespace poseidon::planner {
namespace {

using poseidon::v1::LayerSpec;
using poseidon::v1::ModelSpec;

// Exact parameter counts of the architecture variants the specs follow (generate.py), as the
// reference implementations report them, so the tolerance is zero:
//   alexnet       60,965,224  Caffe bvlc_alexnet (two-group conv2/4/5)         "61M"
//   vgg16        138,357,544  torchvision vgg16 / Caffe VGG_ILSVRC_16           "138M"
//   vgg19        143,667,240  torchvision vgg19 / Caffe VGG_ILSVRC_19           "144M"
//   vgg19-22k    229,052,817  vgg19 + (21841 − 1000) × (4096 + 1) for fc8
//   googlenet      6,998,552  Caffe bvlc_googlenet without the two aux heads   "6.8M" quoted
//                             for torchvision's BN variant; ~7.0M with biases
//   inception-v3  23,834,568  torchvision inception_v3 (27,161,264) minus AuxLogits (3,326,696)
//   resnet-50     25,557,032  torchvision resnet50                             "25.6M"
//   resnet-152    60,192,808  torchvision resnet152                            "60.2M"
const std::map<std::string, uint64_t>& ExpectedParameters() {
  static const auto* expected = new std::map<std::string, uint64_t>{
      {"alexnet", 60965224},    {"vgg16", 138357544},     {"vgg19", 143667240},
      {"vgg19-22k", 229052817}, {"googlenet", 6998552},   {"inception-v3", 23834568},
      {"resnet-50", 25557032},  {"resnet-152", 60192808},
  };
  return *expected;
}

const LayerSpec* FindLayer(const ModelSpec& model, const std::string& name) {
  for (const LayerSpec& layer : model.layers()) {
    if (layer.name() == name) return &layer;
  }
  return nullptr;
}

TEST(ModelSpecTest, EveryBuiltinLoadsWithItsPublishedParameterCount) {
  std::vector<std::string> names;
  for (const auto& [name, count] : ExpectedParameters()) names.push_back(name);
  std::vector<std::string> builtin = BuiltinModelNames();
  std::sort(builtin.begin(), builtin.end());
  EXPECT_EQ(builtin, names);
  for (const auto& [name, count] : ExpectedParameters()) {
    const absl::StatusOr<ModelSpec> model = LoadBuiltinModel(name);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(model->name(), name);
    EXPECT_FALSE(model->description().empty());
    EXPECT_EQ(ParameterCount(*model), count) << name;
    for (const LayerSpec& layer : model->layers()) {
      // FLOPs everywhere, backward = 2 × forward, f32.
      ASSERT_TRUE(layer.has_forward_flops() && layer.has_backward_flops()) << layer.name();
      EXPECT_GT(layer.forward_flops(), 0u) << layer.name();
      EXPECT_EQ(layer.backward_flops(), 2 * layer.forward_flops()) << layer.name();
      EXPECT_EQ(layer.element_type(), poseidon::v1::ELEMENT_TYPE_F32);
      if (layer.kind() == poseidon::v1::LAYER_KIND_CONV) {
        EXPECT_EQ(layer.shape_size(), 4);
      }
      if (layer.kind() == poseidon::v1::LAYER_KIND_FC) {
        EXPECT_EQ(layer.shape_size(), 2);
      }
    }
  }
}

TEST(ModelSpecTest, BuiltinShapesAndFlops) {
  const absl::StatusOr<ModelSpec> vgg = LoadBuiltinModel("vgg19-22k");
  ASSERT_TRUE(vgg.ok());
  ASSERT_NE(FindLayer(*vgg, "fc6.weight"), nullptr);
  EXPECT_EQ(FindLayer(*vgg, "fc6.weight")->shape(1), 25088u);  // 512 × 7 × 7
  EXPECT_EQ(FindLayer(*vgg, "fc8.weight")->shape(0), 21841u);
  EXPECT_EQ(FindLayer(*vgg, "fc8.bias")->kind(), poseidon::v1::LAYER_KIND_BIAS);
  // conv1_1 at 224×224: 2 × 64 × 3 × 3 × 3 × 224 × 224 FLOPs per sample.
  EXPECT_EQ(FindLayer(*vgg, "conv1_1.weight")->forward_flops(), 2ull * 64 * 27 * 224 * 224);
  EXPECT_EQ(FindLayer(*vgg, "fc7.weight")->forward_flops(), 2ull * 4096 * 4096);

  // VGG16: 15.47 G multiply-adds per image forward, the commonly quoted figure.
  const absl::StatusOr<ModelSpec> vgg16 = LoadBuiltinModel("vgg16");
  ASSERT_TRUE(vgg16.ok());
  uint64_t flops = 0;
  for (const LayerSpec& layer : vgg16->layers()) flops += layer.forward_flops();
  EXPECT_NEAR(static_cast<double>(flops) / 2e9, 15.5, 0.1);

  // ResNets: no conv bias; batchnorm scale and shift are "other"; one FC.
  const absl::StatusOr<ModelSpec> resnet = LoadBuiltinModel("resnet-50");
  ASSERT_TRUE(resnet.ok());
  int fc = 0;
  for (const LayerSpec& layer : resnet->layers()) {
    if (layer.kind() == poseidon::v1::LAYER_KIND_BIAS) {
      EXPECT_EQ(layer.name(), "fc.bias");
    }
    if (layer.kind() == poseidon::v1::LAYER_KIND_FC) ++fc;
  }
  EXPECT_EQ(fc, 1);
  ASSERT_NE(FindLayer(*resnet, "layer1.0.bn1.scale"), nullptr);
  EXPECT_EQ(FindLayer(*resnet, "layer1.0.bn1.scale")->kind(), poseidon::v1::LAYER_KIND_OTHER);
  EXPECT_EQ(FindLayer(*resnet, "fc.weight")->shape(1), 2048u);

  // AlexNet's grouped conv2 holds in/groups input channels.
  const absl::StatusOr<ModelSpec> alexnet = LoadBuiltinModel("alexnet");
  ASSERT_TRUE(alexnet.ok());
  EXPECT_EQ(FindLayer(*alexnet, "conv2.weight")->shape(1), 48u);
  EXPECT_EQ(FindLayer(*alexnet, "fc6.weight")->shape(1), 9216u);  // 256 × 6 × 6
}

TEST(ModelSpecTest, BuiltinNamesIgnoreCaseDashesAndUnderscores) {
  for (const char* name : {"VGG19_22K", "vgg1922k", "ResNet50", "inception_v3", "AlexNet"}) {
    EXPECT_TRUE(LoadBuiltinModel(name).ok()) << name;
  }
  const absl::StatusOr<ModelSpec> unknown = LoadBuiltinModel("lenet");
  ASSERT_FALSE(unknown.ok());
  EXPECT_TRUE(absl::IsNotFound(unknown.status()));
  EXPECT_NE(unknown.status().message().find("vgg19-22k"), absl::string_view::npos);
}

TEST(ModelSpecTest, ParsesTheDocumentedJson) {
  const absl::StatusOr<ModelSpec> model = ParseModelSpecJson(R"({
    "name": "tiny",
    "layers": [
      {"name": "fc1.weight", "kind": "LAYER_KIND_FC", "shape": [4096, 9216],
       "element_type": "ELEMENT_TYPE_F16", "batch_per_worker": 32,
       "forward_flops": 75497472, "backward_flops": "150994944"},
      {"name": "fc1.bias", "kind": "LAYER_KIND_BIAS", "shape": ["4096"], "forwardTimeNs": 5,
       "backwardTimeNs": 7}
    ]})",
                                                             "tiny.json");
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ(model->layers_size(), 2);
  EXPECT_EQ(model->layers(0).element_type(), poseidon::v1::ELEMENT_TYPE_F16);
  EXPECT_EQ(model->layers(0).batch_per_worker(), 32u);
  EXPECT_EQ(model->layers(0).backward_flops(), 150994944u);
  EXPECT_EQ(model->layers(1).shape(0), 4096u);
  EXPECT_EQ(model->layers(1).backward_time_ns(), 7u);
  EXPECT_FALSE(model->layers(1).has_forward_flops());
  EXPECT_EQ(ElementBytes(model->layers(1).element_type()).value(), 4u);  // absent: f32
}

TEST(ModelSpecTest, MalformedJsonIsAOneLineError) {
  for (const char* json :
       {"{", "{\"name\": 3}", "{\"layers\": [{\"nmae\": \"x\"}]}",
        "{\"layers\": [{\"name\": \"x\", \"kind\": \"LAYER_KIND_FOO\"}]}", "[1, 2]", ""}) {
    const absl::StatusOr<ModelSpec> model = ParseModelSpecJson(json, "bad.json");
    ASSERT_FALSE(model.ok()) << json;
    EXPECT_TRUE(absl::IsInvalidArgument(model.status()));
    EXPECT_EQ(model.status().message().find('\n'), absl::string_view::npos)
        << model.status().message();
    EXPECT_EQ(model.status().message().rfind("bad.json: ", 0), 0u) << model.status().message();
  }
}

// A valid two-layer model the validation tests break one field at a time.
ModelSpec ValidModel() {
  ModelSpec model;
  model.set_name("m");
  LayerSpec* conv = model.add_layers();
  conv->set_name("conv.weight");
  conv->set_kind(poseidon::v1::LAYER_KIND_CONV);
  for (const uint64_t d : {64, 3, 3, 3}) conv->add_shape(d);
  LayerSpec* fc = model.add_layers();
  fc->set_name("fc.weight");
  fc->set_kind(poseidon::v1::LAYER_KIND_FC);
  fc->add_shape(10);
  fc->add_shape(20);
  return model;
}

void ExpectInvalid(const ModelSpec& model, const std::string& fragment) {
  const absl::Status status = ValidateModelSpec(model);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_NE(status.message().find(fragment), absl::string_view::npos)
      << "'" << status.message() << "' lacks '" << fragment << "'";
  EXPECT_EQ(status.message().find('\n'), absl::string_view::npos);
}

TEST(ModelSpecTest, ValidationNamesTheLayerAndTheField) {
  EXPECT_TRUE(ValidateModelSpec(ValidModel()).ok());

  ModelSpec model;
  model.set_name("empty");
  ExpectInvalid(model, "model 'empty' has no layers");

  model = ValidModel();
  model.mutable_layers(1)->clear_name();
  ExpectInvalid(model, "layer 1: name is empty");

  model = ValidModel();
  model.mutable_layers(1)->set_name("conv.weight");
  ExpectInvalid(model, "layer 1 'conv.weight': name is also used by layer 0");

  model = ValidModel();
  model.mutable_layers(0)->set_kind(poseidon::v1::LAYER_KIND_UNSPECIFIED);
  ExpectInvalid(model, "layer 0 'conv.weight': kind is not set");

  model = ValidModel();
  model.mutable_layers(0)->set_kind(static_cast<poseidon::v1::LayerKind>(42));
  ExpectInvalid(model, "kind 42 is unknown");

  model = ValidModel();
  model.mutable_layers(0)->clear_shape();
  ExpectInvalid(model, "layer 0 'conv.weight': shape is empty");

  model = ValidModel();
  model.mutable_layers(0)->set_shape(2, 0);
  ExpectInvalid(model, "layer 0 'conv.weight': shape[2] is 0 in [64, 3, 0, 3]");

  model = ValidModel();
  model.mutable_layers(1)->add_shape(1);
  ExpectInvalid(model,
                "layer 1 'fc.weight': an FC layer's shape must be exactly [M, N], got "
                "[10, 20, 1]");

  model = ValidModel();
  model.mutable_layers(1)->clear_shape();
  model.mutable_layers(1)->add_shape(10);
  ExpectInvalid(model, "exactly [M, N], got [10]");

  model = ValidModel();
  model.mutable_layers(1)->set_element_type(static_cast<poseidon::v1::ElementType>(99));
  ExpectInvalid(model, "layer 1 'fc.weight': element_type 99 is unknown");

  model = ValidModel();
  model.mutable_layers(1)->set_shape(0, uint64_t{1} << 40);
  model.mutable_layers(1)->set_shape(1, uint64_t{1} << 30);
  ExpectInvalid(model,
                "layer 1 'fc.weight': shape [1099511627776, 1073741824] is larger than "
                "2^64 bytes");
}

TEST(ModelSpecTest, LoadModelFindsFilesAndExplainsUnknownNames) {
  const std::string path =
      (std::filesystem::temp_directory_path() / "poseidon_model_spec_test.json").string();
  {
    std::ofstream out(path);
    out << R"({"name": "file-model", "layers": [{"name": "w", "kind": "LAYER_KIND_OTHER",
              "shape": [3]}]})";
  }
  const absl::StatusOr<ModelSpec> from_file = LoadModel(path);
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->name(), "file-model");
  std::remove(path.c_str());

  const absl::StatusOr<ModelSpec> unknown = LoadModel("no-such-model");
  ASSERT_FALSE(unknown.ok());
  EXPECT_TRUE(absl::IsNotFound(unknown.status()));
  EXPECT_EQ(unknown.status().message(),
            "unknown model 'no-such-model': not a built-in model (alexnet, vgg16, vgg19, "
            "vgg19-22k, googlenet, inception-v3, resnet-50, resnet-152) and no such spec file");

  EXPECT_TRUE(LoadModel("vgg19").ok());
}

}  // namespace
}  // namespace poseidon::planner
