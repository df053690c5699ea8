// The registry on its own, with time driven by the test: liveness, retention, the descriptions of
// what a waiting call lacks.
#include "coordinator/registry.h"

#include <google/protobuf/util/message_differencer.h>

#include <map>
#include <optional>

#include "common/status.h"
#include "coordinator/planner/planner.h"
#include "coordinator/test_util.h"
#include "coordinator/validate.h"

namespace poseidon::coordinator::testing {
namespace {

using ::testing::HasSubstr;

class RegistryTest : public ::testing::Test {
 protected:
  explicit RegistryTest(RegistryOptions options = Options())
      : registry_(std::move(options), "test") {}

  static RegistryOptions Options() {
    RegistryOptions options;
    options.lease = absl::Seconds(15);
    options.retention = absl::Minutes(10);
    return options;
  }

  std::string AddAgent(uint32_t gpu, uint32_t world_size, std::optional<uint32_t> rank = {}) {
    v1::RegisterAgentRequest request;
    request.set_host(absl::StrCat("host", gpu));
    request.set_gpu_index(gpu);
    *request.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, "10.0.0.1:7200");
    request.set_world_size(world_size);
    if (rank) request.set_requested_rank(*rank);
    v1::RegisterAgentResponse response;
    const absl::Status status = registry_.RegisterAgent(job_, request, now_, &response);
    EXPECT_TRUE(status.ok()) << status;
    return response.node_id();
  }

  std::string AddServer() {
    v1::RegisterServerRequest request;
    request.set_host("server-host");
    *request.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, "10.0.0.9:7100");
    v1::RegisterServerResponse response;
    EXPECT_TRUE(registry_.RegisterServer(Caller{""}, request, now_, &response).ok());
    return response.node_id();
  }

  v1::NodeState StateOf(const std::string& node) {
    v1::GetClusterStatusResponse status;
    EXPECT_TRUE(registry_.ClusterStatus(Caller{""}, now_, &status).ok());
    for (const v1::NodeStatus& n : status.nodes()) {
      if (n.node_id() == node) return n.state();
    }
    return v1::NODE_STATE_UNSPECIFIED;  // forgotten
  }

  Registry registry_;
  Caller job_{"job"};
  absl::Time now_ = absl::UnixEpoch() + absl::Hours(100);
};

TEST_F(RegistryTest, SilentNodesBecomeSuspectThenDeadAndTheWorldSaysWho) {
  AddServer();
  const std::string a = AddAgent(0, 2, 0);
  const std::string b = AddAgent(1, 2, 1);
  v1::RendezvousResponse world;
  ASSERT_TRUE(*registry_.TryRendezvous(job_, a, now_, &world));

  now_ += absl::Seconds(7);  // two heartbeat intervals (3s each) missed
  EXPECT_FALSE(registry_.Expire(now_));
  EXPECT_EQ(StateOf(a), v1::NODE_STATE_SUSPECT);
  v1::HeartbeatRequest beat;
  beat.mutable_header()->set_node_id(a);
  beat.set_role(v1::NODE_ROLE_AGENT);
  v1::HeartbeatResponse response;
  ASSERT_TRUE(registry_.Heartbeat(job_, beat, now_, &response).ok());
  EXPECT_EQ(StateOf(a), v1::NODE_STATE_ALIVE);

  now_ += absl::Seconds(9);  // b silent for 16s > the 15s lease
  const uint64_t epoch = registry_.membership_epoch();
  EXPECT_TRUE(registry_.Expire(now_));
  EXPECT_EQ(StateOf(b), v1::NODE_STATE_DEAD);
  EXPECT_EQ(StateOf(a), v1::NODE_STATE_SUSPECT);  // silent 9s: suspect, not dead
  EXPECT_GT(registry_.membership_epoch(), epoch);
  EXPECT_FALSE(*registry_.TryRendezvous(job_, a, now_, &world));
  EXPECT_THAT(registry_.DescribeIncompleteWorld("job", now_),
              HasSubstr(absl::StrCat("1 of 2 ranks have a live agent; missing: rank 1 (", b,
                                     " on host host1 gpu 1, declared dead 0s ago (no heartbeat "
                                     "for 16s; lease 15s))")));

  // A replacement takes rank 1; the world forms again.
  const std::string c = AddAgent(5, 2);
  ASSERT_TRUE(*registry_.TryRendezvous(job_, a, now_, &world));
  EXPECT_EQ(world.peers(1).node_id(), c);
}

// Elastic workers (issue 18): `poseidon status` counts each rank's restarts. A replacement on
// another host or GPU cannot take a rank whose agent is live (AlreadyExists: poseidon-agent
// --rejoin asks again) and can once the coordinator has declared it dead; an agent restarting
// on its own GPU replaces it at once.
TEST_F(RegistryTest, ARanksRestartsAreCountedAndAReplacementElsewhereWaitsForTheLease) {
  AddServer();
  const std::string a = AddAgent(0, 2, 0);
  const std::string b = AddAgent(1, 2, 1);
  auto restarts = [&](const std::string& node) -> int64_t {
    v1::GetClusterStatusResponse status;
    EXPECT_TRUE(registry_.ClusterStatus(Caller{""}, now_, &status).ok());
    for (const v1::NodeStatus& n : status.nodes()) {
      if (n.node_id() == node) return n.rank_restarts();
    }
    return -1;
  };
  EXPECT_EQ(restarts(a), 0);
  EXPECT_EQ(restarts(b), 0);
  v1::RegisterAgentRequest elsewhere;
  elsewhere.set_host("host7");
  elsewhere.set_gpu_index(7);
  *elsewhere.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, "10.0.0.7:7200");
  elsewhere.set_world_size(2);
  elsewhere.set_requested_rank(1);
  v1::RegisterAgentResponse response;
  const absl::Status held = registry_.RegisterAgent(job_, elsewhere, now_, &response);
  EXPECT_EQ(held.code(), absl::StatusCode::kAlreadyExists) << held;
  EXPECT_THAT(held.message(), HasSubstr("duplicate rank: rank 1"));
  // Rank 1's agent goes silent past the lease; rank 0's keeps beating.
  v1::HeartbeatRequest beat;
  beat.mutable_header()->set_node_id(a);
  beat.set_role(v1::NODE_ROLE_AGENT);
  v1::HeartbeatResponse beat_response;
  now_ += absl::Seconds(9);
  ASSERT_TRUE(registry_.Heartbeat(job_, beat, now_, &beat_response).ok());
  now_ += absl::Seconds(7);
  EXPECT_TRUE(registry_.Expire(now_));
  EXPECT_EQ(StateOf(b), v1::NODE_STATE_DEAD);
  ASSERT_TRUE(registry_.RegisterAgent(job_, elsewhere, now_, &response).ok());
  const std::string c = response.node_id();
  EXPECT_EQ(response.rank(), 1u);
  EXPECT_EQ(restarts(c), 1);
  // Restarted again, on its own GPU: it replaces the live agent at once.
  const std::string d = AddAgent(7, 2, 1);
  EXPECT_NE(d, c);
  EXPECT_EQ(restarts(d), 2);
  EXPECT_EQ(restarts(a), 0);
  v1::RendezvousResponse world;
  ASSERT_TRUE(*registry_.TryRendezvous(job_, a, now_, &world));
  EXPECT_EQ(world.peers(1).node_id(), d);
}

TEST_F(RegistryTest, AParkedCallKeepsItsNodeAlive) {
  const std::string a = AddAgent(0, 2);
  registry_.BeginWait(a, now_);
  now_ += absl::Minutes(5);
  EXPECT_FALSE(registry_.Expire(now_));
  EXPECT_EQ(StateOf(a), v1::NODE_STATE_ALIVE);
  registry_.EndWait(a, now_);
  now_ += absl::Seconds(16);
  EXPECT_TRUE(registry_.Expire(now_));
  EXPECT_EQ(StateOf(a), v1::NODE_STATE_DEAD);
}

TEST_F(RegistryTest, DepartedNodesAreForgottenAfterTheRetention) {
  const std::string server = AddServer();
  v1::DeregisterRequest bye;
  bye.mutable_header()->set_node_id(server);
  ASSERT_TRUE(registry_.Deregister(Caller{""}, bye, now_).ok());
  EXPECT_EQ(StateOf(server), v1::NODE_STATE_LEFT);
  now_ += absl::Minutes(11);
  registry_.Expire(now_);
  EXPECT_EQ(StateOf(server), v1::NODE_STATE_UNSPECIFIED);
}

TEST_F(RegistryTest, AJobWithoutLiveAgentsStartsAfresh) {
  const std::string a = AddAgent(0, 4);
  now_ += absl::Seconds(16);
  ASSERT_TRUE(registry_.Expire(now_));
  // A new run with another world size is welcome once nobody of the old one is alive.
  AddAgent(1, 2);
  EXPECT_THAT(registry_.DescribeIncompleteWorld("job", now_),
              HasSubstr("1 of 2 ranks have a live agent"));
}

// ---- The job's rendezvous store ----------------------------------------------------------------

v1::StoreSetRequest Set(const std::string& node, const std::string& key, const std::string& value) {
  v1::StoreSetRequest request;
  request.mutable_header()->set_node_id(node);
  request.set_key(key);
  request.set_value(value);
  return request;
}

v1::StoreGetRequest Get(const std::string& node, const std::vector<std::string>& keys) {
  v1::StoreGetRequest request;
  request.mutable_header()->set_node_id(node);
  for (const std::string& key : keys) request.add_keys(key);
  return request;
}

TEST_F(RegistryTest, TheStoreHoldsAtMostItsKeysAndBytesPerJob) {
  const std::string a = AddAgent(0, 2);
  for (size_t i = 0; i < kMaxStoreKeys; ++i) {
    const absl::Status status = registry_.StoreSet(job_, Set(a, absl::StrCat("k", i), "v"), now_);
    ASSERT_TRUE(status.ok()) << i << ": " << status;
  }
  EXPECT_EQ(registry_.StoreKeys("job"), kMaxStoreKeys);
  const absl::Status full = registry_.StoreSet(job_, Set(a, "one more", "v"), now_);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_THAT(std::string(full.message()), HasSubstr("job 'job''s store already holds 16384 keys"));
  EXPECT_THAT(std::string(full.message()), HasSubstr("'one more'"));
  // A key it holds can still take a new value.
  EXPECT_TRUE(registry_.StoreSet(job_, Set(a, "k7", "new"), now_).ok());
  v1::StoreGetResponse got;
  ASSERT_TRUE(*registry_.TryStoreGet(job_, Get(a, {"k7", "k0"}), now_, &got));
  EXPECT_THAT(got.values(), ::testing::ElementsAre("new", "v"));

  // Another job is unaffected; its bytes are bounded too: 32 MiB of keys and values.
  Caller other{"other"};
  v1::RegisterAgentRequest join;
  join.set_host("h");
  *join.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, "10.0.0.2:7200");
  join.set_world_size(1);
  v1::RegisterAgentResponse joined;
  ASSERT_TRUE(registry_.RegisterAgent(other, join, now_, &joined).ok());
  const std::string big(kMaxStoreValueBytes, 'x');
  size_t stored = 0;
  absl::Status status;
  while ((status = registry_.StoreSet(other, Set(joined.node_id(), absl::StrCat("b", stored), big),
                                      now_))
             .ok()) {
    ++stored;
    ASSERT_LE(stored, kMaxStoreBytes / kMaxStoreValueBytes);
  }
  EXPECT_EQ(stored, kMaxStoreBytes / kMaxStoreValueBytes - 1);  // keys count too
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("at most 33554432 allowed"));
}

