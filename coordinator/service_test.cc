// The Coordinator service end to end: CoordinatorClient threads against an in-process
// CoordinatorServer on 127.0.0.1:0. Rendezvous, every refusal the issue names, models, plans,
// telemetry and re-planning, liveness, status, validation and shutdown.
#include <atomic>
#include <cmath>
#include <random>
#include <set>
#include <thread>

#include "coordinator/test_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/generic/generic_stub.h"

namespace poseidon::coordinator::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

#define EXPECT_STATUS(expr, expected_code, substring)                             \
  do {                                                                            \
    const absl::Status status_ = (expr);                                          \
    EXPECT_EQ(status_.code(), absl::StatusCode::expected_code) << status_;        \
    EXPECT_THAT(std::string(status_.message()), HasSubstr(substring)) << status_; \
  } while (false)

class CoordinatorServiceTest : public CoordinatorFixture {};

// ---- Rendezvous
// ----------------------------------------------------------------------------------

// A shared server fleet: a cluster-wide server that holds some jobs' secrets only (poseidon-server
// --secrets_file) is in those jobs' worlds and no other's.
TEST_F(CoordinatorServiceTest, AClusterWideServerOfSomeJobsServesThoseJobsOnly) {
  StartServer();
  auto everyone = AddServer(7100);
  auto only_a = AddServer(7101, "127.0.0.1", {kJobA});
  std::vector<Member> a = FormWorld(1, kJobA, kTokenA);
  std::vector<Member> b = FormWorld(1, kJobB, kTokenB);
  ASSERT_EQ(a[0].world.servers.size(), 2u);
  EXPECT_EQ(a[0].world.servers[1].node_id(), only_a->node_id());
  ASSERT_EQ(b[0].world.servers.size(), 1u);
  EXPECT_EQ(b[0].world.servers[0].node_id(), everyone->node_id());
  // A list of jobs is validated like any id.
  auto admin = Client("", kClusterToken);
  ServerRegistration bad;
  bad.host = "h";
  bad.endpoints.push_back(MakeEndpoint(v1::TRANSPORT_KIND_TCP, "127.0.0.1:7102"));
  bad.jobs = {"not an id!"};
  EXPECT_EQ(admin->RegisterServer(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorServiceTest, FourAgentsRendezvousAndGetOnePlan) {
  StartServer();
  auto server = AddServer(7100);
  std::vector<Member> members = FormWorld(4);
  ASSERT_EQ(members.size(), 4u);

  std::set<uint32_t> ranks;
  for (const Member& member : members) {
    const World& world = member.world;
    ranks.insert(world.rank);
    EXPECT_EQ(world.world_size, 4u);
    ASSERT_EQ(world.peers.size(), 4u);
    for (uint32_t r = 0; r < 4; ++r) {
      EXPECT_EQ(world.peers[r].rank(), r);
      // Everyone sees the same membership.
      EXPECT_EQ(world.peers[r].node_id(), members[0].world.peers[r].node_id());
      EXPECT_EQ(world.peers[r].endpoints(0).address(),
                absl::StrCat("127.0.0.1:", 7200 + world.peers[r].gpu_index()));
    }
    EXPECT_EQ(world.peers[world.rank].node_id(), member.client->node_id());
    ASSERT_EQ(world.servers.size(), 1u);
    EXPECT_EQ(world.servers[0].node_id(), server->node_id());
    EXPECT_EQ(world.servers[0].endpoints(0).address(), "127.0.0.1:7100");
  }
  EXPECT_EQ(ranks, (std::set<uint32_t>{0, 1, 2, 3}));

  std::vector<absl::StatusOr<v1::Plan>> plans = RegisterModels(members, TinyModel());
  for (const auto& plan : plans) {
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->job_id(), kJobA);
    EXPECT_EQ(plan->plan_epoch(), 1u);
    EXPECT_EQ(plan->effective_iteration(), 0u);
    EXPECT_EQ(plan->layers_size(), 4);
    ASSERT_EQ(plan->servers_size(), 1);
    EXPECT_EQ(plan->servers(0).node_id(), server->node_id());
    EXPECT_EQ(plan->servers(0).endpoints(0).address(), "127.0.0.1:7100");
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*plan, *plans[0]));
  }
  auto current = members[2].client->GetPlan();
  ASSERT_TRUE(current.ok()) << current.status();
  EXPECT_EQ(current->plan_epoch(), 1u);
}

// A server that registers for a job once its first plan is out (a replacement for a lost one)
// is listed to the job's agents as joined, with its endpoints, in the order such servers came;
// a server of the plan is not, and neither is one before the plan.
TEST_F(CoordinatorServiceTest, AServerRegisteredAfterThePlanIsListedToTheAgentsAsJoined) {
  StartServer();
  auto server = AddServer(7100);
  std::vector<Member> members = FormWorld(2);
  ASSERT_EQ(members.size(), 2u);
  auto before = members[0].client->Heartbeat({});
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->joined_servers_size(), 0) << "nothing joined before the plan";
  std::vector<absl::StatusOr<v1::Plan>> plans = RegisterModels(members, TinyModel());
  ASSERT_TRUE(plans[0].ok()) << plans[0].status();
  auto none = members[1].client->Heartbeat({});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->joined_servers_size(), 0);
  auto first = AddServer(7101);
  auto second = AddServer(7102);
  for (const Member& member : members) {
    auto heartbeat = member.client->Heartbeat({});
    ASSERT_TRUE(heartbeat.ok()) << heartbeat.status();
    ASSERT_EQ(heartbeat->joined_servers_size(), 2);
    EXPECT_EQ(heartbeat->joined_servers(0).node_id(), first->node_id());
    EXPECT_EQ(heartbeat->joined_servers(0).endpoints(0).address(), "127.0.0.1:7101");
    EXPECT_EQ(heartbeat->joined_servers(1).node_id(), second->node_id());
  }
}

TEST_F(CoordinatorServiceTest, RequestedRanksOrderThePeers) {
  StartServer();
  auto server = AddServer(7100);
  std::vector<std::unique_ptr<CoordinatorClient>> clients;
  std::vector<absl::StatusOr<World>> worlds(3, absl::UnknownError(""));
  std::vector<std::thread> threads;
  const uint32_t requested[3] = {2, 0, 1};
  for (int i = 0; i < 3; ++i) clients.push_back(Client());
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      worlds[i] =
          clients[i]->RegisterAgentAndRendezvous(Agent(i, 3, requested[i]), absl::Seconds(30));
    });
  }
  for (auto& thread : threads) thread.join();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(worlds[i].ok()) << worlds[i].status();
    EXPECT_EQ(worlds[i]->rank, requested[i]);
    // Rank r is the agent that asked for it (GPU i asked for requested[i]).
    EXPECT_EQ(worlds[i]->peers[requested[i]].gpu_index(), static_cast<uint32_t>(i));
  }
}

TEST_F(CoordinatorServiceTest, WorldSizeMismatchIsRefused) {
  StartServer();
  auto first = Client();
  ASSERT_TRUE(first->RegisterAgent(Agent(0, 4)).ok());
  auto second = Client();
  EXPECT_STATUS(second->RegisterAgent(Agent(1, 3)).status(), kFailedPrecondition,
                "world_size mismatch: this agent says 3, job 'job-a' has world_size 4");
}

