#include "tools/simulate_command.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "common/status.h"
#include "coordinator/planner/model_spec.h"
#include "coordinator/planner/planner.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "sim/simulator.h"
#include "tools/json_writer.h"

namespace poseidon::tools {
namespace {

// The flags of `poseidon simulate` (environment: POSEIDON_SIMULATE_<NAME>; file: --config). The
// cluster's flags mean what they mean for `poseidon plan`.
struct SimulateFlags {
  std::string model;
  std::string workers = "1,2,4,8";
  uint32_t servers = 0;
  uint32_t batch = 0;
  double bandwidth = 0;
  absl::Duration latency = absl::Microseconds(50);
  bool colocated = true;
  std::string gpu = "titanx";
  uint64_t block_size = planner::kDefaultBlockBytes;
  std::string scheme = "auto";
  std::string lossy_wire = "none";
  bool wfbp = true;
  bool priority = true;
  uint64_t credit_bytes = uint64_t{64} << 20;
  std::string fusion = "plan";
  uint64_t bucket_bytes = uint64_t{512} << 10;
  uint64_t allreduce_bucket_bytes = planner::kDefaultAllreduceBucketBytes;
  absl::Duration allreduce_step = absl::ZeroDuration();
  absl::Duration allreduce_cpu_per_step = absl::ZeroDuration();
  uint32_t iterations = 20;
  std::string calibration;
  absl::Duration alpha = absl::ZeroDuration();
  absl::Duration compute_overhead = absl::ZeroDuration();
  std::string jitter = "none";
  double jitter_sigma = 0;
  double layer_jitter_sigma = 0;
  bool sfb_rebuild = true;
  uint64_t seed = 1;
  bool emulation = false;
  absl::Duration link_burst = absl::ZeroDuration();
  bool json = false;
  double cpu_ns_per_byte = 0;
  uint32_t shared_cpus = 0;
  uint32_t replicas = 1;
  uint32_t mtu = 1500;
  uint32_t frame_overhead = 38;
  absl::Duration pass_cpu = absl::ZeroDuration();
  double host_cpu_load = 0;
};

// Positions of the fields a calibration sets, in declaration order (LoadedConfig::origins): a new
// field goes after them (at the end of SimulateFlagsSchema).
constexpr size_t kAlphaField = 17;
constexpr size_t kOverheadField = 18;
constexpr size_t kJitterField = 19;
constexpr size_t kJitterSigmaField = 20;
constexpr size_t kLayerJitterSigmaField = 21;
constexpr size_t kCpuPerByteField = 28;
constexpr size_t kSharedCpusField = 29;
constexpr size_t kAllreduceStepField = 32;
constexpr size_t kAllreduceCpuPerStepField = 33;
constexpr size_t kFrameOverheadField = 35;
constexpr size_t kPassCpuField = 36;
constexpr size_t kHostCpuLoadField = 37;

ConfigSchema<SimulateFlags> SimulateFlagsSchema() {
  ConfigSchema<SimulateFlags> schema("poseidon simulate", "POSEIDON_SIMULATE_");
  schema
      .Field("model", &SimulateFlags::model,
             "built-in model (alexnet, vgg16, vgg19, vgg19-22k, googlenet, inception-v3, "
             "resnet-50, resnet-152) or the path of a ModelSpec JSON file",
             NonEmpty())
      .Field("workers", &SimulateFlags::workers,
             "P1: the cluster sizes to simulate, comma-separated (16,32,64); N = 1 is always "
             "simulated as the speed-up's base",
             NonEmpty())
      .Field("servers", &SimulateFlags::servers, "P2, the number of servers; 0: as many as workers")
      .Field("batch", &SimulateFlags::batch,
             "K, the per-worker batch size; 0: each layer's batch_per_worker from the spec")
      .BandwidthField("bandwidth", &SimulateFlags::bandwidth,
                      "link rate per host and direction (10Gbit, 1.25GB/s)",
                      [](const double& v) {
                        return v > 0 ? absl::OkStatus()
                                     : absl::InvalidArgumentError("must be > 0 (e.g. 10Gbit)");
                      })
      .Field("latency", &SimulateFlags::latency, "one-way latency host to host (50us)")
      .Field("colocated", &SimulateFlags::colocated,
             "every worker machine also runs a server (default true; false: servers on hosts "
             "of their own)")
      .Field("gpu", &SimulateFlags::gpu,
             "GPU rate for compute time from FLOPs: titanx, v100, a100, h100, a FLOP/s number "
             "(12.5T), or none (the spec's measured times)")
      .ByteSizeField("block_size", &SimulateFlags::block_size, "largest PS chunk (4MiB)")
      .Field("scheme", &SimulateFlags::scheme,
             "the agents' --scheme: auto (the plan's), ps (every layer), allreduce (every layer)",
             OneOf({"auto", "ps", "allreduce"}))
      .Field("wfbp", &SimulateFlags::wfbp,
             "post each layer when its backward ends (false: after the whole backward)")
      .Field("priority", &SimulateFlags::priority,
             "the agents' priority queue (false: in the order layers are posted)")
      .ByteSizeField("credit_bytes", &SimulateFlags::credit_bytes,
                     "the agents' bytes in flight (64MiB)")
      .Field("fusion", &SimulateFlags::fusion,
             "the agents' fusion: plan (the plan's buckets), bytes (runs of at most "
             "--bucket_bytes) or off", OneOf({"plan", "bytes", "off"}))
      .ByteSizeField("bucket_bytes", &SimulateFlags::bucket_bytes,
                     "with --fusion=bytes: the agents' fusion bucket (512KiB)")
      .Field("iterations", &SimulateFlags::iterations, "iterations per run (the first is warm-up)",
             AtLeast(2u))
      .Field("calibration", &SimulateFlags::calibration,
             "a calibration JSON (bench/cluster/calibration.json): alpha, compute overhead and "
             "jitter unless given as flags")
      .Field("alpha", &SimulateFlags::alpha, "per-message overhead on the sender's link (0)")
      .Field("compute_overhead", &SimulateFlags::compute_overhead,
             "added to every layer's forward and backward (0)")
      .Field("jitter", &SimulateFlags::jitter, "compute jitter: none, normal, lognormal",
             OneOf({"none", "normal", "lognormal"}))
      .Field("jitter_sigma", &SimulateFlags::jitter_sigma,
             "relative σ of one factor per worker and iteration")
      .Field("layer_jitter_sigma", &SimulateFlags::layer_jitter_sigma,
             "relative σ of one factor per layer pass")
      .Field("sfb_rebuild", &SimulateFlags::sfb_rebuild,
             "count SFB's rebuild GEMM (2·K·M·N·P1 FLOPs) at the GPU rate")
      .Field("seed", &SimulateFlags::seed, "seed of the jitter")
      .Field("emulation", &SimulateFlags::emulation,
             "with --calibration: add its emulation terms, the compute overhead per pass of the "
             "emulated cluster (sleep overshoot, gradient writes: c0 + c1·(N−1)), the senders' "
             "CPU per byte and the machine's CPUs shared by every emulated host's sending; for "
             "comparing with bench/cluster runs, not for predicting a real cluster")
      .Field("link_burst", &SimulateFlags::link_burst,
             "every link a token bucket of this many seconds of its rate (bench/cluster's tc "
             "tbf: 10ms); 0: plain rate")
      .Field("json", &SimulateFlags::json, "print JSON instead of a table")
      // Last: the calibration's fields are found by position (kAlphaField ...).
      .Field("lossy_wire", &SimulateFlags::lossy_wire,
             "none: every PS byte float32; bf16 or fp16: the plan puts a PS layer on that 16-bit "
             "wire where the cost model says it pays (half its bytes; docs/planner.md)",
             OneOf({"none", "bf16", "fp16"}))
      .Field("cpu_ns_per_byte", &SimulateFlags::cpu_ns_per_byte,
             "the sender's CPU per byte of a message, in ns, beside alpha (0; with --emulation "
             "the calibration's)",
             [](const double& v) {
               return v >= 0 ? absl::OkStatus() : absl::InvalidArgumentError("must be >= 0");
             })
      .Field("shared_cpus", &SimulateFlags::shared_cpus,
             "0: every host has its own CPUs; k: the message work (both ends) of all hosts "
             "shares k CPUs (an emulated cluster on one machine; with --emulation the "
             "calibration's)",
             InRange(0u, sim::kMaxSharedCpus))
      .Field("replicas", &SimulateFlags::replicas,
             "backups per PS key, as the agents' --replicas (default 1, capped at servers - 1; "
             "0: no replication)",
             InRange(0u, 8u))
      .ByteSizeField("allreduce_bucket_bytes", &SimulateFlags::allreduce_bucket_bytes,
                     "the agents' --allreduce_bucket_bytes: consecutive all-reduce layers run as "
                     "one collective of at most this size (25MiB; 0: one per layer)")
      .Field("allreduce_step", &SimulateFlags::allreduce_step,
             "the cost of one ring all-reduce step, as the agents measure it (0: the latency "
             "and alpha bound each step)")
      .Field("allreduce_cpu_per_step", &SimulateFlags::allreduce_cpu_per_step,
             "with --shared_cpus: each rank's CPU work per ring step, on the shared CPUs (0)")
      .Field("mtu", &SimulateFlags::mtu,
             "the links' MTU: a message crosses as TCP segments of MTU - 52 bytes, each with "
             "its headers and --frame_overhead on the link (1500; 0: the link rate is the "
             "payload rate)",
             [](const uint32_t& v) {
               return v == 0 || (v >= sim::kMinMtu && v <= sim::kMaxMtu)
                          ? absl::OkStatus()
                          : absl::InvalidArgumentError(absl::StrCat(
                                "must be 0 or in [", sim::kMinMtu, ", ", sim::kMaxMtu, "]"));
             })
      .Field("frame_overhead", &SimulateFlags::frame_overhead,
             "bytes per packet on the link besides the IP packet: 38 on an Ethernet wire "
             "(header, FCS, preamble, gap); bench/cluster's tc tbf counts 14 (with --emulation "
             "the calibration's)",
             InRange(0u, 1024u))
      .Field("pass_cpu", &SimulateFlags::pass_cpu,
             "CPU work of each layer pass at its worker's host, on the shared CPUs with "
             "--shared_cpus (an emulated worker's wake-up and gradient write, its agent's "
             "handling; 0; with --emulation the calibration's)")
      .Field("host_cpu_load", &SimulateFlags::host_cpu_load,
             "with --shared_cpus: the CPU each host spends whatever the job does (timers, "
             "heartbeats), as a fraction of one CPU; it takes its share of the shared CPUs (0; "
             "with --emulation the calibration's)",
             [](const double& v) {
               return v >= 0 && v < 1 ? absl::OkStatus()
                                      : absl::InvalidArgumentError("must be in [0, 1)");
             });
  return schema;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "poseidon simulate: %s\n", std::string(status.message()).c_str());
  return 2;
}

absl::StatusOr<sim::JitterKind> ParseJitter(absl::string_view text) {
  if (text == "none") return sim::JitterKind::kNone;
  if (text == "normal") return sim::JitterKind::kNormal;
  if (text == "lognormal") return sim::JitterKind::kLognormal;
  return absl::InvalidArgumentError(absl::StrCat("jitter '", text, "': none, normal, lognormal"));
}

absl::StatusOr<std::vector<uint32_t>> ParseWorkers(absl::string_view text) {
  std::vector<uint32_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    uint32_t n = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &n) || n < 1 ||
        n > planner::kMaxWorkers) {
      return absl::InvalidArgumentError(
          absl::StrCat("--workers: '", part, "' is not a number in [1, ", planner::kMaxWorkers,
                       "]"));
    }
    out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty()) return absl::InvalidArgumentError("--workers: no cluster size");
  return out;
}