TEST_F(RegistryTest, TheStoreIsTheCallersJobsAndEndsWithItsWorld) {
  const std::string a = AddAgent(0, 1);
  ASSERT_TRUE(registry_.StoreSet(job_, Set(a, std::string("k\0", 2), "v1"), now_).ok());
  v1::StoreGetResponse got;
  // Another job's token cannot act for this job's node, and sees nothing of its store.
  const absl::StatusOr<bool> foreign =
      registry_.TryStoreGet(Caller{"other"}, Get(a, {std::string("k\0", 2)}), now_, &got);
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kPermissionDenied) << foreign.status();
  EXPECT_EQ(registry_.StoreSet(Caller{"other"}, Set(a, "k", "v"), now_).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry_.StoreKeys("other"), 0u);
  // Missing keys are named, escaped, once each.
  EXPECT_EQ(
      registry_.DescribeMissingKeys("job", Get(a, {std::string("k\0", 2), "x\n", "x\n"}).keys()),
      "1 of 2 keys not set: 'x\\n'");

  // The node dies: its calls are refused; a new world of the job starts with an empty store.
  now_ += absl::Seconds(16);
  ASSERT_TRUE(registry_.Expire(now_));
  EXPECT_EQ(
      registry_.TryStoreGet(job_, Get(a, {std::string("k\0", 2)}), now_, &got).status().code(),
      absl::StatusCode::kFailedPrecondition);
  const std::string b = AddAgent(1, 1);
  EXPECT_EQ(registry_.StoreKeys("job"), 0u);
  EXPECT_FALSE(*registry_.TryStoreGet(job_, Get(b, {std::string("k\0", 2)}), now_, &got));
}

// ---- Telemetry in the status view, and what achieved throughput does to the planner ----------

v1::LinkTelemetry Window(const std::string& peer, uint64_t sent, uint64_t received,
                         absl::Duration window) {
  v1::LinkTelemetry link;
  link.set_peer_node_id(peer);
  link.set_transport(v1::TRANSPORT_KIND_TCP);
  link.set_bytes(sent);
  link.set_received_bytes(received);
  link.set_window_ns(static_cast<uint64_t>(absl::ToInt64Nanoseconds(window)));
  link.set_bytes_per_second(static_cast<double>(std::max(sent, received)) /
                            absl::ToDoubleSeconds(window));
  return link;
}

v1::LayerTelemetry Layer(uint32_t index, double mean_seconds, uint64_t syncs = 5) {
  v1::LayerTelemetry layer;
  layer.set_index(index);
  layer.set_syncs(syncs);
  layer.set_mean_sync_seconds(mean_seconds);
  layer.set_max_sync_seconds(mean_seconds * 2);
  return layer;
}

class RegistryTelemetryTest : public RegistryTest {
 protected:
  using RegistryTest::RegistryTest;

  // Two servers and two agents with a formed world and `model` registered by both: the plan.
  void FormJob(const v1::ModelSpec& model) {
    servers_ = {AddServer(), AddServer()};
    agents_ = {AddAgent(0, 2, 0), AddAgent(1, 2, 1)};
    v1::RendezvousResponse world;
    ASSERT_TRUE(*registry_.TryRendezvous(job_, agents_[0], now_, &world));
    for (const std::string& agent : agents_) {
      v1::RegisterModelRequest request;
      request.mutable_header()->set_node_id(agent);
      *request.mutable_model() = model;
      ASSERT_TRUE(registry_.RegisterModel(job_, request, now_).ok());
    }
    v1::Plan plan;
    ASSERT_TRUE(*registry_.TryModelPlan(job_, agents_[0], now_, &plan));
    ASSERT_EQ(plan.plan_epoch(), 1u);
  }

  void Report(const std::string& agent, std::vector<v1::LinkTelemetry> links,
              std::vector<v1::LayerTelemetry> layers, uint64_t iteration) {
    v1::ReportTelemetryRequest request;
    request.mutable_header()->set_node_id(agent);
    for (auto& link : links) *request.add_links() = std::move(link);
    for (auto& layer : layers) *request.add_layers() = std::move(layer);
    request.set_iteration(iteration);
    request.set_window_ns(1000000000);
    const absl::Status status = registry_.ReportTelemetry(job_, request, now_);
    ASSERT_TRUE(status.ok()) << status;
  }

  v1::GetClusterStatusResponse Status() {
    v1::GetClusterStatusResponse status;
    EXPECT_TRUE(registry_.ClusterStatus(job_, now_, &status).ok());
    return status;
  }

  const v1::NodeStatus* NodeOf(const v1::GetClusterStatusResponse& status, const std::string& id) {
    for (const v1::NodeStatus& node : status.nodes()) {
      if (node.node_id() == id) return &node;
    }
    ADD_FAILURE() << "no node " << id;
    return nullptr;
  }

  uint64_t PlanEpoch() {
    const v1::Plan* plan = registry_.CurrentPlan("job");
    return plan == nullptr ? 0 : plan->plan_epoch();
  }

  std::vector<std::string> servers_, agents_;
};

TEST_F(RegistryTelemetryTest, ReportsShowPerLinkThroughputAndTheSlowestRankAndLayer) {
  FormJob(TinyModel());  // conv.weight, conv.bias, fc.weight, fc.bias
  // Rank 0: quick conv.weight, slow fc.weight; 3 MB to server 0 and 1 MB from it in 1s.
  Report(agents_[0],
         {Window(servers_[0], 3000000, 1000000, absl::Seconds(1)),
          Window(agents_[1], 0, 0, absl::Seconds(1))},
         {Layer(0, 0.010), Layer(2, 0.030)}, 41);
  // Rank 1: slow conv.weight; fc.bias posted ready for iteration 43 and waiting for 4s.
  v1::LayerTelemetry waiting;
  waiting.set_index(3);
  waiting.set_waiting_iteration(43);
  waiting.set_waiting_seconds(4);
  Report(agents_[1], {Window(servers_[1], 2000000, 2000000, absl::Seconds(2))},
         {Layer(0, 0.050), Layer(2, 0.020), waiting}, 42);
  now_ += absl::Seconds(1);

  v1::GetClusterStatusResponse status = Status();
  const v1::NodeStatus* rank0 = NodeOf(status, agents_[0]);
  ASSERT_NE(rank0, nullptr);
  EXPECT_EQ(rank0->iteration(), 41u);
  EXPECT_EQ(rank0->telemetry_age_ms(), 1000u);
  ASSERT_EQ(rank0->links_size(), 2);
  const v1::LinkStatus& to_server = rank0->links(0);
  EXPECT_EQ(to_server.peer_node_id(), servers_[0]);
  EXPECT_EQ(to_server.peer_role(), v1::NODE_ROLE_SERVER);
  EXPECT_EQ(to_server.peer_host(), "server-host");
  EXPECT_EQ(to_server.sent_bytes(), 3000000u);
  EXPECT_EQ(to_server.received_bytes(), 1000000u);
  EXPECT_EQ(to_server.window_ns(), 1000000000u);
  EXPECT_DOUBLE_EQ(to_server.bytes_per_second(), 3e6);
  // 3 MB is below telemetry_min_bytes (16 MiB): the planner takes nothing from this window.
  EXPECT_EQ(to_server.bandwidth_bytes_per_second(), 0);
  EXPECT_TRUE(to_server.lower_bound());
  const v1::LinkStatus& to_peer = rank0->links(1);
  EXPECT_EQ(to_peer.peer_role(), v1::NODE_ROLE_AGENT);
  EXPECT_EQ(to_peer.peer_rank(), 1u);
  EXPECT_EQ(to_peer.bytes_per_second(), 0);
  EXPECT_DOUBLE_EQ(rank0->sync_seconds(), 0.040);
  EXPECT_EQ(rank0->slowest_layer(), "fc.weight");
  EXPECT_DOUBLE_EQ(rank0->slowest_layer_sync_seconds(), 0.030);
  const v1::NodeStatus* rank1 = NodeOf(status, agents_[1]);
  ASSERT_NE(rank1, nullptr);
  EXPECT_DOUBLE_EQ(rank1->sync_seconds(), 0.070);
  EXPECT_EQ(rank1->slowest_layer(), "conv.weight");
  ASSERT_EQ(rank1->links_size(), 1);
  EXPECT_DOUBLE_EQ(rank1->links(0).bytes_per_second(), 1e6);
  const v1::NodeStatus* server0 = NodeOf(status, servers_[0]);
  ASSERT_NE(server0, nullptr);
  EXPECT_FALSE(server0->has_telemetry_age_ms());
  EXPECT_EQ(server0->links_size(), 0);

  ASSERT_EQ(status.jobs_size(), 1);
  const v1::JobStatus& job = status.jobs(0);
  ASSERT_TRUE(job.has_slowest_rank());
  EXPECT_EQ(job.slowest_rank(), 1u);
  EXPECT_DOUBLE_EQ(job.slowest_rank_sync_seconds(), 0.070);
  // conv.weight: (10 + 50) / 2 = 30ms; fc.weight: (30 + 20) / 2 = 25ms.
  EXPECT_EQ(job.slowest_layer(), "conv.weight");
  EXPECT_DOUBLE_EQ(job.slowest_layer_sync_seconds(), 0.030);
  ASSERT_EQ(job.layers_size(), 4);
  EXPECT_DOUBLE_EQ(job.layers(0).sync_seconds(), 0.030);
  EXPECT_EQ(job.layers(1).sync_seconds(), 0);
  EXPECT_DOUBLE_EQ(job.layers(2).sync_seconds(), 0.025);
  ASSERT_TRUE(job.has_waiting_rank());
  EXPECT_EQ(job.waiting_rank(), 1u);
  EXPECT_EQ(job.waiting_layer(), "fc.bias");
  EXPECT_EQ(job.waiting_iteration(), 43u);
  EXPECT_EQ(job.waiting_seconds(), 4);

  EXPECT_EQ(job.layers(2).wire_fallback_ranks(), 0u);

  // A newer report replaces the old one: rank 0 is now the slowest; its layer 2 fell back from a
  // lossy wire (its divergence guard), which the job's layer shows.
  v1::LayerTelemetry fell_back = Layer(2, 0.030);
  fell_back.set_wire_fell_back(true);
  Report(agents_[0], {}, {Layer(0, 0.100), fell_back}, 45);
  status = Status();
  EXPECT_EQ(status.jobs(0).layers(2).wire_fallback_ranks(), 1u);
  EXPECT_EQ(status.jobs(0).layers(0).wire_fallback_ranks(), 0u);
  EXPECT_EQ(status.jobs(0).slowest_rank(), 0u);
  EXPECT_EQ(NodeOf(status, agents_[0])->links_size(), 0);

  // Reports older than telemetry_max_age are not shown.
  now_ += absl::Seconds(61);
  for (const std::string& agent : agents_) {  // stay alive
    v1::HeartbeatRequest beat;
    beat.mutable_header()->set_node_id(agent);
    beat.set_role(v1::NODE_ROLE_AGENT);
    v1::HeartbeatResponse response;
    ASSERT_TRUE(registry_.Heartbeat(job_, beat, now_, &response).ok());
  }
  status = Status();
  EXPECT_FALSE(status.jobs(0).has_slowest_rank());
  EXPECT_FALSE(status.jobs(0).has_waiting_rank());
  EXPECT_EQ(NodeOf(status, agents_[1])->links_size(), 0);
  EXPECT_EQ(NodeOf(status, agents_[1])->sync_seconds(), 0);
}

