// The built-in model specs (coordinator/models/*.json) as bytes compiled into the library; the
// definitions are generated at build time by coordinator/planner/embed_models.cmake.
// Thread-safety: immutable data.
#pragma once

#include <cstddef>

namespace poseidon::planner::builtin_internal {

// One embedded JSON file.
struct EmbeddedModel {
  const char* name;  // the file name without ".json"
  const unsigned char* data;
  size_t size;
};

extern const EmbeddedModel kEmbeddedModels[];
extern const size_t kEmbeddedModelCount;

}  // namespace poseidon::planner::builtin_internal
