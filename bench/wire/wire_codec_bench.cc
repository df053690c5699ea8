// The cost of a lossy wire's casts (common/wire_codec.h), per element of a PS key, for the
// planner's PS-16 column (coordinator/planner/cost_model.h, WireCastSecondsPerElement): one
// element's trips are the agent's encode with error feedback, the server's decode into the
// float32 sum, the server's encode of the result with feedback and the agent's decode. Prints a
// table of ns per element for each 16-bit type, against float32's copies of the same bytes (what
// an exact wire does instead) measured in the same run.
//   poseidon-bench-wire-codec [--elements N] [--repeats R]   (--quick: a smoke run)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/wire_codec.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

}  // namespace

int main(int argc, char** argv) {
  size_t elements = size_t{1} << 20;
  int repeats = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      elements = size_t{1} << 14;
      repeats = 3;
    } else if (arg == "--elements" && i + 1 < argc) {
      elements = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--repeats" && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--elements N] [--repeats R] [--quick]\n", argv[0]);
      return 2;
    }
  }
  if (elements == 0 || repeats < 1) {
    std::fprintf(stderr, "--elements and --repeats must be at least 1\n");
    return 2;
  }
  using poseidon::WireType;
  std::vector<float> grad(elements), residual(elements, 0.0f), sum(elements, 0.0f),
      result_residual(elements, 0.0f), out(elements), copy(elements);
  for (size_t i = 0; i < elements; ++i) grad[i] = 1.0f + static_cast<float>(i % 1000) * 1e-4f;
  std::vector<uint16_t> wire(elements), result(elements);

  // float32: the same four trips as copies (push out, into the sum, result out, result in).
  const Clock::time_point f32_start = Clock::now();
  for (int r = 0; r < repeats; ++r) {
    std::memcpy(copy.data(), grad.data(), elements * sizeof(float));
    for (size_t i = 0; i < elements; ++i) sum[i] += copy[i];
    std::memcpy(copy.data(), sum.data(), elements * sizeof(float));
    std::memcpy(out.data(), copy.data(), elements * sizeof(float));
  }
  const double f32 = Seconds(f32_start) / repeats / static_cast<double>(elements) * 1e9;
  std::printf("%-6s %14s %16s\n", "wire", "ns / element", "vs fp32 copies");
  std::printf("%-6s %14.2f %16s\n", "fp32", f32, "1.00");
  float check = out[elements / 2];
  for (WireType type : {WireType::kBf16, WireType::kF16}) {
    const Clock::time_point start = Clock::now();
    for (int r = 0; r < repeats; ++r) {
      poseidon::EncodeWithFeedback(type, grad, residual, wire);       // agent: push
      poseidon::AddWire16Into(type, sum, wire);                       // server: into the sum
      poseidon::EncodeWithFeedback(type, sum, result_residual, result);  // server: result
      poseidon::DecodeWire16(type, result, out);                      // agent: pull
    }
    const double ns = Seconds(start) / repeats / static_cast<double>(elements) * 1e9;
    std::printf("%-6s %14.2f %16.2f\n", poseidon::WireName(type), ns, ns / f32);
    check += out[elements / 2];
  }
  std::printf("(%zu elements, %d repeats; checksum %g)\n", elements, repeats,
              static_cast<double>(check));
  return 0;
}