// What a calibration file holds (bench/cluster/calibrate.py writes it).
struct Calibration {
  double alpha_seconds = 0;
  double compute_overhead_seconds = 0;           // emulation: c0
  double overhead_per_extra_host_seconds = 0;    // emulation: c1
  double cpu_seconds_per_byte = 0;               // emulation: the senders' CPU per byte
  double shared_cpus = 0;                        // emulation: the machine's CPUs
  double allreduce_step_seconds = 0;             // emulation: a ring step under its load
  double allreduce_cpu_seconds_per_step = 0;     // emulation: a rank's CPU per ring step
  double cpu_seconds_per_pass = 0;               // emulation: a layer pass's CPU work
  double host_cpu_load = 0;                      // emulation: each host's constant CPU
  std::optional<uint32_t> frame_overhead_bytes;  // emulation: the links' framing per packet
  std::string jitter = "none";
  double iteration_sigma = 0;
  double layer_sigma = 0;
};

absl::StatusOr<Calibration> LoadCalibration(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read calibration ", path));
  std::stringstream text;
  text << in.rdbuf();
  google::protobuf::Struct root;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  const auto parsed = google::protobuf::util::JsonStringToMessage(text.str(), &root, options);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration ", path, ": ", std::string(parsed.message())));
  }
  Calibration c;
  auto number = [&](const google::protobuf::Struct& s, const char* key,
                    double* out) -> absl::Status {
    auto it = s.fields().find(key);
    if (it == s.fields().end()) return absl::OkStatus();
    if (!it->second.has_number_value() || it->second.number_value() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration ", path, ": '", key, "' must be a number >= 0"));
    }
    *out = it->second.number_value();
    return absl::OkStatus();
  };
  if (absl::Status s = number(root, "alpha_seconds", &c.alpha_seconds); !s.ok()) return s;
  if (auto it = root.fields().find("emulation"); it != root.fields().end()) {
    if (!it->second.has_struct_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration ", path, ": 'emulation' object"));
    }
    const google::protobuf::Struct& e = it->second.struct_value();
    double frame_overhead = 0;
    const std::pair<const char*, double*> numbers[] = {
        {"compute_overhead_seconds", &c.compute_overhead_seconds},
        {"overhead_per_extra_host_seconds", &c.overhead_per_extra_host_seconds},
        {"cpu_seconds_per_byte", &c.cpu_seconds_per_byte},
        {"shared_cpus", &c.shared_cpus},
        {"allreduce_step_seconds", &c.allreduce_step_seconds},
        {"allreduce_cpu_seconds_per_step", &c.allreduce_cpu_seconds_per_step},
        {"cpu_seconds_per_pass", &c.cpu_seconds_per_pass},
        {"host_cpu_load", &c.host_cpu_load},
        {"frame_overhead_bytes", &frame_overhead},
    };
    for (const auto& [key, out] : numbers) RETURN_IF_ERROR(number(e, key, out));
    if (c.host_cpu_load >= 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration ", path, ": 'host_cpu_load' must be below 1 CPU"));
    }
    if (e.fields().count("frame_overhead_bytes") > 0) {
      if (frame_overhead > 1024 ||
          frame_overhead != static_cast<double>(static_cast<uint32_t>(frame_overhead))) {
        return absl::InvalidArgumentError(
            absl::StrCat("calibration ", path,
                         ": 'frame_overhead_bytes' must be a whole number of bytes (0..1024)"));
      }
      c.frame_overhead_bytes = static_cast<uint32_t>(frame_overhead);
    }
    if (c.shared_cpus > sim::kMaxSharedCpus ||
        c.shared_cpus != static_cast<double>(static_cast<uint32_t>(c.shared_cpus))) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration ", path, ": 'shared_cpus' must be a whole number of CPUs (0..",
                       sim::kMaxSharedCpus, ")"));
    }
  }
  if (auto it = root.fields().find("jitter"); it != root.fields().end()) {
    if (!it->second.has_struct_value()) {
      return absl::InvalidArgumentError(absl::StrCat("calibration ", path, ": 'jitter' object"));
    }
    const google::protobuf::Struct& j = it->second.struct_value();
    if (auto k = j.fields().find("kind"); k != j.fields().end()) c.jitter = k->second.string_value();
    if (absl::Status s = number(j, "iteration_sigma", &c.iteration_sigma); !s.ok()) return s;
    if (absl::Status s = number(j, "layer_sigma", &c.layer_sigma); !s.ok()) return s;
  }
  if (!ParseJitter(c.jitter).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration ", path, ": jitter kind '", c.jitter, "'"));
  }
  return c;
}

