#include "sim/simulator.h"

#include <cmath>
#include <string>
#include <vector>

#include "coordinator/planner/cost_model.h"
#include "coordinator/planner/model_spec.h"
#include "coordinator/planner/time_model.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace poseidon::sim {
namespace {

using ::testing::DoubleNear;

struct TestLayer {
  std::string name;
  poseidon::v1::LayerKind kind;
  std::vector<uint64_t> shape;
  double forward_ms;
  double backward_ms;
};

poseidon::v1::ModelSpec Model(const std::vector<TestLayer>& layers, uint32_t batch = 0) {
  poseidon::v1::ModelSpec model;
  model.set_name("test");
  for (const TestLayer& t : layers) {
    poseidon::v1::LayerSpec* l = model.add_layers();
    l->set_name(t.name);
    l->set_kind(t.kind);
    for (uint64_t d : t.shape) l->add_shape(d);
    l->set_forward_time_ns(static_cast<uint64_t>(t.forward_ms * 1e6));
    l->set_backward_time_ns(static_cast<uint64_t>(t.backward_ms * 1e6));
    if (batch) l->set_batch_per_worker(batch);
  }
  return model;
}

planner::PlannerConfig Cluster(uint32_t workers, uint32_t servers, bool colocated,
                               double bytes_per_second) {
  planner::PlannerConfig c;
  c.workers = workers;
  c.servers = servers;
  c.colocated = colocated;
  c.bandwidth_bytes_per_second = bytes_per_second;
  c.latency_seconds = 0;
  c.block_bytes = uint64_t{4} << 20;
  c.batch_per_worker = 1;  // K only matters for SFB layers (their specs set it)
  return c;
}

SimOptions Options(uint32_t iterations = 11) {
  SimOptions o;
  o.iterations = iterations;
  o.fusion_from_plan = false;
  o.bucket_bytes = 0;
  return o;
}

constexpr double kMs = 1e-3;
constexpr double kEps = 1e-9;
constexpr auto kOther = poseidon::v1::LAYER_KIND_OTHER;

// The agents' all-reduce buckets: two workers, every layer on the ring, 1 GB/s, 1 ms a leg (a
// collective: 2 ms of steps plus S·4 / 1 GB/s: layer a 4 ms, b 1 ms). One collective per layer
// (allreduce_bucket_bytes 0): b's runs during a's backward. One bucket: a single collective of
// 2 + 5 ms once a is posted. With a's backward of 10 ms b's collective was hidden, so the bucket
// loses its overlap: period 3 + 10 + 6 + 3 = 22 ms per layer against 3 + 10 + 7 + 3 = 23 ms.
// With a's backward of 1 ms, b's collective held a's back: 3 + (6 - 4 + 6) + 3 = 15 ms per
// layer against 3 + 1 + 7 + 3 = 14 ms: the bucket pays its steps once.
TEST(SimulatorTest, AnAllReduceBucketIsOneCollectiveOnceItsLastMemberIsReady) {
  for (const double backward_a : {10.0, 1.0}) {
    const auto model =
        Model({{"a", kOther, {1000000}, 1, backward_a}, {"b", kOther, {250000}, 2, 3}});
    planner::PlannerConfig config = Cluster(2, 2, true, 1e9);
    config.latency_seconds = 1e-3;
    SimOptions o = Options();
    o.scheme = AgentScheme::kAllreduce;
    double periods[2];
    for (const uint64_t cap : {uint64_t{0}, uint64_t{25} << 20}) {
      config.allreduce_bucket_bytes = cap;
      absl::StatusOr<SimResult> r = Simulate(model, config, o);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->allreduce_layers, 2u);
      periods[cap == 0 ? 0 : 1] = r->period_seconds;
    }
    EXPECT_THAT(periods[0], DoubleNear((backward_a == 10 ? 22 : 15) * kMs, kEps)) << backward_a;
    EXPECT_THAT(periods[1], DoubleNear((backward_a == 10 ? 23 : 14) * kMs, kEps)) << backward_a;
  }
}

