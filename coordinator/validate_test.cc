#include "coordinator/validate.h"

#include <limits>

#include "coordinator/test_util.h"

namespace poseidon::coordinator::testing {
namespace {

using ::testing::HasSubstr;

std::string Message(const absl::Status& status) {
  return std::string(status.message());
}

TEST(ValidateTest, Ids) {
  EXPECT_TRUE(ValidateId("id", "job-1.a_b:c").ok());
  EXPECT_THAT(Message(ValidateId("header.job_id", "")), HasSubstr("header.job_id: must not be"));
  EXPECT_THAT(Message(ValidateId("id", "a/b")), HasSubstr("id: may contain only"));
  EXPECT_THAT(Message(ValidateId("id", std::string(129, 'a'))),
              HasSubstr("id: is 129 bytes; at most 128"));
  EXPECT_TRUE(ValidateId("id", std::string(128, 'a')).ok());
}

TEST(ValidateTest, HostPort) {
  for (const char* good : {"10.0.0.1:7100", "host-a.example:1", "[::1]:65535", "[fe80::1%2]:80"}) {
    EXPECT_TRUE(ValidateHostPort("a", good).ok()) << good;
  }
  for (const char* bad : {"", "host", "host:", ":7100", "host:0", "host:65536", "host:+80",
                          "ho st:80", "[::1]80", "[zz]:80", "::1:80", "host:80x"}) {
    const absl::Status status = ValidateHostPort("endpoints[0].address", bad);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(Message(status), HasSubstr("endpoints[0].address: ")) << bad;
  }
}

TEST(ValidateTest, ConsistencyNeedsAServerSideRuleForSsp) {
  v1::RegisterModelRequest request;
  request.mutable_header()->set_node_id("agent-1");
  *request.mutable_model() = TinyModel();
  request.mutable_consistency()->set_model(v1::CONSISTENCY_MODEL_SSP);
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("consistency.model: "));
  request.mutable_update_rule()->set_rule(v1::UPDATE_RULE_ADAM);
  request.mutable_update_rule()->set_beta1(0.9);
  request.mutable_update_rule()->set_beta2(0.999);
  EXPECT_TRUE(ValidateRequest(request).ok()) << ValidateRequest(request);
  request.mutable_update_rule()->set_beta2(1.5);
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("update_rule.beta2: must be below 1"));
  request.mutable_update_rule()->set_beta2(0.999);
  request.mutable_update_rule()->set_learning_rate(-1);
  EXPECT_THAT(Message(ValidateRequest(request)),
              HasSubstr("update_rule.learning_rate: must be a finite number >= 0, got -1"));
}

// A running plan an agent sends a restarted coordinator must fit its model and its servers, and
// every server id it names must be an id: otherwise the registration is refused, naming the field.
TEST(ValidateTest, ARunningPlanMustFitItsModelAndServers) {
  v1::RegisterModelRequest request;
  request.mutable_header()->set_node_id("agent-1");
  *request.mutable_model() = TinyModel();
  v1::Plan& plan = *request.mutable_running_plan();
  plan.set_plan_epoch(3);
  plan.add_servers()->set_node_id("server-a");
  for (int l = 0; l < request.model().layers_size(); ++l) {
    plan.add_layers()->add_chunks()->set_server_index(0);
  }
  request.add_joined_servers("server-b");
  request.add_lost_servers("server-a");
  EXPECT_TRUE(ValidateRequest(request).ok()) << ValidateRequest(request);

  v1::RegisterModelRequest bad = request;
  bad.mutable_running_plan()->mutable_layers()->RemoveLast();
  EXPECT_THAT(Message(ValidateRequest(bad)),
              HasSubstr("running_plan.layers: 3 layers; the model has 4"));
  bad = request;
  bad.mutable_running_plan()->mutable_layers(2)->mutable_chunks(0)->set_server_index(1);
  EXPECT_THAT(Message(ValidateRequest(bad)),
              HasSubstr("running_plan.layers[2].chunks[0].server_index: 1; the plan has 1 servers"));
  bad = request;
  bad.mutable_running_plan()->set_plan_epoch(0);
  EXPECT_THAT(Message(ValidateRequest(bad)), HasSubstr("running_plan.plan_epoch: "));
  bad = request;
  bad.mutable_running_plan()->clear_servers();
  EXPECT_THAT(Message(ValidateRequest(bad)), HasSubstr("running_plan.servers: 0 servers"));
  bad = request;
  bad.mutable_running_plan()->mutable_layers(0)->set_scheme(static_cast<v1::SyncScheme>(99));
  EXPECT_THAT(Message(ValidateRequest(bad)),
              HasSubstr("running_plan.layers[0].scheme: unknown scheme 99"));
  bad = request;
  bad.set_lost_servers(0, std::string(500, 'x'));
  EXPECT_THAT(Message(ValidateRequest(bad)), HasSubstr("lost_servers[0]"));
  bad = request;
  bad.set_joined_servers(0, "");
  EXPECT_THAT(Message(ValidateRequest(bad)), HasSubstr("joined_servers[0]"));
}

