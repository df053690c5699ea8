#include "agent/lowrank.h"

#include <cblas.h>

#include <cmath>
#include <limits>
#include <random>

namespace poseidon::agent {

void Orthogonalize(std::span<float> p, uint64_t rows, uint32_t rank) {
  std::vector<double> m(p.begin(), p.end());
  for (uint32_t c = 0; c < rank; ++c) {
    // Remove the earlier (orthonormal) columns, twice (re-orthogonalisation: the second pass
    // takes out what rounding left of them).
    double before = 0;
    for (uint64_t r = 0; r < rows; ++r) before += m[r * rank + c] * m[r * rank + c];
    for (int pass = 0; pass < 2; ++pass) {
      for (uint32_t prev = 0; prev < c; ++prev) {
        double dot = 0;
        for (uint64_t r = 0; r < rows; ++r) dot += m[r * rank + prev] * m[r * rank + c];
        for (uint64_t r = 0; r < rows; ++r) m[r * rank + c] -= dot * m[r * rank + prev];
      }
    }
    double norm = 0;
    for (uint64_t r = 0; r < rows; ++r) norm += m[r * rank + c] * m[r * rank + c];
    // Zero, or (numerically) in the span of the earlier columns: a zero column, which the
    // reconstruction ignores (its part of the gradient stays in the residual).
    const bool degenerate = !(norm > 1e-24) || !(norm > before * 1e-12) || !std::isfinite(norm);
    const double scale = degenerate ? 0.0 : 1.0 / std::sqrt(norm);
    for (uint64_t r = 0; r < rows; ++r) m[r * rank + c] *= scale;
  }
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<float>(m[i]);
}

namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double Ratio(double held, double grads) {
  if (!std::isfinite(held) || !std::isfinite(grads)) {
    return std::numeric_limits<double>::infinity();
  }
  if (grads == 0) return held == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(held / grads);
}

double SumOfSquares(std::span<const float> v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return s;
}

}  // namespace

void AddToSketch(std::span<const float> x, uint64_t first_index, std::span<float> sketch) {
  for (size_t i = 0; i < x.size(); ++i) {
    const uint64_t h = SplitMix64(first_index + i);
    const float v = (h >> 63) != 0 ? -x[i] : x[i];
    sketch[h % kSketchSlots] += v;
  }
}

double SketchedHeldBackRatio(std::span<const float> held_sketch,
                             std::span<const float> grad_sketch) {
  return Ratio(SumOfSquares(held_sketch), SumOfSquares(grad_sketch));
}

LowRankLayer::LowRankLayer(LowRankShape shape, uint32_t rank, uint64_t seed)
    : rows_(shape.rows),
      cols_(shape.cols),
      rank_(rank),
      q_(shape.cols * rank),
      residual_(shape.rows * shape.cols, 0.0f) {
  // The first Q: standard normal from the shared seed (Box-Muller over mt19937_64's raw words,
  // so every rank's library draws the same numbers).
  std::mt19937_64 gen(seed * 0x9e3779b97f4a7c15ull + 1);
  const double two_pi = 6.283185307179586;
  for (size_t i = 0; i < q_.size(); i += 2) {
    const double u1 = (static_cast<double>(gen() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(gen() >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    q_[i] = static_cast<float>(radius * std::cos(two_pi * u2));
    if (i + 1 < q_.size()) q_[i + 1] = static_cast<float>(radius * std::sin(two_pi * u2));
  }
}

void LowRankLayer::Project(std::span<const float> grad, std::span<float> p) {
  for (size_t i = 0; i < residual_.size(); ++i) residual_[i] += grad[i];  // M
  const int m = static_cast<int>(rows_), n = static_cast<int>(cols_), r = static_cast<int>(rank_);
  // p (m x r) = M (m x n) Q (n x r)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, r, n, 1.0f, residual_.data(), n,
              q_.data(), r, 0.0f, p.data(), r);
}

void LowRankLayer::ProjectBack(std::span<float> p, std::span<float> q) {
  Orthogonalize(p, rows_, rank_);
  const int m = static_cast<int>(rows_), n = static_cast<int>(cols_), r = static_cast<int>(rank_);
  // q (n x r) = M^T (n x m) p (m x r)
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, r, m, 1.0f, residual_.data(), n,
              p.data(), r, 0.0f, q.data(), r);
}

void LowRankLayer::Reconstruct(std::span<const float> p, std::span<const float> q, uint32_t world,
                               std::span<float> grad) {
  const int m = static_cast<int>(rows_), n = static_cast<int>(cols_), r = static_cast<int>(rank_);
  // grad (m x n) = p (m x r) q^T (r x n)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, r, 1.0f, p.data(), r, q.data(), r,
              0.0f, grad.data(), n);
  const float share = 1.0f / static_cast<float>(world);
  for (size_t i = 0; i < residual_.size(); ++i) residual_[i] -= grad[i] * share;
  q_.assign(q.begin(), q.end());
}

void LowRankLayer::ReleaseResidual() {
  residual_.clear();
  residual_.shrink_to_fit();
  q_.clear();
  q_.shrink_to_fit();
}

double HeldBackRatio(std::span<const float> held, std::span<const float> grads) {
  return Ratio(SumOfSquares(held), SumOfSquares(grads));
}

void LowRankLayer::ZeroQForTest() { std::fill(q_.begin(), q_.end(), 0.0f); }

}  // namespace poseidon::agent
