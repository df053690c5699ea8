// Runs the `poseidon` binary as a user would (popen) and checks exit codes and output.

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "tools/cli_test_util.h"
#include "gtest/gtest.h"

namespace {

using ::poseidon::tools::testing::CliRun;
using ::poseidon::tools::testing::Field;
using ::poseidon::tools::testing::RunCli;
using ::poseidon::tools::testing::Stderr;
using ::poseidon::tools::testing::Stdout;

constexpr char kPaperCluster[] =
    "plan --model vgg19-22k --workers 16 --servers 16 --batch 32 --bandwidth 10Gbit --colocated";

TEST(PlanCliTest, Vgg19_22kJsonHasFc7OnSfb) {
  const CliRun run = Stdout(std::string(kPaperCluster) + " --json");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  google::protobuf::Struct root;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(run.output, &root).ok()) << run.output;
  const auto& layers = Field(root, "layers").list_value().values();
  ASSERT_EQ(layers.size(), 38);
  int found = 0;
  for (const auto& layer : layers) {
    const auto& fields = layer.struct_value();
    const std::string name = Field(fields, "name").string_value();
    const std::string scheme = Field(fields, "scheme").string_value();
    if (name == "fc6.weight" || name == "fc7.weight" || name == "fc8.weight") {
      EXPECT_EQ(scheme, "SFB") << name;
      ++found;
    } else {
      EXPECT_EQ(scheme, "PS") << name;
    }
    if (name == "fc7.weight") {
      EXPECT_EQ(Field(Field(fields, "sfb").struct_value(), "bytes_per_worker").number_value(),
                31457280);
      EXPECT_EQ(Field(Field(fields, "ps").struct_value(), "bytes_per_machine").number_value(),
                2.0 * 4096 * 4096 * 30 / 16 * 4);
    }
  }
  EXPECT_EQ(found, 3);
  const auto& totals = Field(root, "totals").struct_value();
  EXPECT_GT(Field(Field(totals, "plan").struct_value(), "speedup").number_value(), 1);
  EXPECT_EQ(Field(Field(root, "plan").struct_value(), "layers").list_value().values_size(), 38);
}

TEST(PlanCliTest, TableNamesEveryLayerAndTheTotals) {
  const CliRun run = Stdout(kPaperCluster);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (const char* text :
       {"conv1_1.weight", "fc7.weight", "SFB", "PS only", "speed-up at 16", "bytes per machine"}) {
    EXPECT_NE(run.output.find(text), std::string::npos) << text << "\n" << run.output;
  }
}

// Wire precision: the lossy column and the wire appear only when the job allows a lossy wire;
// an override is marked.
TEST(PlanCliTest, TheLossyWireColumnShowsTheChoiceAndOverrides) {
  const CliRun exact = Stdout(kPaperCluster);
  ASSERT_EQ(exact.exit_code, 0) << exact.output;
  EXPECT_EQ(exact.output.find("PS-16/worker"), std::string::npos) << exact.output;
  const CliRun lossy = Stdout(std::string(kPaperCluster) +
                              " --lossy_wire bf16 --wire conv1_1.weight=fp32 --json");
  ASSERT_EQ(lossy.exit_code, 0) << lossy.output;
  google::protobuf::Struct root;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(lossy.output, &root).ok());
  int bf16 = 0;
  for (const auto& layer : Field(root, "layers").list_value().values()) {
    const auto& fields = layer.struct_value();
    const std::string name = Field(fields, "name").string_value();
    const std::string wire = Field(fields, "wire").string_value();
    if (name == "conv1_1.weight" || Field(fields, "scheme").string_value() == "SFB") {
      EXPECT_EQ(wire, "fp32") << name;
    } else {
      EXPECT_EQ(wire, "bf16") << name;
      ++bf16;
    }
  }
  EXPECT_EQ(Field(Field(root, "totals").struct_value(), "lossy_layers").number_value(), bf16);
  const CliRun table =
      Stdout(std::string(kPaperCluster) + " --lossy_wire bf16 --wire conv1_1.weight=fp32");
  ASSERT_EQ(table.exit_code, 0) << table.output;
  for (const std::string& text : {std::string("PS-16/worker"), std::string("fp32*"),
                                 "wire     " + std::to_string(bf16) + " of 38 layers lossy"}) {
    EXPECT_NE(table.output.find(text), std::string::npos) << text << "\n" << table.output;
  }
}