// A server knows agents by job and rank only (the data-plane handshake): its links name them so,
// and the status view shows them per link, resolved to the agents' nodes.
v1::LinkTelemetry ServerWindow(const std::string& job, uint32_t rank, uint64_t sent,
                               uint64_t received, absl::Duration window) {
  v1::LinkTelemetry link = Window("", sent, received, window);
  link.set_peer_job_id(job);
  link.set_peer_rank(rank);
  return link;
}

TEST_F(RegistryTelemetryTest, AServersReportShowsPerLinkAndAgentsLatencyToo) {
  FormJob(TinyModel());
  v1::ReportTelemetryRequest request;
  request.mutable_header()->set_node_id(servers_[0]);
  request.set_window_ns(1000000000);
  *request.add_links() = ServerWindow("job", 0, 1000000, 3000000, absl::Seconds(1));
  *request.add_links() = ServerWindow("job", 1, 2000000, 500000, absl::Seconds(1));
  *request.add_links() = ServerWindow("job", 7, 1000, 1000, absl::Seconds(1));    // no such rank
  *request.add_links() = ServerWindow("other", 0, 1000, 1000, absl::Seconds(1));  // no such job
  ASSERT_TRUE(ValidateRequest(request).ok());
  ASSERT_TRUE(registry_.ReportTelemetry(Caller{""}, request, now_).ok());
  // Rank 0 measured a 120us round trip to server 0.
  v1::LinkTelemetry pinged = Window(servers_[0], 3000000, 1000000, absl::Seconds(1));
  pinged.set_latency_ns(120000);
  Report(agents_[0], {pinged}, {}, 5);
  now_ += absl::Seconds(1);

  for (const Caller& caller : {Caller{""}, job_}) {
    const v1::GetClusterStatusResponse status = [&] {
      v1::GetClusterStatusResponse out;
      EXPECT_TRUE(registry_.ClusterStatus(caller, now_, &out).ok());
      return out;
    }();
    const v1::NodeStatus* server = NodeOf(status, servers_[0]);
    ASSERT_NE(server, nullptr);
    EXPECT_EQ(server->telemetry_age_ms(), 1000u);
    ASSERT_EQ(server->links_size(), 2);
    for (uint32_t rank = 0; rank < 2; ++rank) {
      const v1::LinkStatus& link = server->links(static_cast<int>(rank));
      EXPECT_EQ(link.peer_node_id(), agents_[rank]);
      EXPECT_EQ(link.peer_role(), v1::NODE_ROLE_AGENT);
      EXPECT_EQ(link.peer_job_id(), "job");
      EXPECT_EQ(link.peer_rank(), rank);
      EXPECT_EQ(link.window_ns(), 1000000000u);
      EXPECT_TRUE(link.lower_bound());
      EXPECT_EQ(link.latency_ns(), 0u);  // servers do not ping
    }
    EXPECT_EQ(server->links(0).sent_bytes(), 1000000u);
    EXPECT_EQ(server->links(0).received_bytes(), 3000000u);
    EXPECT_DOUBLE_EQ(server->links(0).bytes_per_second(), 3e6);
    EXPECT_DOUBLE_EQ(server->links(1).bytes_per_second(), 2e6);
    EXPECT_DOUBLE_EQ(server->bytes_per_second(), 2.5e6);
    const v1::NodeStatus* rank0 = NodeOf(status, agents_[0]);
    ASSERT_NE(rank0, nullptr);
    ASSERT_EQ(rank0->links_size(), 1);
    EXPECT_EQ(rank0->links(0).latency_ns(), 120000u);
  }

  // A server scoped to one job cannot name another job's ranks: those links are dropped.
  v1::RegisterServerRequest join;
  join.set_host("server-host");
  *join.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, "10.0.0.8:7100");
  v1::RegisterServerResponse joined;
  ASSERT_TRUE(registry_.RegisterServer(job_, join, now_, &joined).ok());
  v1::ReportTelemetryRequest scoped;
  scoped.mutable_header()->set_node_id(joined.node_id());
  *scoped.add_links() = ServerWindow("other", 0, 1000, 1000, absl::Seconds(1));
  *scoped.add_links() = ServerWindow("job", 1, 1000, 1000, absl::Seconds(1));
  ASSERT_TRUE(registry_.ReportTelemetry(job_, scoped, now_).ok());
  const v1::GetClusterStatusResponse status = Status();
  const v1::NodeStatus* scoped_status = NodeOf(status, joined.node_id());
  ASSERT_NE(scoped_status, nullptr);
  ASSERT_EQ(scoped_status->links_size(), 1);
  EXPECT_EQ(scoped_status->links(0).peer_node_id(), agents_[1]);
}

// Replication (issue 17): a server's report of its primary and backup keys shows in the status
// view, each job's only to that job's callers; a job-scoped server reports its job only; a report
// that counts more degraded keys than primaries is refused.
TEST_F(RegistryTelemetryTest, AServersReplicationShowsInTheStatus) {
  FormJob(TinyModel());
  auto entry = [](const std::string& job, uint64_t primaries, uint64_t backups, uint64_t degraded) {
    v1::ReplicationTelemetry r;
    r.set_job_id(job);
    r.set_primary_keys(primaries);
    r.set_backup_keys(backups);
    r.set_degraded_keys(degraded);
    r.set_max_backup_lag_clocks(1);
    return r;
  };
  v1::ReportTelemetryRequest request;
  request.mutable_header()->set_node_id(servers_[0]);
  *request.add_replication() = entry("job", 5, 3, 1);
  *request.add_replication() = entry("other", 2, 0, 0);
  ASSERT_TRUE(ValidateRequest(request).ok());
  ASSERT_TRUE(registry_.ReportTelemetry(Caller{""}, request, now_).ok());
  auto shown = [&](const Caller& caller) {
    v1::GetClusterStatusResponse out;
    EXPECT_TRUE(registry_.ClusterStatus(caller, now_, &out).ok());
    const v1::NodeStatus* server = NodeOf(out, servers_[0]);
    EXPECT_NE(server, nullptr);
    return server == nullptr ? std::vector<v1::ReplicationTelemetry>{}
                             : std::vector<v1::ReplicationTelemetry>(server->replication().begin(),
                                                                     server->replication().end());
  };
  const auto all = shown(Caller{""});
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].job_id(), "job");
  EXPECT_EQ(all[0].primary_keys(), 5u);
  EXPECT_EQ(all[0].backup_keys(), 3u);
  EXPECT_EQ(all[0].degraded_keys(), 1u);
  EXPECT_EQ(all[0].max_backup_lag_clocks(), 1u);
  const auto mine = shown(job_);
  ASSERT_EQ(mine.size(), 1u) << "another job's keys are not this job's business";
  EXPECT_EQ(mine[0].job_id(), "job");
  // Stale telemetry is not shown.
  now_ += absl::Minutes(10);
  EXPECT_TRUE(shown(Caller{""}).empty());
  // Counts that cannot be are refused.
  v1::ReportTelemetryRequest bad;
  bad.mutable_header()->set_node_id(servers_[0]);
  *bad.add_replication() = entry("job", 1, 0, 2);
  const absl::Status refused = ValidateRequest(bad);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("replication[0]"), std::string::npos) << refused;
  *bad.mutable_replication(0) = entry("", 1, 0, 0);
  EXPECT_FALSE(ValidateRequest(bad).ok());
}

class PlannerTelemetryTest : public RegistryTelemetryTest {
 protected:
  PlannerTelemetryTest() : RegistryTelemetryTest(PlannerOptions()) {}

  static RegistryOptions PlannerOptions() {
    RegistryOptions options = Options();
    options.colocated = true;
    options.nominal_bandwidth_bytes_per_second = 10e9 / 8;
    options.nominal_latency_seconds = 7e-6;
    options.min_servers = 2;
    options.telemetry_min_bytes = uint64_t{16} << 20;
    return options;
  }
};

TEST_F(PlannerTelemetryTest, AchievedThroughputNeverDragsTheBandwidthDown) {
  FormJob(BoundaryModel());
  ASSERT_EQ(registry_.CurrentPlan("job")->layers(0).scheme(), v1::SYNC_SCHEME_SFB);

  // A nearly idle window: 1 MB in 1s (8 Mbit/s) says nothing about the link's capacity.
  Report(agents_[0], {Window(agents_[1], 1000000, 0, absl::Seconds(1))}, {}, 10);
  EXPECT_EQ(PlanEpoch(), 1u);
  EXPECT_EQ(NodeOf(Status(), agents_[0])->links(0).bandwidth_bytes_per_second(), 0);

  // A busy window at 4 Gbit/s (the link was not busy all the time): a lower bound, below the
  // plan's 10 Gbit/s, so the estimate stays 10 Gbit/s and so does the plan.
  Report(agents_[0], {Window(agents_[1], 500000000, 0, absl::Seconds(1))}, {}, 20);
  EXPECT_EQ(PlanEpoch(), 1u);
  const v1::LinkStatus busy = NodeOf(Status(), agents_[0])->links(0);
  EXPECT_DOUBLE_EQ(busy.bandwidth_bytes_per_second(), 5e8);
  EXPECT_TRUE(busy.lower_bound());

  // A capacity measurement of 7 Gbit/s (no window) still moves the plan to PS: the test above
  // would have re-planned had the throughput counted as capacity.
  v1::LinkTelemetry measured;
  measured.set_peer_node_id(agents_[1]);
  measured.set_transport(v1::TRANSPORT_KIND_TCP);
  measured.set_bytes_per_second(7e9 / 8);
  now_ += absl::Seconds(11);  // past replan_min_interval (10s) since the first plan
  Report(agents_[0], {measured}, {}, 30);
  EXPECT_EQ(PlanEpoch(), 2u);
  EXPECT_EQ(registry_.CurrentPlan("job")->layers(0).scheme(), v1::SYNC_SCHEME_PS);
  EXPECT_FALSE(NodeOf(Status(), agents_[0])->links(0).lower_bound());
}

