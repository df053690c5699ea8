// Runs `poseidon simulate` as a user would (popen): JSON rows per N, the calibration file and the
// flags that override it, errors.

#include <cstdio>
#include <fstream>
#include <string>

#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "tools/cli_test_util.h"
#include "gtest/gtest.h"

namespace {

using ::poseidon::tools::testing::CliRun;
using ::poseidon::tools::testing::Field;
using ::poseidon::tools::testing::Stderr;
using ::poseidon::tools::testing::Stdout;

google::protobuf::Struct Json(const CliRun& run) {
  google::protobuf::Struct root;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(run.output, &root).ok()) << run.output;
  return root;
}

constexpr char kGooglenet[] =
    "simulate --model googlenet --batch 32 --bandwidth 10Gbit --iterations 5 --json";

TEST(SimulateCliTest, RowsPerClusterSizeWithSpeedup) {
  const CliRun run = Stdout(std::string(kGooglenet) + " --workers 4,2");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const google::protobuf::Struct root = Json(run);
  EXPECT_EQ(Field(root, "model").string_value(), "googlenet");
  const auto& rows = Field(root, "rows").list_value().values();
  ASSERT_EQ(rows.size(), 2);  // N = 1 is simulated as the base, not listed
  const auto& two = rows[0].struct_value();
  EXPECT_EQ(Field(two, "workers").number_value(), 2);
  EXPECT_GT(Field(two, "speedup").number_value(), 1.0);
  EXPECT_LE(Field(two, "speedup").number_value(), 2.0 + 1e-9);
  const double parts = Field(two, "compute_seconds").number_value() +
                       Field(two, "exposed_seconds").number_value() +
                       Field(two, "waiting_seconds").number_value();
  EXPECT_NEAR(parts, Field(two, "period_seconds").number_value(), 1e-9);
}

TEST(SimulateCliTest, CalibrationFillsWhatFlagsDoNotSet) {
  const std::string path = ::testing::TempDir() + "/calibration.json";
  {
    std::ofstream out(path);
    out << R"({"alpha_seconds": 4e-05, "jitter": {"kind": "lognormal", "iteration_sigma": 0.02},
              "emulation": {"compute_overhead_seconds": 1e-04,
                            "overhead_per_extra_host_seconds": 1e-05,
                            "cpu_seconds_per_byte": 2e-11, "shared_cpus": 2,
                            "allreduce_step_seconds": 3e-04,
                            "cpu_seconds_per_pass": 5e-05, "host_cpu_load": 0.1,
                            "frame_overhead_bytes": 14},
              "validation": []})";
  }
  const std::string with = std::string(kGooglenet) + " --workers 3 --calibration " + path;
  const google::protobuf::Struct plain = Json(Stdout(with));
  const auto& settings = Field(plain, "settings").struct_value();
  EXPECT_DOUBLE_EQ(Field(settings, "alpha_seconds").number_value(), 4e-05);
  EXPECT_EQ(Field(settings, "jitter").string_value(), "lognormal");
  const auto& row = Field(plain, "rows").list_value().values(0).struct_value();
  EXPECT_EQ(Field(row, "compute_overhead_seconds").number_value(), 0);  // not without --emulation
  EXPECT_EQ(Field(settings, "cpu_seconds_per_byte").number_value(), 0);
  EXPECT_EQ(Field(settings, "shared_cpus").number_value(), 0);
  EXPECT_EQ(Field(settings, "allreduce_step_seconds").number_value(), 0);
  EXPECT_EQ(Field(settings, "pass_cpu_seconds").number_value(), 0);
  EXPECT_EQ(Field(settings, "host_cpu_load").number_value(), 0);
  EXPECT_EQ(Field(settings, "mtu").number_value(), 1500);
  EXPECT_EQ(Field(settings, "frame_overhead_bytes").number_value(), 38) << "an Ethernet wire's";
  const google::protobuf::Struct emulated = Json(Stdout(with + " --emulation --alpha 0us"));
  EXPECT_EQ(Field(Field(emulated, "settings").struct_value(), "alpha_seconds").number_value(), 0);
  const auto& row3 = Field(emulated, "rows").list_value().values(0).struct_value();
  EXPECT_NEAR(Field(row3, "compute_overhead_seconds").number_value(), 1e-04 + 2 * 1e-05, 1e-12);
  const auto& emulated_settings = Field(emulated, "settings").struct_value();
  EXPECT_NEAR(Field(emulated_settings, "cpu_seconds_per_byte").number_value(), 2e-11, 1e-20);
  EXPECT_EQ(Field(emulated_settings, "shared_cpus").number_value(), 2);
  EXPECT_NEAR(Field(emulated_settings, "allreduce_step_seconds").number_value(), 3e-04, 1e-12);
  EXPECT_NEAR(Field(emulated_settings, "pass_cpu_seconds").number_value(), 5e-05, 1e-12);
  EXPECT_DOUBLE_EQ(Field(emulated_settings, "host_cpu_load").number_value(), 0.1);
  EXPECT_EQ(Field(emulated_settings, "frame_overhead_bytes").number_value(), 14) << "tc tbf's";
  // A flag still wins over the calibration.
  const google::protobuf::Struct own =
      Json(Stdout(with + " --emulation --shared_cpus 0 --allreduce_step 0us"));
  EXPECT_EQ(Field(Field(own, "settings").struct_value(), "shared_cpus").number_value(), 0);
  EXPECT_EQ(Field(Field(own, "settings").struct_value(), "allreduce_step_seconds").number_value(),
            0);
}