TEST_F(CoordinatorServiceTest, DuplicateRankIsRefused) {
  StartServer();
  auto first = Client();
  ASSERT_TRUE(first->RegisterAgent(Agent(0, 2, 1)).ok());
  auto second = Client();
  const absl::Status status = second->RegisterAgent(Agent(1, 2, 1)).status();
  EXPECT_STATUS(status, kAlreadyExists, "duplicate rank: rank 1 of job 'job-a' is held by");
  EXPECT_THAT(std::string(status.message()), HasSubstr("gpu 0, alive"));
  // Both are named: the holder above, and the agent that asked.
  EXPECT_THAT(std::string(status.message()), HasSubstr("; asked for by host "));
  EXPECT_THAT(std::string(status.message()), HasSubstr(" gpu 1;"));
  // The same GPU index on another host is another agent too, not the holder restarted.
  auto elsewhere = Client();
  const absl::Status other = elsewhere->RegisterAgent(Agent(0, 2, 1, "node-b")).status();
  EXPECT_STATUS(other, kAlreadyExists, "duplicate rank: rank 1 of job 'job-a' is held by");
  EXPECT_THAT(std::string(other.message()), HasSubstr("on host 127.0.0.1 gpu 0"));
  EXPECT_THAT(std::string(other.message()), HasSubstr("asked for by host node-b gpu 0;"));

  // With every rank held, an agent without a requested rank is refused too.
  auto third = Client();
  ASSERT_TRUE(third->RegisterAgent(Agent(2, 2)).ok());  // takes rank 0
  auto fourth = Client();
  EXPECT_STATUS(fourth->RegisterAgent(Agent(3, 2)).status(), kAlreadyExists,
                "job 'job-a' already has 2 live agents");
}

TEST_F(CoordinatorServiceTest, RetriedRegistrationGetsTheSameRank) {
  StartServer();
  auto client = Client();
  auto first = client->RegisterAgent(Agent(0, 2));
  ASSERT_TRUE(first.ok()) << first.status();
  auto again = client->RegisterAgent(Agent(0, 2));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->node_id(), first->node_id());
  EXPECT_EQ(again->rank(), first->rank());
}

TEST_F(CoordinatorServiceTest, RestartOnTheSameGpuTakesTheRankOver) {
  StartServer();
  auto old_agent = Client();
  ASSERT_TRUE(old_agent->RegisterAgent(Agent(0, 2, 0)).ok());
  auto restarted = Client();
  auto registered = restarted->RegisterAgent(Agent(0, 2, 0));
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ(registered->rank(), 0u);
  EXPECT_NE(registered->node_id(), old_agent->node_id());
  // The replaced process is told to stop.
  auto heartbeat = old_agent->Heartbeat({});
  ASSERT_TRUE(heartbeat.ok()) << heartbeat.status();
  EXPECT_TRUE(heartbeat->shutdown());
}

// ---- Authentication ----------------------------------------------------------------------------

TEST_F(CoordinatorServiceTest, UnknownJobIsNotFound) {
  StartServer();
  auto client = Client("no-such-job", "whatever");
  EXPECT_STATUS(client->RegisterAgent(Agent(0, 1)).status(), kNotFound,
                "job 'no-such-job' is not configured on this coordinator");
}

TEST_F(CoordinatorServiceTest, WrongOrMissingTokenIsRefusedOnEveryCall) {
  StartServer();
  for (const std::string& token : {std::string("wrong"), std::string()}) {
    SCOPED_TRACE(token);
    auto client = Client(kJobA, token);
    const char* expected = token.empty() ? "header.token is empty: job 'job-a' needs its token"
                                         : "wrong token for job 'job-a'";
    EXPECT_STATUS(client->RegisterAgent(Agent(0, 1)).status(), kUnauthenticated, expected);
    ServerRegistration server;
    server.host = "h";
    server.endpoints.push_back(MakeEndpoint(v1::TRANSPORT_KIND_TCP, "127.0.0.1:1"));
    EXPECT_STATUS(client->RegisterServer(server).status(), kUnauthenticated, expected);
    EXPECT_STATUS(client->Rendezvous(absl::Seconds(5)).status(), kUnauthenticated, expected);
    EXPECT_STATUS(client->RegisterModel(TinyModel(), {}, {}, absl::Seconds(5)).status(),
                  kUnauthenticated, expected);
    EXPECT_STATUS(client->GetPlan().status(), kUnauthenticated, expected);
    EXPECT_STATUS(client->WaitForPlan(1, absl::Seconds(5)).status(), kUnauthenticated, expected);
    EXPECT_STATUS(client->ReportTelemetry({}, 0), kUnauthenticated, expected);
    EXPECT_STATUS(client->Heartbeat({}).status(), kUnauthenticated, expected);
    EXPECT_STATUS(client->Deregister("bye"), kUnauthenticated, expected);
    EXPECT_STATUS(client->GetClusterStatus().status(), kUnauthenticated, expected);
    EXPECT_STATUS(client->SetLayerSchemes({{"fc.weight", v1::SYNC_SCHEME_PS}}).status(),
                  kUnauthenticated, expected);
    EXPECT_STATUS(client->StoreSet("k", "v"), kUnauthenticated, expected);
    EXPECT_STATUS(client->StoreGet({"k"}, absl::Seconds(5)).status(), kUnauthenticated, expected);
  }
  // Cluster-wide calls need the cluster token.
  auto cluster = Client("", "not-the-cluster-token");
  EXPECT_STATUS(cluster->GetClusterStatus().status(), kUnauthenticated, "wrong cluster token");
}