TEST_F(PlannerTelemetryTest, AServersAchievedThroughputIsALowerBoundToo) {
  FormJob(BoundaryModel());
  ASSERT_EQ(registry_.CurrentPlan("job")->layers(0).scheme(), v1::SYNC_SCHEME_SFB);
  // Both servers report busy windows at 4 Gbit/s with both ranks: below the plan's 10 Gbit/s,
  // a lower bound only, so the estimate and the plan stay.
  for (const std::string& server : servers_) {
    v1::ReportTelemetryRequest request;
    request.mutable_header()->set_node_id(server);
    for (uint32_t rank = 0; rank < 2; ++rank) {
      *request.add_links() = ServerWindow("job", rank, 500000000, 0, absl::Seconds(1));
    }
    ASSERT_TRUE(registry_.ReportTelemetry(Caller{""}, request, now_).ok());
  }
  EXPECT_EQ(PlanEpoch(), 1u);
  const v1::GetClusterStatusResponse status = Status();
  const v1::NodeStatus* server = NodeOf(status, servers_[0]);
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(server->links_size(), 2);
  EXPECT_DOUBLE_EQ(server->links(0).bandwidth_bytes_per_second(), 5e8);
  EXPECT_TRUE(server->links(0).lower_bound());
}

// ---- Plans that change while training runs: chunks, the effective iteration, the re-plan policy,
// capacity samples, operator overrides
// -------------------------------------------------------------

// A capacity sample (bytes over busy time) of `gigabits` in a report that also carries achieved
// throughput of 1 Gbit/s over a busy 1s window.
v1::LinkTelemetry Capacity(const std::string& peer, double gigabits) {
  v1::LinkTelemetry link = Window(peer, 125000000, 125000000, absl::Seconds(1));
  link.set_capacity_bytes_per_second(gigabits * 1e9 / 8);
  return link;
}

class PlanChangeTest : public PlannerTelemetryTest {
 protected:
  void Beat(const std::string& agent, uint64_t iteration, uint64_t plan_epoch = 1) {
    v1::HeartbeatRequest beat;
    beat.mutable_header()->set_node_id(agent);
    beat.set_role(v1::NODE_ROLE_AGENT);
    beat.set_iteration(iteration);
    beat.set_plan_epoch(plan_epoch);
    v1::HeartbeatResponse response;
    ASSERT_TRUE(registry_.Heartbeat(job_, beat, now_, &response).ok());
  }

  v1::SyncScheme Scheme(int layer = 0) {
    return registry_.CurrentPlan("job")->layers(layer).scheme();
  }

  absl::StatusOr<v1::SetLayerSchemesResponse> Override(
      const std::map<std::string, v1::SyncScheme>& schemes, const Caller& caller,
      const std::string& job_id = "") {
    v1::SetLayerSchemesRequest request;
    request.set_job_id(job_id);
    for (const auto& [name, scheme] : schemes) (*request.mutable_schemes())[name] = scheme;
    v1::SetLayerSchemesResponse response;
    RETURN_IF_ERROR(registry_.SetLayerSchemes(caller, request, now_, &response));
    return response;
  }
};

// Every layer's chunks of a plan.
std::vector<std::string> ChunksOf(const v1::Plan& plan) {
  std::vector<std::string> chunks;
  for (const v1::LayerPlan& layer : plan.layers()) {
    for (const v1::Chunk& chunk : layer.chunks()) chunks.push_back(chunk.SerializeAsString());
    chunks.push_back("|");
  }
  return chunks;
}

TEST_F(PlanChangeTest, EveryEpochOfAWorldKeepsTheFirstPlansChunks) {
  FormJob(BoundaryModel());
  const v1::Plan first = *registry_.CurrentPlan("job");
  ASSERT_EQ(first.layers(0).scheme(), v1::SYNC_SCHEME_SFB);
  ASSERT_FALSE(first.layers(0).chunks().empty());  // the SFB layer's chunks for PS
  ASSERT_FALSE(first.layers(1).chunks().empty());

  // Telemetry moves fc.weight to PS: the same chunks.
  now_ += absl::Seconds(11);
  Report(agents_[0], {Capacity(agents_[1], 7)}, {}, 50);
  ASSERT_EQ(PlanEpoch(), 2u);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_PS);
  EXPECT_EQ(ChunksOf(*registry_.CurrentPlan("job")), ChunksOf(first));

  // A server re-joins with new endpoints: a new epoch, the same chunks.
  v1::RegisterServerRequest rejoin;
  rejoin.set_host("server-host");
  rejoin.set_previous_node_id(servers_[1]);
  *rejoin.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, "10.0.0.9:7999");
  v1::RegisterServerResponse response;
  ASSERT_TRUE(registry_.RegisterServer(Caller{""}, rejoin, now_, &response).ok());
  ASSERT_EQ(PlanEpoch(), 3u);
  EXPECT_EQ(registry_.CurrentPlan("job")->servers(1).endpoints(0).address(), "10.0.0.9:7999");
  EXPECT_EQ(ChunksOf(*registry_.CurrentPlan("job")), ChunksOf(first));

  // An operator override: the same chunks.
  ASSERT_TRUE(Override({{"fc.weight", v1::SYNC_SCHEME_SFB}}, job_).ok());
  ASSERT_EQ(PlanEpoch(), 4u);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_SFB);
  EXPECT_EQ(ChunksOf(*registry_.CurrentPlan("job")), ChunksOf(first));
}

// Every layer's bucket number of a plan.
std::vector<uint32_t> BucketsOf(const v1::Plan& plan) {
  std::vector<uint32_t> buckets;
  for (const v1::LayerPlan& layer : plan.layers()) buckets.push_back(layer.bucket());
  return buckets;
}

// The agents form their buckets once, from the world's first plan: a re-plan at another
// bandwidth, whose own fusion target would group the layers differently, keeps them.
TEST_F(PlanChangeTest, EveryEpochOfAWorldKeepsTheFirstPlansBuckets) {
  planner::PlannerConfig config;
  config.workers = 2;
  config.servers = 2;
  config.colocated = true;
  config.latency_seconds = 7e-6;
  config.bandwidth_bytes_per_second = 10e9 / 8;
  // Six biases of 2/5 of the target at 10 Gbit/s: two to a bucket there, none at 7 Gbit/s.
  const uint64_t target = planner::BuildPlan(BoundaryModel(), config)->plan.max_chunk_bytes();
  v1::ModelSpec model = BoundaryModel();
  v1::ModelSpec probe = model;
  v1::LayerSpec* one = probe.add_layers();
  one->set_name("b");
  one->set_kind(v1::LAYER_KIND_BIAS);
  one->add_shape(4);
  one->set_batch_per_worker(513);
  v1::LayerSpec* two = probe.add_layers();
  *two = *one;
  two->set_name("c");
  const uint64_t b_star = planner::BuildPlan(probe, config)->plan.bucket_bytes();
  ASSERT_GT(b_star, 0u);
  ASSERT_LE(b_star, target);
  for (int i = 0; i < 6; ++i) {
    v1::LayerSpec* bias = model.add_layers();
    bias->set_name(absl::StrCat("b", i));
    bias->set_kind(v1::LAYER_KIND_BIAS);
    bias->add_shape(b_star * 2 / 5 / 4);
    bias->set_batch_per_worker(513);
  }
  FormJob(model);
  const v1::Plan first = *registry_.CurrentPlan("job");
  ASSERT_EQ(first.layers(0).scheme(), v1::SYNC_SCHEME_SFB);
  ASSERT_GT(first.bucket_bytes(), 0u);
  config.bandwidth_bytes_per_second = 7e9 / 8;
  const absl::StatusOr<planner::PlanResult> fresh = planner::BuildPlan(model, config);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ASSERT_NE(BucketsOf(fresh->plan), BucketsOf(first));  // the re-plan would fuse otherwise

  now_ += absl::Seconds(11);
  Report(agents_[0], {Capacity(agents_[1], 7)}, {}, 50);
  ASSERT_EQ(PlanEpoch(), 2u);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_PS);
  EXPECT_EQ(BucketsOf(*registry_.CurrentPlan("job")), BucketsOf(first));
  EXPECT_EQ(registry_.CurrentPlan("job")->bucket_bytes(), first.bucket_bytes());
}

TEST_F(PlanChangeTest, TheEffectiveIterationAccountsForTheStalenessOfTheView) {
  FormJob(BoundaryModel());
  const absl::Time start = now_;
  // No progress reported yet (the job may be training all the same: reports lag): the wide
  // margin of an unknown rate, above the first plan's iteration 0.
  EXPECT_EQ(registry_.NextEffectiveIteration("job", now_), 200u);
  // 10 iterations per second for 10 seconds, reported by both agents' heartbeats.
  for (int second = 0; second <= 10; ++second) {
    now_ = start + absl::Seconds(second);
    Beat(agents_[0], static_cast<uint64_t>(second) * 10);
    Beat(agents_[1], static_cast<uint64_t>(second) * 10);
  }
  EXPECT_DOUBLE_EQ(registry_.IterationRate("job", now_), 10.0);
  // Reported just now: 100 + 10/s * 2s of plan lead time + 10 lead iterations.
  EXPECT_EQ(registry_.NextEffectiveIteration("job", now_), 130u);
  // 3 seconds later with no newer report: the job has moved on by about 30 iterations.
  now_ += absl::Seconds(3);
  EXPECT_EQ(registry_.NextEffectiveIteration("job", now_), 160u);
  // A fractional estimate is rounded up: 0.25s later, 162.5 -> 163.
  now_ += absl::Milliseconds(250);
  EXPECT_EQ(registry_.NextEffectiveIteration("job", now_), 163u);

  // The re-plan that telemetry causes now takes effect there (the report itself carries an older
  // iteration, which changes nothing).
  Report(agents_[0], {Capacity(agents_[1], 7)}, {}, 95);
  ASSERT_EQ(PlanEpoch(), 2u);
  EXPECT_EQ(registry_.CurrentPlan("job")->effective_iteration(), 163u);
  // The next plan always comes after the current one's iteration, even when the estimate does
  // not (here: the job stalls for longer than the rate window, so the rate falls to 0 and the
  // estimate to 100 + 10).
  now_ += absl::Seconds(31);
  EXPECT_EQ(registry_.IterationRate("job", now_), 0);
  EXPECT_EQ(registry_.NextEffectiveIteration("job", now_), 164u);
}

