// Runs the `poseidon` binary (popen) against an in-process coordinator with a planned job:
// `poseidon plan --coordinator ... [--set ...]` and the plan epochs in `poseidon status`.

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

#include "coordinator/test_util.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "tools/cli_test_util.h"
#include "tools/plan_live_command.h"

namespace poseidon::coordinator::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using ::poseidon::tools::testing::CliRun;
using ::poseidon::tools::testing::Field;
using ::poseidon::tools::testing::RunCli;
using ::poseidon::tools::testing::Stderr;
using ::poseidon::tools::testing::Stdout;

TEST(ParseSchemeOverridesTest, ParsesAndNamesTheBadEntry) {
  auto parsed =
      poseidon::tools::ParseSchemeOverrides("fc1.weight=ps, fc2.weight=SFB,fc3=auto,c=allreduce");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->size(), 4u);
  EXPECT_EQ(parsed->at("c"), v1::SYNC_SCHEME_ALLREDUCE);
  EXPECT_EQ(parsed->at("fc1.weight"), v1::SYNC_SCHEME_PS);
  EXPECT_EQ(parsed->at("fc2.weight"), v1::SYNC_SCHEME_SFB);
  EXPECT_EQ(parsed->at("fc3"), v1::SYNC_SCHEME_UNSPECIFIED);
  EXPECT_EQ(poseidon::tools::ParseSchemeOverrides("fc1").status().message(),
            "--set: 'fc1' needs =ps, =sfb, =allreduce or =auto");
  EXPECT_EQ(poseidon::tools::ParseSchemeOverrides("fc1=fast").status().message(),
            "--set: layer 'fc1': unknown scheme 'fast' (ps, sfb, allreduce or auto)");
  EXPECT_EQ(poseidon::tools::ParseSchemeOverrides("a=ps,a=sfb").status().message(),
            "--set: layer 'a' is named more than once");
  EXPECT_EQ(poseidon::tools::ParseSchemeOverrides("=ps").status().message(),
            "--set: '=ps' names no layer");
  EXPECT_FALSE(poseidon::tools::ParseSchemeOverrides("").ok());
  EXPECT_FALSE(poseidon::tools::ParseSchemeOverrides("a=ps,").ok());
}

class LiveCliTest : public CoordinatorFixture {};

