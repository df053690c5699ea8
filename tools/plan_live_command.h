// `poseidon plan --coordinator ADDR --job J --token T [--set 'layer=ps|sfb|auto,...']`: the plan of
// a running job, and the operator's override of layer schemes (the coordinator's SetLayerSchemes).
// Thread-safety: runs on the main thread; touches only stdout and stderr.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "poseidon/v1/plan.pb.h"

namespace poseidon::tools {

// Whether `args` (after "plan") ask for the live form: they name --coordinator or --set.
bool IsLivePlanCommand(const std::vector<std::string>& args);

// Runs the live form. Exit code: 0 on success (or --help); 2 on bad flags, an unreachable
// coordinator or a refused override (one line on stderr naming the reason).
int RunLivePlanCommand(const std::vector<std::string>& args);

// 'fc1.weight=ps,fc2.weight=sfb,fc3.weight=auto' -> layer name -> scheme (auto, default or
// unset: SYNC_SCHEME_UNSPECIFIED, back to the cost model's choice). Case-insensitive schemes;
// spaces around entries are ignored. Errors name the entry: an empty name, a missing '=', an
// unknown scheme, a layer named twice, no entry at all.
absl::StatusOr<std::map<std::string, poseidon::v1::SyncScheme>> ParseSchemeOverrides(
    absl::string_view text);

}  // namespace poseidon::tools
