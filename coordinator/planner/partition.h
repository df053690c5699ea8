// Partitioning of the parameter-server layers: every layer cut into chunks of at most a block
// size, the chunks spread over the servers so that each stores about the same number of bytes.
// Thread-safety: pure functions, safe from any thread.
#pragma once

// The rules (docs/planner.md, "Partitioning"), all deterministic:
//   - Cutting: a layer of E elements of e bytes, with a block of B bytes (rounded down to a whole
//     number of elements, b = floor(B/e)), is cut into n = ceil(E/b) chunks of nearly equal size:
//     the first E mod n chunks hold floor(E/n)+1 elements, the rest floor(E/n). Equal pieces
//     balance better than n−1 full blocks and a remainder, and no chunk exceeds B.
//   - Keys: chunk c of layer l has key (l << 32) | c (c < 2^24: a partition holds at most
//     kMaxChunks chunks). A key names the same bytes of the same layer in every plan epoch that
//     keeps the layer on PS with the same block size, whatever happens to other layers.
//   - Placement: longest processing time first. Chunks sorted by length (largest first; ties by
//     layer, then chunk index) are each given to the server with the fewest bytes so far (ties:
//     the lowest server index). Each chunk lands on a server that held at most the mean of the
//     loads at that moment, so no server ends more than one chunk above the final mean.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace poseidon::planner {

// A layer to partition.
struct PartitionInput {
  uint32_t layer_index = 0;
  uint64_t elements = 0;
  uint64_t element_bytes = 4;
};

// One chunk of one layer.
struct ChunkAssignment {
  uint64_t key = 0;
  uint32_t layer_index = 0;
  uint32_t chunk_index = 0;
  uint64_t offset = 0;  // bytes into the layer's dense tensor
  uint64_t length = 0;  // bytes
  uint32_t server_index = 0;
};

// Most chunks one partition may hold (each is a key on a server and a plan entry).
inline constexpr uint64_t kMaxChunks = uint64_t{1} << 24;

// How many chunks a layer of `elements` elements of `element_bytes` bytes is cut into; 0 when the
// block is smaller than an element.
uint64_t ChunkCount(uint64_t elements, uint64_t element_bytes, uint64_t block_bytes);

// The chunks of every input layer, grouped by layer in input order and by offset within a layer.
// Errors: no servers, a block smaller than an element, more than kMaxChunks chunks in all.
absl::StatusOr<std::vector<ChunkAssignment>> PartitionLayers(
    const std::vector<PartitionInput>& layers, uint32_t servers, uint64_t block_bytes);

// Bytes stored on each server by `chunks`.
std::vector<uint64_t> ServerLoads(const std::vector<ChunkAssignment>& chunks, uint32_t servers);

}  // namespace poseidon::planner
