#include "coordinator/planner/planner.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "coordinator/planner/model_spec.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace poseidon::planner {
namespace {

using poseidon::v1::LayerSpec;
using poseidon::v1::ModelSpec;
using poseidon::v1::Plan;

ModelSpec Builtin(const std::string& name) {
  absl::StatusOr<ModelSpec> model = LoadBuiltinModel(name);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *model : ModelSpec();
}

// The Poseidon paper's headline cluster: 16 machines, each a worker and a server, 10GbE, K = 32.
PlannerConfig PaperCluster(uint32_t machines = 16) {
  PlannerConfig config;
  config.workers = machines;
  config.servers = machines;
  config.batch_per_worker = 32;
  config.colocated = true;
  config.bandwidth_bytes_per_second = 10e9 / 8;
  config.latency_seconds = 50e-6;
  config.gpu = ParseGpuRate("titanx").value();
  return config;
}

const poseidon::v1::LayerPlan* FindLayer(const Plan& plan, const std::string& name) {
  for (const auto& layer : plan.layers()) {
    if (layer.layer_name() == name) return &layer;
  }
  return nullptr;
}

// Every layer's chunks, without the rest of the plan.
Plan ChunksOf(const Plan& plan) {
  Plan chunks;
  for (const auto& layer : plan.layers()) *chunks.add_layers()->mutable_chunks() = layer.chunks();
  return chunks;
}

TEST(PlannerTest, Vgg19_22kAt16MachinesUsesSfbForFcWeightsOnly) {
  const ModelSpec model = Builtin("vgg19-22k");
  const absl::StatusOr<PlanResult> result = BuildPlan(model, PaperCluster());
  ASSERT_TRUE(result.ok()) << result.status();
  const Plan& plan = result->plan;
  ASSERT_EQ(plan.layers_size(), model.layers_size());
  int sfb = 0;
  for (int i = 0; i < plan.layers_size(); ++i) {
    const auto& layer = plan.layers(i);
    const auto& spec = model.layers(i);
    EXPECT_EQ(layer.layer_index(), static_cast<uint32_t>(i));
    EXPECT_EQ(layer.layer_name(), spec.name());
    EXPECT_EQ(layer.priority(), static_cast<uint32_t>(i));  // layer 0 first
    if (spec.kind() == poseidon::v1::LAYER_KIND_FC) {
      EXPECT_EQ(layer.scheme(), poseidon::v1::SYNC_SCHEME_SFB) << spec.name();
      ++sfb;
    } else {
      // Every conv layer and every bias, fc biases included.
      EXPECT_EQ(layer.scheme(), poseidon::v1::SYNC_SCHEME_PS) << spec.name();
    }
    // Every layer has chunks covering it, SFB layers too (the chunks they would use on PS).
    uint64_t covered = 0;
    for (const auto& chunk : layer.chunks()) {
      EXPECT_EQ(chunk.offset(), covered);
      EXPECT_LE(chunk.length(), kDefaultBlockBytes);
      EXPECT_LT(chunk.server_index(), 16u);
      covered += chunk.length();
    }
    EXPECT_EQ(covered, ParameterCount(spec) * 4) << spec.name();
  }
  EXPECT_EQ(sfb, 3);  // fc6, fc7, fc8
  for (const char* name : {"fc6.weight", "fc7.weight", "fc8.weight"}) {
    ASSERT_NE(FindLayer(plan, name), nullptr);
    EXPECT_EQ(FindLayer(plan, name)->scheme(), poseidon::v1::SYNC_SCHEME_SFB);
  }
  // Bookkeeping.
  EXPECT_EQ(plan.plan_epoch(), 1u);
  EXPECT_EQ(plan.max_chunk_bytes(), kDefaultBlockBytes);
  ASSERT_EQ(plan.servers_size(), 16);
  EXPECT_EQ(plan.servers(3).node_id(), "server-3");
  // fc7 under SFB: 2·32·15·8192·4 bytes per worker.
  EXPECT_EQ(FindLayer(plan, "fc7.weight")->predicted_bytes_per_worker(), 31457280u);
  // conv5_4 under PS: 2·S·4.
  EXPECT_EQ(FindLayer(plan, "conv5_4.weight")->predicted_bytes_per_worker(), 18874368u);
  EXPECT_GT(FindLayer(plan, "fc7.weight")->predicted_seconds(), 0);
}

TEST(PlannerTest, Fc7SwitchesToPsBeyond128Machines) {
  const ModelSpec model = Builtin("vgg19-22k");
  for (const uint32_t machines : {2u, 16u, 64u, 127u, 128u, 129u, 256u}) {
    const absl::StatusOr<PlanResult> result = BuildPlan(model, PaperCluster(machines));
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(FindLayer(result->plan, "fc7.weight")->scheme(),
              machines <= 128 ? poseidon::v1::SYNC_SCHEME_SFB : poseidon::v1::SYNC_SCHEME_PS)
        << machines;
  }
}

TEST(PlannerTest, ReportTotalsMatchTheLayers) {
  const ModelSpec model = Builtin("vgg19-22k");
  const absl::StatusOr<PlanResult> result = BuildPlan(model, PaperCluster());
  ASSERT_TRUE(result.ok());
  const PlanReport& report = result->report;
  double plan_bytes = 0;
  double ps_bytes = 0;
  for (const LayerReport& layer : report.layers) {
    ps_bytes += layer.cost.ps_bytes.per_machine;
    plan_bytes += layer.cost.scheme == poseidon::v1::SYNC_SCHEME_SFB
                      ? layer.cost.sfb_bytes->per_machine
                      : layer.cost.ps_bytes.per_machine;
  }
  EXPECT_DOUBLE_EQ(report.plan.compared_bytes, plan_bytes);
  EXPECT_DOUBLE_EQ(report.ps_only.compared_bytes, ps_bytes);
  // 2·229,052,817·30/16·4 bytes per machine under PS only.
  EXPECT_DOUBLE_EQ(ps_bytes, 2.0 * 229052817 * 30 / 16 * 4);
  EXPECT_LT(report.plan.compared_bytes, report.ps_only.compared_bytes / 4);
  EXPECT_EQ(report.sfb_layers, 3u);
  EXPECT_TRUE(report.compute_unknown_reason.empty());
  ASSERT_TRUE(report.plan.iteration.has_value());
  ASSERT_TRUE(report.ps_only.iteration.has_value());
  EXPECT_GE(report.plan.iteration->iteration_seconds, report.plan.iteration->compute_seconds);
  EXPECT_LT(report.plan.iteration->iteration_seconds, report.ps_only.iteration->iteration_seconds);
  ASSERT_TRUE(report.plan.speedup.has_value());
  EXPECT_GT(*report.plan.speedup, *report.ps_only.speedup);
  EXPECT_LE(*report.plan.speedup, 16.0);
  // Placed bytes: every layer's, SFB layers' included (their chunks are placed too).
  const uint64_t stored =
      std::accumulate(report.server_bytes.begin(), report.server_bytes.end(), uint64_t{0});
  uint64_t layer_bytes = 0;
  for (const LayerReport& layer : report.layers) {
    layer_bytes += layer.cost.parameters * 4;
    EXPECT_EQ(layer.chunks, layer.ps_chunks) << layer.name;
  }
  EXPECT_EQ(stored, layer_bytes);
  EXPECT_EQ(stored, uint64_t{229052817} * 4);
}

TEST(PlannerTest, PartitionIsBalancedForEveryModelAndServerCount) {
  for (const std::string& name : BuiltinModelNames()) {
    const ModelSpec model = Builtin(name);
    for (const uint32_t servers : {1u, 3u, 8u, 16u, 32u}) {
      PlannerConfig config = PaperCluster(16);
      config.servers = servers;
      config.colocated = false;
      const absl::StatusOr<PlanResult> result = BuildPlan(model, config);
      ASSERT_TRUE(result.ok()) << result.status();
      const std::vector<uint64_t>& loads = result->report.server_bytes;
      ASSERT_EQ(loads.size(), servers);
      const double mean =
          static_cast<double>(std::accumulate(loads.begin(), loads.end(), uint64_t{0})) / servers;
      const uint64_t max_load = *std::max_element(loads.begin(), loads.end());
      EXPECT_LE(static_cast<double>(max_load),
                mean + static_cast<double>(result->report.largest_chunk_bytes))
          << name << " on " << servers << " servers";
    }
  }
}

TEST(PlannerTest, SameInputSamePlan) {
  for (const char* name : {"resnet-152", "vgg19-22k", "inception-v3"}) {
    const ModelSpec model = Builtin(name);
    const absl::StatusOr<PlanResult> a = BuildPlan(model, PaperCluster(8));
    const absl::StatusOr<PlanResult> b = BuildPlan(model, PaperCluster(8));
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(a->plan, b->plan)) << name;
    std::string bytes_a;
    std::string bytes_b;
    ASSERT_TRUE(a->plan.SerializeToString(&bytes_a));
    ASSERT_TRUE(b->plan.SerializeToString(&bytes_b));
    EXPECT_EQ(bytes_a, bytes_b);
  }
}