TEST_F(PlanChangeTest, TheRateNeedsSamplesSpanningASecond) {
  FormJob(BoundaryModel());
  Beat(agents_[0], 0);
  now_ += absl::Milliseconds(50);
  Beat(agents_[1], 7);  // 140 iterations/s if it were believed
  EXPECT_EQ(registry_.IterationRate("job", now_), 0);
  // Without a rate: the wide margin (plan_unknown_rate_lead_iterations).
  EXPECT_EQ(registry_.NextEffectiveIteration("job", now_), 207u);
  // Telemetry carries the iteration too.
  now_ += absl::Seconds(2);
  Report(agents_[0], {}, {}, 27);
  EXPECT_DOUBLE_EQ(registry_.IterationRate("job", now_), 27 / 2.05);
  // The agents' plan epochs show in status.
  Beat(agents_[1], 27, 1);
  const v1::GetClusterStatusResponse status = Status();
  EXPECT_EQ(NodeOf(status, agents_[1])->plan_epoch(), 1u);
  EXPECT_EQ(NodeOf(status, agents_[1])->iteration(), 27u);
}

// Failure detection for the agents: a world member declared dead is listed in the other agents'
// heartbeat answers (rank, host, why), a member that left cleanly is not.
TEST_F(PlanChangeTest, HeartbeatsNameTheWorldsDeadMembers) {
  FormJob(BoundaryModel());
  auto beat = [&](const std::string& agent) {
    v1::HeartbeatRequest request;
    request.mutable_header()->set_node_id(agent);
    request.set_role(v1::NODE_ROLE_AGENT);
    v1::HeartbeatResponse response;
    EXPECT_TRUE(registry_.Heartbeat(job_, request, now_, &response).ok());
    return response;
  };
  EXPECT_EQ(beat(agents_[0]).lost_size(), 0);
  // Rank 1 and the servers go silent past the lease; rank 0 keeps beating.
  for (int second = 0; second < 20; ++second) {
    now_ += absl::Seconds(1);
    beat(agents_[0]);
    registry_.Expire(now_);
  }
  const v1::HeartbeatResponse response = beat(agents_[0]);
  ASSERT_GE(response.lost_size(), 1) << response.DebugString();
  const v1::LostMember& rank1 = response.lost(0);
  EXPECT_EQ(rank1.role(), v1::NODE_ROLE_AGENT);
  EXPECT_EQ(rank1.rank(), 1u);
  EXPECT_EQ(rank1.node_id(), agents_[1]);
  EXPECT_FALSE(rank1.host().empty());
  EXPECT_THAT(rank1.reason(), HasSubstr("no heartbeat"));
  EXPECT_GT(rank1.dead_for_ms(), 0u);
  // The servers were silent too: listed as servers.
  int servers = 0;
  for (const v1::LostMember& m : response.lost()) servers += m.role() == v1::NODE_ROLE_SERVER;
  EXPECT_EQ(servers, static_cast<int>(servers_.size()));
}

// A KV server's heartbeat names the dead servers of its jobs (HeartbeatResponse.lost_servers)
// at their index in the job's server list — the plan's servers, then the joined ones — with
// their endpoints and why, so that it gives them up as backups; never itself, never to an
// agent, and never a job's servers to a server of another job.
TEST_F(PlanChangeTest, AServersHeartbeatNamesTheDeadServersOfItsJobsByTheirIndex) {
  FormJob(BoundaryModel());
  const std::string joined = AddServer();  // after the plan: the running job's server 2
  v1::RegisterServerRequest elsewhere;
  elsewhere.set_host("other-host");
  *elsewhere.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, "10.0.0.8:7100");
  v1::RegisterServerResponse other;
  ASSERT_TRUE(registry_.RegisterServer(Caller{"other"}, elsewhere, now_, &other).ok());
  auto beat = [&](const std::string& node, v1::NodeRole role, const Caller& caller) {
    v1::HeartbeatRequest request;
    request.mutable_header()->set_node_id(node);
    request.set_role(role);
    v1::HeartbeatResponse response;
    EXPECT_TRUE(registry_.Heartbeat(caller, request, now_, &response).ok());
    return response;
  };
  EXPECT_EQ(beat(servers_[0], v1::NODE_ROLE_SERVER, Caller{""}).lost_servers_size(), 0);
  // Server 1 and the joined server go silent past the lease; the rest keep beating.
  for (int second = 0; second < 20; ++second) {
    now_ += absl::Seconds(1);
    beat(servers_[0], v1::NODE_ROLE_SERVER, Caller{""});
    beat(other.node_id(), v1::NODE_ROLE_SERVER, Caller{"other"});
    for (const std::string& agent : agents_) beat(agent, v1::NODE_ROLE_AGENT, job_);
    registry_.Expire(now_);
  }
  ASSERT_EQ(StateOf(servers_[1]), v1::NODE_STATE_DEAD);
  const v1::HeartbeatResponse response = beat(servers_[0], v1::NODE_ROLE_SERVER, Caller{""});
  ASSERT_EQ(response.lost_servers_size(), 2) << response.DebugString();
  for (int i = 0; i < 2; ++i) {
    const v1::LostServer& lost = response.lost_servers(i);
    EXPECT_EQ(lost.job_id(), "job");
    EXPECT_EQ(lost.server_index(), static_cast<uint32_t>(i + 1));
    EXPECT_EQ(lost.server().node_id(), i == 0 ? servers_[1] : joined);
    ASSERT_EQ(lost.server().endpoints_size(), 1);
    EXPECT_EQ(lost.server().endpoints(0).address(), "10.0.0.9:7100");
    EXPECT_THAT(lost.reason(), HasSubstr("no heartbeat"));
    EXPECT_GT(lost.dead_for_ms(), 0u);
  }
  EXPECT_EQ(beat(other.node_id(), v1::NODE_ROLE_SERVER, Caller{"other"}).lost_servers_size(), 0);
  EXPECT_EQ(beat(agents_[0], v1::NODE_ROLE_AGENT, job_).lost_servers_size(), 0);
}