// Low rank: the AR-LR column is priced for every matrix rank 4 shrinks (biases have none) when
// the job allows it; the offline plan has no measured ring step, so no layer goes by all-reduce
// and none at low rank.
TEST(PlanCliTest, TheLowRankColumnIsPricedWhereTheJobAllowsIt) {
  const CliRun exact = Stdout(kPaperCluster);
  ASSERT_EQ(exact.exit_code, 0) << exact.output;
  EXPECT_EQ(exact.output.find("AR-LR/worker"), std::string::npos) << exact.output;
  const CliRun low = Stdout(std::string(kPaperCluster) + " --lowrank_rank 4 --json");
  ASSERT_EQ(low.exit_code, 0) << low.output;
  google::protobuf::Struct root;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(low.output, &root).ok());
  int priced = 0;
  for (const auto& layer : Field(root, "layers").list_value().values()) {
    const auto& fields = layer.struct_value();
    const std::string name = Field(fields, "name").string_value();
    const bool matrix = Field(fields, "shape").list_value().values_size() >= 2;
    const bool has = Field(fields, "allreduce_lowrank").has_struct_value();
    EXPECT_EQ(has, matrix) << name;
    priced += has;
  }
  EXPECT_GT(priced, 0);
  EXPECT_EQ(Field(Field(root, "totals").struct_value(), "lowrank_layers").number_value(), 0);
  const CliRun table = Stdout(std::string(kPaperCluster) + " --lowrank_rank 4");
  ASSERT_EQ(table.exit_code, 0) << table.output;
  for (const char* text :
       {"AR-LR/worker", "lowrank  0 of 38 layers at low rank (AR-LR, PowerSGD: at rank 4 "}) {
    EXPECT_NE(table.output.find(text), std::string::npos) << text << "\n" << table.output;
  }
}

// --lowrank: an operator's per-layer rank, whatever the cost. fc6 goes by all-reduce at rank 4
// (marked *) although the job allows no low rank (and no measured ring step ever chose
// all-reduce here); fc7 at 0 stays off low rank where the job allows rank 4 everywhere.
TEST(PlanCliTest, ALowRankOverrideForcesOrForbidsALayersRank) {
  const CliRun run = Stdout(std::string(kPaperCluster) +
                            " --lowrank_rank 4 --lowrank fc6.weight=8,fc7.weight=0 --json");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  google::protobuf::Struct root;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(run.output, &root).ok());
  int seen = 0;
  for (const auto& layer : Field(root, "layers").list_value().values()) {
    const auto& fields = layer.struct_value();
    const std::string name = Field(fields, "name").string_value();
    const double rank = Field(fields, "lowrank_rank").number_value();
    const bool overridden = Field(fields, "lowrank_overridden").bool_value();
    if (name == "fc6.weight") {
      ++seen;
      EXPECT_EQ(rank, 8);
      EXPECT_EQ(Field(fields, "scheme").string_value(), "AR") << run.output;
      EXPECT_TRUE(overridden);
    } else if (name == "fc7.weight") {
      ++seen;
      EXPECT_EQ(rank, 0);
      EXPECT_TRUE(overridden);
      EXPECT_FALSE(Field(fields, "allreduce_lowrank").has_struct_value()) << "priced at 0";
    } else {
      EXPECT_FALSE(overridden) << name;
    }
  }
  EXPECT_EQ(seen, 2);
  EXPECT_EQ(Field(Field(root, "totals").struct_value(), "lowrank_layers").number_value(), 1);
  const CliRun table = Stdout(std::string(kPaperCluster) + " --lowrank fc6.weight=8");
  ASSERT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("lowrank  1 of 38 layers at low rank"), std::string::npos)
      << table.output;
  EXPECT_NE(table.output.find("8*"), std::string::npos) << table.output;
}

// --allreduce_by_cost: what the coordinator's rule would choose with the agents' measured ring
// step; the ring is weighed with the agents' all-reduce buckets (docs/planner.md), which the
// table names, and which --allreduce_bucket_bytes 0 turns off.
TEST(PlanCliTest, TheRingIsWeighedWithTheAgentsBuckets) {
  const std::string cluster =
      "plan --model resnet-152 --workers 8 --servers 1 --batch 32 --bandwidth 10Gbit "
      "--allreduce_by_cost --allreduce_step 40us";
  auto totals = [](const std::string& args, google::protobuf::Struct* root) {
    const CliRun run = Stdout(args + " --json");
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(run.output, root).ok()) << run.output;
    return Field(*root, "totals").struct_value();
  };
  google::protobuf::Struct bucketed_root, per_layer_root;
  const auto bucketed = totals(cluster, &bucketed_root);
  const auto per_layer = totals(cluster + " --allreduce_bucket_bytes 0", &per_layer_root);
  EXPECT_GT(Field(bucketed, "allreduce_buckets").number_value(), 0);
  EXPECT_EQ(Field(bucketed, "allreduce_bucket_bytes").number_value(), 25 << 20);
  EXPECT_EQ(Field(per_layer, "allreduce_buckets").number_value(), 0);
  EXPECT_GT(Field(bucketed, "allreduce_layers").number_value(),
            Field(per_layer, "allreduce_layers").number_value());
  const CliRun table = Stdout(cluster);
  ASSERT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("all-reduce layers in "), std::string::npos) << table.output;
  EXPECT_NE(table.output.find("buckets of at most 25.0 MiB"), std::string::npos) << table.output;
}