// The ring's work on shared CPUs (an emulation): each rank's 2 steps cost 3 ms of CPU, and one
// CPU serves both ranks, so a collective ends no earlier than 12 ms after it starts: b's
// (posted at 3 ms) at 15 ms, a's (posted at 13 ms, started at 15) at 27 ms; period 27 + 3 = 30 ms
// against 22 without that work. CPUs of their own (a real cluster): the term does not apply.
TEST(SimulatorTest, TheRingsWorkOnSharedCpusBoundsACollective) {
  const auto model = Model({{"a", kOther, {1000000}, 1, 10}, {"b", kOther, {250000}, 2, 3}});
  planner::PlannerConfig config = Cluster(2, 2, true, 1e9);
  config.latency_seconds = 1e-3;
  config.allreduce_bucket_bytes = 0;
  SimOptions o = Options();
  o.scheme = AgentScheme::kAllreduce;
  o.allreduce_cpu_seconds_per_step = 3e-3;
  o.shared_cpus = 1;
  absl::StatusOr<SimResult> r = Simulate(model, config, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->period_seconds, DoubleNear(30 * kMs, kEps));
  o.shared_cpus = 0;
  r = Simulate(model, config, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->period_seconds, DoubleNear(22 * kMs, kEps));
  o.allreduce_cpu_seconds_per_step = -1;
  EXPECT_FALSE(Simulate(model, config, o).ok());
}

// A measured ring step above the latency bounds every step: 2 ms a step, so b's collective
// takes 4 + 1 ms and a's 4 + 4 ms: per layer 3 + 10 + 8 + 3 = 24 ms, one bucket (4 + 5 ms from
// a's post) 3 + 10 + 9 + 3 = 25 ms.
TEST(SimulatorTest, AMeasuredRingStepBoundsEveryStepOfACollective) {
  const auto model = Model({{"a", kOther, {1000000}, 1, 10}, {"b", kOther, {250000}, 2, 3}});
  planner::PlannerConfig config = Cluster(2, 2, true, 1e9);
  config.latency_seconds = 1e-3;
  SimOptions o = Options();
  o.scheme = AgentScheme::kAllreduce;
  o.allreduce_step_seconds = 2e-3;
  for (const uint64_t cap : {uint64_t{0}, uint64_t{25} << 20}) {
    config.allreduce_bucket_bytes = cap;
    absl::StatusOr<SimResult> r = Simulate(model, config, o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(r->period_seconds, DoubleNear((cap == 0 ? 24 : 25) * kMs, kEps)) << cap;
  }
  o.allreduce_step_seconds = -1;
  EXPECT_FALSE(Simulate(model, config, o).ok());
}

// One worker, one server on its own host, one link each way at 1 GB/s. Layer 0: 4 MB (one chunk,
// 4 ms a leg), layer 1: 1 MB (1 ms). Backward of layer 0 (10 ms) hides layer 1's push and pull
// (2 ms); layer 0's push and pull (8 ms, store-and-forward at the server: the answer leaves once
// the whole push is in) are exposed before the next forward. Period = 8 + 1 + 2 + 3 + 10 ms.
TEST(SimulatorTest, OneLinkTwoLayers) {
  const auto model =
      Model({{"a", kOther, {1000000}, 1, 10}, {"b", kOther, {250000}, 2, 3}});
  absl::StatusOr<SimResult> r = Simulate(model, Cluster(1, 1, false, 1e9), Options());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->period_seconds, DoubleNear(24 * kMs, kEps));
  EXPECT_THAT(r->breakdown.compute_seconds, DoubleNear(16 * kMs, kEps));
  EXPECT_THAT(r->breakdown.exposed_seconds, DoubleNear(8 * kMs, kEps));
  EXPECT_THAT(r->breakdown.waiting_seconds, DoubleNear(0, kEps));
  // bench/synth's figure also counts the last iteration's final wait (8 ms over 10 periods).
  EXPECT_THAT(r->iteration_seconds, DoubleNear(24.8 * kMs, kEps));
  EXPECT_EQ(r->tasks_per_iteration, 2u);
}

// The same without WFBP: both layers are posted after the whole backward, so layer 1's transfer
// (posted first) delays layer 0's push by 1 ms: 1 + 8 + 16 ms.
TEST(SimulatorTest, WithoutWfbpTheLaterLayerDelaysTheFirst) {
  const auto model =
      Model({{"a", kOther, {1000000}, 1, 10}, {"b", kOther, {250000}, 2, 3}});
  SimOptions o = Options();
  o.wfbp = false;
  absl::StatusOr<SimResult> r = Simulate(model, Cluster(1, 1, false, 1e9), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->period_seconds, DoubleNear(25 * kMs, kEps));
}

