#include "server/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>

#include "transport/checksum.h"

namespace poseidon::server {
namespace {

JobSnapshot Sample() {
  JobSnapshot s;
  s.job_id = 7;
  s.clock = 12;
  s.spec.set_num_workers(2);
  auto* t = s.spec.add_tables();
  t->set_name("fc.weight");
  t->mutable_update_rule()->set_rule(v1::UPDATE_RULE_ADAM);
  for (uint64_t key : {1, 2}) {
    auto* k = t->add_keys();
    k->set_key(key);
    k->set_elements(3);
    KeySnapshot ks;
    ks.key = key;
    ks.completed_clock = 12;
    ks.initialized = true;
    ks.optimizer_steps = 12;
    ks.exact_from = key == 2 ? 13 : 0;  // a key that fell back at the clock after the label
    ks.params = {1.5f, -2.0f, static_cast<float>(key)};
    ks.optimizer_state = {{0.1f, 0.2f, 0.3f}, {1.0f, 2.0f, 3.0f}};
    s.keys.push_back(ks);
  }
  return s;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("psd-ckpt-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

// An agent's checkpoint between iterations: keys of layers that ran fewer times are behind the
// label and come back so; a key past it is a corrupt file.
TEST_F(CheckpointTest, KeysBehindTheLabelRoundTripAndAKeyPastItIsRefused) {
  JobSnapshot s = Sample();
  s.keys[1].completed_clock = 0;
  s.keys[1].exact_from = 1;  // fell back at the clock after its last
  ASSERT_TRUE(WriteCheckpoint(dir_, s).ok());
  auto loaded = LoadCheckpoints(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), 1u);
  EXPECT_EQ((*loaded)[0].keys[0].completed_clock, 12u);
  EXPECT_EQ((*loaded)[0].keys[1].completed_clock, 0u);
  s.keys[1].completed_clock = 13;
  ASSERT_TRUE(WriteCheckpoint(dir_, s).ok());
  loaded = LoadCheckpoints(dir_);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("past the snapshot's clock"), std::string::npos)
      << loaded.status();
}

TEST_F(CheckpointTest, RoundTripsEveryField) {
  const JobSnapshot s = Sample();
  ASSERT_TRUE(WriteCheckpoint(dir_, s).ok());
  auto loaded = LoadCheckpoints(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), 1u);
  const JobSnapshot& r = (*loaded)[0];
  EXPECT_EQ(r.job_id, 7u);
  EXPECT_EQ(r.clock, 12u);
  EXPECT_EQ(r.spec.SerializeAsString(), s.spec.SerializeAsString());
  ASSERT_EQ(r.keys.size(), 2u);
  EXPECT_EQ(r.keys[1].params, s.keys[1].params);
  EXPECT_EQ(r.keys[1].optimizer_state, s.keys[1].optimizer_state);
  EXPECT_EQ(r.keys[0].optimizer_steps, 12u);
  EXPECT_EQ(r.keys[0].exact_from, 0u);
  EXPECT_EQ(r.keys[1].exact_from, 13u);
}

TEST_F(CheckpointTest, EveryTruncationAndEveryByteFlipIsRefused) {
  ASSERT_TRUE(WriteCheckpoint(dir_, Sample()).ok());
  const std::string path = CheckpointPath(dir_, 7);
  std::ifstream in(path, std::ios::binary);
  const std::string good((std::istreambuf_iterator<char>(in)), {});
  ASSERT_GT(good.size(), 100u);
  for (size_t cut = 0; cut < good.size(); cut += 7) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << good.substr(0, cut);
    auto r = ReadCheckpoint(path);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << "cut at " << cut;
  }
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x5A);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
    EXPECT_FALSE(ReadCheckpoint(path).ok()) << "byte " << i;
  }
}

// Found by checkpoint_fuzzer: a spec length of 4 GiB in a file of 100 bytes (CRC and length
// field right) was allocated, and zero-filled, before the reader found the bytes missing.
TEST_F(CheckpointTest, ASpecLengthBeyondTheFileIsRefusedBeforeAllocating) {
  JobSnapshot s;
  s.job_id = 3;
  ASSERT_TRUE(WriteCheckpoint(dir_, s).ok());
  const std::string path = CheckpointPath(dir_, 3);
  std::ifstream in(path, std::ios::binary);
  std::string file((std::istreambuf_iterator<char>(in)), {});
  ASSERT_GT(file.size(), 44u + 12u);
  const uint32_t spec_len = 0xffffffffu;  // magic, version, reserved, total, job, clock: 40 bytes
  std::memcpy(file.data() + 40, &spec_len, 4);
  const uint32_t crc = transport::Crc32c(
      0, std::span(reinterpret_cast<const std::byte*>(file.data()), file.size() - 12));
  std::memcpy(file.data() + file.size() - 12, &crc, 4);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << file;
  rusage before{}, after{};
  getrusage(RUSAGE_SELF, &before);
  auto r = ReadCheckpoint(path);
  getrusage(RUSAGE_SELF, &after);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("bad spec"), std::string::npos) << r.status();
  // Peak resident memory in KiB: not the 4 GiB the length field asked for.
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 256 * 1024);
}

TEST_F(CheckpointTest, LeftoverTemporaryFilesAreIgnoredAndACorruptFileFailsTheLoad) {
  std::ofstream(dir_ / "job-9.ckpt.tmp.123") << "half written";
  auto loaded = LoadCheckpoints(dir_);
  ASSERT_TRUE(loaded.ok());
  EXPECT_TRUE(loaded->empty());
  std::ofstream(dir_ / "job-9.ckpt") << "garbage";
  auto bad = LoadCheckpoints(dir_);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("job-9.ckpt"), std::string::npos);
}

TEST_F(CheckpointTest, TemporaryFilesOfDeadWritersAreRemovedLiveOnesKept) {
  // A writer that is gone: a child that has exited and been reaped.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  const auto dead = dir_ / ("job-3.ckpt.tmp." + std::to_string(child));
  const auto live = dir_ / ("job-4.ckpt.tmp." + std::to_string(::getpid()));
  const auto odd = dir_ / "job-5.ckpt.tmp.notapid";
  for (const auto& p : {dead, live, odd}) std::ofstream(p) << "half written";
  auto loaded = LoadCheckpoints(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->empty());
  EXPECT_FALSE(std::filesystem::exists(dead)) << "a dead writer's temporary file stays forever";
  EXPECT_TRUE(std::filesystem::exists(live)) << "a live writer's file must not be removed";
  EXPECT_TRUE(std::filesystem::exists(odd));
}

TEST_F(CheckpointTest, MissingDirectoryIsEmpty) {
  auto loaded = LoadCheckpoints((dir_ / "nope").string());
  ASSERT_TRUE(loaded.ok());
  EXPECT_TRUE(loaded->empty());
}

}  // namespace
}  // namespace poseidon::server