// An agent whose peers report every connection to it closed (HeartbeatRequest.peers_gone, a
// job that may shrink) is declared dead once it is suspect (silent for two heartbeat intervals,
// 6 s here), not after its 15 s lease; one that beats after the report is not. A report of the
// reporter's own rank or of one beyond the world is refused.
TEST_F(PlanChangeTest, AnAgentItsPeersLostIsDeclaredDeadOnceItMissesItsHeartbeats) {
  FormJob(BoundaryModel());
  auto beat = [&](const std::string& agent, std::vector<uint32_t> gone) {
    v1::HeartbeatRequest request;
    request.mutable_header()->set_node_id(agent);
    request.set_role(v1::NODE_ROLE_AGENT);
    for (uint32_t r : gone) request.add_peers_gone(r);
    v1::HeartbeatResponse response;
    const absl::Status s = registry_.Heartbeat(job_, request, now_, &response);
    return std::make_pair(s, response);
  };
  EXPECT_EQ(beat(agents_[0], {0}).first.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(beat(agents_[0], {7}).first.message(), HasSubstr("peers_gone names rank 7"));
  // Rank 1 beats after rank 0's report: alive, however long it then stays below its lease.
  ASSERT_TRUE(beat(agents_[0], {1}).first.ok());
  now_ += absl::Seconds(1);
  ASSERT_TRUE(beat(agents_[1], {}).first.ok());
  for (int second = 0; second < 7; ++second) {
    now_ += absl::Seconds(1);
    ASSERT_TRUE(beat(agents_[0], {}).first.ok());
    registry_.Expire(now_);
  }
  EXPECT_NE(StateOf(agents_[1]), v1::NODE_STATE_DEAD);
  // Reported again, and silent past two intervals: dead, 7 s after its last heartbeat.
  ASSERT_TRUE(beat(agents_[0], {1}).first.ok());
  registry_.Expire(now_);
  EXPECT_EQ(StateOf(agents_[1]), v1::NODE_STATE_DEAD);
  const v1::HeartbeatResponse response = beat(agents_[0], {}).second;
  ASSERT_EQ(response.lost_size(), 1) << response.DebugString();
  EXPECT_EQ(response.lost(0).rank(), 1u);
  EXPECT_THAT(response.lost(0).reason(),
              HasSubstr("its connections to rank 0's agent closed and no heartbeat for 7s"));
}

// The same from a KV server (HeartbeatRequest.ranks_gone): every rank's agent connects to the
// servers, so this covers a job whose agents are not connected to each other (every layer on
// PS). A report of a rank beyond the world, or from an agent, is refused; one of a job this
// coordinator knows no world of is left out without failing the server's heartbeat.
TEST_F(PlanChangeTest, AnAgentAServerLostIsDeclaredDeadOnceItMissesItsHeartbeats) {
  FormJob(BoundaryModel());
  auto server_beat = [&](const std::string& job, std::vector<uint32_t> gone) {
    v1::HeartbeatRequest request;
    request.mutable_header()->set_node_id(servers_[0]);
    request.set_role(v1::NODE_ROLE_SERVER);
    v1::RanksGone* report = request.add_ranks_gone();
    report->set_job_id(job);
    for (uint32_t r : gone) report->add_ranks(r);
    v1::HeartbeatResponse response;
    return registry_.Heartbeat(Caller{""}, request, now_, &response);
  };
  auto agent_beat = [&](const std::string& agent, bool report) {
    v1::HeartbeatRequest request;
    request.mutable_header()->set_node_id(agent);
    request.set_role(v1::NODE_ROLE_AGENT);
    if (report) request.add_ranks_gone()->set_job_id("job");
    v1::HeartbeatResponse response;
    const absl::Status s = registry_.Heartbeat(job_, request, now_, &response);
    return std::make_pair(s, response);
  };
  // A job this coordinator has no world of (it restarted, say): left out, the beat taken.
  EXPECT_TRUE(server_beat("other", {1}).ok());
  registry_.Expire(now_);
  EXPECT_NE(StateOf(agents_[1]), v1::NODE_STATE_DEAD);
  EXPECT_THAT(server_beat("job", {7}).message(), HasSubstr("ranks_gone names rank 7"));
  EXPECT_EQ(agent_beat(agents_[0], true).first.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(server_beat("job", {1}).ok());
  for (int second = 0; second < 6; ++second) {
    now_ += absl::Seconds(1);
    ASSERT_TRUE(agent_beat(agents_[0], false).first.ok());
    registry_.Expire(now_);
  }
  EXPECT_NE(StateOf(agents_[1]), v1::NODE_STATE_DEAD) << "6 s: not past two intervals yet";
  now_ += absl::Seconds(1);
  ASSERT_TRUE(server_beat("job", {1}).ok());
  registry_.Expire(now_);
  EXPECT_EQ(StateOf(agents_[1]), v1::NODE_STATE_DEAD);
  const v1::HeartbeatResponse response = agent_beat(agents_[0], false).second;
  ASSERT_EQ(response.lost_size(), 1) << response.DebugString();
  EXPECT_EQ(response.lost(0).rank(), 1u);
  EXPECT_THAT(response.lost(0).reason(),
              HasSubstr("its connections to KV server " + servers_[0] +
                        " closed and no heartbeat for 7s"));
}

// An agent that leaves because of an error (its training process died; DeregisterRequest.failed)
// is listed to the other agents as departed, so that a job that may shrink goes on without it;
// one whose training finished is not, and neither is listed as dead.
class DepartedTest : public PlanChangeTest, public ::testing::WithParamInterface<bool> {};

TEST_P(DepartedTest, HeartbeatsNameTheAgentsThatLeftWithAnError) {
  const bool failed = GetParam();
  FormJob(BoundaryModel());
  v1::DeregisterRequest bye;
  bye.mutable_header()->set_node_id(agents_[1]);
  bye.set_reason(failed ? "agent exiting" : "training finished");
  bye.set_failed(failed);
  ASSERT_TRUE(registry_.Deregister(job_, bye, now_).ok());
  now_ += absl::Seconds(3);
  v1::HeartbeatRequest request;
  request.mutable_header()->set_node_id(agents_[0]);
  request.set_role(v1::NODE_ROLE_AGENT);
  v1::HeartbeatResponse response;
  ASSERT_TRUE(registry_.Heartbeat(job_, request, now_, &response).ok());
  EXPECT_EQ(response.lost_size(), 0) << response.DebugString();
  if (!failed) {
    EXPECT_EQ(response.departed_size(), 0) << response.DebugString();
    return;
  }
  ASSERT_EQ(response.departed_size(), 1) << response.DebugString();
  EXPECT_EQ(response.departed(0).role(), v1::NODE_ROLE_AGENT);
  EXPECT_EQ(response.departed(0).rank(), 1u);
  EXPECT_EQ(response.departed(0).node_id(), agents_[1]);
  EXPECT_EQ(response.departed(0).reason(), "agent exiting");
  EXPECT_EQ(response.departed(0).dead_for_ms(), 3000u);
  EXPECT_EQ(response.replaced_size(), 0) << response.DebugString();
  // A replacement takes the rank (--rejoin): it is listed as replaced, no longer as departed
  // (a job that shrank without it grows again).
  const std::string replacement = AddAgent(1, 2, 1);
  response.Clear();
  ASSERT_TRUE(registry_.Heartbeat(job_, request, now_, &response).ok());
  EXPECT_EQ(response.departed_size(), 0) << response.DebugString();
  ASSERT_EQ(response.replaced_size(), 1) << response.DebugString();
  EXPECT_EQ(response.replaced(0), 1u);
  // By which node: a ring makes room for each replacement once (agent: PeerReturning).
  ASSERT_EQ(response.replaced_by_size(), 1) << response.DebugString();
  EXPECT_EQ(response.replaced_by(0), replacement);
  EXPECT_EQ(response.takeovers(), 0u) << "not before it says it took up the running job";
  // It took up the running job at iteration 7 (said in every heartbeat: counted once); the
  // others learn it, so that a job with a local optimizer hands it its state.
  v1::HeartbeatRequest took;
  took.mutable_header()->set_node_id(replacement);
  took.set_role(v1::NODE_ROLE_AGENT);
  took.set_took_up_at(7);
  for (int i = 0; i < 2; ++i) {
    v1::HeartbeatResponse ignored;
    ASSERT_TRUE(registry_.Heartbeat(job_, took, now_, &ignored).ok());
  }
  response.Clear();
  ASSERT_TRUE(registry_.Heartbeat(job_, request, now_, &response).ok());
  EXPECT_EQ(response.takeovers(), 1u) << response.DebugString();
}

// A job whose world shrank (or grew again): its agents report the ranks they train with now in
// their heartbeats, and the cluster status shows the newest generation; a report beyond the
// world is refused.
TEST_F(PlanChangeTest, TheWorldAJobTrainsWithNowIsReportedByItsAgents) {
  FormJob(BoundaryModel());
  auto job_status = [&] {
    v1::GetClusterStatusResponse status;
    EXPECT_TRUE(registry_.ClusterStatus(Caller{""}, now_, &status).ok());
    EXPECT_EQ(status.jobs_size(), 1);
    return status.jobs(0);
  };
  EXPECT_FALSE(job_status().has_live_world());  // never changed
  auto beat = [&](const std::string& agent, uint32_t live, uint64_t generation) {
    v1::HeartbeatRequest request;
    request.mutable_header()->set_node_id(agent);
    request.set_role(v1::NODE_ROLE_AGENT);
    request.set_live_world(live);
    request.set_world_generation(generation);
    v1::HeartbeatResponse response;
    return registry_.Heartbeat(job_, request, now_, &response);
  };
  ASSERT_TRUE(beat(agents_[0], 1, 1).ok());
  ASSERT_TRUE(beat(agents_[1], 2, 0).ok());  // has not learnt of it yet: not shown
  EXPECT_EQ(job_status().live_world(), 1u);
  EXPECT_EQ(job_status().world_generation(), 1u);
  ASSERT_TRUE(beat(agents_[1], 2, 2).ok());  // grew again: the newest generation
  EXPECT_EQ(job_status().live_world(), 2u);
  EXPECT_EQ(job_status().world_generation(), 2u);
  const absl::Status beyond = beat(agents_[0], 3, 3);
  EXPECT_EQ(beyond.code(), absl::StatusCode::kInvalidArgument) << beyond;
  EXPECT_NE(beyond.message().find("between 1 and its job's world size (2)"), std::string::npos)
      << beyond;
  EXPECT_EQ(beat(agents_[0], 0, 3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(job_status().live_world(), 2u);
}

INSTANTIATE_TEST_SUITE_P(Leaving, DepartedTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("WithAnError")
                                             : std::string("Finished");
                         });

TEST_F(PlanChangeTest, ABandwidthOscillatingInsideTheBandNeverReplans) {
  FormJob(BoundaryModel());
  // 8.5 and 10 Gbit/s alternately, around the 9.36 Gbit/s boundary: each would change the
  // scheme, but neither is 20% away from the plan's 10 Gbit/s.
  for (int second = 1; second <= 60; ++second) {
    now_ += absl::Seconds(1);
    Report(agents_[0], {Capacity(agents_[1], second % 2 == 1 ? 8.5 : 10)}, {},
           static_cast<uint64_t>(second) * 10);
    registry_.ReplanDue(now_);
  }
  EXPECT_EQ(PlanEpoch(), 1u);
  EXPECT_EQ(registry_.plans_installed(), 1u);
}

TEST_F(PlanChangeTest, ABandwidthOscillatingAcrossTheBandReplansAtMostOncePerInterval) {
  FormJob(BoundaryModel());
  // 7 and 10 Gbit/s alternately every second: every report is beyond the band of the plan before,
  // and flips the scheme. Plans may change at most once per replan_min_interval (10s).
  std::vector<absl::Time> installed;
  uint64_t epoch = PlanEpoch();
  for (int second = 1; second <= 60; ++second) {
    now_ += absl::Seconds(1);
    Report(agents_[0], {Capacity(agents_[1], second % 2 == 1 ? 7 : 10)}, {},
           static_cast<uint64_t>(second) * 10);
    registry_.ReplanDue(now_);
    if (PlanEpoch() != epoch) {
      epoch = PlanEpoch();
      installed.push_back(now_);
    }
  }
  EXPECT_GE(installed.size(), 1u);
  EXPECT_LE(installed.size(), 6u);  // 60 reports, not 60 plans
  for (size_t i = 1; i < installed.size(); ++i) {
    EXPECT_GE(installed[i] - installed[i - 1], absl::Seconds(10));
  }
}

TEST_F(PlanChangeTest, ARealDropReplansOnceAndBackUpOnceAfterTheInterval) {
  FormJob(BoundaryModel());
  const absl::Time start = now_;
  ASSERT_EQ(Scheme(), v1::SYNC_SCHEME_SFB);
  // One report of a 10x drop, 1s after the first plan: held back by the interval, not lost.
  now_ = start + absl::Seconds(1);
  Report(agents_[0], {Capacity(agents_[1], 1)}, {}, 10);
  EXPECT_EQ(PlanEpoch(), 1u);
  now_ = start + absl::Milliseconds(9900);
  registry_.ReplanDue(now_);
  EXPECT_EQ(PlanEpoch(), 1u);
  // No newer report: the housekeeper's ReplanDue re-plans once the interval has passed.
  now_ = start + absl::Seconds(10);
  registry_.ReplanDue(now_);
  ASSERT_EQ(PlanEpoch(), 2u);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_PS);
  // The low bandwidth goes on being reported: no more plans.
  for (int second = 11; second <= 15; ++second) {
    now_ = start + absl::Seconds(second);
    Report(agents_[0], {Capacity(agents_[1], 1)}, {}, static_cast<uint64_t>(second) * 10);
    registry_.ReplanDue(now_);
  }
  EXPECT_EQ(PlanEpoch(), 2u);
  // Back up to 10 Gbit/s at 16s: re-planned back once, at 20s (10s after epoch 2).
  for (int second = 16; second <= 40; ++second) {
    now_ = start + absl::Seconds(second);
    Report(agents_[0], {Capacity(agents_[1], 10)}, {}, static_cast<uint64_t>(second) * 10);
    registry_.ReplanDue(now_);
    EXPECT_EQ(PlanEpoch(), second < 20 ? 2u : 3u) << second;
  }
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_SFB);
  EXPECT_EQ(registry_.plans_installed(), 3u);
}

TEST_F(PlanChangeTest, AchievedThroughputAloneCannotLowerButCapacityCan) {
  FormJob(BoundaryModel());
  now_ += absl::Seconds(11);
  // Achieved 1 Gbit/s over a busy window, no capacity estimate: a lower bound, floored at the
  // plan's 10 Gbit/s.
  Report(agents_[0], {Window(agents_[1], 125000000, 125000000, absl::Seconds(1))}, {}, 10);
  EXPECT_EQ(PlanEpoch(), 1u);
  // The same report with a capacity estimate of 7 Gbit/s: taken as is.
  Report(agents_[0], {Capacity(agents_[1], 7)}, {}, 20);
  EXPECT_EQ(PlanEpoch(), 2u);
  const v1::LinkStatus link = NodeOf(Status(), agents_[0])->links(0);
  EXPECT_DOUBLE_EQ(link.capacity_bytes_per_second(), 7e9 / 8);
  EXPECT_DOUBLE_EQ(link.bandwidth_bytes_per_second(), 7e9 / 8);
  EXPECT_FALSE(link.lower_bound());
  EXPECT_DOUBLE_EQ(link.bytes_per_second(), 125000000);
}

TEST_F(PlanChangeTest, TheFirstPlanUsesFreshCapacitySamples) {
  servers_ = {AddServer(), AddServer()};
  agents_ = {AddAgent(0, 2, 0), AddAgent(1, 2, 1)};
  v1::RendezvousResponse world;
  ASSERT_TRUE(*registry_.TryRendezvous(job_, agents_[0], now_, &world));
  // Measured before the model is registered: 7 Gbit/s, below the nominal 10 Gbit/s.
  Report(agents_[0], {Capacity(agents_[1], 7)}, {}, 0);
  for (const std::string& agent : agents_) {
    v1::RegisterModelRequest request;
    request.mutable_header()->set_node_id(agent);
    *request.mutable_model() = BoundaryModel();
    ASSERT_TRUE(registry_.RegisterModel(job_, request, now_).ok());
  }
  ASSERT_EQ(PlanEpoch(), 1u);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_PS);  // nominally SFB
}