TEST_F(CoordinatorServiceTest, AnotherJobsTokenCannotActForANode) {
  StartServer();
  auto agent = Client();
  ASSERT_TRUE(agent->RegisterAgent(Agent(0, 2)).ok());
  auto stub = RawStub();
  v1::HeartbeatRequest request;
  request.mutable_header()->set_job_id(kJobB);
  request.mutable_header()->set_token(kTokenB);
  request.mutable_header()->set_node_id(agent->node_id());
  request.set_role(v1::NODE_ROLE_AGENT);
  v1::HeartbeatResponse response;
  grpc::ClientContext context;
  Deadline(&context);
  const grpc::Status status = stub->Heartbeat(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(status.error_message(),
              HasSubstr(absl::StrCat("node '", agent->node_id(),
                                     "' belongs to job 'job-a', not to job 'job-b'")));
}

// ---- Deadlines name who is missing -----------------------------------------------------------

TEST_F(CoordinatorServiceTest, RendezvousDeadlineNamesTheMissingRanks) {
  StartServer();
  auto server = AddServer(7100);
  auto rank0 = Client();
  auto rank2 = Client();
  ASSERT_TRUE(rank0->RegisterAgent(Agent(0, 4, 0)).ok());
  ASSERT_TRUE(rank2->RegisterAgent(Agent(2, 4, 2)).ok());
  const absl::Status status = rank0->Rendezvous(absl::Milliseconds(800)).status();
  EXPECT_STATUS(status, kDeadlineExceeded, "rendezvous of job 'job-a' incomplete after");
  EXPECT_THAT(std::string(status.message()), HasSubstr("2 of 4 ranks have a live agent"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("rank 1 (no agent has registered)"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("rank 3 (no agent has registered)"));
}

TEST_F(CoordinatorServiceTest, RendezvousDeadlineNamesMissingServers) {
  StartServer();
  auto agent = Client(kJobB, kTokenB);
  ASSERT_TRUE(agent->RegisterAgent(Agent(0, 1)).ok());
  EXPECT_STATUS(agent->Rendezvous(absl::Milliseconds(800)).status(), kDeadlineExceeded,
                "servers: 0 of the 1 required have registered");
}

TEST_F(CoordinatorServiceTest, ConfiguredRendezvousTimeoutBoundsTheWait) {
  CoordinatorServerOptions options = DefaultServerOptions();
  options.service.rendezvous_timeout = absl::Milliseconds(300);
  StartServer(options);
  auto agent = Client();
  ASSERT_TRUE(agent->RegisterAgent(Agent(0, 2)).ok());
  // The call would allow a minute; the coordinator answers when its own bound passes.
  EXPECT_STATUS(agent->Rendezvous(absl::Minutes(1)).status(), kDeadlineExceeded,
                "rank 1 (no agent has registered)");
}

// ---- Models ------------------------------------------------------------------------------------

TEST_F(CoordinatorServiceTest, DifferingModelsNameTheFirstDifferingLayer) {
  StartServer();
  auto server = AddServer(7100);
  std::vector<Member> members = FormWorld(2);
  Member* first = members[0].world.rank == 0 ? &members[0] : &members[1];
  Member* second = members[0].world.rank == 0 ? &members[1] : &members[0];

  absl::StatusOr<v1::Plan> first_plan = absl::UnknownError("");
  std::thread waiting(
      [&] { first_plan = first->client->RegisterModel(TinyModel(32), {}, {}, absl::Seconds(30)); });
  // Wait until rank 0's model is the job's (its call is parked, waiting for rank 1).
  while (server_->service().parked_calls() == 0) absl::SleepFor(absl::Milliseconds(5));

  EXPECT_STATUS(second->client->RegisterModel(TinyModel(64), {}, {}, absl::Seconds(30)).status(),
                kFailedPrecondition,
                "the model of rank 1 differs from job 'job-a''s model (first registered by rank "
                "0): layer 2 'fc.weight': shape is [10, 64] here, [10, 32] in the job's model");
  v1::UpdateRuleSpec sgd;
  sgd.set_rule(v1::UPDATE_RULE_SGD);
  sgd.set_learning_rate(0.1);
  EXPECT_STATUS(second->client->RegisterModel(TinyModel(32), sgd, {}, absl::Seconds(30)).status(),
                kFailedPrecondition,
                "update_rule.rule is UPDATE_RULE_SGD here, UPDATE_RULE_UNSPECIFIED in the job's");

  // Fixed, the second rank gets the plan, and so does the first, which was waiting for it.
  auto second_plan = second->client->RegisterModel(TinyModel(32), {}, {}, absl::Seconds(30));
  waiting.join();
  ASSERT_TRUE(second_plan.ok()) << second_plan.status();
  ASSERT_TRUE(first_plan.ok()) << first_plan.status();
  EXPECT_EQ(first_plan->plan_epoch(), 1u);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*first_plan, *second_plan));
}

TEST_F(CoordinatorServiceTest, ModelWaitNamesTheRanksWithoutAModel) {
  StartServer();
  auto server = AddServer(7100);
  std::vector<Member> members = FormWorld(2);
  Member& rank0 = members[0].world.rank == 0 ? members[0] : members[1];
  // The coordinator answers before the call's own deadline, saying who is missing.
  EXPECT_STATUS(rank0.client->RegisterModel(TinyModel(), {}, {}, absl::Seconds(1)).status(),
                kDeadlineExceeded, "1 of 2 ranks have not registered the model: rank 1 (agent-");
}

TEST_F(CoordinatorServiceTest, GetPlanBeforeAnyModelSaysWhy) {
  StartServer();
  auto agent = Client();
  ASSERT_TRUE(agent->RegisterAgent(Agent(0, 2)).ok());
  EXPECT_STATUS(agent->GetPlan().status(), kFailedPrecondition,
                "job 'job-a' has no plan yet: the world is incomplete");
}

// ---- Plans and telemetry ---------------------------------------------------------------------


v1::LinkTelemetry Link(const std::string& peer, double gigabits) {
  v1::LinkTelemetry link;
  link.set_peer_node_id(peer);
  link.set_transport(v1::TRANSPORT_KIND_TCP);
  link.set_bytes_per_second(gigabits * 1e9 / 8);
  return link;
}

TEST_F(CoordinatorServiceTest, TelemetryBeyondTheThresholdSwitchesThePlanEpoch) {
  CoordinatorServerOptions options = DefaultServerOptions();
  options.service.registry.colocated = true;
  options.service.registry.nominal_bandwidth_bytes_per_second = 10e9 / 8;
  options.service.registry.nominal_latency_seconds = 7e-6;
  options.service.registry.replan_threshold = 0.2;
  options.service.registry.plan_lead_iterations = 10;
  // Wall-clock time: no minimum interval and no lead time, so the epochs and iterations below do
  // not depend on how fast the test runs (registry_test drives both with a fake clock).
  options.service.registry.replan_min_interval = absl::ZeroDuration();
  options.service.registry.plan_lead_time = absl::ZeroDuration();
  options.service.registry.plan_unknown_rate_lead_iterations = 0;  // wall clock: no rate
  options.service.registry.min_servers = 2;
  StartServer(options);
  auto server0 = AddServer(7100);
  auto server1 = AddServer(7101);
  std::vector<Member> members = FormWorld(2);
  std::vector<absl::StatusOr<v1::Plan>> plans = RegisterModels(members, BoundaryModel());
  ASSERT_TRUE(plans[0].ok()) << plans[0].status();
  EXPECT_EQ(plans[0]->plan_epoch(), 1u);
  EXPECT_EQ(plans[0]->layers(0).scheme(), v1::SYNC_SCHEME_SFB);  // nominal 10 Gbit/s

  CoordinatorClient& agent = *members[0].client;
  const std::string peer = members[1].client->node_id();
  auto current = [&] {
    auto plan = agent.GetPlan();
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *plan : v1::Plan();
  };

  // A long poll for epoch 2 waits for the switch below.
  absl::StatusOr<v1::Plan> awaited = absl::UnknownError("");
  std::thread waiter([&] { awaited = members[1].client->WaitForPlan(2, absl::Seconds(30)); });
  while (server_->service().parked_calls() == 0) absl::SleepFor(absl::Milliseconds(5));

  // 8.5 Gbit/s: PS would now be faster, but a 15% move is inside the hysteresis band.
  ASSERT_TRUE(agent.ReportTelemetry({Link(peer, 8.5)}, 100).ok());
  EXPECT_EQ(current().plan_epoch(), 1u);

  // 7 Gbit/s: a 30% move, and the schemes change: epoch 2, effective 10 iterations after the
  // highest iteration reported.
  ASSERT_TRUE(agent.ReportTelemetry({Link(peer, 7)}, 120).ok());
  EXPECT_EQ(agent.plan_epoch(), 2u);  // learned from the response header
  v1::Plan switched = current();
  EXPECT_EQ(switched.plan_epoch(), 2u);
  EXPECT_EQ(switched.effective_iteration(), 130u);
  EXPECT_EQ(switched.layers(0).scheme(), v1::SYNC_SCHEME_PS);
  EXPECT_FALSE(switched.layers(0).chunks().empty());
  waiter.join();
  ASSERT_TRUE(awaited.ok()) << awaited.status();
  EXPECT_EQ(awaited->plan_epoch(), 2u);

  // 5 Gbit/s moves beyond the band again, but PS stays PS: no new epoch.
  ASSERT_TRUE(agent.ReportTelemetry({Link(peer, 5)}, 140).ok());
  EXPECT_EQ(current().plan_epoch(), 2u);

  // Back to 10 Gbit/s: SFB again, epoch 3.
  ASSERT_TRUE(agent.ReportTelemetry({Link(peer, 10)}, 150).ok());
  v1::Plan back = current();
  EXPECT_EQ(back.plan_epoch(), 3u);
  EXPECT_EQ(back.effective_iteration(), 160u);
  EXPECT_EQ(back.layers(0).scheme(), v1::SYNC_SCHEME_SFB);

  // A long poll with nothing newer answers the current plan when its bound passes.
  auto unchanged = agent.WaitForPlan(4, absl::Milliseconds(500));
  ASSERT_TRUE(unchanged.ok()) << unchanged.status();
  EXPECT_EQ(unchanged->plan_epoch(), 3u);
}

// ---- Operator overrides
// --------------------------------------------------------------------------

TEST_F(CoordinatorServiceTest, SetLayerSchemesInstallsAnEpochThatWakesLongPolls) {
  StartServer();
  auto server = AddServer(7100);
  std::vector<Member> members = FormWorld(2);
  std::vector<absl::StatusOr<v1::Plan>> plans = RegisterModels(members, TinyModel());
  ASSERT_TRUE(plans[0].ok()) << plans[0].status();
  const v1::Plan first = *plans[0];
  ASSERT_EQ(first.layers(2).layer_name(), "fc.weight");
  const v1::SyncScheme other =
      first.layers(2).scheme() == v1::SYNC_SCHEME_SFB ? v1::SYNC_SCHEME_PS : v1::SYNC_SCHEME_SFB;
  ASSERT_TRUE(members[0].client->Heartbeat({.iteration = 200, .plan_epoch = 1}).ok());

  // An agent's watcher waits for epoch 2.
  absl::StatusOr<v1::Plan> awaited = absl::UnknownError("");
  std::thread waiter([&] { awaited = members[1].client->WaitForPlan(2, absl::Seconds(30)); });
  while (server_->service().parked_calls() == 0) absl::SleepFor(absl::Milliseconds(5));

  // A tool with the job's token (no node id) forces fc.weight to the other scheme.
  auto tool = Client();
  absl::StatusOr<v1::Plan> plan = tool->SetLayerSchemes({{"fc.weight", other}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->plan_epoch(), 2u);
  EXPECT_GE(plan->effective_iteration(), 210u);  // 200 + plan_lead 10 (+ the rate's share)
  EXPECT_EQ(plan->layers(2).scheme(), other);
  for (int i = 0; i < first.layers_size(); ++i) {  // the same chunks, SFB layers' included
    ASSERT_EQ(plan->layers(i).chunks_size(), first.layers(i).chunks_size());
    ASSERT_GT(plan->layers(i).chunks_size(), 0);
    for (int c = 0; c < first.layers(i).chunks_size(); ++c) {
      EXPECT_EQ(plan->layers(i).chunks(c).SerializeAsString(),
                first.layers(i).chunks(c).SerializeAsString());
    }
  }
  waiter.join();
  ASSERT_TRUE(awaited.ok()) << awaited.status();
  EXPECT_EQ(awaited->plan_epoch(), 2u);
  EXPECT_EQ(awaited->layers(2).scheme(), other);

  // Refusals name the layer.
  EXPECT_STATUS(tool->SetLayerSchemes({{"no.such.layer", v1::SYNC_SCHEME_PS}}).status(),
                kInvalidArgument, "has no layer 'no.such.layer'");
  EXPECT_STATUS(tool->SetLayerSchemes({{"conv.bias", v1::SYNC_SCHEME_SFB}}).status(),
                kInvalidArgument,
                "schemes['conv.bias']: layer 'conv.bias' is LAYER_KIND_BIAS: only FC layers can "
                "use SFB");
  EXPECT_STATUS(tool->SetLayerSchemes({}).status(), kInvalidArgument,
                "schemes: at least one layer -> scheme entry is required");
  // Another job's token cannot change job-a's plan; a job without a plan has none to change.
  auto other_job = Client(kJobB, kTokenB);
  auto denied = other_job->SetLayerSchemes({{"fc.weight", other}}, kJobA, "");
  EXPECT_STATUS(denied.status(), kPermissionDenied, "may only change that job's plan");
  EXPECT_STATUS(other_job->SetLayerSchemes({{"fc.weight", other}}).status(), kNotFound,
                "job 'job-b' is unknown");
  // The cluster token names the job; clearing the override goes back to the cost model.
  auto admin = Client("", kClusterToken);
  EXPECT_STATUS(admin->SetLayerSchemes({{"fc.weight", other}}).status(), kInvalidArgument,
                "job_id: must name the job");
  auto cleared =
      admin->SetLayerSchemes({{"fc.weight", v1::SYNC_SCHEME_UNSPECIFIED}}, kJobA, "test");
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  EXPECT_TRUE(cleared->installed());
  EXPECT_TRUE(cleared->overrides().empty());
  EXPECT_EQ(cleared->plan().plan_epoch(), 3u);
  EXPECT_EQ(cleared->plan().layers(2).scheme(), first.layers(2).scheme());
  EXPECT_GT(cleared->plan().effective_iteration(), plan->effective_iteration());

  // Status shows the epoch each agent says it runs, next to the job's.
  ASSERT_TRUE(members[0].client->Heartbeat({.iteration = 205, .plan_epoch = 2}).ok());
  auto status = tool->GetClusterStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->jobs_size(), 1);
  EXPECT_EQ(status->jobs(0).plan_epoch(), 3u);
  for (const v1::NodeStatus& node : status->nodes()) {
    if (node.node_id() == members[0].client->node_id()) {
      EXPECT_EQ(node.plan_epoch(), 2u);
    }
  }
}

TEST_F(CoordinatorServiceTest, ServerRejoiningWithNewEndpointsGetsANewPlanEpoch) {
  StartServer();
  auto server = AddServer(7100);
  std::vector<Member> members = FormWorld(1);
  auto plans = RegisterModels(members, TinyModel());
  ASSERT_TRUE(plans[0].ok()) << plans[0].status();
  ASSERT_TRUE(members[0].client->Heartbeat({.iteration = 42, .plan_epoch = 1}).ok());

  // The server restarts on another port and re-joins under its old id.
  auto restarted = Client("", kClusterToken);
  ServerRegistration again;
  again.host = "127.0.0.1";
  again.endpoints.push_back(MakeEndpoint(v1::TRANSPORT_KIND_TCP, "127.0.0.1:7999"));
  again.previous_node_id = server->node_id();
  auto rejoined = restarted->RegisterServer(again);
  ASSERT_TRUE(rejoined.ok()) << rejoined.status();
  EXPECT_EQ(rejoined->node_id(), server->node_id());

  auto plan = members[0].client->GetPlan();
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->plan_epoch(), 2u);
  // 42 + the lead while the job's rate is unknown (one report)
  EXPECT_EQ(plan->effective_iteration(), 242u);
  EXPECT_EQ(plan->servers(0).endpoints(0).address(), "127.0.0.1:7999");
}