// Links so fast that nothing shows: the iteration is the compute (plus the per-pass overhead),
// whatever the number of workers, so the speed-up is N.
TEST(SimulatorTest, PureComputeBound) {
  const auto model = Model({{"a", kOther, {1000000}, 1, 2},
                            {"b", kOther, {2000000}, 3, 4},
                            {"c", kOther, {10}, 5, 6}});
  for (uint32_t n : {1u, 4u, 16u}) {
    SimOptions o = Options();
    o.compute_overhead_seconds = 0.1 * kMs;
    absl::StatusOr<SimResult> r = Simulate(model, Cluster(n, n, true, 1e18), o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(r->period_seconds, DoubleNear((21 + 6 * 0.1) * kMs, 1e-7)) << n;
    EXPECT_THAT(r->breakdown.exposed_seconds + r->breakdown.waiting_seconds,
                DoubleNear(0, 1e-7));
  }
}

// One 64 MiB layer in 64 chunks of 1 MiB over four colocated machines, compute negligible: the
// iteration approaches the planner's bandwidth bound, PS per machine 2·S·(P1+P2−2)/P2 over the
// full-duplex link (time_model.h PsSeconds), from above (the last chunk's pull cannot overlap
// its push; the first pushes all go to server 0).
TEST(SimulatorTest, PureBandwidthBound) {
  const auto model = Model({{"a", kOther, {16u << 20}, 0.001, 0.001}});
  planner::PlannerConfig c = Cluster(4, 4, true, 1e9);
  c.block_bytes = 1u << 20;
  absl::StatusOr<SimResult> r = Simulate(model, c, Options());
  ASSERT_TRUE(r.ok()) << r.status();
  planner::ClusterShape shape{4, 4, 1, true};
  planner::SchemeVolume ps = planner::PsElements(16u << 20, shape);
  ps.per_machine *= 4;
  const double bound = planner::PsSeconds(ps, true, {1e9, 0});
  EXPECT_GE(r->period_seconds, bound);
  EXPECT_LE(r->period_seconds, 1.1 * bound);
  EXPECT_EQ(r->tasks_per_iteration, 64u);
}

// A 16-bit wire (the plan's LayerPlan.wire_type, where the job allows it and it pays) moves half
// the bytes: the bandwidth-bound period above halves with it (its bound at half the volume).
TEST(SimulatorTest, ALossyWireHalvesTheBandwidthBoundPeriod) {
  const auto model = Model({{"a", kOther, {16u << 20}, 0.001, 0.001}});
  planner::PlannerConfig c = Cluster(4, 4, true, 1e9);
  c.block_bytes = 1u << 20;
  absl::StatusOr<SimResult> exact = Simulate(model, c, Options());
  ASSERT_TRUE(exact.ok()) << exact.status();
  c.lossy_wire = poseidon::v1::ELEMENT_TYPE_BF16;
  absl::StatusOr<SimResult> lossy = Simulate(model, c, Options());
  ASSERT_TRUE(lossy.ok()) << lossy.status();
  planner::ClusterShape shape{4, 4, 1, true};
  planner::SchemeVolume ps = planner::PsElements(16u << 20, shape);
  ps.per_machine *= 2;  // 2-byte elements
  const double bound = planner::PsSeconds(ps, true, {1e9, 0});
  EXPECT_GE(lossy->period_seconds, bound);
  EXPECT_LE(lossy->period_seconds, 1.1 * bound);
  EXPECT_NEAR(lossy->period_seconds / exact->period_seconds, 0.5, 0.05);
  EXPECT_EQ(lossy->tasks_per_iteration, exact->tasks_per_iteration) << "the same chunks";
}

// P workers push one 1 MB chunk to one server on its own host: its switch port takes the P
// pushes one after the other, its uplink the P answers (1 ms each at 1 GB/s). In iteration 1 all
// push at once, so the last worker's answer comes 2·P ms after its post; from then on the
// workers stay staggered by one transfer (the order the answers leave in) and the last one's
// period is (P + 1) ms plus the 2 ms of compute, against 2 + 2 ms for one worker.
TEST(SimulatorTest, IncastAtOneServer) {
  const auto model = Model({{"a", kOther, {250000}, 1, 1}});
  constexpr uint32_t kIterations = 21;
  for (uint32_t p : {1u, 4u, 8u}) {
    absl::StatusOr<SimResult> r = Simulate(model, Cluster(p, 1, false, 1e9), Options(kIterations));
    ASSERT_TRUE(r.ok()) << r.status();
    const double first = 2.0 * p + 2, steady = p + 1.0 + 2;
    EXPECT_THAT(r->period_seconds,
                DoubleNear((first + (kIterations - 2) * steady) / (kIterations - 1) * kMs, kEps))
        << p;
    EXPECT_THAT(r->breakdown.compute_seconds, DoubleNear(2 * kMs, kEps));
    if (p > 1) {
      EXPECT_EQ(r->max_port_queue_host, p);  // the server's host
      EXPECT_EQ(r->max_port_queue, p);       // iteration 1: every worker's push at once
    }
  }
}

// Two workers exchange the factors of one FC layer (SFB: K·(M+N) floats each way, 0.8 ms at
// 100 MB/s), which the planner prefers to PS here; the link is full-duplex, so both directions
// go at once.
TEST(SimulatorTest, SfbOneExchange) {
  const auto model = Model({{"fc", poseidon::v1::LAYER_KIND_FC, {1000, 1000}, 1, 1}}, 10);
  planner::PlannerConfig c = Cluster(2, 2, true, 1e8);
  c.batch_per_worker = 0;
  absl::StatusOr<SimResult> r = Simulate(model, c, Options());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sfb_layers, 1u);
  EXPECT_THAT(r->period_seconds, DoubleNear(0.8 * kMs + 2 * kMs, kEps));
  SimOptions ps = Options();
  ps.scheme = AgentScheme::kPs;
  absl::StatusOr<SimResult> r_ps = Simulate(model, c, ps);
  ASSERT_TRUE(r_ps.ok()) << r_ps.status();
  EXPECT_EQ(r_ps->sfb_layers, 0u);
  EXPECT_GT(r_ps->period_seconds, 10 * r->period_seconds);
}

