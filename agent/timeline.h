// Timeline: per-layer events of one agent (ready, push, pull, send, rebuild, done) written as a
// Chrome trace / Perfetto JSON file ("traceEvents" array; pid = rank, tid = layer), for
// chrome://tracing or ui.perfetto.dev. tools/timeline_merge.py merges the ranks into one view.
// Thread-safety: Record may be called from any thread (one mutex around the file).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace poseidon::agent {

class Timeline {
 public:
  static absl::StatusOr<std::unique_ptr<Timeline>> Open(const std::string& path, uint32_t rank);
  ~Timeline();  // closes the JSON array

  // A span [start, end) of `name` on the layer's track, with the iteration as an argument.
  void Span(const char* name, uint32_t layer, const std::string& layer_name, uint64_t iteration,
            absl::Time start, absl::Time end);
  // An instant event.
  void Instant(const char* name, uint32_t layer, uint64_t iteration, absl::Time at);

 private:
  Timeline(std::FILE* file, uint32_t rank) : file_(file), rank_(rank) {}
  std::mutex mu_;
  std::FILE* file_;
  uint32_t rank_;
  std::string Escape(const std::string& s);
};

}  // namespace poseidon::agent
