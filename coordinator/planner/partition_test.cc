#include "coordinator/planner/partition.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "coordinator/planner/model_spec.h"
#include "gtest/gtest.h"

namespace poseidon::planner {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::vector<PartitionInput> AllLayers(const poseidon::v1::ModelSpec& model) {
  std::vector<PartitionInput> layers;
  layers.reserve(static_cast<size_t>(model.layers_size()));
  for (int i = 0; i < model.layers_size(); ++i) {
    layers.push_back(PartitionInput{static_cast<uint32_t>(i), ParameterCount(model.layers(i)), 4});
  }
  return layers;
}

TEST(PartitionTest, ChunksCoverEachLayerContiguouslyAndRespectTheBlock) {
  // 10 MiB + 4 bytes of f32 with a 4 MiB block: 3 chunks of nearly equal size.
  const uint64_t elements = (10 * kMiB + 4) / 4;
  const auto chunks = PartitionLayers({{7, elements, 4}, {8, 1, 4}}, 4, 4 * kMiB);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 4u);
  uint64_t offset = 0;
  for (int c = 0; c < 3; ++c) {
    const ChunkAssignment& chunk = (*chunks)[c];
    EXPECT_EQ(chunk.layer_index, 7u);
    EXPECT_EQ(chunk.chunk_index, static_cast<uint32_t>(c));
    EXPECT_EQ(chunk.key, (uint64_t{7} << 32) | c);
    EXPECT_EQ(chunk.offset, offset);
    EXPECT_LE(chunk.length, 4 * kMiB);
    EXPECT_EQ(chunk.length % 4, 0u);
    offset += chunk.length;
  }
  EXPECT_EQ(offset, 10 * kMiB + 4);
  // Sizes differ by at most one element.
  EXPECT_LE((*chunks)[0].length - (*chunks)[2].length, 4u);
  EXPECT_EQ((*chunks)[3].key, uint64_t{8} << 32);
  EXPECT_EQ((*chunks)[3].length, 4u);
}

TEST(PartitionTest, BlockIsRoundedDownToWholeElements) {
  // A 10-byte block holds two f32 elements.
  const auto chunks = PartitionLayers({{0, 5, 4}}, 2, 10);
  ASSERT_TRUE(chunks.ok());
  ASSERT_EQ(chunks->size(), 3u);
  for (const ChunkAssignment& chunk : *chunks) {
    EXPECT_LE(chunk.length, 8u);
    EXPECT_EQ(chunk.offset % 4, 0u);
  }
}

TEST(PartitionTest, Errors) {
  EXPECT_FALSE(PartitionLayers({{0, 5, 4}}, 0, 4 * kMiB).ok());
  const auto small = PartitionLayers({{3, 5, 8}}, 2, 4);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("layer 3"), absl::string_view::npos);
  const auto too_many = PartitionLayers({{0, uint64_t{1} << 40, 4}}, 2, 4);
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.status().message().find("chunks"), absl::string_view::npos);
}

TEST(PartitionTest, LargestFirstOntoTheLeastLoadedServer) {
  // Chunks 8, 5, 4, 3 (bytes / 4) onto 2 servers: 8 -> s0, 5 -> s1, 4 -> s1 (5 < 8), 3 -> s0.
  const auto chunks = PartitionLayers({{0, 3, 4}, {1, 8, 4}, {2, 4, 4}, {3, 5, 4}}, 2, 1024);
  ASSERT_TRUE(chunks.ok());
  std::map<uint32_t, uint32_t> server_of;
  for (const ChunkAssignment& chunk : *chunks) server_of[chunk.layer_index] = chunk.server_index;
  EXPECT_EQ(server_of[1], 0u);
  EXPECT_EQ(server_of[3], 1u);
  EXPECT_EQ(server_of[2], 1u);
  EXPECT_EQ(server_of[0], 0u);
  EXPECT_EQ(ServerLoads(*chunks, 2), (std::vector<uint64_t>{44, 36}));
}

TEST(PartitionTest, NoServerEndsMoreThanOneChunkAboveTheMean) {
  for (const std::string& name : BuiltinModelNames()) {
    const absl::StatusOr<poseidon::v1::ModelSpec> model = LoadBuiltinModel(name);
    ASSERT_TRUE(model.ok()) << model.status();
    for (const uint32_t servers : {1u, 2u, 3u, 4u, 7u, 8u, 16u, 31u, 64u, 100u}) {
      for (const uint64_t block : {4 * kMiB, 1 * kMiB, 256 * uint64_t{1024}}) {
        const auto chunks = PartitionLayers(AllLayers(*model), servers, block);
        ASSERT_TRUE(chunks.ok()) << chunks.status();
        const std::vector<uint64_t> loads = ServerLoads(*chunks, servers);
        const uint64_t total = std::accumulate(loads.begin(), loads.end(), uint64_t{0});
        EXPECT_EQ(total, ParameterCount(*model) * 4);
        uint64_t largest = 0;
        for (const ChunkAssignment& chunk : *chunks) largest = std::max(largest, chunk.length);
        const double mean = static_cast<double>(total) / servers;
        const uint64_t max_load = *std::max_element(loads.begin(), loads.end());
        EXPECT_LE(static_cast<double>(max_load), mean + static_cast<double>(largest))
            << name << " servers=" << servers << " block=" << block;
      }
    }
  }
}

TEST(PartitionTest, KeysAreUniqueAndTheResultIsDeterministic) {
  const absl::StatusOr<poseidon::v1::ModelSpec> model = LoadBuiltinModel("resnet-152");
  ASSERT_TRUE(model.ok());
  const auto a = PartitionLayers(AllLayers(*model), 16, 4 * kMiB);
  const auto b = PartitionLayers(AllLayers(*model), 16, 4 * kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->size(), b->size());
  std::set<uint64_t> keys;
  for (size_t i = 0; i < a->size(); ++i) {
    EXPECT_TRUE(keys.insert((*a)[i].key).second);
    EXPECT_EQ((*a)[i].key, (*b)[i].key);
    EXPECT_EQ((*a)[i].offset, (*b)[i].offset);
    EXPECT_EQ((*a)[i].length, (*b)[i].length);
    EXPECT_EQ((*a)[i].server_index, (*b)[i].server_index);
  }
}

}  // namespace
}  // namespace poseidon::planner