TEST(PlannerTest, ChunkKeysAreUniqueAcrossThePlan) {
  const absl::StatusOr<PlanResult> result = BuildPlan(Builtin("resnet-50"), PaperCluster(4));
  ASSERT_TRUE(result.ok());
  std::vector<uint64_t> keys;
  for (const auto& layer : result->plan.layers()) {
    for (const auto& chunk : layer.chunks()) keys.push_back(chunk.key());
  }
  std::sort(keys.begin(), keys.end());
  EXPECT_EQ(std::adjacent_find(keys.begin(), keys.end()), keys.end());
  EXPECT_GE(keys.size(), static_cast<size_t>(result->plan.layers_size()));
}

TEST(PlannerTest, BookkeepingIsCopiedIntoThePlan) {
  PlannerConfig config = PaperCluster(2);
  config.job_id = "job-7";
  config.plan_epoch = 5;
  config.effective_iteration = 1200;
  config.membership_epoch = 9;
  config.block_bytes = 1 << 20;
  config.server_node_ids = {"alpha", "beta"};
  const absl::StatusOr<PlanResult> result = BuildPlan(Builtin("alexnet"), config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->plan.job_id(), "job-7");
  EXPECT_EQ(result->plan.plan_epoch(), 5u);
  EXPECT_EQ(result->plan.effective_iteration(), 1200u);
  EXPECT_EQ(result->plan.membership_epoch(), 9u);
  EXPECT_EQ(result->plan.max_chunk_bytes(), 1u << 20);
  EXPECT_EQ(result->plan.servers(1).node_id(), "beta");
}

TEST(PlannerTest, BatchComesFromTheSpecWhenTheClusterLeavesItOpen) {
  ModelSpec model = Builtin("vgg19");
  PlannerConfig config = PaperCluster();
  config.batch_per_worker = 0;
  const absl::StatusOr<PlanResult> missing = BuildPlan(model, config);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()),
              testing::HasSubstr("layer 0 'conv1_1.weight': batch_per_worker (K) must be in"));
  for (auto& layer : *model.mutable_layers()) layer.set_batch_per_worker(32);
  const absl::StatusOr<PlanResult> from_spec = BuildPlan(model, config);
  ASSERT_TRUE(from_spec.ok()) << from_spec.status();
  EXPECT_EQ(from_spec->report.layers[0].batch_per_worker, 32u);
}

TEST(PlannerTest, ComputeIsUnknownWithoutRateOrTimes) {
  PlannerConfig config = PaperCluster();
  config.gpu.reset();
  const absl::StatusOr<PlanResult> result = BuildPlan(Builtin("alexnet"), config);
  ASSERT_TRUE(result.ok());
  EXPECT_THAT(result->report.compute_unknown_reason,
              testing::HasSubstr("layer 0 'conv1.weight' has no measured times"));
  EXPECT_FALSE(result->report.plan.iteration.has_value());
  EXPECT_FALSE(result->report.plan.speedup.has_value());
}

void ExpectConfigError(const PlannerConfig& config, const std::string& message) {
  const absl::StatusOr<PlanResult> result = BuildPlan(Builtin("alexnet"), config);
  ASSERT_FALSE(result.ok()) << message;
  EXPECT_TRUE(absl::IsInvalidArgument(result.status()));
  EXPECT_THAT(std::string(result.status().message()), testing::HasSubstr(message));
  EXPECT_EQ(result.status().message().find('\n'), absl::string_view::npos);
}

TEST(PlannerTest, ValidationErrorsNameTheField) {
  PlannerConfig config = PaperCluster();
  config.workers = 0;
  ExpectConfigError(config, "workers (P1) must be in [1, 65536], got 0");
  config = PaperCluster();
  config.workers = 70000;
  ExpectConfigError(config, "workers (P1) must be in [1, 65536], got 70000");
  config = PaperCluster();
  config.servers = 0;
  ExpectConfigError(config, "servers (P2) must be in [1, 65536], got 0");
  config = PaperCluster();
  config.batch_per_worker = kMaxBatchPerWorker + 1;
  ExpectConfigError(config, "batch_per_worker (K) must be in [1, 1048576], got 1048577");
  config = PaperCluster();
  config.bandwidth_bytes_per_second = 0;
  ExpectConfigError(config, "bandwidth must be a finite number of bytes/s > 0, got 0");
  config.bandwidth_bytes_per_second = std::numeric_limits<double>::quiet_NaN();
  ExpectConfigError(config, "bandwidth must be");
  config.bandwidth_bytes_per_second = std::numeric_limits<double>::infinity();
  ExpectConfigError(config, "bandwidth must be");
  config = PaperCluster();
  config.latency_seconds = -1;
  ExpectConfigError(config, "latency must be a finite number of seconds >= 0, got -1");
  config = PaperCluster();
  config.block_bytes = 0;
  ExpectConfigError(config, "block_size must be at least 1 byte, got 0");
  config = PaperCluster();
  config.block_bytes = 2;
  ExpectConfigError(config, "block_size 2 bytes is smaller than an element (4 bytes) of layer 0");
  config = PaperCluster();
  config.gpu = GpuRate{"broken", 0};
  ExpectConfigError(config, "gpu 'broken': rate must be a finite FLOP/s > 0, got 0");
  config = PaperCluster();
  config.server_node_ids = {"a"};
  ExpectConfigError(config, "server_node_ids has 1 entries for 16 servers");

  // Model errors come through with the layer named.
  ModelSpec model = Builtin("alexnet");
  model.mutable_layers(14)->add_shape(7);
  const absl::StatusOr<PlanResult> result = BuildPlan(model, PaperCluster());
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(std::string(result.status().message()),
              testing::HasSubstr("layer 14 'fc8.weight': an FC layer's shape must be exactly"));
}

TEST(PlannerTest, NotColocatedComparesPerWorkerBytes) {
  // fc7 at K = 32 not colocated: SFB while P1 <= 65.
  for (const uint32_t workers : {65u, 66u}) {
    PlannerConfig config = PaperCluster(workers);
    config.colocated = false;
    config.servers = 8;
    const absl::StatusOr<PlanResult> result = BuildPlan(Builtin("vgg19"), config);
    ASSERT_TRUE(result.ok());
    EXPECT_EQ(FindLayer(result->plan, "fc7.weight")->scheme(),
              workers <= 65 ? poseidon::v1::SYNC_SCHEME_SFB : poseidon::v1::SYNC_SCHEME_PS);
  }
}