TEST_F(LiveCliTest, PlanSetOverridesSchemesAndStatusShowsTheAgentsEpochs) {
  StartServer();
  auto server = AddServer(7100);
  std::vector<Member> members = FormWorld(2);
  std::vector<absl::StatusOr<v1::Plan>> plans = RegisterModels(members, TinyModel());
  ASSERT_TRUE(plans[0].ok()) << plans[0].status();
  ASSERT_EQ(plans[0]->layers(2).layer_name(), "fc.weight");
  const bool sfb = plans[0]->layers(2).scheme() == v1::SYNC_SCHEME_SFB;
  const std::string other = sfb ? "ps" : "sfb";
  for (Member& member : members) {
    ASSERT_TRUE(member.client->Heartbeat({.iteration = 100, .plan_epoch = 1}).ok());
  }
  const std::string base = absl::StrCat("plan --coordinator ", server_->address(), " --job ", kJobA,
                                        " --token ", kTokenA);

  // The job's plan, without --set.
  CliRun run = Stdout(base);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("job job-a: plan epoch 1, effective from iteration 0\n"));
  EXPECT_THAT(run.output, HasSubstr("conv.weight"));

  // An override: a new epoch, printed with its effective iteration.
  run = Stdout(absl::StrCat(base, " --set 'fc.weight=", other, "' --reason test"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const absl::StatusOr<v1::Plan> current = members[0].client->GetPlan();
  ASSERT_TRUE(current.ok()) << current.status();
  EXPECT_EQ(current->plan_epoch(), 2u);
  EXPECT_GE(current->effective_iteration(), 110u);
  EXPECT_THAT(run.output, HasSubstr(absl::StrCat("job job-a: new plan epoch 2, effective from "
                                                 "iteration ",
                                                 current->effective_iteration(), "\n")));
  EXPECT_THAT(run.output, HasSubstr(absl::StrCat("overrides in force: fc.weight=", other)));
  EXPECT_EQ(current->layers(2).scheme(), sfb ? v1::SYNC_SCHEME_PS : v1::SYNC_SCHEME_SFB);

  // The same again: nothing to install.
  run = Stdout(absl::StrCat(base, " --set fc.weight=", other));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("these overrides are in force already; plan epoch 2 kept"));

  // Back to the cost model, as JSON.
  run = Stdout(absl::StrCat(base, " --set fc.weight=auto --json"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  google::protobuf::Struct root;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(run.output, &root).ok()) << run.output;
  EXPECT_EQ(Field(root, "plan_epoch").number_value(), 3);
  EXPECT_TRUE(Field(root, "installed").bool_value());
  EXPECT_EQ(Field(root, "overrides").struct_value().fields_size(), 0);
  const auto& layers = Field(root, "layers").list_value().values();
  ASSERT_EQ(layers.size(), 4);
  EXPECT_EQ(Field(layers[2].struct_value(), "scheme").string_value(), sfb ? "sfb" : "ps");
  EXPECT_GE(Field(layers[2].struct_value(), "chunks").number_value(), 1);

  // Refusals: one line, exit code 2, naming the layer or the entry.
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {" --set conv.weight=sfb",
            "INVALID_ARGUMENT: schemes['conv.weight']: layer 'conv.weight' is LAYER_KIND_CONV: "
            "only FC layers can use SFB"},
           {" --set nosuch.weight=ps", "has no layer 'nosuch.weight'"},
           {" --set fc.weight", "'fc.weight' needs =ps, =sfb, =allreduce or =auto"},
           {" --set fc.weight=fast", "unknown scheme 'fast'"},
           {" --reason why", "--reason needs --set"},
       }) {
    run = Stderr(base + args);
    EXPECT_EQ(run.exit_code, 2) << args;
    EXPECT_THAT(run.output, HasSubstr(message)) << args;
    EXPECT_EQ(run.output.find('\n'), run.output.size() - 1) << args << ": " << run.output;
    EXPECT_EQ(run.output.rfind("poseidon plan: ", 0), 0u) << run.output;
  }
  run = Stderr(absl::StrCat("plan --coordinator ", server_->address(), " --job ", kJobA,
                            " --token wrong --set fc.weight=ps"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("UNAUTHENTICATED"));
  run = Stderr(absl::StrCat("plan --coordinator ", server_->address(), " --set fc.weight=ps"));
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("job_id"));
  EXPECT_EQ(members[0].client->GetPlan()->plan_epoch(), 3u);  // no refusal installed anything

  // Status: the job is on epoch 3, its agents said they run epoch 1; then one moves to 3.
  ASSERT_TRUE(members[0].client->Heartbeat({.iteration = 120, .plan_epoch = 3}).ok());
  const std::string status = absl::StrCat("status --coordinator ", server_->address(), " --job ",
                                          kJobA, " --token ", kTokenA);
  run = Stdout(status);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("PLAN EPOCH"));
  EXPECT_THAT(run.output, HasSubstr("1 (job: 3)"));
  EXPECT_THAT(run.output, HasSubstr("plan epoch 3 (from iteration "));
  EXPECT_THAT(run.output, HasSubstr("; agents on epoch 1: 1 of 2, 3: 1 of 2"));
  ASSERT_TRUE(members[1].client->Heartbeat({.iteration = 121, .plan_epoch = 3}).ok());
  run = Stdout(status);
  EXPECT_THAT(run.output, HasSubstr("; every agent on epoch 3"));
  run = Stdout(status + " --json");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(run.output, &root).ok()) << run.output;
  int agents = 0;
  for (const auto& node : Field(root, "nodes").list_value().values()) {
    if (Field(node.struct_value(), "role").string_value() != "agent") continue;
    ++agents;
    EXPECT_EQ(Field(node.struct_value(), "plan_epoch").number_value(), 3);
  }
  EXPECT_EQ(agents, 2);

  // Links: a connected one shows its transport, one not connected yet shows "none".
  std::vector<v1::LinkTelemetry> links(2);
  links[0].set_peer_node_id(members[0].world.servers[0].node_id());
  links[0].set_transport(v1::TRANSPORT_KIND_RDMA);
  links[0].set_window_ns(1000000000);
  links[1].set_peer_node_id(members[1].client->node_id());  // the other agent (any rank)
  links[1].set_window_ns(1000000000);  // transport unspecified: not connected yet
  ASSERT_TRUE(members[0].client->ReportTelemetry(links, 122).ok());
  run = Stdout(status + " --json");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(run.output, &root).ok()) << run.output;
  std::vector<std::string> kinds;
  for (const auto& node : Field(root, "nodes").list_value().values()) {
    if (!node.struct_value().fields().contains("links")) continue;
    for (const auto& link : Field(node.struct_value(), "links").list_value().values()) {
      kinds.push_back(absl::StrCat(Field(link.struct_value(), "peer_role").string_value(), ":",
                                   Field(link.struct_value(), "transport").string_value()));
    }
  }
  EXPECT_THAT(kinds, ::testing::UnorderedElementsAre("server:rdma", "agent:none"));
  run = Stdout(status);
  EXPECT_THAT(run.output, HasSubstr(" rdma "));
  EXPECT_THAT(run.output, HasSubstr(" none "));

  // A world that shrank (an agent's heartbeat says so): the status shows what it trains with.
  EXPECT_THAT(run.output, Not(HasSubstr("training with")));
  ASSERT_TRUE(
      members[1].client->Heartbeat({.iteration = 123, .plan_epoch = 3, .world = {1, 1}}).ok());
  run = Stdout(status);
  EXPECT_THAT(run.output, HasSubstr("world size 2 (training with 1 now, world generation 1)"));
  run = Stdout(status + " --json");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(run.output, &root).ok()) << run.output;
  const auto& job = Field(root, "jobs").list_value().values(0).struct_value();
  EXPECT_EQ(Field(job, "live_world").number_value(), 1);
  EXPECT_EQ(Field(job, "world_generation").number_value(), 1);
}

}  // namespace
}  // namespace poseidon::coordinator::testing