TEST(ValidateTest, ModelLimits) {
  v1::ModelSpec model = TinyModel();
  for (int i = 0; i < 17; ++i) model.mutable_layers(0)->add_shape(1);
  EXPECT_THAT(Message(ValidateModel(model)),
              HasSubstr("model.layers[0].shape: 21 dimensions; at most 16"));
  model = TinyModel();
  model.mutable_layers(3)->set_name(std::string(2000, 'n'));
  EXPECT_THAT(Message(ValidateModel(model)), HasSubstr("model.layers[3].name: is 2000 bytes"));
  model = TinyModel();
  model.mutable_layers(3)->set_name("conv.bias");
  EXPECT_THAT(Message(ValidateModel(model)),
              HasSubstr("model: layer 3 'conv.bias': name is also used by layer 1"));
}

TEST(ValidateTest, ServerRegistration) {
  v1::RegisterServerRequest request;
  request.set_host("h");
  *request.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_RDMA, "10.0.0.1:7100");
  EXPECT_TRUE(ValidateRequest(request).ok());
  request.mutable_capacity()->set_network_bytes_per_second(-1);
  EXPECT_THAT(Message(ValidateRequest(request)),
              HasSubstr("capacity.network_bytes_per_second: must be a finite number >= 0"));
  request.mutable_capacity()->set_network_bytes_per_second(1e9);
  request.set_previous_node_id("bad id");
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("previous_node_id: may contain only"));
  request.set_previous_node_id("");
  for (int i = 0; i < 16; ++i) {
    *request.add_endpoints() = MakeEndpoint(v1::TRANSPORT_KIND_INPROC, "inproc-1");
  }
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("endpoints: 17 entries; at most 16"));
}

TEST(ValidateTest, TelemetryLinksNameTheirPeerByNodeIdOrByJobAndRank) {
  v1::ReportTelemetryRequest request;
  request.mutable_header()->set_node_id("s-1");
  v1::LinkTelemetry* link = request.add_links();
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("links[0].peer_node_id: must not be"));
  link->set_peer_job_id("job-1");
  link->set_peer_rank(3);
  EXPECT_TRUE(ValidateRequest(request).ok());
  link->set_peer_node_id("a-2");
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("links[0].peer_job_id: name the peer"));
  link->clear_peer_node_id();
  link->set_peer_job_id("bad job");
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("links[0].peer_job_id: may contain"));
  link->set_peer_job_id("job-1");
  link->set_peer_rank(kMaxWorldSize);
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("links[0].peer_rank: must be below"));
  link->set_peer_rank(1);
  link->set_capacity_bytes_per_second(-1);
  EXPECT_THAT(Message(ValidateRequest(request)),
              HasSubstr("links[0].capacity_bytes_per_second: must be a finite number >= 0"));
  link->set_capacity_bytes_per_second(std::numeric_limits<double>::quiet_NaN());
  EXPECT_THAT(Message(ValidateRequest(request)),
              HasSubstr("links[0].capacity_bytes_per_second: must be a finite number"));
  link->set_capacity_bytes_per_second(1e9);
  EXPECT_TRUE(ValidateRequest(request).ok());
}