TEST(PlannerTest, TimeRuleDependsOnBandwidthNearTheBoundary) {
  // A 1024x1024 FC layer at K = 258 on 4 colocated machines: SFB moves 12,681,216 bytes per
  // worker, PS 12,582,912 per machine, 98,304 more for SFB. SFB saves one latency leg, so under
  // the time rule it wins while 98,304 <= 2 * bandwidth * latency.
  ModelSpec model;
  model.set_name("boundary");
  auto* fc = model.add_layers();
  fc->set_name("fc.weight");
  fc->set_kind(poseidon::v1::LAYER_KIND_FC);
  fc->add_shape(1024);
  fc->add_shape(1024);
  fc->set_batch_per_worker(258);
  PlannerConfig config;
  config.workers = 4;
  config.servers = 4;
  config.colocated = true;
  config.latency_seconds = 50e-6;
  config.bandwidth_bytes_per_second = 10e9 / 8;  // 2 * bw * latency = 125,000
  config.scheme_rule = SchemeRule::kBytes;
  absl::StatusOr<PlanResult> result = BuildPlan(model, config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_PS);

  config.scheme_rule = SchemeRule::kTime;
  result = BuildPlan(model, config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_SFB);
  EXPECT_FALSE(result->plan.layers(0).chunks().empty());  // the chunks it would use on PS
  EXPECT_EQ(result->report.sfb_layers, 1u);
  const Plan sfb_plan = result->plan;

  config.bandwidth_bytes_per_second = 5e9 / 8;  // 62,500
  result = BuildPlan(model, config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_PS);
  // The scheme moved; the chunks did not.
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(ChunksOf(sfb_plan),
                                                                 ChunksOf(result->plan)));
}

TEST(PlannerTest, ChunksDoNotDependOnSchemesOrTheNetwork) {
  // Whatever the schemes (rule, bandwidth, latency, overrides), one world's chunks are the same.
  for (const char* name : {"vgg19-22k", "alexnet", "resnet-50"}) {
    const ModelSpec model = Builtin(name);
    PlannerConfig base = PaperCluster(16);
    base.servers = 5;
    const absl::StatusOr<PlanResult> reference = BuildPlan(model, base);
    ASSERT_TRUE(reference.ok()) << reference.status();
    std::vector<PlannerConfig> variants;
    for (const double bandwidth : {1e6, 1e8, 1e11}) {
      PlannerConfig config = base;
      config.bandwidth_bytes_per_second = bandwidth;
      config.scheme_rule = SchemeRule::kTime;
      variants.push_back(config);
    }
    PlannerConfig many_workers = base;
    many_workers.workers = 1024;  // every FC layer on PS
    variants.push_back(many_workers);
    PlannerConfig forced = base;
    for (const LayerSpec& spec : model.layers()) {
      forced.scheme_overrides[spec.name()] = poseidon::v1::SYNC_SCHEME_PS;
    }
    variants.push_back(forced);
    for (const PlannerConfig& config : variants) {
      const absl::StatusOr<PlanResult> result = BuildPlan(model, config);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(ChunksOf(reference->plan),
                                                                     ChunksOf(result->plan)))
          << name;
      EXPECT_EQ(result->report.server_bytes, reference->report.server_bytes) << name;
    }
  }
}

