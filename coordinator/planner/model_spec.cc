#include "coordinator/planner/model_spec.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <system_error>

#include "absl/container/flat_hash_map.h"
#include "absl/numeric/int128.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "coordinator/planner/builtin_models.h"
#include "google/protobuf/util/json_util.h"

namespace poseidon::planner {

using poseidon::v1::LayerSpec;
using poseidon::v1::ModelSpec;

namespace {

constexpr uint64_t kMaxSpecFileBytes = uint64_t{64} << 20;

std::string LayerLabel(int index, const LayerSpec& layer) {
  return absl::StrCat("layer ", index, " '", layer.name(), "'");
}

std::string ShapeText(const LayerSpec& layer) {
  return absl::StrCat("[", absl::StrJoin(layer.shape(), ", "), "]");
}

// Lower case without '-' and '_': the form built-in names are compared in.
std::string NormalizedName(absl::string_view name) {
  std::string out;
  for (const char c : name) {
    if (c != '-' && c != '_') out.push_back(absl::ascii_tolower(static_cast<unsigned char>(c)));
  }
  return out;
}

}  // namespace

absl::StatusOr<uint64_t> ElementBytes(poseidon::v1::ElementType type) {
  switch (type) {
    case poseidon::v1::ELEMENT_TYPE_UNSPECIFIED:
    case poseidon::v1::ELEMENT_TYPE_F32:
      return 4;
    case poseidon::v1::ELEMENT_TYPE_F16:
    case poseidon::v1::ELEMENT_TYPE_BF16:
      return 2;
    case poseidon::v1::ELEMENT_TYPE_F64:
      return 8;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("element_type ", static_cast<int>(type), " is unknown"));
  }
}

uint64_t ParameterCount(const LayerSpec& layer) {
  uint64_t count = 1;
  for (const uint64_t d : layer.shape()) count *= d;
  return count;
}

uint64_t ParameterCount(const ModelSpec& model) {
  uint64_t total = 0;
  for (const LayerSpec& layer : model.layers()) total += ParameterCount(layer);
  return total;
}

absl::Status ValidateModelSpec(const ModelSpec& model) {
  if (model.layers().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("model '", model.name(), "' has no layers"));
  }
  absl::flat_hash_map<std::string, int> seen;
  absl::uint128 total_bytes = 0;
  for (int i = 0; i < model.layers_size(); ++i) {
    const LayerSpec& layer = model.layers(i);
    if (layer.name().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", i, ": name is empty"));
    }
    const std::string label = LayerLabel(i, layer);
    if (const auto [it, inserted] = seen.emplace(layer.name(), i); !inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": name is also used by layer ", it->second));
    }
    switch (layer.kind()) {
      case poseidon::v1::LAYER_KIND_FC:
      case poseidon::v1::LAYER_KIND_CONV:
      case poseidon::v1::LAYER_KIND_BIAS:
      case poseidon::v1::LAYER_KIND_OTHER:
        break;
      case poseidon::v1::LAYER_KIND_UNSPECIFIED:
        return absl::InvalidArgumentError(
            absl::StrCat(label,
                         ": kind is not set (LAYER_KIND_FC, LAYER_KIND_CONV, LAYER_KIND_BIAS or "
                         "LAYER_KIND_OTHER)"));
      default:
        return absl::InvalidArgumentError(
            absl::StrCat(label, ": kind ", static_cast<int>(layer.kind()), " is unknown"));
    }
    if (layer.shape().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(label, ": shape is empty"));
    }
    for (int d = 0; d < layer.shape_size(); ++d) {
      if (layer.shape(d) == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(label, ": shape[", d, "] is 0 in ", ShapeText(layer)));
      }
    }
    if (layer.kind() == poseidon::v1::LAYER_KIND_FC && layer.shape_size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          label, ": an FC layer's shape must be exactly [M, N], got ", ShapeText(layer)));
    }
    const absl::StatusOr<uint64_t> element_bytes = ElementBytes(layer.element_type());
    if (!element_bytes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": ", element_bytes.status().message()));
    }
    absl::uint128 bytes = *element_bytes;
    for (const uint64_t d : layer.shape()) {
      bytes *= d;
      if (bytes > std::numeric_limits<uint64_t>::max()) {
        return absl::InvalidArgumentError(
            absl::StrCat(label, ": shape ", ShapeText(layer), " is larger than 2^64 bytes"));
      }
    }
    total_bytes += bytes;
    if (total_bytes > std::numeric_limits<uint64_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": the model up to here is larger than 2^64 bytes"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelSpec> ParseModelSpecJson(absl::string_view json, absl::string_view origin) {
  ModelSpec model;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto parsed = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &model, options);
  if (!parsed.ok()) {
    // protobuf's messages may span lines; errors here are one line.
    const std::string message = absl::StrReplaceAll(
        absl::string_view(parsed.message().data(), parsed.message().size()), {{"\n", " "}});
    return absl::InvalidArgumentError(absl::StrCat(origin, ": not a ModelSpec: ", message));
  }
  if (absl::Status valid = ValidateModelSpec(model); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": ", valid.message()));
  }
  return model;
}

absl::StatusOr<ModelSpec> LoadModelSpecFile(const std::string& path) {
  std::error_code error;
  const uint64_t size = std::filesystem::file_size(path, error);
  if (error) {
    return absl::NotFoundError(
        absl::StrCat("cannot read model spec ", path, ": ", error.message()));
  }
  if (size > kMaxSpecFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat("model spec ", path, " is ", size,
                                                   " bytes; the limit is ", kMaxSpecFileBytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open model spec ", path));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read model spec ", path));
  return ParseModelSpecJson(text, path);
}

std::vector<std::string> BuiltinModelNames() {
  std::vector<std::string> names;
  for (size_t i = 0; i < builtin_internal::kEmbeddedModelCount; ++i) {
    names.emplace_back(builtin_internal::kEmbeddedModels[i].name);
  }
  return names;
}

absl::StatusOr<ModelSpec> LoadBuiltinModel(absl::string_view name) {
  const std::string wanted = NormalizedName(name);
  for (size_t i = 0; i < builtin_internal::kEmbeddedModelCount; ++i) {
    const builtin_internal::EmbeddedModel& embedded = builtin_internal::kEmbeddedModels[i];
    if (NormalizedName(embedded.name) != wanted) continue;
    return ParseModelSpecJson(
        absl::string_view(reinterpret_cast<const char*>(embedded.data), embedded.size),
        absl::StrCat("built-in model ", embedded.name));
  }
  return absl::NotFoundError(absl::StrCat(
      "unknown model '", name, "' (built-in: ", absl::StrJoin(BuiltinModelNames(), ", "), ")"));
}

absl::StatusOr<ModelSpec> LoadModel(absl::string_view name_or_path) {
  absl::StatusOr<ModelSpec> builtin = LoadBuiltinModel(name_or_path);
  if (builtin.ok() || !absl::IsNotFound(builtin.status())) return builtin;
  const std::string path(name_or_path);
  std::error_code error;
  if (!path.empty() && std::filesystem::exists(path, error)) return LoadModelSpecFile(path);
  return absl::NotFoundError(
      absl::StrCat("unknown model '", name_or_path, "': not a built-in model (",
                   absl::StrJoin(BuiltinModelNames(), ", "), ") and no such spec file"));
}

}  // namespace poseidon::planner
