// The layer table: the buffer layout shared with the framework, the plan's validation, bucket
// formation, and the schedules a plan change writes (ComposeSchedule's rules: no change for an
// iteration the framework may have read, one switch at a time, what a layer cannot run).
#include "agent/layer_table.h"

#include <gtest/gtest.h>

#include <random>

#include "absl/strings/str_cat.h"
#include "coordinator/planner/planner.h"

namespace poseidon::agent {
namespace {

LayerDesc Fc(const std::string& name, uint64_t m, uint64_t n, uint32_t k, bool fusable = false) {
  LayerDesc d;
  d.name = name;
  d.kind = PSD_KIND_FC;
  d.shape = {m, n};
  d.batch_k = k;
  d.elements = m * n;
  d.fusable = fusable;
  return d;
}

LayerDesc Bias(const std::string& name, uint64_t n, bool fusable = true) {
  LayerDesc d;
  d.name = name;
  d.kind = PSD_KIND_BIAS;
  d.shape = {n};
  d.elements = n;
  d.fusable = fusable;
  return d;
}

// A plan of one chunk per layer on server 0, keys 1.., the given schemes.
v1::Plan PlanFor(const std::vector<LayerDesc>& descs, const std::vector<v1::SyncScheme>& schemes) {
  v1::Plan plan;
  plan.set_plan_epoch(1);
  plan.add_servers()->set_node_id("s0");
  for (size_t i = 0; i < descs.size(); ++i) {
    auto* l = plan.add_layers();
    l->set_layer_index(static_cast<uint32_t>(i));
    l->set_scheme(schemes[i]);
    l->set_priority(static_cast<uint32_t>(i));
    auto* c = l->add_chunks();
    c->set_key(i + 1);
    c->set_offset(0);
    c->set_length(descs[i].elements * 4);
    c->set_server_index(0);
  }
  return plan;
}

TEST(LayerTable, LayoutIsAlignedAndGivesSfbCapableLayersTheirFactors) {
  const std::vector<LayerDesc> descs = {Fc("fc1", 256, 100, 8), Bias("b1", 3), Fc("big", 4, 4, 64)};
  auto table = BuildLayerTable(
      descs, PlanFor(descs, {v1::SYNC_SCHEME_SFB, v1::SYNC_SCHEME_PS, v1::SYNC_SCHEME_PS}),
      {.world_size = 2, .sfb_possible = true});
  ASSERT_TRUE(table.ok()) << table.status();
  const LayerSpec& fc1 = table->layers[0];
  EXPECT_TRUE(fc1.sfb_capable);
  EXPECT_EQ(fc1.layout.scheme, PSD_SCHEME_SFB);
  EXPECT_EQ(fc1.layout.grad_offset, 0u);
  EXPECT_EQ(fc1.layout.u_offset, 256u * 100 * 4);
  EXPECT_EQ(fc1.layout.v_offset % kBufferAlign, 0u);
  EXPECT_EQ(fc1.layout.v_offset, fc1.layout.u_offset + 8 * 256 * 4);
  EXPECT_EQ(fc1.k, 8u);
  // The bias follows fc1's V, aligned.
  const uint64_t v_end = fc1.layout.v_offset + 8 * 100 * 4;
  EXPECT_EQ(table->layers[1].layout.grad_offset, (v_end + 63) / 64 * 64);
  // Factors larger than the gradient (64 x (4 + 4) > 16): no SFB buffers.
  EXPECT_FALSE(table->layers[2].sfb_capable);
  EXPECT_FALSE(table->layers[2].layout.sfb_buffers);
  EXPECT_EQ(table->layers[2].layout.u_offset, 0u);
  EXPECT_EQ(table->data_bytes % kBufferAlign, 0u);
  EXPECT_GE(table->data_bytes, table->layers[2].layout.grad_offset + 16 * 4);
}

TEST(LayerTable, WithoutSfbNoLayerGetsFactorBuffersAndAnSfbPlanIsRefused) {
  const std::vector<LayerDesc> descs = {Fc("fc1", 256, 100, 8)};
  auto ps = BuildLayerTable(descs, PlanFor(descs, {v1::SYNC_SCHEME_PS}), {.sfb_possible = false});
  ASSERT_TRUE(ps.ok());
  EXPECT_FALSE(ps->layers[0].sfb_capable);
  auto sfb = BuildLayerTable(descs, PlanFor(descs, {v1::SYNC_SCHEME_SFB}), {.sfb_possible = false});
  EXPECT_FALSE(sfb.ok());
}

TEST(LayerTable, RefusesABadPlan) {
  const std::vector<LayerDesc> descs = {Bias("b", 16)};
  v1::Plan plan = PlanFor(descs, {v1::SYNC_SCHEME_PS});
  plan.mutable_layers(0)->mutable_chunks(0)->set_length(65 * 4);  // past the tensor
  EXPECT_FALSE(BuildLayerTable(descs, plan, {}).ok());
  plan = PlanFor(descs, {v1::SYNC_SCHEME_PS});
  plan.mutable_layers(0)->mutable_chunks(0)->set_length(6);  // not whole floats
  EXPECT_FALSE(BuildLayerTable(descs, plan, {}).ok());
  plan = PlanFor(descs, {v1::SYNC_SCHEME_PS});
  plan.mutable_layers(0)->mutable_chunks(0)->set_server_index(3);
  EXPECT_FALSE(BuildLayerTable(descs, plan, {}).ok());
  plan = PlanFor(descs, {v1::SYNC_SCHEME_PS});
  plan.mutable_layers(0)->clear_chunks();
  EXPECT_FALSE(BuildLayerTable(descs, plan, {}).ok()) << "a PS layer without chunks";
  plan = PlanFor({Bias("b", 16), Bias("c", 16)}, {v1::SYNC_SCHEME_PS, v1::SYNC_SCHEME_PS});
  EXPECT_FALSE(BuildLayerTable(descs, plan, {}).ok()) << "a plan for another model";
}

TEST(LayerTable, RefusesBuffersBeyondTheLimit) {
  LayerDesc huge = Bias("huge", kMaxDataBytes / 4 + 1024);
  v1::Plan plan;
  auto* l = plan.add_layers();
  l->set_scheme(v1::SYNC_SCHEME_PS);
  auto* c = l->add_chunks();
  c->set_length(4);
  auto table = BuildLayerTable({huge}, plan, {});
  ASSERT_FALSE(table.ok());
  EXPECT_EQ(table.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(LayerTable, BucketsFuseAdjacentSmallFusableLayersOnly) {
  const std::vector<LayerDesc> descs = {Bias("b1", 16), Bias("b2", 16), Bias("b3", 16, false),
                                        Bias("b4", 16), Bias("b5", 16), Bias("big", 4096)};
  auto table = BuildLayerTable(descs, PlanFor(descs, std::vector(6, v1::SYNC_SCHEME_PS)),
                               {.bucket_bytes = 1024});
  ASSERT_TRUE(table.ok());
  ASSERT_EQ(table->buckets.size(), 2u);
  EXPECT_EQ(table->buckets[0].members, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(table->buckets[1].members, (std::vector<uint32_t>{3, 4}));
  // The bucket's key covers its members' gradients, padding included.
  EXPECT_EQ(table->buckets[0].chunk.length, 64u + 64u);
  EXPECT_EQ(table->layers[2].bucket, -1);
  EXPECT_EQ(table->layers[5].bucket, -1);
  EXPECT_EQ(table->layers[4].bucket, 1);
  auto off = BuildLayerTable(descs, PlanFor(descs, std::vector(6, v1::SYNC_SCHEME_PS)),
                             {.bucket_bytes = 0});
  EXPECT_TRUE(off->buckets.empty());
}

// --fusion=plan: the plan's buckets, split where the agent cannot fuse (a layer the framework
// did not mark fusable) and never joined across two of the plan's buckets.
TEST(LayerTable, ThePlansBucketsAreFormedWhereTheLayersAllowIt) {
  const std::vector<LayerDesc> descs = {Bias("b1", 16), Bias("b2", 16), Bias("b3", 16, false),
                                        Bias("b4", 16), Bias("b5", 16), Bias("b6", 16),
                                        Bias("b7", 16)};
  v1::Plan plan = PlanFor(descs, std::vector(7, v1::SYNC_SCHEME_PS));
  plan.set_max_chunk_bytes(4 << 20);
  const uint32_t planned[] = {1, 1, 1, 2, 2, 3, 3};
  for (int i = 0; i < 7; ++i) plan.mutable_layers(i)->set_bucket(planned[i]);
  // bucket_bytes is not what decides here.
  auto table = BuildLayerTable(descs, plan, {.fusion_from_plan = true, .bucket_bytes = 0});
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_EQ(table->buckets.size(), 3u);
  EXPECT_EQ(table->buckets[0].members, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(table->buckets[1].members, (std::vector<uint32_t>{3, 4}));
  EXPECT_EQ(table->buckets[2].members, (std::vector<uint32_t>{5, 6}));
  EXPECT_EQ(table->layers[2].bucket, -1);
  // A plan without buckets (or from a coordinator that sets no size) fuses nothing.
  for (int i = 0; i < 7; ++i) plan.mutable_layers(i)->set_bucket(0);
  auto none = BuildLayerTable(descs, plan, {.fusion_from_plan = true});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->buckets.empty());
  for (int i = 0; i < 7; ++i) plan.mutable_layers(i)->set_bucket(1);
  plan.set_max_chunk_bytes(0);
  auto unsized = BuildLayerTable(descs, plan, {.fusion_from_plan = true});
  ASSERT_TRUE(unsized.ok());
  EXPECT_TRUE(unsized->buckets.empty());
  // A plan's bucket larger than its own chunk size is cut there.
  plan.set_max_chunk_bytes(128);
  auto capped = BuildLayerTable(descs, plan, {.fusion_from_plan = true});
  ASSERT_TRUE(capped.ok());
  for (const BucketSpec& b : capped->buckets) EXPECT_LE(b.chunk.length, 128u);
  EXPECT_EQ(capped->buckets.size(), 3u);  // {0, 1}, {3, 4}, {5, 6}
}

// A bucket is one key, averaged by the servers or summed: layers asking for the mean over the
// ranks summed (PSD_LAYER_AVERAGE) never share one with layers that want the sum.
TEST(LayerTable, BucketsNeverMixAveragedAndSummedLayers) {
  std::vector<LayerDesc> descs = {Bias("b1", 16), Bias("b2", 16), Bias("b3", 16), Bias("b4", 16),
                                  Bias("b5", 16)};
  for (int i : {0, 1, 2}) descs[i].average = true;
  v1::Plan plan = PlanFor(descs, std::vector(5, v1::SYNC_SCHEME_PS));
  plan.set_max_chunk_bytes(4 << 20);
  for (int i = 0; i < 5; ++i) plan.mutable_layers(i)->set_bucket(1);
  auto table = BuildLayerTable(descs, plan, {.fusion_from_plan = true, .bucket_bytes = 0});
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_EQ(table->buckets.size(), 2u);
  EXPECT_EQ(table->buckets[0].members, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(table->buckets[1].members, (std::vector<uint32_t>{3, 4}));
}

TEST(Schedule, PacksAndAnswersByIteration) {
  const Schedule s{PSD_SCHEME_PS, PSD_SCHEME_SFB, 42};
  EXPECT_EQ(s.At(41), PSD_SCHEME_PS);
  EXPECT_EQ(s.At(42), PSD_SCHEME_SFB);
  const uint64_t word = s.Pack();
  EXPECT_EQ(PSD_SCHEDULE_SCHEME(word, 41), PSD_SCHEME_PS);
  EXPECT_EQ(PSD_SCHEDULE_SCHEME(word, 1000), PSD_SCHEME_SFB);
  const Schedule back = Schedule::Unpack(word);
  EXPECT_EQ(back.before, s.before);
  EXPECT_EQ(back.after, s.after);
  EXPECT_EQ(back.switch_at, s.switch_at);
  LayerSchedules all(3);
  all.Set(1, s);
  EXPECT_EQ(all.At(1, 42), PSD_SCHEME_SFB);
  EXPECT_EQ(all.At(0, 42), PSD_SCHEME_PS);
}

LayerSpec CapableLayer() {
  LayerSpec spec;
  spec.desc = Fc("fc", 256, 256, 8);
  spec.sfb_capable = true;
  spec.chunks = {{1, 0, 256 * 256 * 4, 0}};
  return spec;
}

TEST(ComposeSchedule, SwitchesFromTheEffectiveIterationOn) {
  const LayerSpec spec = CapableLayer();
  const ScheduleChange c =
      ComposeSchedule(spec, Schedule::Fixed(PSD_SCHEME_PS), PSD_SCHEME_SFB, 20, 11);
  ASSERT_EQ(c.outcome, ScheduleChange::kApply);
  EXPECT_TRUE(c.changed);
  EXPECT_EQ(c.schedule.At(19), PSD_SCHEME_PS);
  EXPECT_EQ(c.schedule.At(20), PSD_SCHEME_SFB);
  // And back later: the new word keeps SFB until the next switch.
  const ScheduleChange back = ComposeSchedule(spec, c.schedule, PSD_SCHEME_PS, 30, 25);
  ASSERT_EQ(back.outcome, ScheduleChange::kApply);
  EXPECT_EQ(back.schedule.At(29), PSD_SCHEME_SFB);
  EXPECT_EQ(back.schedule.At(30), PSD_SCHEME_PS);
}

TEST(ComposeSchedule, TheSameSchemeChangesNothing) {
  const ScheduleChange c =
      ComposeSchedule(CapableLayer(), Schedule::Fixed(PSD_SCHEME_PS), PSD_SCHEME_PS, 20, 11);
  ASSERT_EQ(c.outcome, ScheduleChange::kApply);
  EXPECT_FALSE(c.changed);
}

TEST(ComposeSchedule, NeverChangesAnIterationTheFrameworkMayHaveRead) {
  // The framework will post iteration 20 next and may have read its scheme already.
  const ScheduleChange c =
      ComposeSchedule(CapableLayer(), Schedule::Fixed(PSD_SCHEME_PS), PSD_SCHEME_SFB, 20, 20);
  EXPECT_EQ(c.outcome, ScheduleChange::kRefused);
  EXPECT_NE(c.why.find("too late"), std::string::npos) << c.why;
}

TEST(ComposeSchedule, ALatePlanThatChangesNothingHereIsNoError) {
  const ScheduleChange c =
      ComposeSchedule(CapableLayer(), Schedule::Fixed(PSD_SCHEME_PS), PSD_SCHEME_PS, 5, 20);
  EXPECT_EQ(c.outcome, ScheduleChange::kApply);
  EXPECT_FALSE(c.changed);
}

TEST(ComposeSchedule, ASecondSwitchWaitsForThePendingOne) {
  const LayerSpec spec = CapableLayer();
  const Schedule pending{PSD_SCHEME_PS, PSD_SCHEME_SFB, 20};
  // Next post 15: iterations 15..19 are PS, 20.. SFB; a switch back at 30 needs three phases.
  const ScheduleChange c = ComposeSchedule(spec, pending, PSD_SCHEME_PS, 30, 15);
  EXPECT_EQ(c.outcome, ScheduleChange::kDefer);
  // Once the layer passed 20 it composes.
  const ScheduleChange later = ComposeSchedule(spec, pending, PSD_SCHEME_PS, 30, 21);
  ASSERT_EQ(later.outcome, ScheduleChange::kApply);
  EXPECT_EQ(later.schedule.At(29), PSD_SCHEME_SFB);
  EXPECT_EQ(later.schedule.At(30), PSD_SCHEME_PS);
  // A switch that supersedes a pending one at or after it replaces it.
  const ScheduleChange replace = ComposeSchedule(spec, pending, PSD_SCHEME_PS, 18, 15);
  ASSERT_EQ(replace.outcome, ScheduleChange::kApply);
  EXPECT_TRUE(replace.changed);
  EXPECT_EQ(replace.schedule.At(25), PSD_SCHEME_PS);
}

TEST(ComposeSchedule, RefusesWhatTheLayerCannotRun) {
  LayerSpec plain = CapableLayer();
  plain.sfb_capable = false;
  EXPECT_EQ(ComposeSchedule(plain, Schedule::Fixed(PSD_SCHEME_PS), PSD_SCHEME_SFB, 20, 1).outcome,
            ScheduleChange::kRefused);
  LayerSpec fused = CapableLayer();
  fused.bucket = 0;
  EXPECT_EQ(ComposeSchedule(fused, Schedule::Fixed(PSD_SCHEME_PS), PSD_SCHEME_SFB, 20, 1).outcome,
            ScheduleChange::kRefused);
  LayerSpec no_chunks = CapableLayer();
  no_chunks.chunks.clear();
  EXPECT_EQ(
      ComposeSchedule(no_chunks, Schedule::Fixed(PSD_SCHEME_SFB), PSD_SCHEME_PS, 20, 1).outcome,
      ScheduleChange::kRefused);
  // All-reduce: only where the job can run it, never for a bucket's member.
  LayerSpec ring = CapableLayer();
  EXPECT_EQ(ComposeSchedule(ring, Schedule::Fixed(PSD_SCHEME_PS), PSD_SCHEME_ALLREDUCE, 20, 1)
                .outcome,
            ScheduleChange::kRefused);
  ring.allreduce_capable = true;
  const ScheduleChange to_ring =
      ComposeSchedule(ring, Schedule::Fixed(PSD_SCHEME_SFB), PSD_SCHEME_ALLREDUCE, 20, 1);
  EXPECT_EQ(to_ring.outcome, ScheduleChange::kApply);
  EXPECT_EQ(to_ring.schedule.At(19), PSD_SCHEME_SFB);
  EXPECT_EQ(to_ring.schedule.At(20), PSD_SCHEME_ALLREDUCE);
  ring.bucket = 0;
  EXPECT_EQ(ComposeSchedule(ring, Schedule::Fixed(PSD_SCHEME_PS), PSD_SCHEME_ALLREDUCE, 20, 1)
                .outcome,
            ScheduleChange::kRefused);
  // An all-reduce bucket's member stays on all-reduce.
  LayerSpec grouped = CapableLayer();
  grouped.allreduce_capable = true;
  grouped.ring_group = 0;
  for (const uint32_t away : {PSD_SCHEME_PS, PSD_SCHEME_SFB}) {
    const ScheduleChange change =
        ComposeSchedule(grouped, Schedule::Fixed(PSD_SCHEME_ALLREDUCE), away, 20, 1);
    EXPECT_EQ(change.outcome, ScheduleChange::kRefused);
    EXPECT_NE(change.why.find("all-reduce bucket"), std::string::npos) << change.why;
  }
}

// All-reduce buckets (DDP's): runs of adjacent, fusable layers the first plan puts on
// all-reduce, on one wire, up to the size; an SFB-capable layer's factors, a layer on another
// scheme or wire, or one not fusable ends a run; a run of one is no bucket.
TEST(LayerTable, AllReduceBucketsFuseAdjacentFusableAllReduceLayers) {
  const std::vector<LayerDesc> descs = {Bias("a", 100), Bias("b", 100), Bias("c", 100),
                                        Bias("d", 100, /*fusable=*/false), Bias("e", 100),
                                        Bias("f", 100), Bias("g", 100), Bias("h", 100)};
  v1::Plan plan = PlanFor(descs, std::vector(8, v1::SYNC_SCHEME_ALLREDUCE));
  plan.mutable_layers(6)->set_scheme(v1::SYNC_SCHEME_PS);
  plan.mutable_layers(2)->set_wire_type(v1::ELEMENT_TYPE_BF16);
  const LayerTableOptions options{.world_size = 2, .sfb_possible = false,
                                  .allreduce_possible = true, .allreduce_bucket_bytes = 1024};
  auto table = BuildLayerTable(descs, plan, options);
  ASSERT_TRUE(table.ok()) << table.status();
  // a, b (c is on bf16); e, f (g on PS); h alone.
  ASSERT_EQ(table->ring_groups.size(), 2u);
  EXPECT_EQ(table->ring_groups[0].members, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(table->ring_groups[1].members, (std::vector<uint32_t>{4, 5}));
  // The span from the first gradient to the last one's end, padding included (400 -> 448).
  EXPECT_EQ(table->ring_groups[0].bytes, 448u + 400u);
  EXPECT_EQ(table->ring_groups[0].name, "all-reduce bucket a .. b");
  for (const uint32_t l : {2u, 3u, 6u, 7u}) EXPECT_EQ(table->layers[l].ring_group, -1) << l;
  EXPECT_EQ(table->layers[5].ring_group, 1);
  EXPECT_TRUE(table->buckets.empty()) << "no PS fusion asked for";
  // The size bounds a bucket: 848 > 800 leaves none of two.
  LayerTableOptions small = options;
  small.allreduce_bucket_bytes = 800;
  table = BuildLayerTable(descs, plan, small);
  ASSERT_TRUE(table.ok());
  EXPECT_TRUE(table->ring_groups.empty());
  // Off (0), and never without all-reduce.
  small.allreduce_bucket_bytes = 0;
  EXPECT_TRUE(BuildLayerTable(descs, plan, small)->ring_groups.empty());
  LayerTableOptions no_ring = options;
  no_ring.allreduce_possible = false;
  EXPECT_TRUE(BuildLayerTable(descs, plan, no_ring)->ring_groups.empty());
}

// The planner weighs the ring by the buckets the agents will form (coordinator/planner/fusion.h
// RingBuckets): on random models and plans (FC layers with and without factor buffers, biases,
// layers on PS, SFB and all-reduce, bfloat16 wires, bucket sizes), the plan report's all-reduce
// buckets are exactly the layer table's ring groups.
TEST(LayerTable, ThePlannersAllReduceBucketsAreTheAgentsRingGroups) {
  std::mt19937 rng(20261206);
  auto below = [&](uint32_t n) { return static_cast<uint32_t>(rng() % n); };
  constexpr uint32_t kBatch = 4;
  int grouped = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const uint64_t caps[] = {0, 256, 1024, 4096, uint64_t{1} << 20};
    const uint64_t cap = caps[below(5)];
    v1::ModelSpec model;
    model.set_name("random");
    std::vector<LayerDesc> descs;
    planner::PlannerConfig config;
    config.workers = 2;
    config.servers = 1;
    config.batch_per_worker = kBatch;
    config.bandwidth_bytes_per_second = 1.25e9;
    config.allreduce_bucket_bytes = cap;
    const uint32_t layers = 1 + below(12);
    for (uint32_t i = 0; i < layers; ++i) {
      const std::string name = absl::StrCat("layer", i);
      v1::LayerSpec* spec = model.add_layers();
      spec->set_name(name);
      const bool fc = below(2) == 0;
      if (fc) {
        const uint64_t m = 1 + below(40), n = 1 + below(40);
        spec->set_kind(v1::LAYER_KIND_FC);
        spec->add_shape(m);
        spec->add_shape(n);
        descs.push_back(Fc(name, m, n, kBatch, /*fusable=*/true));
      } else {
        const uint64_t n = 1 + below(300);
        spec->set_kind(v1::LAYER_KIND_BIAS);
        spec->add_shape(n);
        descs.push_back(Bias(name, n));
      }
      const uint32_t pick = below(10);
      if (pick < 6) {
        config.scheme_overrides[name] = v1::SYNC_SCHEME_ALLREDUCE;
        if (below(3) == 0) config.wire_overrides[name] = v1::ELEMENT_TYPE_BF16;
      } else if (pick < 8 || !fc) {
        config.scheme_overrides[name] = v1::SYNC_SCHEME_PS;
      } else {
        config.scheme_overrides[name] = v1::SYNC_SCHEME_SFB;
      }
    }
    absl::StatusOr<planner::PlanResult> planned = planner::BuildPlan(model, config);
    ASSERT_TRUE(planned.ok()) << planned.status();
    const LayerTableOptions options{.world_size = 2, .sfb_possible = true,
                                    .allreduce_possible = true, .allreduce_bucket_bytes = cap};
    absl::StatusOr<LayerTable> table = BuildLayerTable(descs, planned->plan, options);
    ASSERT_TRUE(table.ok()) << table.status();
    for (uint32_t i = 0; i < layers; ++i) {
      const uint32_t bucket = planned->report.layers[i].allreduce_bucket;
      EXPECT_EQ(table->layers[i].ring_group, bucket == 0 ? -1 : static_cast<int>(bucket) - 1)
          << "trial " << trial << ", layer " << i << ", bucket size " << cap;
    }
    EXPECT_EQ(table->ring_groups.size(), planned->report.allreduce_buckets) << "trial " << trial;
    grouped += static_cast<int>(table->ring_groups.size());
  }
  EXPECT_GT(grouped, 50) << "the random plans should form many buckets";
}

// Low rank: a layer the first plan puts on all-reduce, whose 2-D view the rank shrinks, by the
// plan's LayerPlan.lowrank_rank or --lowrank_rank (forced, or 0: off); never on PS, never with a
// server-side rule (lossy_possible false); and such a layer stays on all-reduce.
TEST(LayerTable, LowRankOnlyForAllReduceMatricesItShrinks) {
  const std::vector<LayerDesc> descs = {Fc("fc1", 256, 100, 8), Bias("b1", 256),
                                        Fc("fc2", 64, 32, 8), Fc("fc3", 6, 6, 8)};
  v1::Plan plan = PlanFor(descs, {v1::SYNC_SCHEME_ALLREDUCE, v1::SYNC_SCHEME_ALLREDUCE,
                                  v1::SYNC_SCHEME_PS, v1::SYNC_SCHEME_ALLREDUCE});
  for (int i = 0; i < plan.layers_size(); ++i) plan.mutable_layers(i)->set_lowrank_rank(4);
  const LayerTableOptions options{.world_size = 2, .sfb_possible = false,
                                  .allreduce_possible = true};
  auto table = BuildLayerTable(descs, plan, options);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->layers[0].lowrank, 4u);
  EXPECT_EQ(table->layers[0].lowrank_view.rows, 256u);
  EXPECT_EQ(table->layers[0].lowrank_view.cols, 100u);
  EXPECT_EQ(table->layers[1].lowrank, 0u) << "a bias is not a matrix";
  EXPECT_EQ(table->layers[2].lowrank, 0u) << "on PS";
  EXPECT_EQ(table->layers[3].lowrank, 0u) << "(6 + 6) 4 > 36: it would grow";
  // Forced off, and forced to another rank.
  LayerTableOptions off = options;
  off.force_lowrank = 0;
  EXPECT_EQ(BuildLayerTable(descs, plan, off)->layers[0].lowrank, 0u);
  LayerTableOptions two = options;
  two.force_lowrank = 2;
  EXPECT_EQ(BuildLayerTable(descs, plan, two)->layers[0].lowrank, 2u);
  // A server-side rule: exact.
  LayerTableOptions rule = options;
  rule.lossy_possible = false;
  EXPECT_EQ(BuildLayerTable(descs, plan, rule)->layers[0].lowrank, 0u);
  // Its residual lives on all-reduce: a plan moving it is refused.
  const LayerSpec& low = table->layers[0];
  const ScheduleChange change =
      ComposeSchedule(low, Schedule::Fixed(PSD_SCHEME_ALLREDUCE), PSD_SCHEME_PS, 20, 1);
  EXPECT_EQ(change.outcome, ScheduleChange::kRefused);
  EXPECT_NE(change.why.find("low rank"), std::string::npos) << change.why;
}

TEST(LayerTable, AllReduceLayersOnlyWhereTheJobCanRunThem) {
  const std::vector<LayerDesc> descs = {Fc("fc1", 256, 100, 8), Bias("b1", 3)};
  const v1::Plan plan = PlanFor(descs, {v1::SYNC_SCHEME_ALLREDUCE, v1::SYNC_SCHEME_PS});
  auto table = BuildLayerTable(descs, plan, {.world_size = 2, .allreduce_possible = true});
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->layers[0].layout.scheme, PSD_SCHEME_ALLREDUCE);
  EXPECT_TRUE(table->layers[0].allreduce_capable);
  EXPECT_EQ(table->layers[1].layout.scheme, PSD_SCHEME_PS);
  EXPECT_TRUE(table->layers[1].allreduce_capable);  // a later plan may move it
  EXPECT_FALSE(table->layers[0].chunks.empty());    // and the first back to PS
  // Forced: every layer.
  table = BuildLayerTable(descs, PlanFor(descs, {v1::SYNC_SCHEME_PS, v1::SYNC_SCHEME_PS}),
                          {.world_size = 2, .allreduce_possible = true, .force_allreduce = true});
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->layers[1].layout.scheme, PSD_SCHEME_ALLREDUCE);
  // A plan that asks for it where the job cannot (a scheme forced to PS, a server-side rule):
  // PS, on every rank alike.
  table = BuildLayerTable(descs, plan, {.world_size = 2});
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->layers[0].layout.scheme, PSD_SCHEME_PS);
  EXPECT_FALSE(table->layers[0].allreduce_capable);
}

// PSD_LAYER_BY_SERVERS: PS whatever the plan or a forced scheme says, and never movable.
TEST(LayerTable, ALayerThatGoesByTheServersStaysOnPs) {
  std::vector<LayerDesc> descs = {Fc("fc1", 256, 100, 8), Bias("b1", 3)};
  descs[0].by_servers = true;
  for (const LayerTableOptions& options :
       {LayerTableOptions{.world_size = 2, .sfb_possible = true, .allreduce_possible = true},
        LayerTableOptions{.world_size = 2, .allreduce_possible = true, .force_allreduce = true},
        LayerTableOptions{.world_size = 2, .sfb_possible = true, .force_sfb = true}}) {
    for (v1::SyncScheme planned : {v1::SYNC_SCHEME_ALLREDUCE, v1::SYNC_SCHEME_SFB}) {
      auto table = BuildLayerTable(descs, PlanFor(descs, {planned, v1::SYNC_SCHEME_PS}), options);
      ASSERT_TRUE(table.ok()) << table.status();
      EXPECT_EQ(table->layers[0].layout.scheme, PSD_SCHEME_PS) << planned;
      EXPECT_FALSE(table->layers[0].allreduce_capable);
      EXPECT_FALSE(table->layers[0].sfb_capable);
      EXPECT_FALSE(table->layers[0].chunks.empty());
    }
  }
}

}  // namespace
}  // namespace poseidon::agent