TEST(PlannerTest, OverridesForceSchemesAndAreChecked) {
  const ModelSpec model = Builtin("vgg19-22k");
  PlannerConfig config = PaperCluster();
  config.scheme_overrides["fc7.weight"] = poseidon::v1::SYNC_SCHEME_PS;
  config.scheme_overrides["conv1_1.weight"] = poseidon::v1::SYNC_SCHEME_PS;
  absl::StatusOr<PlanResult> result = BuildPlan(model, config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(FindLayer(result->plan, "fc7.weight")->scheme(), poseidon::v1::SYNC_SCHEME_PS);
  EXPECT_EQ(FindLayer(result->plan, "fc6.weight")->scheme(), poseidon::v1::SYNC_SCHEME_SFB);
  EXPECT_EQ(result->report.sfb_layers, 2u);
  // The prediction follows the forced scheme: fc7 under PS moves 2·S·4 bytes per worker.
  EXPECT_EQ(FindLayer(result->plan, "fc7.weight")->predicted_bytes_per_worker(),
            uint64_t{2} * 4096 * 4096 * 4);
  EXPECT_TRUE(result->report.layers[34].overridden);
  EXPECT_FALSE(result->report.layers[32].overridden);

  // 256 machines: the rule picks PS for fc7; forced back to SFB.
  config = PaperCluster(256);
  config.scheme_overrides["fc7.weight"] = poseidon::v1::SYNC_SCHEME_SFB;
  result = BuildPlan(model, config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(FindLayer(result->plan, "fc7.weight")->scheme(), poseidon::v1::SYNC_SCHEME_SFB);

  const auto refused = [&](const char* layer, poseidon::v1::SyncScheme scheme) {
    PlannerConfig bad = PaperCluster();
    bad.scheme_overrides[layer] = scheme;
    const absl::StatusOr<PlanResult> r = BuildPlan(model, bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << layer;
    return std::string(r.status().message());
  };
  EXPECT_EQ(refused("fc9.weight", poseidon::v1::SYNC_SCHEME_PS),
            "scheme override for layer 'fc9.weight': the model has no such layer");
  EXPECT_EQ(refused("conv1_1.weight", poseidon::v1::SYNC_SCHEME_SFB),
            "scheme override for layer 'conv1_1.weight': SFB needs an FC layer, this one is "
            "LAYER_KIND_CONV");
  EXPECT_EQ(refused("fc7.bias", poseidon::v1::SYNC_SCHEME_SFB),
            "scheme override for layer 'fc7.bias': SFB needs an FC layer, this one is "
            "LAYER_KIND_BIAS");
  EXPECT_EQ(refused("fc7.weight", poseidon::v1::SYNC_SCHEME_UNSPECIFIED),
            "scheme override for layer 'fc7.weight': scheme must be PS, SFB or ALLREDUCE, got 0");

  // All-reduce may be forced on any layer, given two workers or more.
  config = PaperCluster();
  config.scheme_overrides["conv1_1.weight"] = poseidon::v1::SYNC_SCHEME_ALLREDUCE;
  result = BuildPlan(model, config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(FindLayer(result->plan, "conv1_1.weight")->scheme(),
            poseidon::v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(result->report.allreduce_layers, 1u);
  config.workers = 1;
  config.servers = 1;
  config.colocated = false;
  EXPECT_EQ(BuildPlan(model, config).status().code(), absl::StatusCode::kInvalidArgument);
}

// One conv layer of S = 2^20 parameters (4 MiB) and a 16-element bias.
ModelSpec ConvAndBias() {
  ModelSpec model;
  model.set_name("conv-and-bias");
  auto* conv = model.add_layers();
  conv->set_name("conv.weight");
  conv->set_kind(poseidon::v1::LAYER_KIND_CONV);
  for (const uint64_t d : {256, 256, 4, 4}) conv->add_shape(d);
  auto* bias = model.add_layers();
  bias->set_name("conv.bias");
  bias->set_kind(poseidon::v1::LAYER_KIND_BIAS);
  bias->add_shape(16);
  return model;
}

// 8 workers and one server, not colocated, 10 Gbit/s, 50 us per leg, the time rule, a measured
// ring step of 20 us (below the latency: the latency counts).
PlannerConfig RingCluster() {
  PlannerConfig config;
  config.workers = 8;
  config.servers = 1;
  config.batch_per_worker = 1;
  config.bandwidth_bytes_per_second = 10e9 / 8;
  config.latency_seconds = 50e-6;
  config.scheme_rule = SchemeRule::kTime;
  config.allreduce_step_seconds = 20e-6;
  return config;
}

TEST(PlannerTest, TheTimeRuleTakesAllReduceWhereItIsFaster) {
  // 8 workers and one server, not colocated: PS's busiest interface is the server's, 2·8·S
  // elements; the ring moves 4·S·7/8 through each worker's. At 10 Gbit/s and 50 us per leg the
  // 4 MiB layer takes 2 legs + 26.8 ms by PS, 14 legs + 5.9 ms by ring: ring. The bias pays the
  // ring's 14 legs for nothing: PS.
  PlannerConfig config = RingCluster();
  absl::StatusOr<PlanResult> result = BuildPlan(ConvAndBias(), config);
  ASSERT_TRUE(result.ok()) << result.status();
  const LayerReport& conv = result->report.layers[0];
  ASSERT_TRUE(conv.cost.allreduce_bytes.has_value());
  EXPECT_DOUBLE_EQ(conv.cost.allreduce_bytes->per_worker, 4.0 * (1 << 20) * 7 / 8 * 4);
  EXPECT_DOUBLE_EQ(*conv.allreduce_seconds,
                   14 * 50e-6 + 4.0 * (1 << 20) * 7 / 8 * 4 / (2 * config.bandwidth_bytes_per_second));
  EXPECT_EQ(result->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(result->report.allreduce_layers, 2u);
  EXPECT_FALSE(result->plan.layers(0).chunks().empty());  // the chunks it would use on PS
  EXPECT_EQ(result->plan.layers(0).predicted_bytes_per_worker(),
            static_cast<uint64_t>(4.0 * (1 << 20) * 7 / 8 * 4));

  // With the agents' all-reduce buckets (the default 25 MiB) the bias shares the conv's
  // collective, whose 14 legs it then costs nothing: the ring; one collective per layer
  // (allreduce_bucket_bytes 0): the bias pays the ring's 14 legs for nothing: PS.
  EXPECT_EQ(result->plan.layers(1).scheme(), poseidon::v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(result->report.layers[1].allreduce_bucket, 1u);
  PlannerConfig per_layer = config;
  per_layer.allreduce_bucket_bytes = 0;
  result = BuildPlan(ConvAndBias(), per_layer);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(result->plan.layers(1).scheme(), poseidon::v1::SYNC_SCHEME_PS);
  EXPECT_EQ(result->report.allreduce_buckets, 0u);

  // The bytes rule is the paper's (PS or SFB); all-reduce off; not measured; a measured step of
  // 3 ms (14 of them: 42 ms + 5.9 > 26.9 ms); colocated with P2 = P1 the ring moves PS's bytes
  // with more legs: PS in all five.
  PlannerConfig bytes = config;
  bytes.scheme_rule = SchemeRule::kBytes;
  PlannerConfig off = config;
  off.allreduce = false;
  PlannerConfig unmeasured = config;
  unmeasured.allreduce_step_seconds.reset();
  PlannerConfig slow = config;
  slow.allreduce_step_seconds = 3e-3;
  PlannerConfig colocated = config;
  colocated.servers = 8;
  colocated.colocated = true;
  for (const PlannerConfig& c : {bytes, off, unmeasured, slow, colocated}) {
    result = BuildPlan(ConvAndBias(), c);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_PS);
    EXPECT_EQ(result->report.allreduce_layers, 0u);
  }
  // One worker: no ring at all.
  PlannerConfig one = config;
  one.workers = 1;
  result = BuildPlan(ConvAndBias(), one);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_FALSE(result->report.layers[0].cost.allreduce_bytes.has_value());
}

// `count` conv layers of 10,000 parameters (40,000 bytes, a multiple of the agents' 64-byte
// alignment) and, when `fc` is set, a 512 x 512 FC layer after them; each conv's forward and
// backward take `compute_ns` when it is not 0.
ModelSpec SmallConvs(int count, bool fc, uint64_t compute_ns = 0) {
  ModelSpec model;
  model.set_name("small-convs");
  for (int i = 0; i < count; ++i) {
    auto* conv = model.add_layers();
    conv->set_name(absl::StrCat("conv", i, ".weight"));
    conv->set_kind(poseidon::v1::LAYER_KIND_CONV);
    for (const uint64_t d : {10, 10, 10, 10}) conv->add_shape(d);
    if (compute_ns != 0) {
      conv->set_forward_time_ns(compute_ns);
      conv->set_backward_time_ns(compute_ns);
    }
  }
  if (fc) {
    auto* layer = model.add_layers();
    layer->set_name("fc.weight");
    layer->set_kind(poseidon::v1::LAYER_KIND_FC);
    for (const uint64_t d : {512, 512}) layer->add_shape(d);
  }
  return model;
}

TEST(PlannerTest, SmallLayersGoByRingTogetherWhereTheirBucketPays) {
  // RingCluster: alone, a 40,000-byte layer takes 2 legs + 256 us by PS (the server's interface
  // carries 2·8·S) and 14 legs (700 us) + 56 us by ring: PS. The agents run 40 of them in one
  // all-reduce bucket: one collective of 14 legs + 40 x 56 us = 2.94 ms, against 40 x 256 us
  // plus one PS message per fused key (B* ~ 125 KB: 13 keys) = 11.5 ms: the ring.
  const PlannerConfig config = RingCluster();
  const NetworkModel network{config.bandwidth_bytes_per_second, config.latency_seconds};
  absl::StatusOr<PlanResult> result = BuildPlan(SmallConvs(40, false), config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->report.allreduce_layers, 40u);
  EXPECT_EQ(result->report.allreduce_buckets, 1u);
  EXPECT_EQ(result->report.allreduce_fused_layers, 40u);
  double seconds = 0;
  SchemeVolume total;
  for (const LayerReport& layer : result->report.layers) {
    EXPECT_EQ(layer.cost.scheme, poseidon::v1::SYNC_SCHEME_ALLREDUCE) << layer.name;
    EXPECT_EQ(layer.allreduce_bucket, 1u) << layer.name;
    seconds += layer.seconds;
    total.per_worker += layer.cost.allreduce_bytes->per_worker;
  }
  // The members' shares add up to the bucket's one collective.
  EXPECT_NEAR(seconds, AllreduceSeconds(total, 8, network, 20e-6), 1e-12);
  EXPECT_NEAR(result->report.plan.sync_seconds, seconds, 1e-12);

  // Buckets of at most 400 KiB: four of ten layers (each 1.26 ms against 2.96 ms): the ring.
  PlannerConfig smaller = config;
  smaller.allreduce_bucket_bytes = 400 << 10;
  result = BuildPlan(SmallConvs(40, false), smaller);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->report.allreduce_layers, 40u);
  EXPECT_EQ(result->report.allreduce_buckets, 4u);
  EXPECT_EQ(result->report.layers[9].allreduce_bucket, 1u);
  EXPECT_EQ(result->report.layers[10].allreduce_bucket, 2u);

  // One collective per layer (the agents' --allreduce_bucket_bytes=0), or a step of 1 ms
  // (14 ms a collective: more than 11.5 ms): PS, no buckets.
  PlannerConfig per_layer = config;
  per_layer.allreduce_bucket_bytes = 0;
  PlannerConfig slow = config;
  slow.allreduce_step_seconds = 1e-3;
  for (const PlannerConfig& c : {per_layer, slow}) {
    result = BuildPlan(SmallConvs(40, false), c);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->report.allreduce_layers, 0u);
    EXPECT_EQ(result->report.allreduce_buckets, 0u);
  }

  // Colocated with P2 = P1 a PS layer moves what the ring moves with 2 legs instead of 14 (and
  // fuses too): PS.
  PlannerConfig colocated = config;
  colocated.servers = 8;
  colocated.colocated = true;
  result = BuildPlan(SmallConvs(40, false), colocated);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->report.allreduce_layers, 0u);
}

TEST(PlannerTest, ABucketGivesWayWhereTheOverlapItLosesCostsMore) {
  // The 40 convs with 1 ms of backward each: alone on PS each layer's 356 us is hidden behind
  // the next layer's backward, and only layer 0's shows; one bucket is sent when layer 0 is
  // ready, and its 2.94 ms all show. The iteration model sees it: PS, no bucket. With 1 us of
  // compute nothing hides anything, and the bucket's one collective beats 40 PS syncs: the ring.
  absl::StatusOr<PlanResult> result = BuildPlan(SmallConvs(40, false, 1000000), RingCluster());
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE(result->report.compute_unknown_reason.empty());
  EXPECT_EQ(result->report.allreduce_layers, 0u);
  EXPECT_EQ(result->report.allreduce_buckets, 0u);
  result = BuildPlan(SmallConvs(40, false, 1000), RingCluster());
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->report.allreduce_layers, 40u);
  EXPECT_EQ(result->report.allreduce_buckets, 1u);
  // The plan's prediction includes the bucket, and is no worse than PS everywhere.
  ASSERT_TRUE(result->report.plan.iteration.has_value());
  EXPECT_LT(result->report.plan.iteration->iteration_seconds,
            result->report.ps_only.iteration->iteration_seconds);
}

TEST(PlannerTest, WithoutComputeTimesABucketMustWinByAMargin) {
  // A ring step of 400 us: the 40 convs' one collective takes 14 x 400 us + 40 x 56 us = 7.8 ms
  // against 11.5 ms by PS. With compute times (1 us a pass: nothing to overlap) the iteration
  // model sees the gain: the ring. Without them the overlap the bucket gives up is unknown and
  // the gain is below kRingBucketMarginWithoutCompute: PS.
  PlannerConfig config = RingCluster();
  config.allreduce_step_seconds = 400e-6;
  absl::StatusOr<PlanResult> result = BuildPlan(SmallConvs(40, false, 1000), config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->report.allreduce_layers, 40u);
  result = BuildPlan(SmallConvs(40, false), config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->report.allreduce_layers, 0u);
}

// A re-plan of a running world: the agents formed their all-reduce buckets from its first plan
// (and form none later), so the planner keeps them and their members on the ring, and forms
// none: a layer moved onto the ring runs alone.
TEST(PlannerTest, ARePlanKeepsTheFirstPlansAllReduceBuckets) {
  PlannerConfig config = RingCluster();
  config.fixed_allreduce_buckets = {1, 1};
  absl::StatusOr<PlanResult> result = BuildPlan(ConvAndBias(), config);
  ASSERT_TRUE(result.ok()) << result.status();
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(result->plan.layers(l).scheme(), poseidon::v1::SYNC_SCHEME_ALLREDUCE) << l;
    EXPECT_EQ(result->plan.layers(l).allreduce_bucket(), 1u) << l;
  }
  // The first plan had no bucket: the bias alone pays the ring's 14 legs for nothing.
  config.fixed_allreduce_buckets = {0, 0};
  result = BuildPlan(ConvAndBias(), config);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(result->plan.layers(1).scheme(), poseidon::v1::SYNC_SCHEME_PS);
  EXPECT_EQ(result->report.allreduce_buckets, 0u);
  // A bucket's member cannot be moved off the ring (the agents would refuse the plan), nor can
  // the ring be off for it; the list must cover the model.
  config.fixed_allreduce_buckets = {1, 1};
  config.scheme_overrides = {{"conv.bias", poseidon::v1::SYNC_SCHEME_PS}};
  result = BuildPlan(ConvAndBias(), config);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(result.status().message().find("layer 1 'conv.bias' is in all-reduce bucket 1"),
            std::string::npos)
      << result.status();
  config.scheme_overrides.clear();
  config.allreduce = false;
  EXPECT_EQ(BuildPlan(ConvAndBias(), config).status().code(),
            absl::StatusCode::kFailedPrecondition);
  config.allreduce = true;
  config.fixed_allreduce_buckets = {1};
  EXPECT_EQ(BuildPlan(ConvAndBias(), config).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PlannerTest, AMemberWhoseBytesCostMoreOnTheRingLeavesItsBucket) {
  // 20 small convs and a 512 x 512 FC layer (K = 1) last: the FC layer's bytes take 1.47 ms on
  // the ring and its SFB factors 73 us, so it leaves the bucket although the bucket as a whole
  // (21 members) beats their other schemes; the convs stay on the ring in one bucket. Its factor
  // buffers follow its gradient, so it could only have been a bucket's last member.
  absl::StatusOr<PlanResult> result = BuildPlan(SmallConvs(20, true), RingCluster());
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->plan.layers(20).scheme(), poseidon::v1::SYNC_SCHEME_SFB);
  EXPECT_EQ(result->report.layers[20].allreduce_bucket, 0u);
  EXPECT_EQ(result->report.allreduce_layers, 20u);
  EXPECT_EQ(result->report.allreduce_buckets, 1u);
  EXPECT_EQ(result->report.layers[19].allreduce_bucket, 1u);
}

// Fusion as the plan's decision (fusion.h): buckets of consecutive single-chunk PS layers, each
// within Plan.bucket_bytes; none when fusion is off; the prediction with the buckets is no worse
// than without them (the iteration model decided where each ends).
TEST(PlannerTest, ThePlanFusesSmallPsLayersIntoBucketsWithinTheTarget) {
  const ModelSpec model = Builtin("inception-v3");
  PlannerConfig config = PaperCluster(8);
  const absl::StatusOr<PlanResult> fused = BuildPlan(model, config);
  ASSERT_TRUE(fused.ok()) << fused.status();
  const Plan& plan = fused->plan;
  EXPECT_GT(fused->report.buckets, 10u);
  EXPECT_TRUE(fused->report.fusion_by_model);
  EXPECT_GT(plan.bucket_bytes(), 0u);
  EXPECT_LE(plan.bucket_bytes(), plan.max_chunk_bytes());
  std::map<uint32_t, std::vector<int>> members;
  for (int i = 0; i < plan.layers_size(); ++i) {
    const auto& layer = plan.layers(i);
    EXPECT_EQ(layer.bucket(), fused->report.layers[i].bucket);
    if (layer.bucket() == 0) continue;
    EXPECT_EQ(layer.scheme(), poseidon::v1::SYNC_SCHEME_PS) << layer.layer_name();
    EXPECT_EQ(layer.chunks_size(), 1) << layer.layer_name();
    members[layer.bucket()].push_back(i);
  }
  EXPECT_EQ(members.size(), fused->report.buckets);
  uint32_t expected_number = 1;
  for (const auto& [number, layers] : members) {
    EXPECT_EQ(number, expected_number++);  // numbered 1, 2, … in forward order
    EXPECT_GE(layers.size(), 2u);
    uint64_t bytes = 0;
    for (size_t j = 0; j < layers.size(); ++j) {
      if (j > 0) EXPECT_EQ(layers[j], layers[j - 1] + 1) << "bucket " << number;
      bytes += plan.layers(layers[j]).chunks(0).length();
    }
    EXPECT_LE(bytes, plan.bucket_bytes()) << "bucket " << number;
  }
  config.fusion = FusionRule::kOff;
  const absl::StatusOr<PlanResult> alone = BuildPlan(model, config);
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(alone->report.buckets, 0u);
  EXPECT_EQ(alone->plan.bucket_bytes(), 0u);
  for (const auto& layer : alone->plan.layers()) EXPECT_EQ(layer.bucket(), 0u);
  // Fusion changes no chunk.
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(ChunksOf(plan),
                                                                 ChunksOf(alone->plan)));
  ASSERT_TRUE(fused->report.plan.iteration.has_value());
  ASSERT_TRUE(alone->report.plan.iteration.has_value());
  EXPECT_LE(fused->report.plan.iteration->iteration_seconds,
            alone->report.plan.iteration->iteration_seconds);
}