// A calibration's emulation field that is no number of its kind is refused, naming it.
TEST(SimulateCliTest, ABadCalibrationFieldIsRefusedNamingIt) {
  const std::string path = ::testing::TempDir() + "/bad_calibration.json";
  for (const char* field : {R"("shared_cpus": 1.5)", R"("host_cpu_load": 1.0)",
                            R"("frame_overhead_bytes": 2.5)", R"("cpu_seconds_per_pass": -1)"}) {
    {
      std::ofstream out(path);
      out << R"({"emulation": {)" << field << "}}";
    }
    const CliRun run = Stderr(std::string(kGooglenet) + " --workers 2 --emulation --calibration " +
                              path);
    EXPECT_EQ(run.exit_code, 2) << field;
    const std::string name = std::string(field).substr(1, std::string(field).find('"', 1) - 1);
    EXPECT_NE(run.output.find(name), std::string::npos) << field << ": " << run.output;
  }
}

// With a lossy wire allowed on a slow network the plan puts PS layers on bfloat16 and the
// simulated iteration is shorter (half the PS bytes).
TEST(SimulateCliTest, ALossyWireShortensABandwidthBoundIteration) {
  const std::string base =
      "simulate --model resnet-152 --batch 32 --bandwidth 1Gbit --iterations 5 --workers 8 --json";
  const google::protobuf::Struct exact = Json(Stdout(base));
  const google::protobuf::Struct lossy = Json(Stdout(base + " --lossy_wire bf16"));
  EXPECT_EQ(Field(Field(lossy, "settings").struct_value(), "lossy_wire").string_value(), "bf16");
  const double e = Field(Field(exact, "rows").list_value().values(0).struct_value(),
                         "period_seconds").number_value();
  const double l = Field(Field(lossy, "rows").list_value().values(0).struct_value(),
                         "period_seconds").number_value();
  EXPECT_LT(l, 0.8 * e) << "exact " << e << " s, lossy " << l << " s";
}

TEST(SimulateCliTest, BadInputIsOneLineAndExitCode2) {
  CliRun run = Stderr("simulate --model googlenet --bandwidth 10Gbit --batch 32 --workers 0");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.output.find("--workers"), std::string::npos) << run.output;
  run = Stderr("simulate --model googlenet --bandwidth 10Gbit --batch 32 --calibration /nope");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.output.find("/nope"), std::string::npos) << run.output;
  run = Stderr("simulate --model googlenet --bandwidth 10Gbit --batch 32 --lossy_wire fp8");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.output.find("lossy_wire"), std::string::npos) << run.output;
  run = Stderr("simulate --model googlenet --bandwidth 10Gbit --batch 32 --shared_cpus 4000000000");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.output.find("shared_cpus"), std::string::npos) << run.output;
  run = Stderr("simulate --model googlenet --bandwidth 10Gbit --batch 32 --mtu 100");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.output.find("mtu"), std::string::npos) << run.output;
  run = Stderr("simulate --model googlenet --bandwidth 10Gbit --batch 32 --host_cpu_load 1.5");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.output.find("host_cpu_load"), std::string::npos) << run.output;
  // Eight hosts' load of 0.3 CPU each is more than 2 shared CPUs.
  run = Stderr("simulate --model googlenet --bandwidth 10Gbit --batch 32 --workers 8 "
               "--shared_cpus 2 --host_cpu_load 0.3");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.output.find("leaves nothing of the 2 shared CPUs"), std::string::npos)
      << run.output;
  run = Stderr("simulate --model googlenet --bandwidth 10Gbit --batch 32 --gpu none");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.output.find("compute time unknown"), std::string::npos) << run.output;
}

}  // namespace
