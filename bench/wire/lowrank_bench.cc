// The cost of low rank's arithmetic (agent/lowrank.h, PowerSGD) per gradient element, for the
// planner's AR-LR column (coordinator/planner/cost_model.h, LowRankSecondsPerElement): one
// step's three products (P = M Q, Q = M^T P, M ≈ P Q^T, OpenBLAS's sgemm), the Gram-Schmidt of P
// and the error feedback, on one rank (the all-reduces of P and Q are the network's, not here).
// Prints ns per element for each shape and rank, and per element and rank, against a float32
// copy of the gradient measured in the same run.
//   poseidon-bench-lowrank [--repeats R] [--threads T]   (--quick: a smoke run)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "agent/lowrank.h"
#include "agent/syncer.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 20, threads = 1;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
      repeats = 2;
    } else if (arg == "--repeats" && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
    } else if (arg == "--threads" && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--repeats R] [--threads T] [--quick]\n", argv[0]);
      return 2;
    }
  }
  if (repeats < 1 || threads < 1) {
    std::fprintf(stderr, "--repeats and --threads must be at least 1\n");
    return 2;
  }
  poseidon::agent::SetHostBlasThreads(threads);
  struct Shape {
    const char* name;
    uint64_t rows, cols;
  };
  std::vector<Shape> shapes = {{"fc 1024x1024", 1024, 1024},
                               {"conv 512x4608", 512, 4608},
                               {"fc 4096x4096", 4096, 4096}};
  std::vector<uint32_t> ranks = {1, 2, 4, 8};
  if (quick) {
    shapes = {{"fc 128x256", 128, 256}};
    ranks = {4};
  }
  std::printf("%-14s %5s %14s %20s %14s\n", "shape", "rank", "ns / element",
              "ns / element / rank", "vs f32 copy");
  double check = 0;
  for (const Shape& shape : shapes) {
    const size_t n = shape.rows * shape.cols;
    std::vector<float> grad(n), out(n), copy(n);
    for (size_t i = 0; i < n; ++i) grad[i] = static_cast<float>((i * 7919) % 1000) * 1e-3f - 0.5f;
    const Clock::time_point copy_start = Clock::now();
    for (int r = 0; r < repeats; ++r) {
      std::memcpy(copy.data(), grad.data(), n * sizeof(float));
      check += copy[r % n];
    }
    const double copy_ns = Seconds(copy_start) / repeats / static_cast<double>(n) * 1e9;
    for (uint32_t rank : ranks) {
      poseidon::agent::LowRankLayer layer({shape.rows, shape.cols}, rank, 1);
      std::vector<float> p(layer.p_size()), q(layer.q_size());
      const Clock::time_point start = Clock::now();
      for (int r = 0; r < repeats; ++r) {
        layer.Project(grad, p);
        layer.ProjectBack(p, q);
        layer.Reconstruct(p, q, 1, out);
      }
      const double ns = Seconds(start) / repeats / static_cast<double>(n) * 1e9;
      std::printf("%-14s %5u %14.2f %20.2f %14.1f\n", shape.name, rank, ns, ns / rank,
                  ns / copy_ns);
      check += out[n / 2];
    }
  }
  std::printf("(%d repeats, %d BLAS threads; checksum %g)\n", repeats, threads, check);
  return 0;
}