TEST(PlannerTest, TheFusionTargetFollowsTheNetwork) {
  // B* is where a key's transfer is 8 times its two legs of latency: four times the bandwidth,
  // four times the bytes (until the block size caps it); without compute times only the size
  // rule decides.
  const ModelSpec model = Builtin("resnet-152");
  PlannerConfig config = PaperCluster(4);
  config.gpu.reset();
  const absl::StatusOr<PlanResult> slow = BuildPlan(model, config);
  config.bandwidth_bytes_per_second *= 4;
  const absl::StatusOr<PlanResult> fast = BuildPlan(model, config);
  ASSERT_TRUE(slow.ok() && fast.ok());
  EXPECT_FALSE(slow->report.fusion_by_model);
  ASSERT_LT(fast->plan.bucket_bytes(), fast->plan.max_chunk_bytes());
  EXPECT_NEAR(static_cast<double>(fast->plan.bucket_bytes()),
              4.0 * static_cast<double>(slow->plan.bucket_bytes()), 40);
  config.bandwidth_bytes_per_second *= 100;
  EXPECT_EQ(BuildPlan(model, config)->plan.bucket_bytes(), config.block_bytes);
  EXPECT_LT(fast->report.buckets, slow->report.buckets);
  EXPECT_GE(fast->report.fused_layers, slow->report.fused_layers);
}

