// Low-rank compression of a 2-D gradient (issue 15, "Low rank"; PowerSGD, Vogels et al. 2019,
// as DDP's powerSGD_hook runs it): the gradient G of a layer viewed as rows x cols (the tensor's
// first dimension by the rest, as a conv weight's out x in*kh*kw) is sent as two thin matrices
// of rank r, P (rows x r) and Q (cols x r), so an all-reduce moves (rows + cols) r floats
// instead of rows cols. One power iteration per step, summed over the ranks:
//
//   M  = G + e                 this rank's gradient plus what earlier steps held back
//   P  = M Q                   all-reduced (sum): P = (Σ M_i) Q, the same Q on every rank
//   P̂  = orthonormal columns of P (Gram-Schmidt, the same bits on every rank)
//   Q  = M^T P̂                 all-reduced (sum): Q = (Σ M_i)^T P̂
//   A  = P̂ Q^T                 ≈ Σ M_i: the step's result, the same bits on every rank
//   e  = M − A / W             error feedback: Σ_i e_i = Σ_i M_i − A, nothing lost
//
// Q is kept for the next step (warm start: the power iteration goes on across steps; the first
// Q is random from a seed every rank shares). When Σ M_i has rank ≤ r, A equals it (up to float
// rounding). Summed over steps, Σ_t A_t = Σ_t Σ_i G_i,t − Σ_i e_i: what was not sent yet is held
// in the residuals, never dropped. The divergence guard (HeldBackRatio, estimated by sketches) watches the ranks' summed
// residual against their summed gradient: a compressor that no longer captures the gradient lets
// it grow without bound. (One rank's residual alone is no measure: e_1 − e_2 is the sum of the
// ranks' gradient differences over the steps, which no compressor of the sum sends.)
//
// Thread-safety: a LowRankLayer belongs to one caller (the all-reduce thread running its unit);
// Orthogonalize is a pure function.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/lowrank_shape.h"

namespace poseidon::agent {

// Makes the columns of the row-major rows x rank matrix `p` orthonormal (modified Gram-Schmidt in
// double precision); a column that is zero, or dependent on the earlier ones, becomes zero.
void Orthogonalize(std::span<float> p, uint64_t rows, uint32_t rank);

// ||held|| / ||grads|| in double precision (the ranks' summed residuals against their summed
// gradients of a step): 0 when both are zero, infinite when only `held` is non-zero or anything
// is not finite. The sizes must match.
double HeldBackRatio(std::span<const float> held, std::span<const float> grads);

// The guard's estimate of those norms without sending the vectors: a CountSketch. Element i of a
// vector (its index among the unit's factored elements) adds ±x_i to one of kSketchSlots slots,
// slot and sign from a hash of i that every rank shares, so the sketch of the ranks' sum is the
// sum of their sketches (one all-reduce of kSketchSlots floats), and Σ slot² estimates ‖x‖²
// without bias (relative error about √(2 / kSketchSlots), 9 %).
inline constexpr size_t kSketchSlots = 256;
void AddToSketch(std::span<const float> x, uint64_t first_index, std::span<float> sketch);
// HeldBackRatio's estimate from the summed sketches of the residuals and of the gradients (same
// conventions: 0, infinite).
double SketchedHeldBackRatio(std::span<const float> held_sketch,
                             std::span<const float> grad_sketch);

class LowRankLayer {
 public:
  // `seed`: the first Q's, the same on every rank (the layer's index).
  LowRankLayer(LowRankShape shape, uint32_t rank, uint64_t seed);

  uint64_t rows() const { return rows_; }
  uint64_t cols() const { return cols_; }
  uint32_t rank() const { return rank_; }
  size_t p_size() const { return rows_ * rank_; }
  size_t q_size() const { return cols_ * rank_; }

  // M = grad + residual (kept), p = M Q. `grad` has rows x cols elements, `p` p_size().
  void Project(std::span<const float> grad, std::span<float> p);
  // After the sum of P: orthonormalises `p` in place and computes q = M^T p (q_size()).
  void ProjectBack(std::span<float> p, std::span<float> q);
  // After the sum of Q: grad = p q^T (the step's result), residual = M − grad / world, and q is
  // the next step's Q.
  void Reconstruct(std::span<const float> p, std::span<const float> q, uint32_t world,
                   std::span<float> grad);

  // The residual: added to the gradient when the layer falls back to the exact all-reduce
  // (then released).
  std::span<const float> residual() const { return residual_; }
  void ReleaseResidual();

  // Tests only: forge a broken compressor (a zero Q captures nothing).
  void ZeroQForTest();

 private:
  uint64_t rows_, cols_;
  uint32_t rank_;
  std::vector<float> q_;         // cols x rank, row-major
  std::vector<float> residual_;  // rows x cols; M between Project and Reconstruct
};

}  // namespace poseidon::agent