// Ring all-reduce enters the plans only from the agents' measurement of it.
class RingPlanTest : public RegistryTelemetryTest {
 protected:
  explicit RingPlanTest(bool by_cost = true) : RegistryTelemetryTest(RingOptions(by_cost)) {}
  explicit RingPlanTest(RegistryOptions options) : RegistryTelemetryTest(std::move(options)) {}

  static RegistryOptions RingOptions(bool by_cost) {
    RegistryOptions options = Options();
    options.colocated = false;
    options.nominal_bandwidth_bytes_per_second = 10e9 / 8;
    options.nominal_latency_seconds = 50e-6;
    options.min_servers = 1;
    options.allreduce_by_cost = by_cost;
    return options;
  }

  // One server, two agents, one conv layer of 2^20 parameters registered by both; `allreduce`:
  // whether the agents can run the ring; with `bias` a 16-element bias after it; `buckets`: each
  // rank's --allreduce_bucket_bytes (unset: not sent); `step_ns`: the ring step each rank
  // measured before registering (0: none); `compute_ns`: each layer's forward and backward
  // time in the spec (0: none, as the agents send it).
  void FormRingJob(bool allreduce, bool bias = false,
                   std::vector<std::optional<uint64_t>> buckets = {std::nullopt, std::nullopt},
                   uint64_t step_ns = 0, uint64_t compute_ns = 0) {
    servers_ = {AddServer()};
    agents_ = {AddAgent(0, 2, 0), AddAgent(1, 2, 1)};
    v1::RendezvousResponse world;
    ASSERT_TRUE(*registry_.TryRendezvous(job_, agents_[0], now_, &world));
    v1::ModelSpec model;
    model.set_name("conv");
    auto* conv = model.add_layers();
    conv->set_name("conv.weight");
    conv->set_kind(v1::LAYER_KIND_CONV);
    conv->set_batch_per_worker(1);
    for (const uint64_t d : {256, 256, 4, 4}) conv->add_shape(d);
    if (bias) {
      auto* layer = model.add_layers();
      layer->set_name("conv.bias");
      layer->set_kind(v1::LAYER_KIND_BIAS);
      layer->set_batch_per_worker(1);
      layer->add_shape(16);
    }
    if (compute_ns != 0) {
      for (v1::LayerSpec& layer : *model.mutable_layers()) {
        layer.set_forward_time_ns(compute_ns);
        layer.set_backward_time_ns(compute_ns);
      }
    }
    for (size_t r = 0; r < agents_.size(); ++r) {
      v1::RegisterModelRequest request;
      request.mutable_header()->set_node_id(agents_[r]);
      *request.mutable_model() = model;
      request.set_allreduce_unavailable(!allreduce);
      if (buckets[r].has_value()) request.set_allreduce_bucket_bytes(*buckets[r]);
      request.set_allreduce_step_ns(step_ns);
      last_registration_ = registry_.RegisterModel(job_, request, now_);
      if (r + 1 < agents_.size() || buckets[0] == buckets[r]) {
        ASSERT_TRUE(last_registration_.ok()) << last_registration_;
      }
    }
  }
  absl::Status last_registration_;

  void ReportStep(const std::string& agent, uint64_t step_ns) {
    v1::ReportTelemetryRequest request;
    request.mutable_header()->set_node_id(agent);
    request.set_iteration(5);
    request.set_window_ns(1000000000);
    request.set_allreduce_step_ns(step_ns);
    ASSERT_TRUE(registry_.ReportTelemetry(job_, request, now_).ok());
  }

  v1::SyncScheme Scheme() { return registry_.CurrentPlan("job")->layers(0).scheme(); }
};

TEST_F(RingPlanTest, TheRingIsWeighedOnceEveryRankMeasuredIt) {
  FormRingJob(/*allreduce=*/true);
  // 2 workers, 1 server on its own machine: the ring moves half of the server's bytes, but
  // nobody has measured it yet.
  ASSERT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 1u);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_PS);
  ReportStep(agents_[0], 20000);
  EXPECT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 1u) << "one rank of two measured";
  ReportStep(agents_[1], 30000);
  ASSERT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 2u);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_ALLREDUCE);
}

// The agents form their all-reduce buckets from the world's first plan only, so a re-plan keeps
// them (LayerPlan.allreduce_bucket) and forms none. A ring step measured at 60 us (two of them:
// 120 us against PS's two 50 us legs), reported after the first plan: the conv goes by ring
// alone; the bias would share its collective in a bucket, but the agents would run it alone,
// paying the ring's steps for nothing: PS. (With the step at registration the first plan has
// the bucket: RingStepAtRegistrationTest.)
TEST_F(RingPlanTest, ARePlanFormsNoAllReduceBuckets) {
  FormRingJob(/*allreduce=*/true, /*bias=*/true, {uint64_t{25} << 20, std::nullopt});
  ReportStep(agents_[0], 60000);
  ReportStep(agents_[1], 60000);
  ASSERT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 2u);
  EXPECT_EQ(registry_.CurrentPlan("job")->layers(0).scheme(), v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(registry_.CurrentPlan("job")->layers(1).scheme(), v1::SYNC_SCHEME_PS);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(registry_.CurrentPlan("job")->layers(l).allreduce_bucket(), 0u) << l;
  }
}

// The agents connect their ring and measure its step before registering the model: the first
// plan weighs the ring with it, and with the agents' buckets the bias shares the conv's
// collective (bucket 1: both by ring; the layers' compute times, 1 us, let the iteration model
// weigh the bucket: the ring's 3.5 ms against PS's 6.8 ms is within the margin a plan without
// them asks for). A later re-plan keeps the bucket, and an operator moving a member off the
// ring is refused, naming it.
TEST_F(RingPlanTest, AStepMeasuredAtRegistrationPutsTheRingInTheFirstPlansBuckets) {
  FormRingJob(/*allreduce=*/true, /*bias=*/true, {std::nullopt, std::nullopt}, 60000, 1000);
  ASSERT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 1u);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(registry_.CurrentPlan("job")->layers(l).scheme(), v1::SYNC_SCHEME_ALLREDUCE) << l;
    EXPECT_EQ(registry_.CurrentPlan("job")->layers(l).allreduce_bucket(), 1u) << l;
  }
  // Telemetry of the same step changes nothing.
  ReportStep(agents_[0], 60000);
  ReportStep(agents_[1], 60000);
  EXPECT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 1u);
  v1::SetLayerSchemesRequest request;
  (*request.mutable_schemes())["conv.bias"] = v1::SYNC_SCHEME_PS;
  v1::SetLayerSchemesResponse response;
  const absl::Status moved = registry_.SetLayerSchemes(job_, request, now_, &response);
  EXPECT_EQ(moved.code(), absl::StatusCode::kInvalidArgument) << moved;
  EXPECT_NE(moved.message().find("'conv.bias' is in all-reduce bucket 1"), std::string::npos)
      << moved;
  EXPECT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 1u);
}

TEST_F(RingPlanTest, ARankWithAnotherAllReduceBucketSizeIsRefused) {
  FormRingJob(/*allreduce=*/true, /*bias=*/false, {uint64_t{1} << 20, uint64_t{2} << 20});
  EXPECT_EQ(last_registration_.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(last_registration_.message().find("--allreduce_bucket_bytes must be the same"),
            std::string::npos)
      << last_registration_;
}

TEST_F(RingPlanTest, AJobWhoseAgentsCannotRunTheRingNeverGetsIt) {
  FormRingJob(/*allreduce=*/false);
  ReportStep(agents_[0], 20000);
  ReportStep(agents_[1], 20000);
  EXPECT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 1u);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_PS);
}

// The coordinator's default: the cost model does not choose the ring (--allreduce_by_cost).
class RingPlanOffTest : public RingPlanTest {
 protected:
  RingPlanOffTest() : RingPlanTest(false) {}
};

TEST_F(RingPlanOffTest, WithoutAllreduceByCostOnlyAnOverridePutsALayerOnTheRing) {
  FormRingJob(/*allreduce=*/true);
  ReportStep(agents_[0], 20000);
  ReportStep(agents_[1], 20000);
  EXPECT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 1u);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_PS);
  v1::SetLayerSchemesRequest request;
  (*request.mutable_schemes())["conv.weight"] = v1::SYNC_SCHEME_ALLREDUCE;
  v1::SetLayerSchemesResponse response;
  ASSERT_TRUE(registry_.SetLayerSchemes(job_, request, now_, &response).ok());
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_ALLREDUCE);
}

// Without the coordinator's --allreduce_by_cost the measured step changes nothing.
TEST_F(RingPlanOffTest, AStepMeasuredAtRegistrationIsNotWeighedWithoutAllreduceByCost) {
  FormRingJob(/*allreduce=*/true, /*bias=*/true, {std::nullopt, std::nullopt}, 60000, 1000);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_PS);
  EXPECT_EQ(registry_.CurrentPlan("job")->layers(1).scheme(), v1::SYNC_SCHEME_PS);
}

// --plan_lowrank_layers: the coordinator's per-layer rank is in the job's plan from the first
// epoch, by all-reduce (which the coordinator's default rule never chooses by itself).
class RingLowRankOverrideTest : public RingPlanTest {
 protected:
  RingLowRankOverrideTest() : RingPlanTest(Overridden()) {}
  static RegistryOptions Overridden() {
    RegistryOptions options = RingOptions(/*by_cost=*/false);
    options.lowrank_overrides = {{"conv.weight", 4}};
    return options;
  }
};

TEST_F(RingLowRankOverrideTest, APerLayerRankIsInEveryPlanOfTheJob) {
  FormRingJob(/*allreduce=*/true);
  ASSERT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 1u);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(registry_.CurrentPlan("job")->layers(0).lowrank_rank(), 4u);
  // An operator moving the layer to PS contradicts the setting: refused, naming why; the plan
  // stays.
  v1::SetLayerSchemesRequest request;
  (*request.mutable_schemes())["conv.weight"] = v1::SYNC_SCHEME_PS;
  v1::SetLayerSchemesResponse response;
  const absl::Status moved = registry_.SetLayerSchemes(job_, request, now_, &response);
  EXPECT_FALSE(moved.ok());
  EXPECT_NE(moved.message().find("low rank goes by all-reduce"), std::string::npos) << moved;
  EXPECT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 1u);
  EXPECT_EQ(registry_.CurrentPlan("job")->layers(0).lowrank_rank(), 4u);
}

