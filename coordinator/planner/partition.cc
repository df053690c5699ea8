#include "coordinator/planner/partition.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <queue>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

namespace poseidon::planner {

uint64_t ChunkCount(uint64_t elements, uint64_t element_bytes, uint64_t block_bytes) {
  if (element_bytes == 0 || block_bytes < element_bytes) return 0;
  const uint64_t block_elements = block_bytes / element_bytes;
  return elements / block_elements + (elements % block_elements != 0);
}

absl::StatusOr<std::vector<ChunkAssignment>> PartitionLayers(
    const std::vector<PartitionInput>& layers, uint32_t servers, uint64_t block_bytes) {
  if (servers == 0) return absl::InvalidArgumentError("servers (P2) must be >= 1, got 0");
  // Count first, so that an absurd block size is an error rather than an allocation.
  uint64_t total = 0;
  for (const PartitionInput& layer : layers) {
    if (layer.element_bytes == 0 || block_bytes < layer.element_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("block_size ", block_bytes, " bytes is smaller than an element (",
                       layer.element_bytes, " bytes) of layer ", layer.layer_index));
    }
    total += ChunkCount(layer.elements, layer.element_bytes, block_bytes);
    if (total > kMaxChunks) {
      return absl::InvalidArgumentError(
          absl::StrCat("block_size ", block_bytes, " bytes cuts the model into more than ",
                       kMaxChunks, " chunks (by layer ", layer.layer_index, "): raise block_size"));
    }
  }
  std::vector<ChunkAssignment> chunks;
  chunks.reserve(total);
  for (const PartitionInput& layer : layers) {
    const uint64_t count = ChunkCount(layer.elements, layer.element_bytes, block_bytes);
    if (count == 0) continue;
    const uint64_t base = layer.elements / count;
    const uint64_t larger = layer.elements % count;
    uint64_t offset = 0;
    for (uint64_t c = 0; c < count; ++c) {
      ChunkAssignment chunk;
      chunk.layer_index = layer.layer_index;
      chunk.chunk_index = static_cast<uint32_t>(c);
      chunk.key = (uint64_t{layer.layer_index} << 32) | c;
      chunk.offset = offset * layer.element_bytes;
      chunk.length = (base + (c < larger ? 1 : 0)) * layer.element_bytes;
      offset += base + (c < larger ? 1 : 0);
      chunks.push_back(chunk);
    }
  }

  // Longest processing time first onto the least-loaded server (ties: lowest index).
  std::vector<size_t> order(chunks.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const ChunkAssignment& x = chunks[a];
    const ChunkAssignment& y = chunks[b];
    if (x.length != y.length) return x.length > y.length;
    return std::tie(x.layer_index, x.chunk_index) < std::tie(y.layer_index, y.chunk_index);
  });
  using Load = std::pair<uint64_t, uint32_t>;  // (bytes, server index): smallest first
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> loads;
  for (uint32_t s = 0; s < servers; ++s) loads.emplace(0, s);
  for (const size_t i : order) {
    const auto [bytes, server] = loads.top();
    loads.pop();
    chunks[i].server_index = server;
    loads.emplace(bytes + chunks[i].length, server);
  }
  return chunks;
}

std::vector<uint64_t> ServerLoads(const std::vector<ChunkAssignment>& chunks, uint32_t servers) {
  std::vector<uint64_t> loads(servers, 0);
  for (const ChunkAssignment& chunk : chunks) {
    if (chunk.server_index < servers) loads[chunk.server_index] += chunk.length;
  }
  return loads;
}

}  // namespace poseidon::planner