// Wire precision (issue 15): a lossy wire is never chosen unless the job allows it; allowed, a
// PS layer takes it where half the bytes save more time than the casts cost; overrides pin a
// layer exact or lossy; SFB layers stay exact (all-reduce: the next test).
TEST(PlannerTest, ALossyWireIsChosenOnlyWhereAllowedAndWhereItPays) {
  const ModelSpec model = Builtin("vgg19-22k");
  PlannerConfig config = PaperCluster(8);
  config.fusion = FusionRule::kOff;
  const absl::StatusOr<PlanResult> exact = BuildPlan(model, config);
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_EQ(exact->report.lossy_layers, 0u);
  for (const auto& layer : exact->plan.layers()) {
    EXPECT_EQ(layer.wire_type(), poseidon::v1::ELEMENT_TYPE_UNSPECIFIED) << layer.layer_name();
  }
  for (const LayerReport& layer : exact->report.layers) EXPECT_FALSE(layer.ps_lossy_seconds);

  // 10 Gbit/s, 8 machines colocated: PS moves 3.5 elements through a machine's interface for
  // each one of the layer, 5.6 ns in float32, 2.8 ns in bfloat16 plus its 2 ns of casts: every
  // PS layer goes lossy, the SFB layers stay exact.
  config.lossy_wire = poseidon::v1::ELEMENT_TYPE_BF16;
  const absl::StatusOr<PlanResult> bf16 = BuildPlan(model, config);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  uint32_t ps_layers = 0;
  for (int i = 0; i < bf16->plan.layers_size(); ++i) {
    const auto& layer = bf16->plan.layers(i);
    const LayerReport& report = bf16->report.layers[i];
    ASSERT_TRUE(report.ps_lossy_seconds.has_value()) << layer.layer_name();
    EXPECT_LT(*report.ps_lossy_seconds, report.ps_seconds) << layer.layer_name();
    if (layer.scheme() == poseidon::v1::SYNC_SCHEME_PS) {
      ++ps_layers;
      EXPECT_EQ(layer.wire_type(), poseidon::v1::ELEMENT_TYPE_BF16) << layer.layer_name();
      EXPECT_DOUBLE_EQ(layer.predicted_seconds(), *report.ps_lossy_seconds);
      EXPECT_EQ(layer.predicted_bytes_per_worker(),
                exact->plan.layers(i).predicted_bytes_per_worker() / 2)
          << layer.layer_name();
    } else {
      EXPECT_EQ(layer.wire_type(), poseidon::v1::ELEMENT_TYPE_UNSPECIFIED) << layer.layer_name();
    }
    // Schemes and chunks as in the exact plan (the bytes rule does not look at the wire).
    EXPECT_EQ(layer.scheme(), exact->plan.layers(i).scheme()) << layer.layer_name();
  }
  EXPECT_EQ(bf16->report.lossy_layers, ps_layers);
  EXPECT_GT(ps_layers, 10u);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(ChunksOf(bf16->plan),
                                                                 ChunksOf(exact->plan)));
  EXPECT_LT(bf16->report.plan.bytes_per_worker, exact->report.plan.bytes_per_worker);
  EXPECT_EQ(bf16->report.ps_only.bytes_per_worker, exact->report.ps_only.bytes_per_worker)
      << "the PS-only comparison stays float32";
  EXPECT_LT(bf16->report.plan.iteration->iteration_seconds,
            exact->report.plan.iteration->iteration_seconds);

  // 100 Gbit/s: the bytes saved are worth 0.28 ns an element, less than the casts: exact.
  config.bandwidth_bytes_per_second = 100e9 / 8;
  const absl::StatusOr<PlanResult> fast = BuildPlan(model, config);
  ASSERT_TRUE(fast.ok());
  EXPECT_EQ(fast->report.lossy_layers, 0u);
  // fp16's casts cost more (7 ns): it does not pay at 10 Gbit/s, and does at 1 Gbit/s (28 ns
  // saved an element).
  config.bandwidth_bytes_per_second = 10e9 / 8;
  config.lossy_wire = poseidon::v1::ELEMENT_TYPE_F16;
  const absl::StatusOr<PlanResult> fp16 = BuildPlan(model, config);
  ASSERT_TRUE(fp16.ok());
  EXPECT_EQ(fp16->report.lossy_layers, 0u);
  config.bandwidth_bytes_per_second = 1e9 / 8;
  const absl::StatusOr<PlanResult> slow = BuildPlan(model, config);
  ASSERT_TRUE(slow.ok());
  EXPECT_EQ(slow->report.lossy_layers, ps_layers);
  for (const auto& layer : slow->plan.layers()) {
    if (layer.scheme() == poseidon::v1::SYNC_SCHEME_PS) {
      EXPECT_EQ(layer.wire_type(), poseidon::v1::ELEMENT_TYPE_F16) << layer.layer_name();
    }
  }
}

