// Checkpoint files of poseidon-server: one file per job, `job-<id>.ckpt`, written atomically
// (temporary file, fsync, rename, fsync of the directory) and verified completely on load
// (magic, version, length, CRC-32C, every count against the bytes present) before anything is
// installed: a torn or corrupt file is refused with a clear error, never half-loaded.
// Thread-safety: free functions; concurrent writes of the same job must be serialized by the
// caller.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/kv_engine.h"

namespace poseidon::server {

std::string CheckpointPath(const std::string& dir, uint64_t job_id);

absl::Status WriteCheckpoint(const std::string& dir, const JobSnapshot& snapshot);

absl::StatusOr<JobSnapshot> ReadCheckpoint(const std::string& path);

// Every job-*.ckpt in `dir` (a missing directory is an empty list). Leftover temporary files of
// an interrupted write are ignored (and named in the log). Any bad checkpoint fails the whole
// load: the server must not start with part of its state.
absl::StatusOr<std::vector<JobSnapshot>> LoadCheckpoints(const std::string& dir);

}  // namespace poseidon::server
