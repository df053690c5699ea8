#include "tools/plan_command.h"

#include <cstdint>
#include <cstdio>
#include <optional>
#include <utility>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "coordinator/planner/model_spec.h"
#include "coordinator/planner/planner.h"
#include "tools/plan_live_command.h"
#include "tools/plan_output.h"

namespace poseidon::tools {
namespace {

// The flags of `poseidon plan` (environment: POSEIDON_PLAN_<NAME>; file: --config).
struct PlanFlags {
  std::string model;
  uint32_t workers = 0;
  uint32_t servers = 0;
  uint32_t batch = 0;
  double bandwidth = 0;
  absl::Duration latency = absl::Microseconds(50);
  bool colocated = false;
  std::string gpu = "titanx";
  uint64_t block_size = planner::kDefaultBlockBytes;
  std::string fusion = "cost";
  std::string lossy_wire = "none";
  int64_t lowrank_rank = 0;
  std::string wire;  // "layer=bf16,other=fp32"
  std::string lowrank;  // "layer=4,other=0"
  bool allreduce_by_cost = false;
  absl::Duration allreduce_step = absl::ZeroDuration();
  uint64_t allreduce_bucket_bytes = planner::kDefaultAllreduceBucketBytes;
  bool json = false;
};

Validator<double> Positive() {
  return [](const double& value) {
    return value > 0 ? absl::OkStatus()
                     : absl::InvalidArgumentError("must be > 0 (for example 10Gbit or 1.25GB/s)");
  };
}

ConfigSchema<PlanFlags> PlanFlagsSchema() {
  ConfigSchema<PlanFlags> schema("poseidon plan", "POSEIDON_PLAN_");
  schema
      .Field("model", &PlanFlags::model,
             "built-in model (alexnet, vgg16, vgg19, vgg19-22k, googlenet, inception-v3, "
             "resnet-50, resnet-152) or the path of a ModelSpec JSON file",
             NonEmpty())
      .Field("workers", &PlanFlags::workers, "P1, the number of workers (GPUs)", AtLeast(1))
      .Field("servers", &PlanFlags::servers, "P2, the number of servers; 0: as many as workers")
      .Field("batch", &PlanFlags::batch,
             "K, the per-worker batch size; 0: each layer's batch_per_worker from the spec")
      .BandwidthField("bandwidth", &PlanFlags::bandwidth,
                      "network bandwidth per machine and direction (10Gbit, 1.25GB/s)", Positive())
      .Field("latency", &PlanFlags::latency, "latency of one message (50us)")
      .Field("colocated", &PlanFlags::colocated, "every worker machine also runs a server")
      .Field("gpu", &PlanFlags::gpu,
             "GPU rate for compute time from FLOPs: titanx, v100, a100, h100, a FLOP/s number "
             "(12.5T), or none")
      .ByteSizeField("block_size", &PlanFlags::block_size, "largest PS chunk (4MiB)")
      .Field("fusion", &PlanFlags::fusion,
             "cost: small PS layers fused into buckets where the cost model says it pays; off",
             OneOf({"cost", "off"}))
      .Field("lossy_wire", &PlanFlags::lossy_wire,
             "none: every byte exact; bf16 or fp16: a PS or all-reduce layer may use that 16-bit "
             "wire (lossy, error feedback) where the cost model says it pays",
             OneOf({"none", "bf16", "fp16"}))
      .Field("lowrank_rank", &PlanFlags::lowrank_rank,
             "0: no low rank; r: an all-reduce layer's 2-D gradient may go as rank-r factors "
             "(PowerSGD, lossy, error feedback) where the cost model says it pays",
             InRange<int64_t>(0, 1024))
      .Field("wire", &PlanFlags::wire,
             "per-layer wire overrides, 'fc6.weight=bf16,conv1.weight=fp32' (fp32 keeps a layer "
             "exact; bf16/fp16 puts a PS or all-reduce layer on that wire whatever the cost)")
      .Field("lowrank", &PlanFlags::lowrank,
             "per-layer low-rank overrides, 'fc6.weight=4,conv1.weight=0' (r: that layer by "
             "all-reduce at rank r whatever the cost; 0: never low rank)")
      .Field("allreduce_by_cost", &PlanFlags::allreduce_by_cost,
             "let the time rule put layers on ring all-reduce, each step of the ring costing "
             "at least --allreduce_step (the coordinator's --allreduce_by_cost, with the agents' "
             "measured step); off: only --lowrank overrides put a layer on it")
      .Field("allreduce_step", &PlanFlags::allreduce_step,
             "with --allreduce_by_cost: the measured cost of one ring step (0: the latency)")
      .ByteSizeField("allreduce_bucket_bytes", &PlanFlags::allreduce_bucket_bytes,
                     "the agents' --allreduce_bucket_bytes: consecutive all-reduce layers fused "
                     "into one collective of at most this size (25MiB; 0: one per layer)")
      .Field("json", &PlanFlags::json, "print JSON instead of a table");
  return schema;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "poseidon plan: %s\n", std::string(status.message()).c_str());
  return 2;
}

}  // namespace