TEST_F(RingPlanTest, ASlowRingKeepsThePlan) {
  FormRingJob(/*allreduce=*/true);
  // 10 ms a step: 2 of them cost more than the server's 6.7 ms of bytes.
  ReportStep(agents_[0], 10000000);
  ReportStep(agents_[1], 20000);
  EXPECT_EQ(registry_.CurrentPlan("job")->plan_epoch(), 1u);
  EXPECT_EQ(Scheme(), v1::SYNC_SCHEME_PS);
}

// A restarted coordinator starts empty (issue 17): the job's nodes register again, and each agent
// registers its model again with the newest plan it received and the servers that joined the
// running job. The restarted coordinator takes the newest epoch as the job's plan, with its
// servers in the plan's order whatever order they registered in, lists the joined servers and,
// as dead, a server the agents lost before the restart (keeping its endpoints), and plans on from
// that epoch with the same chunks.
TEST_F(PlanChangeTest, ARestartedCoordinatorTakesUpTheRunningPlanFromItsAgents) {
  FormJob(TinyModel());  // conv.weight, conv.bias, fc.weight, fc.bias
  const v1::Plan first = *registry_.CurrentPlan("job");
  const v1::SyncScheme fc = first.layers(2).scheme();
  const v1::SyncScheme other = fc == v1::SYNC_SCHEME_SFB ? v1::SYNC_SCHEME_PS : v1::SYNC_SCHEME_SFB;
  Beat(agents_[0], 40);
  ASSERT_TRUE(Override({{"fc.weight", other}}, job_).ok());
  const v1::Plan running = *registry_.CurrentPlan("job");
  ASSERT_EQ(running.plan_epoch(), 2u);
  const std::string joined = AddServer();  // after the first plan: it joined the running job
  Beat(agents_[0], 41, 2);

  Registry restarted(Options(), "test");
  // Server 1 was lost before the restart: it never registers again.
  for (const std::string& id : {joined, servers_[0]}) {  // another order
    v1::RegisterServerRequest again;
    again.set_host("server-host");
    again.set_previous_node_id(id);
    *again.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, "10.0.0.9:7100");
    v1::RegisterServerResponse response;
    ASSERT_TRUE(restarted.RegisterServer(Caller{""}, again, now_, &response).ok());
  }
  std::vector<std::string> agents;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    v1::RegisterAgentRequest again;
    again.set_host(absl::StrCat("host", rank));
    again.set_gpu_index(rank);
    *again.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, "10.0.0.1:7200");
    again.set_world_size(2);
    again.set_requested_rank(rank);
    v1::RegisterAgentResponse response;
    ASSERT_TRUE(restarted.RegisterAgent(job_, again, now_, &response).ok());
    agents.push_back(response.node_id());
  }
  auto register_again = [&](const std::string& agent, const v1::Plan& plan) {
    v1::RegisterModelRequest request;
    request.mutable_header()->set_node_id(agent);
    *request.mutable_model() = TinyModel();
    *request.mutable_running_plan() = plan;
    request.add_joined_servers(joined);
    request.add_lost_servers(servers_[1]);
    return restarted.RegisterModel(job_, request, now_);
  };
  // Rank 0 had not received epoch 2 yet, rank 1 had: the newest is the job's.
  ASSERT_TRUE(register_again(agents[0], first).ok());
  ASSERT_TRUE(register_again(agents[1], running).ok());
  v1::Plan plan;
  ASSERT_TRUE(*restarted.TryModelPlan(job_, agents[0], now_, &plan));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(plan, running))
      << plan.DebugString();
  v1::HeartbeatRequest beat;
  beat.mutable_header()->set_node_id(agents[0]);
  beat.set_role(v1::NODE_ROLE_AGENT);
  beat.set_iteration(42);
  beat.set_plan_epoch(2);
  v1::HeartbeatResponse answer;
  ASSERT_TRUE(restarted.Heartbeat(job_, beat, now_, &answer).ok());
  ASSERT_EQ(answer.joined_servers_size(), 1);
  EXPECT_EQ(answer.joined_servers(0).node_id(), joined);
  ASSERT_EQ(answer.lost_size(), 1);
  EXPECT_EQ(answer.lost(0).node_id(), servers_[1]);
  EXPECT_THAT(answer.lost(0).reason(), HasSubstr("lost before this coordinator started"));
  EXPECT_TRUE(restarted.CurrentPlan("job") != nullptr &&
              restarted.CurrentPlan("job")->plan_epoch() == 2u);
  // The operator's override before the restart is in force; the next one is epoch 3 (a layer
  // pinned to the scheme it has: no scheme changes, but the epoch carries the override), then 4,
  // with the running plan's chunks and servers.
  v1::SetLayerSchemesRequest set;
  (*set.mutable_schemes())["conv.bias"] = v1::SYNC_SCHEME_PS;
  v1::SetLayerSchemesResponse kept;
  ASSERT_TRUE(restarted.SetLayerSchemes(job_, set, now_, &kept).ok());
  EXPECT_TRUE(kept.installed());
  EXPECT_EQ(kept.plan().plan_epoch(), 3u);
  ASSERT_EQ(kept.overrides().count("fc.weight"), 1u);
  EXPECT_EQ(kept.overrides().at("fc.weight"), other);
  EXPECT_EQ(kept.plan().scheme_overrides().at("conv.bias"), v1::SYNC_SCHEME_PS);
  EXPECT_EQ(kept.plan().layers(2).scheme(), other);
  set.clear_schemes();
  (*set.mutable_schemes())["fc.weight"] = fc;
  v1::SetLayerSchemesResponse response;
  ASSERT_TRUE(restarted.SetLayerSchemes(job_, set, now_, &response).ok());
  EXPECT_EQ(response.plan().plan_epoch(), 4u);
  EXPECT_EQ(response.plan().layers(2).scheme(), fc);
  EXPECT_EQ(ChunksOf(response.plan()), ChunksOf(running));
  ASSERT_EQ(response.plan().servers_size(), 2);
  EXPECT_EQ(response.plan().servers(0).node_id(), servers_[0]);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(response.plan().servers(1),
                                                                 running.servers(1)));
}

TEST_F(PlanChangeTest, OperatorOverridesAreCheckedInstalledAndPersist) {
  FormJob(TinyModel());  // conv.weight, conv.bias, fc.weight, fc.bias
  const v1::Plan first = *registry_.CurrentPlan("job");
  const v1::SyncScheme fc = first.layers(2).scheme();
  const v1::SyncScheme other = fc == v1::SYNC_SCHEME_SFB ? v1::SYNC_SCHEME_PS : v1::SYNC_SCHEME_SFB;

  // Refusals name the layer and change nothing.
  auto refused = Override({{"fc.weight", other}, {"no.such", v1::SYNC_SCHEME_PS}}, job_);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("has no layer 'no.such'"));
  refused = Override({{"conv.weight", v1::SYNC_SCHEME_SFB}}, job_);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            "schemes['conv.weight']: layer 'conv.weight' is LAYER_KIND_CONV: only FC layers can "
            "use SFB");
  refused = Override({{"fc.weight", other}}, job_, "other-job");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  refused = Override({{"fc.weight", other}}, Caller{""}, "no-job");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(PlanEpoch(), 1u);

  // Forcing fc.weight to the other scheme: a new epoch, effective ahead of the job (one
  // iteration report: no rate yet, so the wide margin).
  Beat(agents_[0], 40);
  auto set = Override({{"fc.weight", other}}, job_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_TRUE(set->installed());
  EXPECT_EQ(set->plan().plan_epoch(), 2u);
  EXPECT_EQ(set->plan().effective_iteration(), 240u);
  EXPECT_EQ(set->plan().layers(2).scheme(), other);
  EXPECT_EQ(set->overrides().at("fc.weight"), other);
  EXPECT_EQ(set->header().plan_epoch(), 2u);
  EXPECT_EQ(ChunksOf(set->plan()), ChunksOf(first));

  // The same again changes nothing: no new epoch. The cluster token may name the job.
  set = Override({{"fc.weight", other}}, Caller{""}, "job");
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_FALSE(set->installed());
  EXPECT_EQ(set->plan().plan_epoch(), 2u);

  // The override persists across the cost model's re-plans: a bandwidth that would change
  // nothing else keeps it; a new plan from a server's new endpoints keeps it too.
  now_ += absl::Seconds(11);
  Report(agents_[0], {Capacity(agents_[1], 0.5)}, {}, 60);
  Report(agents_[0], {Capacity(agents_[1], 100)}, {}, 61);
  EXPECT_EQ(Scheme(2), other);
  v1::RegisterServerRequest rejoin;
  rejoin.set_host("server-host");
  rejoin.set_previous_node_id(servers_[0]);
  *rejoin.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, "10.0.0.9:7998");
  v1::RegisterServerResponse response;
  ASSERT_TRUE(registry_.RegisterServer(Caller{""}, rejoin, now_, &response).ok());
  const uint64_t epoch = PlanEpoch();
  EXPECT_GT(epoch, 2u);
  EXPECT_EQ(Scheme(2), other);

  // Cleared: back to the cost model's choice, a new epoch.
  set = Override({{"fc.weight", v1::SYNC_SCHEME_UNSPECIFIED}}, job_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_TRUE(set->overrides().empty());
  EXPECT_EQ(set->plan().plan_epoch(), epoch + 1);
  EXPECT_EQ(set->plan().layers(2).scheme(), fc);

  // A layer pinned to the scheme it has: no scheme changes, but a new epoch carries the override
  // (Plan.scheme_overrides), so that every agent holds it and a restarted coordinator takes it
  // up with the plan; the same again is nothing new.
  const v1::Plan before = *registry_.CurrentPlan("job");
  set = Override({{"fc.weight", fc}}, job_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_TRUE(set->installed());
  EXPECT_EQ(set->plan().plan_epoch(), epoch + 2);
  for (int l = 0; l < before.layers_size(); ++l) {
    EXPECT_EQ(set->plan().layers(l).scheme(), before.layers(l).scheme()) << l;
  }
  ASSERT_EQ(set->plan().scheme_overrides().count("fc.weight"), 1u);
  EXPECT_EQ(set->plan().scheme_overrides().at("fc.weight"), fc);
  set = Override({{"fc.weight", fc}}, job_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_FALSE(set->installed());
  EXPECT_EQ(set->plan().plan_epoch(), epoch + 2);
}

}  // namespace
}  // namespace poseidon::coordinator::testing