TEST(PlanCliTest, UnknownModelIsOneLineAndExitCode2) {
  const CliRun run = Stderr("plan --model no-such-net --workers 4 --batch 32 --bandwidth 10Gbit");
  EXPECT_EQ(run.exit_code, 2);
  ASSERT_FALSE(run.output.empty());
  EXPECT_EQ(run.output.find('\n'), run.output.size() - 1) << run.output;
  EXPECT_EQ(run.output.rfind("poseidon plan: unknown model 'no-such-net'", 0), 0u) << run.output;
  EXPECT_EQ(Stdout("plan --model no-such-net --workers 4 --batch 32 --bandwidth 10Gbit").output,
            "");
}

TEST(PlanCliTest, BadInputIsOneLineAndExitCode2) {
  const char* bad[] = {
      "plan --model vgg19 --workers 0 --batch 32 --bandwidth 10Gbit",
      "plan --model vgg19 --workers 4 --batch 32",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth fast",
      "plan --model vgg19 --workers 70000 --batch 32 --bandwidth 10Gbit",
      "plan --model vgg19 --workers 4 --bandwidth 10Gbit",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --gpu potato",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --block-size 0",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit stray",
      "plan --model /dev/null --workers 4 --batch 32 --bandwidth 10Gbit",
      "plan --workers 4 --batch 32 --bandwidth 10Gbit",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --lossy_wire fp8",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --lowrank_rank 2000",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --wire fc6.weight=fp8",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --wire fc6.weight",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --wire nope=bf16",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --lowrank fc6.weight=x",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --lowrank fc6.weight=2000",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --lowrank nope=4",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --lowrank fc6.bias=4",
      "plan --model vgg19 --workers 1 --batch 32 --bandwidth 10Gbit --lowrank fc6.weight=4",
      "plan --model vgg19 --workers 4 --bandwidth 10Gbit --batch 32 --lowrank fc6.weight=4 --wire fc6.weight=fp32",
      "plan --model vgg19 --workers 4 --batch 32 --bandwidth 10Gbit --allreduce_by_cost --allreduce_step -5us",
      "frobnicate",
  };
  for (const char* args : bad) {
    const CliRun run = Stderr(args);
    EXPECT_EQ(run.exit_code, 2) << args << ": " << run.output;
    EXPECT_FALSE(run.output.empty()) << args;
    EXPECT_EQ(run.output.find('\n'), run.output.size() - 1) << args << ": " << run.output;
  }
}

TEST(PlanCliTest, MalformedSpecFileIsOneLineAndExitCode2) {
  const std::string path = ::testing::TempDir() + "poseidon_plan_cli_bad_spec.json";
  FILE* file = std::fopen(path.c_str(), "w");
  ASSERT_NE(file, nullptr);
  std::fputs(
      "{\"name\": \"x\", \"layers\": [{\"name\": \"w\", \"kind\": \"LAYER_KIND_FC\",\n"
      "  \"shape\": [3, 4, 5]}]}\n",
      file);
  std::fclose(file);
  CliRun run = Stderr("plan --model " + path + " --workers 4 --batch 32 --bandwidth 10Gbit");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(run.output, "poseidon plan: " + path +
                            ": layer 0 'w': an FC layer's shape must be exactly [M, N], got "
                            "[3, 4, 5]\n");
  file = std::fopen(path.c_str(), "w");
  ASSERT_NE(file, nullptr);
  std::fputs("{\"name\": \"x\", \"layers\": [\n", file);
  std::fclose(file);
  run = Stderr("plan --model " + path + " --workers 4 --batch 32 --bandwidth 10Gbit");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(run.output.find('\n'), run.output.size() - 1) << run.output;
  std::remove(path.c_str());
}

TEST(PlanCliTest, NoCommandPrintsUsageAndExitCode2) {
  const CliRun run = Stderr("");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.output.find("plan"), std::string::npos);
}

TEST(PlanCliTest, HelpExitsZero) {
  const CliRun run = Stdout("plan --help");
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_NE(run.output.find("--bandwidth"), std::string::npos) << run.output;
  EXPECT_EQ(Stdout("help").exit_code, 0);
}

}  // namespace