struct Row {
  uint32_t workers = 0;
  double overhead_seconds = 0;
  sim::SimResult result;
  double wall_seconds = 0;
  double speedup = 0;
};

}  // namespace

int RunSimulateCommand(const std::vector<std::string>& args) {
  const ConfigSchema<SimulateFlags> schema = SimulateFlagsSchema();
  ConfigInput input;
  input.args = args;
  absl::StatusOr<LoadedConfig<SimulateFlags>> loaded = schema.Parse(input);
  if (!loaded.ok()) return Fail(loaded.status());
  if (loaded->help_requested) {
    std::fputs(schema.Usage().c_str(), stdout);
    std::fputs(
        "\nExample (docs/simulator.md):\n"
        "  poseidon simulate --model inception-v3 --batch 32 --bandwidth 10Gbit \\\n"
        "      --workers 16,32,64,128,256,512,1024 --calibration bench/cluster/calibration.json\n",
        stdout);
    return 0;
  }
  for (const std::string& arg : loaded->unparsed_args) {
    if (arg != "--") {
      return Fail(absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'")));
    }
  }
  SimulateFlags flags = loaded->value;
  auto from_default = [&](size_t field) {
    return field < loaded->origins.size() && loaded->origins[field] == "default";
  };
  // The emulation's overhead per pass at N workers (0 unless --emulation or --compute_overhead).
  double overhead_base = 0, overhead_per_host = 0;
  if (flags.emulation && flags.calibration.empty()) {
    return Fail(absl::InvalidArgumentError("--emulation needs --calibration"));
  }
  if (!flags.calibration.empty()) {
    absl::StatusOr<Calibration> c = LoadCalibration(flags.calibration);
    if (!c.ok()) return Fail(c.status());
    if (from_default(kAlphaField)) flags.alpha = absl::Seconds(c->alpha_seconds);
    if (from_default(kOverheadField) && flags.emulation) {
      overhead_base = c->compute_overhead_seconds;
      overhead_per_host = c->overhead_per_extra_host_seconds;
      flags.compute_overhead = absl::Seconds(overhead_base);
    }
    if (flags.emulation && from_default(kCpuPerByteField)) {
      flags.cpu_ns_per_byte = c->cpu_seconds_per_byte * 1e9;
    }
    if (flags.emulation && from_default(kSharedCpusField)) {
      flags.shared_cpus = static_cast<uint32_t>(c->shared_cpus);
    }
    if (flags.emulation && from_default(kAllreduceStepField)) {
      flags.allreduce_step = absl::Seconds(c->allreduce_step_seconds);
    }
    if (flags.emulation && from_default(kAllreduceCpuPerStepField)) {
      flags.allreduce_cpu_per_step = absl::Seconds(c->allreduce_cpu_seconds_per_step);
    }
    if (flags.emulation && from_default(kPassCpuField)) {
      flags.pass_cpu = absl::Seconds(c->cpu_seconds_per_pass);
    }
    if (flags.emulation && from_default(kHostCpuLoadField)) {
      flags.host_cpu_load = c->host_cpu_load;
    }
    if (flags.emulation && from_default(kFrameOverheadField) && c->frame_overhead_bytes) {
      flags.frame_overhead = *c->frame_overhead_bytes;
    }
    if (from_default(kJitterField)) flags.jitter = c->jitter;
    if (from_default(kJitterSigmaField)) flags.jitter_sigma = c->iteration_sigma;
    if (from_default(kLayerJitterSigmaField)) flags.layer_jitter_sigma = c->layer_sigma;
  }
  absl::StatusOr<std::vector<uint32_t>> sizes = ParseWorkers(flags.workers);
  if (!sizes.ok()) return Fail(sizes.status());
  absl::StatusOr<sim::JitterKind> jitter = ParseJitter(flags.jitter);
  if (!jitter.ok()) return Fail(jitter.status());

  planner::PlannerConfig base;
  base.batch_per_worker = flags.batch;
  base.colocated = flags.colocated;
  base.bandwidth_bytes_per_second = flags.bandwidth;
  base.latency_seconds = absl::ToDoubleSeconds(flags.latency);
  base.block_bytes = flags.block_size;
  base.allreduce_bucket_bytes = flags.allreduce_bucket_bytes;
  base.lossy_wire = *planner::ParseWireType(flags.lossy_wire);  // checked by OneOf
  if (absl::AsciiStrToLower(flags.gpu) != "none") {
    absl::StatusOr<planner::GpuRate> gpu = planner::ParseGpuRate(flags.gpu);
    if (!gpu.ok()) return Fail(gpu.status());
    base.gpu = *gpu;
  }
  absl::StatusOr<poseidon::v1::ModelSpec> model = planner::LoadModel(flags.model);
  if (!model.ok()) return Fail(model.status());
  base.job_id = model->name();

  sim::SimOptions options;
  options.iterations = flags.iterations;
  options.scheme = flags.scheme == "ps"          ? sim::AgentScheme::kPs
                   : flags.scheme == "allreduce" ? sim::AgentScheme::kAllreduce
                                                 : sim::AgentScheme::kAuto;
  options.wfbp = flags.wfbp;
  options.priority = flags.priority;
  options.credit_bytes = flags.credit_bytes;
  options.fusion_from_plan = flags.fusion == "plan";
  options.bucket_bytes = flags.fusion == "bytes" ? flags.bucket_bytes : 0;
  options.alpha_seconds = absl::ToDoubleSeconds(flags.alpha);
  options.allreduce_step_seconds = absl::ToDoubleSeconds(flags.allreduce_step);
  options.allreduce_cpu_seconds_per_step = absl::ToDoubleSeconds(flags.allreduce_cpu_per_step);
  options.compute_overhead_seconds = absl::ToDoubleSeconds(flags.compute_overhead);
  options.cpu_seconds_per_byte = flags.cpu_ns_per_byte * 1e-9;
  options.shared_cpus = flags.shared_cpus;
  options.replicas = flags.replicas;
  options.mtu = flags.mtu;
  options.frame_overhead_bytes = flags.frame_overhead;
  options.pass_cpu_seconds = absl::ToDoubleSeconds(flags.pass_cpu);
  options.host_cpu_load = flags.host_cpu_load;
  options.jitter = {*jitter, flags.jitter_sigma, flags.layer_jitter_sigma};
  options.sfb_rebuild = flags.sfb_rebuild;
  options.seed = flags.seed;
  options.link_burst_bytes =
      static_cast<uint64_t>(flags.bandwidth * absl::ToDoubleSeconds(flags.link_burst));

  std::vector<uint32_t> runs = *sizes;
  if (runs.front() != 1) runs.insert(runs.begin(), 1);
  std::vector<Row> rows;
  double base_iteration = 0;
  for (uint32_t n : runs) {
    planner::PlannerConfig config = base;
    config.workers = n;
    config.servers = flags.servers == 0 ? n : flags.servers;
    if (overhead_base > 0 || overhead_per_host > 0) {
      options.compute_overhead_seconds = overhead_base + overhead_per_host * (n - 1);
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<sim::SimResult> r = sim::Simulate(*model, config, options);
    if (!r.ok()) return Fail(absl::Status(r.status().code(), absl::StrCat("N = ", n, ": ",
                                                                          r.status().message())));
    Row row{n, options.compute_overhead_seconds, *r, absl::ToDoubleSeconds(absl::Now() - start),
            0};
    if (n == 1) base_iteration = r->iteration_seconds;
    row.speedup = base_iteration > 0 ? n * base_iteration / r->iteration_seconds : 0;
    if (n == 1 && sizes->front() != 1) continue;  // the base only
    rows.push_back(row);
  }

  const uint32_t batch_for_samples = [&] {
    if (flags.batch > 0) return flags.batch;
    for (const auto& l : model->layers()) {
      if (l.batch_per_worker() > 0) return l.batch_per_worker();
    }
    return 1u;
  }();
  if (flags.json) {
    JsonWriter w;
    w.BeginObject();
    w.Key("model");
    w.String(model->name());
    w.Key("settings");
    w.BeginObject();
    w.Key("batch");
    w.Unsigned(batch_for_samples);
    w.Key("bandwidth_bytes_per_second");
    w.Number(flags.bandwidth);
    w.Key("latency_seconds");
    w.Number(base.latency_seconds);
    w.Key("colocated");
    w.Bool(flags.colocated);
    w.Key("servers");
    w.Unsigned(flags.servers);
    w.Key("gpu");
    if (base.gpu) {
      w.String(base.gpu->name);
    } else {
      w.Null();
    }
    w.Key("gpu_flops");
    w.Number(base.gpu ? base.gpu->flops_per_second : 0);
    w.Key("scheme");
    w.String(flags.scheme);
    w.Key("wfbp");
    w.Bool(flags.wfbp);
    w.Key("priority");
    w.Bool(flags.priority);
    w.Key("credit_bytes");
    w.Unsigned(flags.credit_bytes);
    w.Key("fusion");
    w.String(flags.fusion);
    w.Key("lossy_wire");
    w.String(flags.lossy_wire);
    w.Key("bucket_bytes");
    w.Unsigned(flags.fusion == "bytes" ? flags.bucket_bytes : 0);
    w.Key("allreduce_bucket_bytes");
    w.Unsigned(flags.allreduce_bucket_bytes);
    w.Key("block_bytes");
    w.Unsigned(flags.block_size);
    w.Key("iterations");
    w.Unsigned(flags.iterations);
    w.Key("alpha_seconds");
    w.Number(options.alpha_seconds);
    w.Key("allreduce_step_seconds");
    w.Number(options.allreduce_step_seconds);
    w.Key("allreduce_cpu_seconds_per_step");
    w.Number(options.allreduce_cpu_seconds_per_step);
    w.Key("compute_overhead_seconds");
    w.Number(options.compute_overhead_seconds);
    w.Key("jitter");
    w.String(flags.jitter);
    w.Key("jitter_sigma");
    w.Number(flags.jitter_sigma);
    w.Key("layer_jitter_sigma");
    w.Number(flags.layer_jitter_sigma);
    w.Key("seed");
    w.Unsigned(flags.seed);
    w.Key("calibration");
    w.String(flags.calibration);
    w.Key("emulation");
    w.Bool(flags.emulation);
    w.Key("link_burst_bytes");
    w.Unsigned(options.link_burst_bytes);
    w.Key("cpu_seconds_per_byte");
    w.Number(options.cpu_seconds_per_byte);
    w.Key("shared_cpus");
    w.Unsigned(options.shared_cpus);
    w.Key("replicas");
    w.Unsigned(options.replicas);
    w.Key("mtu");
    w.Unsigned(options.mtu);
    w.Key("frame_overhead_bytes");
    w.Unsigned(options.frame_overhead_bytes);
    w.Key("pass_cpu_seconds");
    w.Number(options.pass_cpu_seconds);
    w.Key("host_cpu_load");
    w.Number(options.host_cpu_load);
    w.EndObject();
    w.Key("rows");
    w.BeginArray();
    for (const Row& row : rows) {
      const sim::SimResult& r = row.result;
      w.BeginObject();
      w.Key("workers");
      w.Unsigned(r.workers);
      w.Key("servers");
      w.Unsigned(r.servers);
      w.Key("iteration_seconds");
      w.Number(r.iteration_seconds);
      w.Key("period_seconds");
      w.Number(r.period_seconds);
      w.Key("compute_seconds");
      w.Number(r.breakdown.compute_seconds);
      w.Key("exposed_seconds");
      w.Number(r.breakdown.exposed_seconds);
      w.Key("waiting_seconds");
      w.Number(r.breakdown.waiting_seconds);
      w.Key("samples_per_second");
      w.Number(r.workers * batch_for_samples / r.iteration_seconds);
      w.Key("speedup");
      w.Number(row.speedup);
      w.Key("efficiency");
      w.Number(row.speedup / r.workers);
      w.Key("sfb_layers");
      w.Unsigned(r.sfb_layers);
      w.Key("allreduce_layers");
      w.Unsigned(r.allreduce_layers);
      w.Key("tasks_per_iteration");
      w.Unsigned(r.tasks_per_iteration);
      w.Key("messages");
      w.Unsigned(r.messages);
      w.Key("events");
      w.Unsigned(r.events);
      w.Key("max_port_queue");
      w.Unsigned(r.max_port_queue);
      w.Key("max_port_queue_host");
      w.Unsigned(r.max_port_queue_host);
      w.Key("busiest_link_fraction");
      w.Number(r.link_busy_fraction);
      w.Key("compute_overhead_seconds");
      w.Number(row.overhead_seconds);
      w.Key("cpu_seconds_per_iteration");
      w.Number(r.cpu_seconds_per_iteration);
      w.Key("wall_seconds");
      w.Number(row.wall_seconds);
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
    std::fputs(w.str().c_str(), stdout);
    std::fputc('\n', stdout);
  } else {
    std::string out = absl::StrFormat(
        "poseidon simulate: %s, K = %u, %s, %s per host and direction%s, latency %s, %s; scheme "
        "%s%s%s%s; alpha %s%s, compute overhead %s per pass%s, jitter %s (σ %g per iteration, %g "
        "per layer)%s%s; %u iterations, seed %u\n\n",
        model->name(), batch_for_samples,
        base.gpu ? absl::StrFormat("%s (%g TFLOP/s)", base.gpu->name,
                                   base.gpu->flops_per_second / 1e12)
                 : std::string("measured compute"),
        FormatBandwidth(flags.bandwidth),
        flags.mtu > 0 ? absl::StrFormat(" (MTU %u, %u B framing per packet)", flags.mtu,
                                        flags.frame_overhead)
                      : std::string(),
        absl::FormatDuration(flags.latency),
        flags.colocated ? "servers colocated" : "servers on hosts of their own", flags.scheme,
        flags.wfbp ? "" : ", no WFBP", flags.priority ? "" : ", no priority",
        flags.replicas > 0 ? absl::StrFormat(", %u backup(s) per key", flags.replicas)
                           : std::string(", no backups"),
        absl::FormatDuration(flags.alpha),
        flags.cpu_ns_per_byte > 0 ? absl::StrFormat(" + %g ns per byte", flags.cpu_ns_per_byte)
                                  : std::string(),
        absl::FormatDuration(flags.compute_overhead),
        overhead_per_host > 0
            ? absl::StrCat(" + ", absl::FormatDuration(absl::Seconds(overhead_per_host)),
                           " per extra host (emulation)")
            : std::string(),
        flags.jitter, flags.jitter_sigma, flags.layer_jitter_sigma,
        flags.shared_cpus > 0
            ? absl::StrFormat(", every host's sending on %u shared CPUs", flags.shared_cpus)
            : std::string(),
        flags.pass_cpu > absl::ZeroDuration()
            ? absl::StrCat(", ", absl::FormatDuration(flags.pass_cpu), " of CPU per pass")
            : std::string(),
        flags.iterations, flags.seed);
    absl::StrAppend(&out,
                    "| N | s/iter | compute s | exposed s | waiting s | samples/s | speed-up | "
                    "efficiency | SFB layers | max port queue | busiest link | sim s |\n"
                    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const Row& row : rows) {
      const sim::SimResult& r = row.result;
      absl::StrAppendFormat(
          &out, "| %u | %.4f | %.4f | %.4f | %.4f | %.0f | %.2f | %.3f | %u | %u | %.2f | %.2f |\n",
          r.workers, r.iteration_seconds, r.breakdown.compute_seconds,
          r.breakdown.exposed_seconds, r.breakdown.waiting_seconds,
          r.workers * batch_for_samples / r.iteration_seconds, row.speedup,
          row.speedup / r.workers, r.sfb_layers, r.max_port_queue, r.link_busy_fraction,
          row.wall_seconds);
    }
    std::fputs(out.c_str(), stdout);
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}

}  // namespace poseidon::tools