TEST(PlannerTest, WireOverridesPinALayerAndAreChecked) {
  const ModelSpec model = Builtin("alexnet");
  PlannerConfig config = PaperCluster(4);
  config.bandwidth_bytes_per_second = 100e9 / 8;  // nothing lossy pays here
  config.wire_overrides["conv1.weight"] = poseidon::v1::ELEMENT_TYPE_F16;
  const absl::StatusOr<PlanResult> forced = BuildPlan(model, config);
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_EQ(forced->report.lossy_layers, 1u);
  EXPECT_EQ(FindLayer(forced->plan, "conv1.weight")->wire_type(), poseidon::v1::ELEMENT_TYPE_F16);
  EXPECT_TRUE(forced->report.layers[0].wire_overridden);

  // F32 keeps a layer exact where the job allows more.
  config.bandwidth_bytes_per_second = 1e9 / 8;
  config.wire_overrides.clear();
  config.lossy_wire = poseidon::v1::ELEMENT_TYPE_BF16;
  config.wire_overrides["conv2.weight"] = poseidon::v1::ELEMENT_TYPE_F32;
  const absl::StatusOr<PlanResult> pinned = BuildPlan(model, config);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ(FindLayer(pinned->plan, "conv2.weight")->wire_type(),
            poseidon::v1::ELEMENT_TYPE_UNSPECIFIED);
  EXPECT_EQ(FindLayer(pinned->plan, "conv1.weight")->wire_type(), poseidon::v1::ELEMENT_TYPE_BF16);

  auto error = [&](PlannerConfig c) {
    const absl::StatusOr<PlanResult> r = BuildPlan(model, c);
    return r.ok() ? std::string("ok") : std::string(r.status().message());
  };
  PlannerConfig bad = config;
  bad.wire_overrides = {{"nope", poseidon::v1::ELEMENT_TYPE_BF16}};
  EXPECT_NE(error(bad).find("'nope': the model has no such layer"), std::string::npos) << error(bad);
  bad.wire_overrides = {{"conv1.weight", poseidon::v1::ELEMENT_TYPE_F64}};
  EXPECT_NE(error(bad).find("must be F32, BF16 or F16"), std::string::npos) << error(bad);
  bad.wire_overrides = {{"conv1.weight", poseidon::v1::ELEMENT_TYPE_BF16}};
  bad.scheme_overrides = {{"fc6.weight", poseidon::v1::SYNC_SCHEME_SFB}};
  bad.wire_overrides = {{"fc6.weight", poseidon::v1::ELEMENT_TYPE_BF16}};
  EXPECT_NE(error(bad).find("a lossy wire is for PS and all-reduce"), std::string::npos)
      << error(bad);
  bad = config;
  bad.lossy_wire = poseidon::v1::ELEMENT_TYPE_F64;
  EXPECT_NE(error(bad).find("lossy_wire must be F32 (none), BF16 or F16"), std::string::npos);
}