int RunPlanCommand(const std::vector<std::string>& args) {
  // Against a running coordinator: its plan, or an operator's override (plan_live_command.h).
  if (IsLivePlanCommand(args)) return RunLivePlanCommand(args);
  const ConfigSchema<PlanFlags> schema = PlanFlagsSchema();
  ConfigInput input;
  input.args = args;
  absl::StatusOr<LoadedConfig<PlanFlags>> loaded = schema.Parse(input);
  if (!loaded.ok()) return Fail(loaded.status());
  if (loaded->help_requested) {
    std::fputs(schema.Usage().c_str(), stdout);
    std::fputs(
        "\nA running job's plan, and an operator's override of layer schemes:\n"
        "  poseidon plan --coordinator ADDR --job J --token T [--set "
        "'fc1.weight=ps,fc2.weight=sfb']\n"
        "  (auto instead of ps/sfb: back to the cost model; poseidon plan --coordinator ADDR "
        "--help)\n",
        stdout);
    return 0;
  }
  for (const std::string& arg : loaded->unparsed_args) {
    if (arg != "--") {
      return Fail(absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'")));
    }
  }
  const PlanFlags& flags = loaded->value;

  planner::PlannerConfig config;
  config.workers = flags.workers;
  config.servers = flags.servers == 0 ? flags.workers : flags.servers;
  config.batch_per_worker = flags.batch;
  config.colocated = flags.colocated;
  config.bandwidth_bytes_per_second = flags.bandwidth;
  config.latency_seconds = absl::ToDoubleSeconds(flags.latency);
  config.block_bytes = flags.block_size;
  config.fusion = flags.fusion == "off" ? planner::FusionRule::kOff : planner::FusionRule::kCost;
  config.lossy_wire = *planner::ParseWireType(flags.lossy_wire);  // checked by OneOf
  config.lowrank_rank = static_cast<uint32_t>(flags.lowrank_rank);
  config.allreduce_bucket_bytes = flags.allreduce_bucket_bytes;
  if (flags.allreduce_by_cost) {
    if (flags.allreduce_step < absl::ZeroDuration()) {
      return Fail(absl::InvalidArgumentError("--allreduce_step must be >= 0"));
    }
    config.scheme_rule = planner::SchemeRule::kTime;
    config.allreduce_step_seconds = absl::ToDoubleSeconds(flags.allreduce_step);
  }
  for (absl::string_view entry : absl::StrSplit(flags.wire, ',', absl::SkipEmpty())) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(entry, '=');
    const std::optional<poseidon::v1::ElementType> wire = planner::ParseWireType(std::string(kv.second));
    if (kv.first.empty() || !wire.has_value()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "--wire: '", entry, "' is not LAYER=fp32, LAYER=bf16 or LAYER=fp16")));
    }
    config.wire_overrides[std::string(kv.first)] = *wire;
  }
  absl::StatusOr<std::map<std::string, uint32_t, std::less<>>> lowrank =
      planner::ParseLowRankOverrides(flags.lowrank);
  if (!lowrank.ok()) return Fail(absl::InvalidArgumentError(absl::StrCat("--lowrank: ", lowrank.status().message())));
  config.lowrank_overrides = *std::move(lowrank);
  if (absl::AsciiStrToLower(flags.gpu) != "none") {
    absl::StatusOr<planner::GpuRate> gpu = planner::ParseGpuRate(flags.gpu);
    if (!gpu.ok()) return Fail(gpu.status());
    config.gpu = *gpu;
  }

  absl::StatusOr<poseidon::v1::ModelSpec> model = planner::LoadModel(flags.model);
  if (!model.ok()) return Fail(model.status());
  config.job_id = model->name();
  absl::StatusOr<planner::PlanResult> result = planner::BuildPlan(*model, config);
  if (!result.ok()) return Fail(result.status());

  if (flags.json) {
    absl::StatusOr<std::string> json = FormatPlanJson(*model, config, *result);
    if (!json.ok()) return Fail(json.status());
    std::fputs(json->c_str(), stdout);
    std::fputc('\n', stdout);
  } else {
    std::fputs(FormatPlanTable(*model, config, *result).c_str(), stdout);
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}

}  // namespace poseidon::tools