// ---- Liveness
// ------------------------------------------------------------------------------------

TEST_F(CoordinatorServiceTest, SilentNodeIsDeclaredDeadAndCanBeReplaced) {
  CoordinatorServerOptions options = DefaultServerOptions();
  options.service.registry.lease = absl::Milliseconds(300);
  options.service.registry.heartbeat_interval = absl::Milliseconds(25);
  StartServer(options);
  auto server = AddServer(7100);
  auto server_heartbeats = server->StartHeartbeats({});
  auto silent = Client();
  ASSERT_TRUE(silent->RegisterAgent(Agent(0, 1)).ok());
  const uint64_t epoch_before = silent->membership_epoch();

  // Wait (bounded) until the agent that never heartbeats is declared dead.
  auto state_of = [&](const std::string& node) {
    auto status = Client("", kClusterToken)->GetClusterStatus();
    EXPECT_TRUE(status.ok()) << status.status();
    for (const v1::NodeStatus& n : status->nodes()) {
      if (n.node_id() == node) return n;
    }
    return v1::NodeStatus();
  };
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (state_of(silent->node_id()).state() != v1::NODE_STATE_DEAD && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const v1::NodeStatus dead = state_of(silent->node_id());
  EXPECT_EQ(dead.state(), v1::NODE_STATE_DEAD);
  EXPECT_EQ(dead.role(), v1::NODE_ROLE_AGENT);
  EXPECT_GT(dead.last_heartbeat_age_ms(), 300u);
  EXPECT_EQ(state_of(server->node_id()).state(), v1::NODE_STATE_ALIVE);

  // The dead node is told to stop, and its calls say why.
  auto heartbeat = silent->Heartbeat({});
  ASSERT_TRUE(heartbeat.ok()) << heartbeat.status();
  EXPECT_TRUE(heartbeat->shutdown());
  EXPECT_GT(heartbeat->header().epoch(), epoch_before);
  EXPECT_STATUS(silent->Rendezvous(absl::Seconds(5)).status(), kFailedPrecondition,
                "was declared dead");

  // A replacement takes the rank and the world forms again.
  auto replacement = Client();
  auto world = replacement->RegisterAgentAndRendezvous(Agent(1, 1), absl::Seconds(30));
  ASSERT_TRUE(world.ok()) << world.status();
  EXPECT_EQ(world->rank, 0u);
  EXPECT_EQ(world->peers[0].node_id(), replacement->node_id());
  server_heartbeats->Stop();
}

// A restarted coordinator starts empty and answers heartbeats NOT_FOUND: a heartbeat loop with
// register_again registers its node again (the server under its old id, the agent with its
// rank), and the new coordinator lists both alive.
TEST_F(CoordinatorServiceTest, HeartbeatsRegisterTheirNodeAgainWithARestartedCoordinator) {
  CoordinatorServerOptions options = DefaultServerOptions();
  StartServer(options);
  std::unique_ptr<CoordinatorClient> server = Client("", kClusterToken);
  ServerRegistration reg;
  reg.host = "127.0.0.1";
  reg.endpoints.push_back(MakeEndpoint(v1::TRANSPORT_KIND_TCP, "127.0.0.1:7100"));
  ASSERT_TRUE(server->RegisterServer(reg).ok());
  const std::string server_id = server->node_id();
  std::unique_ptr<CoordinatorClient> agent = Client();
  ASSERT_TRUE(agent->RegisterAgentAndRendezvous(Agent(0, 1), absl::Seconds(30)).ok());

  CoordinatorClient::HeartbeatOptions beat;
  beat.interval = absl::Milliseconds(25);
  beat.register_again = true;
  // Nothing to register again before a registration.
  EXPECT_STATUS(Client()->RegisterAgain(), kFailedPrecondition, "not registered yet");
  auto server_loop = server->StartHeartbeats(beat);
  auto agent_loop = agent->StartHeartbeats(beat);

  // The coordinator restarts on the same address, knowing nobody.
  options.listen = server_->address();
  server_->Shutdown(absl::Seconds(5));
  server_.reset();
  StartServer(options);

  auto alive = [&](const std::string& node) {
    auto status = Client("", kClusterToken)->GetClusterStatus();
    if (!status.ok()) return false;
    for (const v1::NodeStatus& n : status->nodes()) {
      if (n.node_id() == node) return n.state() == v1::NODE_STATE_ALIVE;
    }
    return false;
  };
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!(alive(server_id) && alive(agent->node_id())) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  server_loop->Stop();
  agent_loop->Stop();
  EXPECT_TRUE(alive(server_id)) << "the server, under its old id " << server_id;
  EXPECT_TRUE(alive(agent->node_id())) << "the agent";
  EXPECT_EQ(server->node_id(), server_id);
  // The agent holds its rank in the new coordinator's world.
  auto world = agent->Rendezvous(absl::Seconds(10));
  ASSERT_TRUE(world.ok()) << world.status();
  EXPECT_EQ(world->rank, 0u);
}

TEST_F(CoordinatorServiceTest, AgentWaitingInRendezvousStaysAlive) {
  CoordinatorServerOptions options = DefaultServerOptions();
  options.service.registry.lease = absl::Milliseconds(200);
  StartServer(options);
  auto server = AddServer(7100);
  CoordinatorClient::HeartbeatOptions beat;
  beat.interval = absl::Milliseconds(25);
  auto server_heartbeats = server->StartHeartbeats(beat);
  auto early = Client();
  ASSERT_TRUE(early->RegisterAgent(Agent(0, 2)).ok());
  absl::StatusOr<World> world = absl::UnknownError("");
  std::thread waiting([&] { world = early->Rendezvous(absl::Seconds(30)); });
  // Longer than the lease, without heartbeats: the open call keeps the agent alive.
  absl::SleepFor(absl::Milliseconds(600));
  auto late = Client();
  ASSERT_TRUE(late->RegisterAgentAndRendezvous(Agent(1, 2), absl::Seconds(30)).ok());
  waiting.join();
  ASSERT_TRUE(world.ok()) << world.status();
  EXPECT_EQ(world->peers.size(), 2u);
}

// ---- Status and leaving ------------------------------------------------------------------------

TEST_F(CoordinatorServiceTest, ClusterStatusShowsNodesJobsAndDepartures) {
  StartServer();
  auto server = AddServer(7100);
  std::vector<Member> members = FormWorld(2);
  ASSERT_TRUE(RegisterModels(members, TinyModel())[0].ok());
  ASSERT_TRUE(members[1].client->Deregister("job finished").ok());

  auto status = members[0].client->GetClusterStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  int alive = 0;
  int left = 0;
  for (const v1::NodeStatus& node : status->nodes()) {
    if (node.state() == v1::NODE_STATE_ALIVE) ++alive;
    if (node.state() == v1::NODE_STATE_LEFT) {
      ++left;
      EXPECT_EQ(node.node_id(), members[1].client->node_id());
      EXPECT_EQ(node.job_id(), kJobA);
    }
  }
  EXPECT_EQ(alive, 2);  // the server and the first agent
  EXPECT_EQ(left, 1);
  ASSERT_EQ(status->jobs_size(), 1);
  EXPECT_EQ(status->jobs(0).job_id(), kJobA);
  EXPECT_EQ(status->jobs(0).model_name(), "tiny");
  EXPECT_EQ(status->jobs(0).world_size(), 2u);
  EXPECT_EQ(status->jobs(0).plan_epoch(), 1u);
  EXPECT_EQ(status->jobs(0).layers_size(), 4);

  // Another job sees the cluster-wide server but not job-a's agents or job.
  auto other = Client(kJobB, kTokenB)->GetClusterStatus();
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_EQ(other->nodes_size(), 1);
  EXPECT_EQ(other->nodes(0).role(), v1::NODE_ROLE_SERVER);
  EXPECT_EQ(other->jobs_size(), 0);
}

// ---- The job's rendezvous store ----------------------------------------------------------------

TEST_F(CoordinatorServiceTest, StoreSetThenGetReturnsTheLatestValuesInOrder) {
  StartServer();
  auto agent = Client();
  ASSERT_TRUE(agent->RegisterAgent(Agent(0, 2)).ok());
  const std::string key(std::string("rank\0\xff", 6));  // bytes, not UTF-8
  const std::string value(
      std::string("\0\x01"
                  "addr\xfe",
                  7));
  ASSERT_TRUE(agent->StoreSet(key, value).ok());
  ASSERT_TRUE(agent->StoreSet("twice", "first").ok());
  ASSERT_TRUE(agent->StoreSet("twice", "second").ok());
  ASSERT_TRUE(agent->StoreSet("empty value", "").ok());
  auto values = agent->StoreGet({"twice", key, "empty value", key}, absl::Seconds(5));
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ::testing::ElementsAre("second", value, "", value));
  // Keys at the limits, and a job-scoped server of the job may use the store too.
  auto server = Client();
  ServerRegistration registration;
  registration.host = "h";
  registration.endpoints.push_back(MakeEndpoint(v1::TRANSPORT_KIND_TCP, "127.0.0.1:7100"));
  ASSERT_TRUE(server->RegisterServer(registration).ok());
  const std::string longest(kMaxStoreKeyBytes, 'k');
  ASSERT_TRUE(server->StoreSet(longest, std::string(kMaxStoreValueBytes, 'v')).ok());
  values = agent->StoreGet({longest}, absl::ZeroDuration());
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(values->at(0).size(), kMaxStoreValueBytes);
}