// Many small messages: the per-message cost alpha bounds them, not the link. 100 chunks of 4 KB
// to a server on its own host at 1 TB/s, alpha 10 us: the worker prepares a push every 10 us,
// the server an answer 10 us after each push is in, so the last answer is in at 101 · 10 us.
TEST(SimulatorTest, PerMessageCostBoundsSmallMessages) {
  const auto model = Model({{"a", kOther, {100 * 1024}, 0.001, 0.001}});
  planner::PlannerConfig c = Cluster(1, 1, false, 1e12);
  c.block_bytes = 4096;
  SimOptions o = Options();
  o.alpha_seconds = 10e-6;
  absl::StatusOr<SimResult> r = Simulate(model, c, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tasks_per_iteration, 100u);
  // 0.002 ms of compute; the transfers of 4 KB at 1 TB/s add 4 ns each.
  EXPECT_THAT(r->period_seconds, DoubleNear(1.010 * kMs + 0.002 * kMs, 1e-7));
}

// Replicate after aggregation: one worker, one 1 MB chunk (1 ms a leg at 1 GB/s) on one of two
// servers on hosts of their own. Without backups: push and answer, 2 ms + 2 ms of compute. With
// one backup the server first sends the aggregated chunk to the other server (1 ms on its
// uplink) and answers once the acknowledgement is back (no latency here): 5 ms. With one
// server there is nobody to replicate to (replicas are capped at servers - 1).
TEST(SimulatorTest, ReplicationDelaysTheAnswersByOneCopyToTheBackup) {
  const auto model = Model({{"a", kOther, {250000}, 1, 1}});
  auto period = [&](uint32_t servers, uint32_t replicas) {
    SimOptions o = Options();
    o.replicas = replicas;
    absl::StatusOr<SimResult> r = Simulate(model, Cluster(1, servers, false, 1e9), o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->period_seconds : 0.0;
  };
  EXPECT_THAT(period(2, 0), DoubleNear(4 * kMs, kEps));
  EXPECT_THAT(period(2, 1), DoubleNear(5 * kMs, kEps));
  EXPECT_THAT(period(2, 3), DoubleNear(5 * kMs, kEps)) << "capped at one backup";
  EXPECT_THAT(period(1, 1), DoubleNear(4 * kMs, kEps)) << "no other server";
}

// CPU per byte at both ends: one worker, one 1 MB chunk to a server on its own host over
// links too fast to matter, 1 ns per byte: the push costs 1 ms at the worker and 1 ms at the
// server, the answer 1 ms at the server and 1 ms at the worker: 4 ms + 2 ms of compute.
TEST(SimulatorTest, CpuPerByteCostsBothEnds) {
  const auto model = Model({{"a", kOther, {250000}, 1, 1}});
  SimOptions o = Options();
  o.cpu_seconds_per_byte = 1e-9;
  absl::StatusOr<SimResult> r = Simulate(model, Cluster(1, 1, false, 1e15), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->period_seconds, DoubleNear(6 * kMs, 1e-7));
  EXPECT_THAT(r->cpu_seconds_per_iteration, DoubleNear(4 * kMs, kEps));
}

// Shared CPUs (an emulated cluster: every host a process on one machine). Four workers push one
// tiny chunk each to one server on its own host at 1 TB/s; a message costs its sender alpha =
// 100 us. Each host with CPUs of its own: the pushes go at once, the server answers the four one
// after the other, and in the steady state the last worker's next push leaves 2 us (its
// compute) + one message after its answer: a period of 2 us + 5 messages. On one shared CPU all
// eight messages of an iteration take turns: 8 messages (the compute hides behind the others'
// turns). On as many CPUs as hosts nothing waits for a CPU: the first case again.
TEST(SimulatorTest, SharedCpusMakeEveryHostsSendingTakeTurns) {
  const auto model = Model({{"a", kOther, {1024}, 0.001, 0.001}});
  const planner::PlannerConfig c = Cluster(4, 1, false, 1e12);
  constexpr double kWork = 100e-6;
  auto run = [&](uint32_t shared_cpus) {
    SimOptions o = Options(21);
    o.alpha_seconds = kWork;
    o.shared_cpus = shared_cpus;
    absl::StatusOr<SimResult> r = Simulate(model, c, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : SimResult{};
  };
  const SimResult own = run(0), one = run(1), enough = run(5);
  EXPECT_THAT(own.cpu_seconds_per_iteration, DoubleNear(8 * kWork, kEps));
  EXPECT_THAT(one.cpu_seconds_per_iteration, DoubleNear(8 * kWork, kEps));
  EXPECT_THAT(own.period_seconds, DoubleNear(0.002 * kMs + 5 * kWork, 1e-7));
  // (each message's 4 ns on the links, out of the CPU's shadow, adds about 0.1 us)
  EXPECT_THAT(one.period_seconds, DoubleNear(8 * kWork, 0.5e-6));
  EXPECT_EQ(enough.period_seconds, own.period_seconds);
  EXPECT_EQ(enough.events, own.events);
}

// Shared CPUs with bursts: two workers push ten 4 KB chunks each at once to a server on a
// third host (links too fast to matter), alpha = 100 us per message. The work of a host's burst
// is serial, and each host's burst is booked as a whole when it is posted. On as many shared
// CPUs as hosts every host still runs on a CPU of its own: the figures equal those of CPUs of
// their own. (Booking each piece after the CPUs' last booking left the gaps between one host's
// pieces unused: both workers' bursts took turns, as on one CPU.)
TEST(SimulatorTest, SharedCpusRunEveryHostsBurstSideBySide) {
  const auto model = Model({{"a", kOther, {10 * 1024}, 0.001, 0.001}});
  planner::PlannerConfig c = Cluster(2, 1, false, 1e12);
  c.block_bytes = 4096;
  auto run = [&](uint32_t shared_cpus) {
    SimOptions o = Options(21);
    o.alpha_seconds = 100e-6;
    o.shared_cpus = shared_cpus;
    absl::StatusOr<SimResult> r = Simulate(model, c, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : SimResult{};
  };
  const SimResult own = run(0), shared = run(3);
  EXPECT_EQ(own.tasks_per_iteration, 10u);
  EXPECT_THAT(shared.period_seconds, DoubleNear(own.period_seconds, 1e-9));
}

// Framing: one worker pushes one 1,448,000-byte chunk (1,000 full segments at MTU 1500) to a
// server on a host of its own at 1 GB/s. Each segment takes 52 bytes of IPv4 and TCP headers and
// 38 of Ethernet framing on the link: 1,538,000 bytes a leg, 1.538 ms instead of 1.448. With
// tc tbf's 14 bytes: 1,514,000.
TEST(SimulatorTest, FramingMakesEveryByteCostItsSegmentsHeaders) {
  const auto model = Model({{"a", kOther, {362000}, 1, 1}});
  auto period = [&](uint32_t mtu, uint32_t overhead) {
    SimOptions o = Options();
    o.mtu = mtu;
    o.frame_overhead_bytes = overhead;
    absl::StatusOr<SimResult> r = Simulate(model, Cluster(1, 1, false, 1e9), o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->period_seconds : 0.0;
  };
  EXPECT_THAT(period(0, 38), DoubleNear(2 * kMs + 2 * 1.448 * kMs, kEps)) << "no framing";
  EXPECT_THAT(period(1500, 38), DoubleNear(2 * kMs + 2 * 1.538 * kMs, kEps));
  EXPECT_THAT(period(1500, 14), DoubleNear(2 * kMs + 2 * 1.514 * kMs, kEps));
  SimOptions o = Options();
  for (const uint32_t mtu : {100u, 70000u}) {
    o.mtu = mtu;
    EXPECT_FALSE(Simulate(model, Cluster(1, 1, false, 1e9), o).ok()) << mtu;
  }
  o.mtu = 1500;
  o.frame_overhead_bytes = 5000;
  EXPECT_FALSE(Simulate(model, Cluster(1, 1, false, 1e9), o).ok());
}

// A pass's CPU work: two workers, one tiny layer (1 ms forward, 1 ms backward), links too fast
// to matter, 0.5 ms of CPU after each pass. With CPUs of their own (or two shared): 3 ms an
// iteration. On one shared CPU the workers' passes take turns: worker 0's forward work runs
// 1-1.5 ms, worker 1's 1.5-2; their backward ends 3 and 3.5 ms: 3.5 ms an iteration.
TEST(SimulatorTest, APassesCpuWorkTakesItsTurnOnTheSharedCpus) {
  const auto model = Model({{"a", kOther, {1024}, 1, 1}});
  auto run = [&](uint32_t shared_cpus) {
    SimOptions o = Options();
    o.pass_cpu_seconds = 0.5e-3;
    o.shared_cpus = shared_cpus;
    absl::StatusOr<SimResult> r = Simulate(model, Cluster(2, 2, true, 1e15), o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : SimResult{};
  };
  const SimResult own = run(0), two = run(2), one = run(1);
  EXPECT_THAT(own.period_seconds, DoubleNear(3 * kMs, 1e-8));
  EXPECT_THAT(two.period_seconds, DoubleNear(3 * kMs, 1e-8));
  EXPECT_THAT(one.period_seconds, DoubleNear(3.5 * kMs, 1e-8));
  EXPECT_THAT(one.cpu_seconds_per_iteration, DoubleNear(2 * kMs, kEps)) << "2 passes x 2 workers";
  SimOptions o = Options();
  o.pass_cpu_seconds = -1;
  EXPECT_FALSE(Simulate(model, Cluster(2, 2, true, 1e15), o).ok());
}

// The hosts' constant load: two hosts at half a CPU each on two shared CPUs leave each piece of
// work half a CPU: the 0.5 ms of a pass holds a CPU 1 ms (2 + 2 × 1 ms an iteration); the work
// counted stays 0.5 ms a pass. A load the CPUs cannot carry is refused.
TEST(SimulatorTest, TheHostsLoadTakesItsShareOfTheSharedCpus) {
  const auto model = Model({{"a", kOther, {1024}, 1, 1}});
  SimOptions o = Options();
  o.pass_cpu_seconds = 0.5e-3;
  o.shared_cpus = 2;
  o.host_cpu_load = 0.5;
  absl::StatusOr<SimResult> r = Simulate(model, Cluster(2, 2, true, 1e15), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->period_seconds, DoubleNear(4 * kMs, 1e-8));
  EXPECT_THAT(r->cpu_seconds_per_iteration, DoubleNear(2 * kMs, kEps));
  o.host_cpu_load = 1;
  EXPECT_FALSE(Simulate(model, Cluster(2, 2, true, 1e15), o).ok());
  o.host_cpu_load = 0.5;
  o.shared_cpus = 0;  // CPUs of their own: no load on anybody's
  r = Simulate(model, Cluster(2, 2, true, 1e15), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->period_seconds, DoubleNear(3 * kMs, 1e-8));
}

TEST(SimulatorTest, RejectsBadCpuSettings) {
  const auto model = Model({{"a", kOther, {1024}, 1, 1}});
  SimOptions o = Options();
  o.cpu_seconds_per_byte = -1e-9;
  EXPECT_FALSE(Simulate(model, Cluster(2, 2, true, 1e9), o).ok());
  o.cpu_seconds_per_byte = std::nan("");
  EXPECT_FALSE(Simulate(model, Cluster(2, 2, true, 1e9), o).ok());
  o.cpu_seconds_per_byte = 0;
  o.shared_cpus = kMaxSharedCpus + 1;  // not an allocation of billions of CPUs
  EXPECT_FALSE(Simulate(model, Cluster(2, 2, true, 1e9), o).ok());
}

// A token-bucket link (tc tbf): after the compute the bucket is full again, so the first
// `burst` bytes of each transfer cross at once. One worker, one 4 MB chunk, 1 MB of burst on
// each of the four links' buckets (worker up, server down, server up, worker down): the push
// takes (4 − 1) ms on the worker's uplink; the server's port, cut-through, ends with it; the
// answer likewise 3 ms: 6 ms + 2 ms of compute instead of 8 + 2.
TEST(SimulatorTest, TokenBucketLinksSendTheirBurstAtOnce) {
  const auto model = Model({{"a", kOther, {1000000}, 1, 1}});
  SimOptions o = Options();
  o.link_burst_bytes = 1000000;
  absl::StatusOr<SimResult> r = Simulate(model, Cluster(1, 1, false, 1e9), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->period_seconds, DoubleNear(8 * kMs, kEps));
}

// Jitter is drawn from a seeded generator: the same seed gives the same run, another seed
// another one; with stragglers, BSP makes more workers slower (the slowest of N each iteration).
TEST(SimulatorTest, DeterministicGivenSeed) {
  absl::StatusOr<poseidon::v1::ModelSpec> model = planner::LoadBuiltinModel("googlenet");
  ASSERT_TRUE(model.ok());
  auto run = [&](uint32_t n, uint64_t seed) {
    planner::PlannerConfig c = Cluster(n, n, true, 1.25e9);
    c.latency_seconds = 20e-6;
    c.batch_per_worker = 32;
    c.gpu = planner::GpuRate{"titanx", 6.1e12};
    SimOptions o;
    o.iterations = 10;
    o.alpha_seconds = 30e-6;
    o.jitter = {JitterKind::kLognormal, 0.05, 0.2};
    o.seed = seed;
    absl::StatusOr<SimResult> r = Simulate(*model, c, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return *r;
  };
  const SimResult a = run(8, 7), b = run(8, 7), other = run(8, 8);
  EXPECT_EQ(a.iteration_seconds, b.iteration_seconds);
  EXPECT_EQ(a.events, b.events);
  EXPECT_EQ(a.breakdown.waiting_seconds, b.breakdown.waiting_seconds);
  EXPECT_NE(a.iteration_seconds, other.iteration_seconds);
  EXPECT_GT(run(8, 7).period_seconds, run(1, 7).period_seconds);
}

TEST(SimulatorTest, RejectsUnknownCompute) {
  absl::StatusOr<poseidon::v1::ModelSpec> model = planner::LoadBuiltinModel("alexnet");
  ASSERT_TRUE(model.ok());
  planner::PlannerConfig c = Cluster(2, 2, true, 1e9);  // no GPU rate: FLOPs give no time
  EXPECT_FALSE(Simulate(*model, c, Options()).ok());
  SimOptions one = Options(1);
  c.gpu = planner::GpuRate{"titanx", 6.1e12};
  EXPECT_FALSE(Simulate(*model, c, one).ok());
}

}  // namespace
}  // namespace poseidon::sim
