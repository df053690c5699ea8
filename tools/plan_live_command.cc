#include "tools/plan_live_command.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "coordinator/client.h"
#include "coordinator/planner/cost_model.h"
#include "tools/coordinator_cli.h"
#include "tools/json_writer.h"

namespace poseidon::tools {
namespace {

namespace v1 = poseidon::v1;

// The flags of the live form (environment: POSEIDON_PLAN_<NAME>; file: --config).
struct LivePlanFlags {
  std::string coordinator;
  std::string job_id;
  std::string token;
  std::string set;
  std::string reason;
  absl::Duration timeout = absl::Seconds(10);
  POSEIDON_CLI_TLS_FIELDS;
  bool json = false;
};

ConfigSchema<LivePlanFlags> LivePlanFlagsSchema() {
  using F = LivePlanFlags;
  ConfigSchema<F> schema("poseidon plan --coordinator", "POSEIDON_PLAN_");
  schema.Field("coordinator", &F::coordinator, "the coordinator (host:port)", NonEmpty())
      .Field("job_id", &F::job_id, "the job (--job also works)", NonEmpty())
      .SecretField("token", &F::token, "the job's coordinator token", NonEmpty())
      .Field("set", &F::set,
             "override layer schemes: 'fc1.weight=ps,fc2.weight=sfb' (auto: back to the cost "
             "model's choice); empty: only show the plan")
      .Field("reason", &F::reason, "why, for the coordinator's log (with --set)")
      .Field("timeout", &F::timeout, "give up on the coordinator after this long",
             InRange(absl::Milliseconds(1), absl::Hours(1)))
      .Field("json", &F::json, "print JSON instead of a table");
  AddTlsFlags(schema);
  return schema;
}

int Fail(absl::string_view message) {
  return tools::Fail("poseidon plan", message);
}

std::string SchemeName(v1::SyncScheme scheme) {
  switch (scheme) {
    case v1::SYNC_SCHEME_PS:
      return "ps";
    case v1::SYNC_SCHEME_SFB:
      return "sfb";
    case v1::SYNC_SCHEME_ALLREDUCE:
      return "allreduce";
    default:
      return "auto";
  }
}

bool NamesFlag(const std::string& arg, absl::string_view name) {
  const std::string flag = absl::StrCat("--", name);
  return arg == flag || absl::StartsWith(arg, absl::StrCat(flag, "="));
}

// What the coordinator answered, printed.
struct Shown {
  v1::Plan plan;
  bool overriding = false;  // --set was given
  bool installed = false;
  std::map<std::string, v1::SyncScheme> overrides;  // known only after --set
};

void PrintText(const Shown& shown) {
  const v1::Plan& plan = shown.plan;
  if (!shown.overriding) {
    std::printf("job %s: plan epoch %llu, effective from iteration %llu\n", plan.job_id().c_str(),
                static_cast<unsigned long long>(plan.plan_epoch()),
                static_cast<unsigned long long>(plan.effective_iteration()));
  } else if (shown.installed) {
    std::printf("job %s: new plan epoch %llu, effective from iteration %llu\n",
                plan.job_id().c_str(), static_cast<unsigned long long>(plan.plan_epoch()),
                static_cast<unsigned long long>(plan.effective_iteration()));
  } else {
    std::printf(
        "job %s: these overrides are in force already; plan epoch %llu kept, effective from "
        "iteration %llu\n",
        plan.job_id().c_str(), static_cast<unsigned long long>(plan.plan_epoch()),
        static_cast<unsigned long long>(plan.effective_iteration()));
  }
  if (shown.overriding) {
    std::vector<std::string> listed;
    for (const auto& [name, scheme] : shown.overrides) {
      listed.push_back(absl::StrCat(name, "=", SchemeName(scheme)));
    }
    std::printf("overrides in force: %s\n",
                listed.empty() ? "none" : absl::StrJoin(listed, ",").c_str());
  }
  size_t width = 5;
  for (const v1::LayerPlan& layer : plan.layers())
    width = std::max(width, layer.layer_name().size());
  std::printf("%-*s  %-9s  %-5s%s\n", static_cast<int>(width), "LAYER", "SCHEME", "WIRE",
              shown.overriding ? "  OVERRIDDEN" : "");
  for (const v1::LayerPlan& layer : plan.layers()) {
    const bool forced = shown.overrides.contains(layer.layer_name());
    std::printf("%-*s  %-9s  %-5s%s\n", static_cast<int>(width), layer.layer_name().c_str(),
                SchemeName(layer.scheme()).c_str(), planner::WireTypeName(layer.wire_type()),
                shown.overriding ? (forced ? "  yes" : "  -") : "");
  }
}

void PrintJson(const Shown& shown) {
  const v1::Plan& plan = shown.plan;
  JsonWriter w;
  w.BeginObject();
  w.Key("job_id");
  w.String(plan.job_id());
  w.Key("plan_epoch");
  w.Unsigned(plan.plan_epoch());
  w.Key("effective_iteration");
  w.Unsigned(plan.effective_iteration());
  w.Key("installed");
  if (shown.overriding) {
    w.Bool(shown.installed);
  } else {
    w.Null();
  }
  w.Key("overrides");
  if (shown.overriding) {
    w.BeginObject();
    for (const auto& [name, scheme] : shown.overrides) {
      w.Key(name);
      w.String(SchemeName(scheme));
    }
    w.EndObject();
  } else {
    w.Null();
  }
  w.Key("layers");
  w.BeginArray();
  for (const v1::LayerPlan& layer : plan.layers()) {
    w.BeginObject();
    w.Key("index");
    w.Unsigned(layer.layer_index());
    w.Key("name");
    w.String(layer.layer_name());
    w.Key("scheme");
    w.String(SchemeName(layer.scheme()));
    w.Key("wire");
    w.String(planner::WireTypeName(layer.wire_type()));
    w.Key("chunks");
    w.Unsigned(static_cast<uint64_t>(layer.chunks_size()));
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  std::printf("%s\n", w.str().c_str());
}

}  // namespace

bool IsLivePlanCommand(const std::vector<std::string>& args) {
  return std::any_of(args.begin(), args.end(), [](const std::string& arg) {
    return NamesFlag(arg, "coordinator") || NamesFlag(arg, "set");
  });
}

absl::StatusOr<std::map<std::string, v1::SyncScheme>> ParseSchemeOverrides(absl::string_view text) {
  std::map<std::string, v1::SyncScheme> schemes;
  for (absl::string_view entry : absl::StrSplit(text, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--set '", text, "': an empty entry (expected layer=ps|sfb|auto,...)"));
    }
    const size_t equals = entry.rfind('=');
    if (equals == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--set: '", entry, "' needs =ps, =sfb, =allreduce or =auto"));
    }
    const std::string name(absl::StripAsciiWhitespace(entry.substr(0, equals)));
    const std::string value =
        absl::AsciiStrToLower(absl::StripAsciiWhitespace(entry.substr(equals + 1)));
    if (name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--set: '", entry, "' names no layer"));
    }
    v1::SyncScheme scheme = v1::SYNC_SCHEME_UNSPECIFIED;
    if (value == "ps") {
      scheme = v1::SYNC_SCHEME_PS;
    } else if (value == "sfb") {
      scheme = v1::SYNC_SCHEME_SFB;
    } else if (value == "allreduce" || value == "ar") {
      scheme = v1::SYNC_SCHEME_ALLREDUCE;
    } else if (value != "auto" && value != "default" && value != "unset") {
      return absl::InvalidArgumentError(absl::StrCat("--set: layer '", name, "': unknown scheme '",
                                                     value, "' (ps, sfb, allreduce or auto)"));
    }
    if (!schemes.emplace(name, scheme).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--set: layer '", name, "' is named more than once"));
    }
  }
  return schemes;
}

int RunLivePlanCommand(const std::vector<std::string>& args) {
  // --job is the short form of --job_id, as in `poseidon status`.
  const std::vector<std::string> normalized = NormalizeJobFlag(args);
  const ConfigSchema<LivePlanFlags> schema = LivePlanFlagsSchema();
  LoadedConfig<LivePlanFlags> loaded;
  if (std::optional<int> code = ParseOrExit("poseidon plan", schema, normalized, &loaded)) {
    return *code;
  }
  const LivePlanFlags& flags = loaded.value;
  const bool overriding = std::any_of(normalized.begin(), normalized.end(),
                                      [](const std::string& a) { return NamesFlag(a, "set"); }) ||
                          !flags.set.empty();
  std::map<std::string, v1::SyncScheme> schemes;
  if (overriding) {
    absl::StatusOr<std::map<std::string, v1::SyncScheme>> parsed = ParseSchemeOverrides(flags.set);
    if (!parsed.ok()) return Fail(parsed.status().message());
    schemes = *std::move(parsed);
  } else if (!flags.reason.empty()) {
    return Fail("--reason needs --set");
  }

  absl::StatusOr<std::unique_ptr<coordinator::CoordinatorClient>> client =
      coordinator::CoordinatorClient::Connect(ClientOptions(flags));
  if (!client.ok()) return Fail(client.status().message());

  Shown shown;
  shown.overriding = overriding;
  absl::Status status;
  if (overriding) {
    absl::StatusOr<v1::SetLayerSchemesResponse> response =
        (*client)->SetLayerSchemes(schemes, "", flags.reason);
    status = response.status();
    if (response.ok()) {
      shown.plan = std::move(*response->mutable_plan());
      shown.installed = response->installed();
      shown.overrides.insert(response->overrides().begin(), response->overrides().end());
    }
  } else {
    absl::StatusOr<v1::Plan> plan = (*client)->GetPlan();
    status = plan.status();
    if (plan.ok()) shown.plan = *std::move(plan);
  }
  if (!status.ok()) return Fail(CoordinatorError(flags.coordinator, status));
  if (flags.json) {
    PrintJson(shown);
  } else {
    PrintText(shown);
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}

}  // namespace poseidon::tools