TEST_F(CoordinatorServiceTest, StoreGetWaitsForAnotherClientsSet) {
  StartServer();
  auto waiter = Client();
  auto setter = Client();
  ASSERT_TRUE(waiter->RegisterAgent(Agent(0, 2)).ok());
  ASSERT_TRUE(setter->RegisterAgent(Agent(1, 2)).ok());
  ASSERT_TRUE(setter->StoreSet("rank_1", "early").ok());
  absl::StatusOr<std::vector<std::string>> values = absl::UnknownError("not returned");
  std::atomic<bool> returned{false};
  std::thread waiting([&] {
    values = waiter->StoreGet({"rank_1", "rank_0"}, absl::Seconds(30));
    returned = true;
  });
  while (server_->service().parked_calls() == 0 && !returned) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_TRUE(setter->StoreSet("rank_0", "late").ok());
  waiting.join();
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ::testing::ElementsAre("early", "late"));
  EXPECT_EQ(server_->service().parked_calls(), 0u);
}

TEST_F(CoordinatorServiceTest, StoreGetTimeoutNamesTheMissingKeys) {
  StartServer();
  auto agent = Client();
  ASSERT_TRUE(agent->RegisterAgent(Agent(0, 2)).ok());
  ASSERT_TRUE(agent->StoreSet("present", "v").ok());
  const absl::Time start = absl::Now();
  const absl::Duration timeout = absl::Milliseconds(300);
  absl::Status status = agent->StoreGet({"present", "rank_1", "bad\n"}, timeout).status();
  // Within the timeout and the gRPC deadline's slack (call_timeout) past it.
  EXPECT_LT(absl::Now() - start, timeout + CoordinatorClientOptions{}.call_timeout);
  EXPECT_STATUS(status, kDeadlineExceeded, "StoreGet of job 'job-a': after ");
  EXPECT_THAT(std::string(status.message()), HasSubstr("2 of 3 keys not set: 'rank_1', 'bad\\n'"));
  // No wait at all: answered at once.
  EXPECT_STATUS(agent->StoreGet({"rank_1"}, absl::ZeroDuration()).status(), kDeadlineExceeded,
                "1 of 1 keys not set: 'rank_1'");
  // Many missing keys: the first few are named, the rest counted.
  std::vector<std::string> keys;
  for (int i = 0; i < 20; ++i) keys.push_back(absl::StrCat("k", i));
  EXPECT_STATUS(
      agent->StoreGet(keys, absl::ZeroDuration()).status(), kDeadlineExceeded,
      "20 of 20 keys not set: 'k0', 'k1', 'k2', 'k3', 'k4', 'k5', 'k6', 'k7' and 12 more");
  EXPECT_EQ(server_->service().parked_calls(), 0u);
}

