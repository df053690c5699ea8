// The registry on its own, with time driven by the test: liveness, retention, the descriptions of
// what a waiting call lacks.
#include "coordinator/registry.h"

#include "coordinator/test_util.h"

namespace poseidon::coordinator::testing {
namespace {

using ::testing::HasSubstr;

class RegistryTest : public ::testing::Test {
 protected:
  RegistryTest() : registry_(Options(), "test") {}

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

}  // namespace
}  // namespace poseidon::coordinator::testing