TEST(ValidateTest, SetLayerSchemesChecksEveryEntry) {
  v1::SetLayerSchemesRequest request;
  request.mutable_header()->set_job_id("job-1");
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("schemes: at least one"));
  (*request.mutable_schemes())["fc.weight"] = v1::SYNC_SCHEME_SFB;
  (*request.mutable_schemes())["conv.weight"] = v1::SYNC_SCHEME_UNSPECIFIED;
  EXPECT_TRUE(ValidateRequest(request).ok());
  (*request.mutable_schemes())["x"] = static_cast<v1::SyncScheme>(7);
  EXPECT_THAT(Message(ValidateRequest(request)),
              HasSubstr("schemes['x']: 7 is not a known SyncScheme"));
  request.mutable_schemes()->erase("x");
  (*request.mutable_schemes())[""] = v1::SYNC_SCHEME_PS;
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("schemes: a layer name is empty"));
  request.mutable_schemes()->erase("");
  (*request.mutable_schemes())[std::string(kMaxLayerNameBytes + 1, 'a')] = v1::SYNC_SCHEME_PS;
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("bytes; at most 1024 allowed"));
  request.mutable_schemes()->erase(std::string(kMaxLayerNameBytes + 1, 'a'));
  request.set_reason(std::string(kMaxReasonBytes + 1, 'r'));
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("reason: is 1025 bytes"));
  request.clear_reason();
  // With the cluster token the job is named in the request.
  request.mutable_header()->clear_job_id();
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("job_id: must name the job"));
  request.set_job_id("bad job");
  EXPECT_THAT(Message(ValidateRequest(request)), HasSubstr("job_id: may contain"));
  request.set_job_id("job-1");
  EXPECT_TRUE(ValidateRequest(request).ok());
}

TEST(ValidateTest, StoreRequestsCheckKeysValuesAndTheCaller) {
  v1::StoreSetRequest set;
  set.mutable_header()->set_job_id("job-1");
  set.mutable_header()->set_node_id("agent-1");
  set.set_key(std::string("k\0\xff", 3));  // bytes, not UTF-8
  set.set_value(std::string(kMaxStoreValueBytes, '\0'));
  EXPECT_TRUE(ValidateRequest(set).ok());
  set.set_key(std::string(kMaxStoreKeyBytes, 'k'));
  EXPECT_TRUE(ValidateRequest(set).ok());
  set.set_key(std::string(kMaxStoreKeyBytes + 1, 'k'));
  EXPECT_THAT(Message(ValidateRequest(set)), HasSubstr("key: is 513 bytes; at most 512 allowed"));
  set.clear_key();
  EXPECT_THAT(Message(ValidateRequest(set)), HasSubstr("key: must not be empty"));
  set.set_key("k");
  set.set_value(std::string(kMaxStoreValueBytes + 1, 'v'));
  EXPECT_THAT(Message(ValidateRequest(set)),
              HasSubstr("value: is 65537 bytes; at most 65536 allowed"));
  set.clear_value();
  set.mutable_header()->clear_node_id();
  EXPECT_THAT(Message(ValidateRequest(set)), HasSubstr("header.node_id: must be set"));
  set.mutable_header()->set_node_id("agent-1");
  set.mutable_header()->clear_job_id();
  EXPECT_THAT(Message(ValidateRequest(set)), HasSubstr("header.job_id: must name the job"));

  v1::StoreGetRequest get;
  get.mutable_header()->set_job_id("job-1");
  get.mutable_header()->set_node_id("agent-1");
  EXPECT_THAT(Message(ValidateRequest(get)), HasSubstr("keys: at least one key is required"));
  for (size_t i = 0; i < kMaxStoreGetKeys; ++i) get.add_keys(absl::StrCat("rank_", i));
  EXPECT_TRUE(ValidateRequest(get).ok());
  get.add_keys("one too many");
  EXPECT_THAT(Message(ValidateRequest(get)), HasSubstr("keys: 1025 entries; at most 1024"));
  get.clear_keys();
  get.add_keys("a");
  get.add_keys("");
  EXPECT_THAT(Message(ValidateRequest(get)), HasSubstr("keys[1]: must not be empty"));
  get.set_keys(1, std::string(kMaxStoreKeyBytes + 1, 'k'));
  EXPECT_THAT(Message(ValidateRequest(get)), HasSubstr("keys[1]: is 513 bytes"));
}

}  // namespace
}  // namespace poseidon::coordinator::testing