TEST_F(CoordinatorServiceTest, ConfiguredRendezvousTimeoutBoundsOneStoreGetNotTheClientsWait) {
  CoordinatorServerOptions options = DefaultServerOptions();
  options.service.rendezvous_timeout = absl::Milliseconds(100);
  StartServer(options);
  auto waiter = Client();
  auto setter = Client();
  ASSERT_TRUE(waiter->RegisterAgent(Agent(0, 2)).ok());
  ASSERT_TRUE(setter->RegisterAgent(Agent(1, 2)).ok());
  absl::StatusOr<std::vector<std::string>> values = absl::UnknownError("not returned");
  std::atomic<bool> returned{false};
  std::thread waiting([&] {
    values = waiter->StoreGet({"late"}, absl::Seconds(30));
    returned = true;
  });
  // Past several of the coordinator's bounds: the client asked again each time.
  while (server_->service().parked_calls() == 0 && !returned) absl::SleepFor(absl::Milliseconds(5));
  absl::SleepFor(absl::Milliseconds(350));
  ASSERT_TRUE(setter->StoreSet("late", "v").ok());
  waiting.join();
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ::testing::ElementsAre("v"));
}

TEST_F(CoordinatorServiceTest, StoreLimitsAreRefusedWithTheField) {
  StartServer();
  auto agent = Client();
  ASSERT_TRUE(agent->RegisterAgent(Agent(0, 2)).ok());
  EXPECT_STATUS(agent->StoreSet("", "v"), kInvalidArgument, "key: must not be empty");
  EXPECT_STATUS(agent->StoreSet(std::string(kMaxStoreKeyBytes + 1, 'k'), "v"), kInvalidArgument,
                "key: is 513 bytes; at most 512 allowed");
  EXPECT_STATUS(agent->StoreSet("k", std::string(kMaxStoreValueBytes + 1, 'v')), kInvalidArgument,
                "value: is 65537 bytes; at most 65536 allowed");
  EXPECT_STATUS(agent->StoreGet({}, absl::Seconds(1)).status(), kInvalidArgument,
                "keys: at least one key is required");
  EXPECT_STATUS(
      agent->StoreGet(std::vector<std::string>(kMaxStoreGetKeys + 1, "k"), absl::Seconds(1))
          .status(),
      kInvalidArgument, "keys: 1025 entries; at most 1024 allowed");
  EXPECT_STATUS(agent->StoreGet({"k", ""}, absl::Seconds(1)).status(), kInvalidArgument,
                "keys[1]: must not be empty");
  // A client that has not registered has no node id; the cluster token has no job.
  EXPECT_STATUS(Client()->StoreSet("k", "v"), kInvalidArgument, "header.node_id: must be set");
  EXPECT_STATUS(Client("", kClusterToken)->StoreGet({"k"}, absl::Seconds(1)).status(),
                kInvalidArgument, "header.job_id: must name the job");
  // kMaxStoreKeys per job: RegistryTest.TheStoreHoldsAtMostItsKeysAndBytesPerJob.
}