// AR-16: the same cluster as TheTimeRuleTakesAllReduceWhereItIsFaster, the job allowing
// bfloat16. The 4 MiB layer's ring moves half the bytes (2.9 ms instead of 5.9 ms) for 2 ns of
// casts an element (2.1 ms): it goes by all-reduce on bfloat16; the bias stays on PS (its ring's
// 14 legs). At 100 Gbit/s the casts cost more than the bytes save: float32 all-reduce. An
// override puts a forced all-reduce layer on a lossy wire whatever the cost; a lossy wire for a
// layer forced to SFB is refused.
TEST(PlannerTest, AllReduceTakesALossyWireWhereAllowedAndWhereItPays) {
  PlannerConfig config = RingCluster();
  // One collective per layer: the conv's predicted time is its column alone (the bias would
  // share its bucket's steps otherwise: SmallLayersGoByRingTogetherWhereTheirBucketPays).
  config.allreduce_bucket_bytes = 0;
  const absl::StatusOr<PlanResult> exact = BuildPlan(ConvAndBias(), config);
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_FALSE(exact->report.layers[0].allreduce_lossy_seconds.has_value());
  config.lossy_wire = poseidon::v1::ELEMENT_TYPE_BF16;
  const absl::StatusOr<PlanResult> lossy = BuildPlan(ConvAndBias(), config);
  ASSERT_TRUE(lossy.ok()) << lossy.status();
  const LayerReport& conv = lossy->report.layers[0];
  ASSERT_TRUE(conv.cost.allreduce_lossy_bytes.has_value());
  const double elements = 1 << 20;
  EXPECT_DOUBLE_EQ(conv.cost.allreduce_lossy_bytes->per_worker, 4.0 * elements * 7 / 8 * 2);
  EXPECT_DOUBLE_EQ(*conv.allreduce_lossy_seconds,
                   14 * 50e-6 + 4.0 * elements * 7 / 8 * 2 / (2 * config.bandwidth_bytes_per_second) +
                       elements * kBf16CastSecondsPerElement);
  EXPECT_LT(*conv.allreduce_lossy_seconds, *conv.allreduce_seconds);
  EXPECT_EQ(lossy->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(lossy->plan.layers(0).wire_type(), poseidon::v1::ELEMENT_TYPE_BF16);
  EXPECT_EQ(lossy->plan.layers(0).predicted_bytes_per_worker(),
            exact->plan.layers(0).predicted_bytes_per_worker() / 2);
  EXPECT_DOUBLE_EQ(lossy->plan.layers(0).predicted_seconds(), *conv.allreduce_lossy_seconds);
  EXPECT_EQ(lossy->report.lossy_layers, 2u) << "the all-reduce layer and the PS bias";
  EXPECT_LT(lossy->report.plan.bytes_per_worker, exact->report.plan.bytes_per_worker);

  PlannerConfig fast = config;
  fast.bandwidth_bytes_per_second = 100e9 / 8;
  const absl::StatusOr<PlanResult> quick = BuildPlan(ConvAndBias(), fast);
  ASSERT_TRUE(quick.ok());
  EXPECT_EQ(quick->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(quick->plan.layers(0).wire_type(), poseidon::v1::ELEMENT_TYPE_UNSPECIFIED);
  EXPECT_DOUBLE_EQ(quick->plan.layers(0).predicted_seconds(),
                   *quick->report.layers[0].allreduce_seconds);

  const std::string conv_name = ConvAndBias().layers(0).name();
  fast.lossy_wire = poseidon::v1::ELEMENT_TYPE_F32;
  fast.scheme_overrides[conv_name] = poseidon::v1::SYNC_SCHEME_ALLREDUCE;
  fast.wire_overrides[conv_name] = poseidon::v1::ELEMENT_TYPE_F16;
  const absl::StatusOr<PlanResult> forced = BuildPlan(ConvAndBias(), fast);
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_EQ(forced->plan.layers(0).wire_type(), poseidon::v1::ELEMENT_TYPE_F16);
  EXPECT_EQ(forced->report.lossy_layers, 1u);

  // A layer with fewer elements than workers cannot be cut into one shard per worker.
  config.workers = 2048;
  const absl::StatusOr<PlanResult> wide = BuildPlan(ConvAndBias(), config);
  ASSERT_TRUE(wide.ok());
  EXPECT_FALSE(wide->report.layers[1].allreduce_lossy_seconds.has_value())
      << "the bias has " << wide->report.layers[1].cost.parameters << " elements";
}

// AR-LR: the ring cluster, the job allowing rank 4. The conv weight (256 x 4096 as a matrix)
// goes as P (256 x 4) and Q (4096 x 4): two all-reduces of 17,408 elements (28 legs) and 5 ns of
// arithmetic an element. At 1 Gbit/s that is 7.6 ms against the float32 ring's 59 ms: low rank.
// At 10 Gbit/s the arithmetic (5.2 ms) costs what the bytes save (6.6 ms float32 ring): the
// column is priced, not chosen. The bias is no matrix; a wire override of fp32 keeps a layer
// exact; a rank above 1024 is refused.
TEST(PlannerTest, AllReduceGoesAtLowRankWhereAllowedAndWhereItPays) {
  PlannerConfig config = RingCluster();
  // One collective per layer: the conv's predicted time is its column alone (the bias would
  // share its bucket's steps otherwise: SmallLayersGoByRingTogetherWhereTheirBucketPays).
  config.allreduce_bucket_bytes = 0;
  config.bandwidth_bytes_per_second = 1e9 / 8;
  const absl::StatusOr<PlanResult> exact = BuildPlan(ConvAndBias(), config);
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_FALSE(exact->report.layers[0].allreduce_lowrank_seconds.has_value());
  EXPECT_EQ(exact->plan.layers(0).lowrank_rank(), 0u);
  config.lowrank_rank = 4;
  const absl::StatusOr<PlanResult> low = BuildPlan(ConvAndBias(), config);
  ASSERT_TRUE(low.ok()) << low.status();
  const LayerReport& conv = low->report.layers[0];
  ASSERT_TRUE(conv.cost.allreduce_lowrank_bytes.has_value());
  const double factors = 256 * 4 + 4096 * 4;
  EXPECT_DOUBLE_EQ(conv.cost.allreduce_lowrank_bytes->per_worker, 4.0 * factors * 7 / 8 * 4);
  const double elements = 1 << 20;
  EXPECT_NEAR(*conv.allreduce_lowrank_seconds,
              28 * 50e-6 + 4.0 * factors * 7 / 8 * 4 / (2 * config.bandwidth_bytes_per_second) +
                  elements * kLowRankSecondsPerElement,
              1e-12);
  EXPECT_LT(*conv.allreduce_lowrank_seconds, *conv.allreduce_seconds);
  EXPECT_EQ(low->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(low->plan.layers(0).lowrank_rank(), 4u);
  EXPECT_EQ(low->plan.layers(0).wire_type(), poseidon::v1::ELEMENT_TYPE_UNSPECIFIED);
  EXPECT_EQ(low->plan.layers(0).predicted_bytes_per_worker(),
            static_cast<uint64_t>(4.0 * factors * 7 / 8 * 4));
  EXPECT_DOUBLE_EQ(low->plan.layers(0).predicted_seconds(), *conv.allreduce_lowrank_seconds);
  EXPECT_FALSE(low->report.layers[1].allreduce_lowrank_seconds.has_value()) << "a bias";
  EXPECT_EQ(low->plan.layers(1).lowrank_rank(), 0u);
  EXPECT_EQ(low->report.lowrank_layers, 1u);

  PlannerConfig fast = config;
  fast.bandwidth_bytes_per_second = 10e9 / 8;
  const absl::StatusOr<PlanResult> priced = BuildPlan(ConvAndBias(), fast);
  ASSERT_TRUE(priced.ok());
  ASSERT_TRUE(priced->report.layers[0].allreduce_lowrank_seconds.has_value());
  EXPECT_GT(*priced->report.layers[0].allreduce_lowrank_seconds,
            *priced->report.layers[0].allreduce_seconds);
  EXPECT_EQ(priced->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(priced->plan.layers(0).lowrank_rank(), 0u);
  EXPECT_EQ(priced->report.lowrank_layers, 0u);

  PlannerConfig pinned = config;
  pinned.wire_overrides[ConvAndBias().layers(0).name()] = poseidon::v1::ELEMENT_TYPE_F32;
  const absl::StatusOr<PlanResult> kept = BuildPlan(ConvAndBias(), pinned);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->plan.layers(0).lowrank_rank(), 0u) << "an fp32 override keeps it exact";

  PlannerConfig bad = config;
  bad.lowrank_rank = 1025;
  EXPECT_NE(BuildPlan(ConvAndBias(), bad).status().message().find("lowrank_rank must be"),
            std::string::npos);
}

// A low-rank override: at 10 Gbit/s the rule prices the conv weight at rank 4 and keeps it on the
// float32 ring (above); the override sends it at rank 2 whatever the cost, its predicted time
// the rank-2 column's. An override of 0 keeps it off low rank where the rule would choose it
// (1 Gbit/s). Refused, naming the layer: a bias (no matrix), a rank the matrix does not shrink,
// one worker, a scheme override to PS, a wire override, an unknown layer.
TEST(PlannerTest, ALowRankOverrideForcesOrForbidsALayersRank) {
  PlannerConfig config = RingCluster();
  // One collective per layer: the conv's predicted time is its column alone (the bias would
  // share its bucket's steps otherwise: SmallLayersGoByRingTogetherWhereTheirBucketPays).
  config.allreduce_bucket_bytes = 0;
  config.bandwidth_bytes_per_second = 10e9 / 8;
  config.lowrank_rank = 4;
  const std::string conv = ConvAndBias().layers(0).name();
  const std::string bias = ConvAndBias().layers(1).name();
  config.lowrank_overrides[conv] = 2;
  const absl::StatusOr<PlanResult> forced = BuildPlan(ConvAndBias(), config);
  ASSERT_TRUE(forced.ok()) << forced.status();
  const LayerReport& layer = forced->report.layers[0];
  EXPECT_TRUE(layer.lowrank_overridden);
  EXPECT_EQ(forced->plan.layers(0).scheme(), poseidon::v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(forced->plan.layers(0).lowrank_rank(), 2u);
  const double factors = 256 * 2 + 4096 * 2;
  EXPECT_DOUBLE_EQ(layer.cost.allreduce_lowrank_bytes->per_worker, 4.0 * factors * 7 / 8 * 4);
  EXPECT_DOUBLE_EQ(forced->plan.layers(0).predicted_seconds(), *layer.allreduce_lowrank_seconds);
  EXPECT_FALSE(forced->report.layers[1].lowrank_overridden);
  EXPECT_EQ(forced->report.lowrank_layers, 1u);

  PlannerConfig slow = config;
  slow.bandwidth_bytes_per_second = 1e9 / 8;  // where the rule chooses rank 4 (above)
  slow.lowrank_overrides[conv] = 0;
  const absl::StatusOr<PlanResult> kept = BuildPlan(ConvAndBias(), slow);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->plan.layers(0).lowrank_rank(), 0u);
  EXPECT_FALSE(kept->report.layers[0].allreduce_lowrank_seconds.has_value());
  EXPECT_EQ(kept->report.lowrank_layers, 0u);

  auto refused = [&](PlannerConfig bad, const std::string& why) {
    const absl::Status status = BuildPlan(ConvAndBias(), bad).status();
    EXPECT_FALSE(status.ok()) << why;
    EXPECT_NE(status.message().find(why), std::string::npos) << status;
  };
  PlannerConfig bad = config;
  bad.lowrank_overrides = {{bias, 2}};
  refused(bad, "does not shrink its tensor");
  bad.lowrank_overrides = {{conv, 256}};
  refused(bad, "rank 256 does not shrink");
  bad.lowrank_overrides = {{conv, 2000}};
  refused(bad, "the rank must be 0 to 1024");
  bad.lowrank_overrides = {{"nope", 2}};
  refused(bad, "'nope': the model has no such layer");
  bad = config;
  bad.workers = 1;
  refused(bad, "needs at least 2 workers");
  bad = config;
  bad.scheme_overrides[conv] = poseidon::v1::SYNC_SCHEME_PS;
  refused(bad, "the layer's scheme is forced to SYNC_SCHEME_PS");
  bad = config;
  bad.wire_overrides[conv] = poseidon::v1::ELEMENT_TYPE_F32;
  refused(bad, "cannot have a wire override too");
}

TEST(PlannerTest, ABucketHasOneWire) {
  // Inception-V3's small layers fuse; with every other layer pinned exact no bucket mixes wires.
  const ModelSpec model = Builtin("inception-v3");
  PlannerConfig config = PaperCluster(8);
  config.lossy_wire = poseidon::v1::ELEMENT_TYPE_BF16;
  for (int i = 0; i < model.layers_size(); i += 2) {
    config.wire_overrides[model.layers(i).name()] = poseidon::v1::ELEMENT_TYPE_F32;
  }
  const absl::StatusOr<PlanResult> result = BuildPlan(model, config);
  ASSERT_TRUE(result.ok()) << result.status();
  const Plan& plan = result->plan;
  std::map<uint32_t, std::set<int>> wires;
  for (const auto& layer : plan.layers()) {
    if (layer.bucket() != 0) wires[layer.bucket()].insert(layer.wire_type());
  }
  for (const auto& [bucket, types] : wires) EXPECT_EQ(types.size(), 1u) << "bucket " << bucket;
  // Alternating wires leave no two neighbours to fuse.
  EXPECT_EQ(result->report.buckets, 0u);
  config.wire_overrides.clear();
  const absl::StatusOr<PlanResult> uniform = BuildPlan(model, config);
  ASSERT_TRUE(uniform.ok());
  EXPECT_GT(uniform->report.buckets, 0u);
}

}  // namespace
}  // namespace poseidon::planner
