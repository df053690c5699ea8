// Which tensors low rank (PowerSGD: agent/lowrank.h) compresses, shared by the agent (which
// compresses them) and the planner (whose AR-LR column prices them). Thread-safety: pure.
#pragma once

#include <cstdint>
#include <vector>

namespace poseidon {

// The matrix view of a tensor of `shape` (its first dimension by the product of the rest, as a
// conv weight's out x in*kh*kw), and whether rank `rank` compresses it: at least 2 dimensions,
// rank < min(rows, cols), (rows + cols) rank < rows cols (DDP's hook sends such a tensor
// uncompressed too), and each dimension below 2^31 (BLAS's int).
struct LowRankShape {
  uint64_t rows = 0, cols = 0;
};

inline bool LowRankPays(const std::vector<uint64_t>& shape, uint32_t rank, LowRankShape* view) {
  if (shape.size() < 2 || rank == 0) return false;
  uint64_t cols = 1;
  for (size_t i = 1; i < shape.size(); ++i) {
    if (shape[i] == 0 || cols > (uint64_t{1} << 40) / shape[i]) return false;
    cols *= shape[i];
  }
  const uint64_t rows = shape[0];
  if (rows == 0 || rank >= rows || rank >= cols) return false;
  if (rows >= (uint64_t{1} << 31) || cols >= (uint64_t{1} << 31)) return false;
  if ((rows + cols) * rank >= rows * cols) return false;
  if (view != nullptr) *view = {rows, cols};
  return true;
}

}  // namespace poseidon