TEST_F(CoordinatorServiceTest, StoreKeysAreTheJobsOwn) {
  StartServer();
  auto a = Client(kJobA, kTokenA);
  auto b = Client(kJobB, kTokenB);
  ASSERT_TRUE(a->RegisterAgent(Agent(0, 2)).ok());
  ASSERT_TRUE(b->RegisterAgent(Agent(0, 2)).ok());
  ASSERT_TRUE(a->StoreSet("addr", "of job a").ok());
  // Job B's client does not see job A's key...
  EXPECT_STATUS(b->StoreGet({"addr"}, absl::Milliseconds(200)).status(), kDeadlineExceeded,
                "StoreGet of job 'job-b': after");
  // ...and its own key of the same name is another one.
  ASSERT_TRUE(b->StoreSet("addr", "of job b").ok());
  auto from_a = a->StoreGet({"addr"}, absl::Seconds(5));
  auto from_b = b->StoreGet({"addr"}, absl::Seconds(5));
  ASSERT_TRUE(from_a.ok()) << from_a.status();
  ASSERT_TRUE(from_b.ok()) << from_b.status();
  EXPECT_THAT(*from_a, ::testing::ElementsAre("of job a"));
  EXPECT_THAT(*from_b, ::testing::ElementsAre("of job b"));

  // Job B's token cannot act for job A's node (PERMISSION_DENIED), nor job A's id with B's token.
  auto stub = RawStub();
  for (const auto& [job, token] : {std::pair<std::string, std::string>{kJobB, kTokenB},
                                   std::pair<std::string, std::string>{kJobA, kTokenB}}) {
    v1::StoreGetRequest request;
    request.mutable_header()->set_job_id(job);
    request.mutable_header()->set_token(token);
    request.mutable_header()->set_node_id(a->node_id());
    request.add_keys("addr");
    v1::StoreGetResponse response;
    grpc::ClientContext context;
    Deadline(&context);
    const grpc::Status status = stub->StoreGet(&context, request, &response);
    EXPECT_EQ(status.error_code(), job == kJobB ? grpc::StatusCode::PERMISSION_DENIED
                                                : grpc::StatusCode::UNAUTHENTICATED)
        << status.error_message();
    EXPECT_EQ(response.values_size(), 0);
    v1::StoreSetRequest set;
    *set.mutable_header() = request.header();
    set.set_key("addr");
    set.set_value("overwritten");
    v1::StoreSetResponse set_response;
    grpc::ClientContext set_context;
    Deadline(&set_context);
    EXPECT_FALSE(stub->StoreSet(&set_context, set, &set_response).ok());
  }
  from_a = a->StoreGet({"addr"}, absl::Seconds(5));
  ASSERT_TRUE(from_a.ok()) << from_a.status();
  EXPECT_THAT(*from_a, ::testing::ElementsAre("of job a"));
}

// ---- Validation and bad input ----------------------------------------------------------------

TEST_F(CoordinatorServiceTest, MalformedRequestsNameTheField) {
  StartServer();
  auto stub = RawStub();
  auto header = [](v1::RequestHeader* h) {
    h->set_job_id(kJobA);
    h->set_token(kTokenA);
  };
  auto register_agent = [&](const std::function<void(v1::RegisterAgentRequest&)>& mutate) {
    v1::RegisterAgentRequest request;
    header(request.mutable_header());
    request.set_host("h");
    *request.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, "127.0.0.1:7200");
    request.set_world_size(4);
    mutate(request);
    v1::RegisterAgentResponse response;
    grpc::ClientContext context;
    Deadline(&context);
    return stub->RegisterAgent(&context, request, &response);
  };
  struct Case {
    std::function<void(v1::RegisterAgentRequest&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](auto& r) { r.set_world_size(0); }, "world_size: must be in [1, 65536], got 0"},
      {[](auto& r) { r.clear_endpoints(); }, "endpoints: at least one data-plane endpoint"},
      {[](auto& r) { r.mutable_endpoints(0)->set_address("no-port"); },
       "endpoints[0].address: 'no-port' is not host:port"},
      {[](auto& r) { r.mutable_endpoints(0)->set_address("host:99999"); },
       "endpoints[0].address: 'host:99999' needs a port in [1, 65535]"},
      {[](auto& r) { r.mutable_endpoints(0)->set_transport(static_cast<v1::TransportKind>(99)); },
       "endpoints[0].transport: must be TRANSPORT_KIND_TCP, _RDMA or _INPROC, got 99"},
      {[](auto& r) { r.set_host(""); }, "host: must not be empty"},
      {[](auto& r) { r.set_host(std::string(300, 'h')); }, "host: is 300 bytes; at most 255"},
      {[](auto& r) { r.set_requested_rank(4); }, "requested_rank: 4 is not below world_size 4"},
      {[](auto& r) { r.set_gpu_index(100000); }, "gpu_index: must be at most 4095"},
      {[](auto& r) { r.mutable_header()->set_job_id("a b"); },
       "header.job_id: may contain only letters"},
      {[](auto& r) { r.mutable_header()->set_node_id(std::string(200, 'n')); },
       "header.node_id: is 200 bytes; at most 128"},
      {[](auto& r) { r.mutable_header()->set_token(std::string(5000, 't')); },
       "header.token: is 5000 bytes; at most 4096"},
  };
  for (const Case& c : cases) {
    const grpc::Status status = register_agent(c.mutate);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.message;
    EXPECT_THAT(status.error_message(), HasSubstr(c.message));
  }

  // Other calls, with a registered agent's id.
  auto agent = Client();
  ASSERT_TRUE(agent->RegisterAgent(Agent(0, 1)).ok());
  {
    v1::HeartbeatRequest request;
    header(request.mutable_header());
    request.mutable_header()->set_node_id(agent->node_id());
    request.set_role(static_cast<v1::NodeRole>(7));
    v1::HeartbeatResponse response;
    grpc::ClientContext context;
    Deadline(&context);
    const grpc::Status status = stub->Heartbeat(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("role: must be NODE_ROLE_SERVER or"));
  }
  {
    std::vector<v1::LinkTelemetry> links = {Link("peer", 1)};
    links[0].set_bytes_per_second(std::nan(""));
    EXPECT_STATUS(agent->ReportTelemetry(links, 1), kInvalidArgument,
                  "links[0].bytes_per_second: must be a finite number >= 0");
    EXPECT_STATUS(agent->ReportTelemetry(std::vector<v1::LinkTelemetry>(5000, Link("p", 1)), 1),
                  kInvalidArgument, "links: 5000 entries; at most 4096");
  }
  {
    v1::ModelSpec empty;
    EXPECT_STATUS(agent->RegisterModel(empty, {}, {}, absl::Seconds(5)).status(), kInvalidArgument,
                  "model.layers: the model has no layers");
    v1::ModelSpec unkind = TinyModel();
    unkind.mutable_layers(1)->set_kind(v1::LAYER_KIND_UNSPECIFIED);
    EXPECT_STATUS(agent->RegisterModel(unkind, {}, {}, absl::Seconds(5)).status(), kInvalidArgument,
                  "model: layer 1 'conv.bias': kind is not set");
    v1::UpdateRuleSpec rule;
    rule.set_rule(static_cast<v1::UpdateRule>(77));
    EXPECT_STATUS(agent->RegisterModel(TinyModel(), rule, {}, absl::Seconds(5)).status(),
                  kInvalidArgument, "update_rule.rule: 77 is not a known UpdateRule");
    v1::ModelSpec no_batch = TinyModel();
    no_batch.mutable_layers(2)->set_batch_per_worker(0);
    EXPECT_STATUS(
        agent->RegisterModel(no_batch, {}, {}, absl::Seconds(5)).status(), kInvalidArgument,
        "model: layer 2 'fc.weight': batch_per_worker (K) must be in [1, 1048576], got 0");
  }
  EXPECT_STATUS(agent->Deregister(std::string(2000, 'r')), kInvalidArgument,
                "reason: is 2000 bytes; at most 1024");
  {
    v1::RendezvousRequest request;
    header(request.mutable_header());
    v1::RendezvousResponse response;
    grpc::ClientContext context;
    Deadline(&context);
    const grpc::Status status = stub->Rendezvous(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("header.node_id: must be set"));
  }
}

