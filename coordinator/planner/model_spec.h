// Model specs: reading a poseidon.v1.ModelSpec from JSON, checking it, and the built-in specs
// (AlexNet, VGG, GoogLeNet, Inception-V3, ResNet) compiled into the binary.
// Thread-safety: pure functions over immutable embedded data, safe from any thread.
#pragma once

// The JSON format is protobuf's JSON mapping of poseidon.v1.ModelSpec (proto/poseidon/v1/
// model.proto), so the wire schema and the file schema are one:
//   {"name": "tiny", "description": "...",
//    "layers": [
//      {"name": "fc1.weight", "kind": "LAYER_KIND_FC", "shape": [4096, 9216],
//       "element_type": "ELEMENT_TYPE_F32", "batch_per_worker": 32,
//       "forward_flops": 75497472, "backward_flops": 150994944},
//      {"name": "fc1.bias", "kind": "LAYER_KIND_BIAS", "shape": [4096]}]}
// Field names may be written snake_case or lowerCamelCase; 64-bit numbers as JSON numbers or
// strings; unknown fields are errors. An absent element_type means f32. docs/planner.md has the
// details; coordinator/models/generate.py writes the built-in specs.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "poseidon/v1/model.pb.h"

namespace poseidon::planner {

// Bytes per element; ELEMENT_TYPE_UNSPECIFIED counts as f32. Unknown values are an error.
absl::StatusOr<uint64_t> ElementBytes(poseidon::v1::ElementType type);

// Elements of a layer (the product of its shape; 1 for an empty shape, which Validate rejects).
uint64_t ParameterCount(const poseidon::v1::LayerSpec& layer);
uint64_t ParameterCount(const poseidon::v1::ModelSpec& model);

// Checks what the planner relies on: at least one layer; every layer a non-empty unique name, a
// known kind other than UNSPECIFIED, a non-empty shape without zeros, exactly [M, N] for FC, a
// known element type, a size in bytes that fits in 64 bits. Errors name the layer and the field.
absl::Status ValidateModelSpec(const poseidon::v1::ModelSpec& model);

// Parses (and validates) a spec; `origin` ("vgg19.json") prefixes errors.
absl::StatusOr<poseidon::v1::ModelSpec> ParseModelSpecJson(absl::string_view json,
                                                           absl::string_view origin);

// Reads and parses a spec file (at most 64 MiB).
absl::StatusOr<poseidon::v1::ModelSpec> LoadModelSpecFile(const std::string& path);

// The built-in specs' names: "alexnet", "vgg16", "vgg19", "vgg19-22k", "googlenet",
// "inception-v3", "resnet-50", "resnet-152".
std::vector<std::string> BuiltinModelNames();

// A built-in spec by name; case, '-' and '_' do not matter ("ResNet50", "vgg19_22k").
absl::StatusOr<poseidon::v1::ModelSpec> LoadBuiltinModel(absl::string_view name);

// A built-in spec if `name_or_path` names one, else the spec file at that path. NotFound when it
// is neither.
absl::StatusOr<poseidon::v1::ModelSpec> LoadModel(absl::string_view name_or_path);

}  // namespace poseidon::planner