// Random strings, numbers and enum values in every field, and bytes that are not a message at
// all: every call is answered, and the coordinator keeps serving.
TEST_F(CoordinatorServiceTest, RandomGarbageNeverStopsTheCoordinator) {
  StartServer();
  auto agent = Client();
  ASSERT_TRUE(agent->RegisterAgent(Agent(0, 2)).ok());
  auto stub = RawStub();
  std::mt19937_64 random(1234);
  const std::vector<std::string> pieces = {
      "",        kJobA, kTokenA, "job-b",          "127.0.0.1:7200",
      "[::1]:1", ":",   "a:b:c", agent->node_id(), std::string(130, 'x')};
  auto text = [&] { return pieces[random() % pieces.size()]; };
  // An enum field's value from a small range around the valid ones (always within int32).
  auto small = [&](int range) {
    return static_cast<int>(random() % static_cast<uint64_t>(range)) - 1;
  };
  auto fill_header = [&](v1::RequestHeader* h) {
    h->set_job_id(random() % 4 == 0 ? text() : kJobA);
    h->set_token(random() % 4 == 0 ? text() : kTokenA);
    h->set_node_id(random() % 2 == 0 ? agent->node_id() : text());
    h->set_epoch(random());
  };
  for (int i = 0; i < 600; ++i) {
    grpc::ClientContext context;
    Deadline(&context, absl::Seconds(5));
    grpc::Status status;
    switch (i % 6) {
      case 0: {
        v1::RegisterAgentRequest r;
        fill_header(r.mutable_header());
        r.set_host(text());
        r.set_gpu_index(static_cast<uint32_t>(random()));
        for (uint64_t e = random() % 3; e > 0; --e) {
          *r.add_endpoints() = MakeEndpoint(static_cast<v1::TransportKind>(small(6)), text());
        }
        r.set_world_size(static_cast<uint32_t>(random() % 5));
        if (random() % 2) r.set_requested_rank(static_cast<uint32_t>(random() % 6));
        v1::RegisterAgentResponse response;
        status = stub->RegisterAgent(&context, r, &response);
        break;
      }
      case 1: {
        v1::ReportTelemetryRequest r;
        fill_header(r.mutable_header());
        for (uint64_t l = random() % 4; l > 0; --l) {
          v1::LinkTelemetry* link = r.add_links();
          link->set_peer_node_id(text());
          link->set_bytes_per_second(static_cast<double>(random() % 1000) - 10);
          link->set_latency_ns(random());
          link->set_transport(static_cast<v1::TransportKind>(small(6)));
        }
        r.set_iteration(random());
        v1::ReportTelemetryResponse response;
        status = stub->ReportTelemetry(&context, r, &response);
        break;
      }
      case 2: {
        v1::RegisterModelRequest r;
        fill_header(r.mutable_header());
        *r.mutable_model() = TinyModel(1 + random() % 64);
        if (random() % 2) r.mutable_model()->mutable_layers(0)->add_shape(random() % 3);
        if (random() % 3 == 0) {
          r.mutable_model()->mutable_layers(2)->set_kind(static_cast<v1::LayerKind>(small(9)));
        }
        r.mutable_update_rule()->set_learning_rate(random() % 2 ? -1 : 0.1);
        v1::RegisterModelResponse response;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(50));
        status = stub->RegisterModel(&context, r, &response);
        break;
      }
      case 3: {
        v1::HeartbeatRequest r;
        fill_header(r.mutable_header());
        r.set_role(static_cast<v1::NodeRole>(small(5)));
        r.set_iteration(random());
        v1::HeartbeatResponse response;
        status = stub->Heartbeat(&context, r, &response);
        break;
      }
      case 4: {
        v1::GetPlanRequest r;
        fill_header(r.mutable_header());
        if (random() % 2) r.set_min_plan_epoch(random() % 3);
        v1::GetPlanResponse response;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(50));
        status = stub->GetPlan(&context, r, &response);
        break;
      }
      case 5: {
        v1::RegisterServerRequest r;
        fill_header(r.mutable_header());
        r.set_host(text());
        *r.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_TCP, text());
        r.mutable_capacity()->set_network_bytes_per_second(random() % 2 ? -5 : 1e9);
        r.set_previous_node_id(random() % 2 ? text() : "");
        v1::RegisterServerResponse response;
        status = stub->RegisterServer(&context, r, &response);
        break;
      }
    }
    EXPECT_NE(status.error_code(), grpc::StatusCode::INTERNAL) << status.error_message();
  }

  // Bytes that do not parse as the request message.
  int malformed = 0;
  grpc::GenericStub generic(
      grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 50; ++i) {
    std::string bytes(static_cast<size_t>(random() % 64), '\0');
    for (char& c : bytes) c = static_cast<char>(random());
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::ClientContext context;
    Deadline(&context, absl::Seconds(5));
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    generic.UnaryCall(&context, "/poseidon.v1.Coordinator/RegisterAgent", grpc::StubOptions(),
                      &request, &response, [&](grpc::Status st) {
                        std::lock_guard<std::mutex> lock(mu);
                        status = st;
                        done = true;
                        cv.notify_one();
                      });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    // Refused with a reason (gRPC alone says UNIMPLEMENTED with no message), or, where the bytes
    // happen to parse, answered by validation like any request.
    EXPECT_NE(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
    if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
        status.error_message().find("does not parse") != std::string::npos) {
      ++malformed;
      EXPECT_THAT(status.error_message(),
                  HasSubstr("/poseidon.v1.Coordinator/RegisterAgent: the request does not parse"));
    }
  }
  EXPECT_GT(malformed, 0) << "random bytes that all parsed";

  // Still serving.
  auto heartbeat = agent->Heartbeat({.iteration = 1});
  EXPECT_TRUE(heartbeat.ok()) << heartbeat.status();
}

// ---- Shutdown and metrics ----------------------------------------------------------------------

TEST_F(CoordinatorServiceTest, ShutdownAnswersParkedCalls) {
  StartServer();
  auto agent = Client();
  ASSERT_TRUE(agent->RegisterAgent(Agent(0, 2)).ok());
  absl::StatusOr<World> world = absl::UnknownError("");
  std::thread waiting([&] { world = agent->Rendezvous(absl::Seconds(60)); });
  while (server_->service().parked_calls() == 0) absl::SleepFor(absl::Milliseconds(5));
  server_->Shutdown(absl::Seconds(5));
  waiting.join();
  EXPECT_THAT(world.status().code(),
              AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kCancelled))
      << world.status();
}

TEST_F(CoordinatorServiceTest, MetricsCountCallsAndNodes) {
  MetricsRegistry metrics;
  CoordinatorServerOptions options = DefaultServerOptions();
  options.service.metrics = &metrics;
  options.service.housekeeping_interval = absl::Milliseconds(10);
  StartServer(options);
  auto agent = Client();
  ASSERT_TRUE(agent->RegisterAgent(Agent(0, 2)).ok());
  EXPECT_FALSE(Client(kJobA, "wrong")->RegisterAgent(Agent(1, 2)).ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  std::string text;
  while (absl::Now() < give_up) {
    text = metrics.TextExposition();
    if (text.find(R"(poseidon_coordinator_nodes{role="agent",state="alive"} 1)") !=
        std::string::npos) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_THAT(text, HasSubstr(R"(poseidon_coordinator_nodes{role="agent",state="alive"} 1)"));
  EXPECT_THAT(text,
              HasSubstr(R"(poseidon_coordinator_rpcs_total{code="OK",method="RegisterAgent"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(poseidon_coordinator_rpcs_total{code="UNAUTHENTICATED",)"
                              R"(method="RegisterAgent"} 1)"));
  EXPECT_THAT(text, HasSubstr("poseidon_coordinator_membership_epoch"));
  server_->Shutdown();  // before `metrics` goes away
}

}  // namespace
}  // namespace poseidon::coordinator::testing
