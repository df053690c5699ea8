// poseidon-synth: a training process that emulates a model from a spec, talking to its agent
// only through the C ABI (libposeidon). Per iteration: the forward pass waits for each layer's
// previous synchronisation and spends the layer's forward time; the backward pass spends each
// layer's backward time, writes deterministic data (the gradient, or for SFB layers the factors)
// and posts the layer ready at once (WFBP). With --verify every synchronised result is checked
// against the exact sum over all ranks (the data are small integers, so sums are exact).
// Compute is emulated by sleeping: it costs no CPU.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "coordinator/planner/model_spec.h"
#include "coordinator/planner/time_model.h"
#include "poseidon/poseidon.h"

#ifdef POSEIDON_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

ABSL_FLAG(std::string, segment, "", "the agent's segment (default $POSEIDON_SEGMENT)");
ABSL_FLAG(std::string, model, "", "built-in model name or spec path");
ABSL_FLAG(uint32_t, batch, 32, "per-worker batch K (FC layers' factor rows; compute time)");
ABSL_FLAG(uint64_t, iterations, 10, "iterations");
ABSL_FLAG(std::string, gpu, "titanx", "GPU rate for compute time (name or FLOP/s)");
ABSL_FLAG(double, compute_scale, 1.0, "multiply the emulated compute time (0: none)");
ABSL_FLAG(bool, verify, false, "check every synchronised result against the exact sum");
ABSL_FLAG(double, grad_fraction, 0,
          "added to every PS gradient value (the values are small integers: exact in any "
          "wire); 2^-10 = 0.0009765625 is not a bfloat16 near 1..11");
ABSL_FLAG(double, grad_scale, 1,
          "multiplies every PS gradient value's integer part (a power of two keeps sums exact); "
          "8192 puts values beyond fp16's range (±65504), which its wire cannot carry");
ABSL_FLAG(bool, allow_shrink, false,
          "with --verify: the world may shrink (poseidon-agent --min_workers): a layer's result "
          "may leave out one removed rank's contribution from some iteration on, the same rank "
          "on every layer, and count it again from a later one (its replacement readmitted: the "
          "world grows again), never out twice");
ABSL_FLAG(uint64_t, verify_from, 1,
          "with --verify: check the results of this iteration and later ones only (a lossy "
          "wire's fallback is exact from the clock after it)");
ABSL_FLAG(double, tolerance, 0,
          "with --verify: accept |result - exact| <= tolerance * max(1, |exact|) (a lossy wire, "
          "agent --wire=bf16); 0: exact");
ABSL_FLAG(bool, print_switches, false,
          "print a line whenever a plan change moves a layer to another scheme");
ABSL_FLAG(bool, print_iterations, false,
          "print a line when each iteration's backward has posted its last layer, with the wall "
          "clock (Unix seconds) and the seconds since the previous such line");
ABSL_FLAG(uint32_t, timeout_ms, 60000, "per-layer wait timeout");
ABSL_FLAG(uint32_t, agent_timeout_ms, 5000,
          "take the agent for lost after this long without its heartbeat (psd_config)");
ABSL_FLAG(bool, cuda, false,
          "keep the layers on the GPU (device 0): write them there, post with "
          "psd_cuda_layer_ready on a stream, wait with psd_cuda_wait_layer");
ABSL_FLAG(bool, wfbp, true,
          "post each layer ready during backward (false: after the whole backward)");

namespace {

using Clock = std::chrono::steady_clock;

// Small integers: sums over ranks (and products for SFB) are exact in float.
// Small integers (sums exact in float32 in any order), plus --grad_fraction (e.g. 2^-10: values
// a bfloat16 wire cannot carry exactly).
float grad_fraction = 0;  // --grad_fraction, read once in main
float grad_scale = 1;     // --grad_scale, likewise
inline float GradValue(uint32_t rank, uint64_t t, uint32_t layer, uint64_t i) {
  return static_cast<float>(
             static_cast<int64_t>(((rank + 1) * 7 + t * 3 + layer * 5 + i % 17) % 23) - 11) *
             grad_scale +
         grad_fraction;
}
inline float UValue(uint32_t rank, uint64_t t, uint32_t layer, uint64_t k, uint64_t m) {
  return static_cast<float>(static_cast<int64_t>((rank * 3 + t + layer + k * 5 + m) % 7) - 3);
}
inline float VValue(uint32_t rank, uint64_t t, uint32_t layer, uint64_t k, uint64_t n) {
  return static_cast<float>(static_cast<int64_t>((rank + 2 * t + layer * 3 + k + n * 2) % 5) - 2);
}

struct Layer {
  std::string name;
  uint32_t kind;
  std::vector<uint64_t> shape;
  double forward_s = 0, backward_s = 0;
  psd_layer_info info{};
  uint32_t scheme = 0;  // of the iteration written last (psd_layer_scheme: plans change)
  float* dev_grad = nullptr;  // --cuda: the layer's device buffers
  float* dev_u = nullptr;
  float* dev_v = nullptr;
  std::vector<float> staging;  // --cuda: host copy written to / read back from the device
};

[[noreturn]] void Die(const char* what, psd_status s) {
  std::fprintf(stderr, "poseidon-synth: %s: %s: %s\n", what, psd_status_string(s),
               psd_last_error());
  std::exit(1);
}

void Sleep(double seconds) {
  if (seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

// Checks layer l's synchronised result of iteration t against the sum over the ranks (but
// `without`, a removed rank, when >= 0); returns the number of mismatches, printing the first
// few unless `quiet`.
uint64_t Verify(const Layer& layer, const float* grad, uint32_t l, uint64_t t, uint32_t world,
                int64_t without = -1, bool quiet = false) {
  const uint64_t n = layer.info.elements;
  const uint64_t stride = std::max<uint64_t>(1, n / 4096);  // sample large layers
  uint64_t bad = 0;
  for (uint64_t i = 0; i < n; i += stride) {
    double expected = 0;
    if (layer.scheme == PSD_SYNC_SFB) {
      const uint64_t M = layer.shape[0], N = layer.shape[1];
      const uint64_t row = i / N, col = i % N;
      (void)M;
      const uint64_t K = absl::GetFlag(FLAGS_batch);
      for (uint32_t r = 0; r < world; ++r) {
        if (r == without) continue;
        for (uint64_t k = 0; k < K; ++k)
          expected += UValue(r, t, l, k, row) * VValue(r, t, l, k, col);
      }
    } else {
      for (uint32_t r = 0; r < world; ++r) {
        if (r != without) expected += GradValue(r, t, l, i);
      }
    }
    const double tolerance = absl::GetFlag(FLAGS_tolerance);
    const double error = std::abs(static_cast<double>(grad[i]) - expected);
    if (tolerance > 0 ? !(error <= tolerance * std::max(1.0, std::abs(expected)))
                      : static_cast<double>(grad[i]) != expected) {
      if (bad < 3 && !quiet) {
        std::fprintf(
            stderr,
            "poseidon-synth: layer %u (%s) iteration %llu element %llu: got %g, expected %g\n", l,
            layer.name.c_str(), static_cast<unsigned long long>(t),
            static_cast<unsigned long long>(i), grad[i], expected);
      }
      ++bad;
    }
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  grad_fraction = static_cast<float>(absl::GetFlag(FLAGS_grad_fraction));
  grad_scale = static_cast<float>(absl::GetFlag(FLAGS_grad_scale));
  auto spec = poseidon::planner::LoadModel(absl::GetFlag(FLAGS_model));
  if (!spec.ok()) {
    std::fprintf(stderr, "poseidon-synth: %s\n", spec.status().ToString().c_str());
    return 2;
  }
  auto rate = poseidon::planner::ParseGpuRate(absl::GetFlag(FLAGS_gpu));
  if (!rate.ok()) {
    std::fprintf(stderr, "poseidon-synth: %s\n", rate.status().ToString().c_str());
    return 2;
  }
  const uint32_t K = absl::GetFlag(FLAGS_batch);
  const double scale = absl::GetFlag(FLAGS_compute_scale);
  std::vector<Layer> layers;
  for (const auto& ls : spec->layers()) {
    Layer l;
    l.name = ls.name();
    l.kind = static_cast<uint32_t>(ls.kind());
    l.shape.assign(ls.shape().begin(), ls.shape().end());
    if (ls.has_forward_flops())
      l.forward_s = scale * ls.forward_flops() * K / rate->flops_per_second;
    if (ls.has_backward_flops())
      l.backward_s = scale * ls.backward_flops() * K / rate->flops_per_second;
    layers.push_back(l);
  }
  psd_config config;
  psd_config_init(&config);
  const std::string segment = absl::GetFlag(FLAGS_segment);
  if (!segment.empty()) config.segment = segment.c_str();
  config.agent_timeout_ms = absl::GetFlag(FLAGS_agent_timeout_ms);
  psd_context* ctx = nullptr;
  if (psd_status s = psd_attach(&config, &ctx); s != PSD_OK) Die("attach", s);
  std::vector<psd_layer_desc> descs(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    descs[i] = {layers[i].name.c_str(),
                layers[i].kind,
                PSD_FLOAT32,
                static_cast<uint32_t>(layers[i].shape.size()),
                layers[i].shape.data(),
                layers[i].kind == PSD_LAYER_FC ? K : 0,
                // Posted during backward with no waits between: fusable (host memory only: the
                // agent refuses fused layers posted on the GPU).
                absl::GetFlag(FLAGS_cuda) ? 0u : PSD_LAYER_FUSABLE};
  }
  const uint32_t timeout = absl::GetFlag(FLAGS_timeout_ms);
  if (psd_status s =
          psd_register_layers(ctx, descs.data(), static_cast<uint32_t>(descs.size()), timeout);
      s != PSD_OK) {
    Die("register", s);
  }
  uint32_t rank = 0, world = 1;
  psd_rank(ctx, &rank, &world);
  // A rank that rejoined a running job (its agent's --rejoin) takes up the job's iteration
  // `first`: its process iteration t is the job's t + offset, which its data follow.
  uint64_t first = 1;
  if (psd_status s = psd_start_iteration(ctx, &first); s != PSD_OK) Die("start iteration", s);
  const uint64_t offset = first - 1;
  if (first > 1) {
    std::printf("poseidon-synth rank %u: takes up the job at iteration %llu\n", rank,
                static_cast<unsigned long long>(first));
    std::fflush(stdout);
  }
  int sfb = 0;
  for (uint32_t l = 0; l < layers.size(); ++l) {
    if (psd_status s = psd_get_layer_info(ctx, l, &layers[l].info); s != PSD_OK)
      Die("layer info", s);
    sfb += layers[l].info.scheme == PSD_SYNC_SFB;
  }
  const bool cuda = absl::GetFlag(FLAGS_cuda);
  void* stream = nullptr;  // cudaStream_t
  if (cuda) {
#ifdef POSEIDON_HAVE_CUDA
    if (psd_status s = psd_cuda_enable(ctx, 0, timeout); s != PSD_OK) Die("cuda enable", s);
    cudaStream_t st;
    if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) {
      std::fprintf(stderr, "poseidon-synth: cannot create a CUDA stream\n");
      return 1;
    }
    stream = st;
    for (uint32_t l = 0; l < layers.size(); ++l) {
      Layer& layer = layers[l];
      if (psd_status s = psd_cuda_layer_buffers(ctx, l, &layer.dev_grad, &layer.dev_u, &layer.dev_v);
          s != PSD_OK) {
        Die("cuda buffers", s);
      }
      uint64_t floats = layer.info.elements;
      if (layer.info.u != nullptr) {  // the layer may run SFB (now or after a plan change)
        floats = std::max<uint64_t>(floats, K * (layer.shape[0] + layer.shape[1]));
      }
      layer.staging.assign(floats, 0.0f);
    }
#else
    std::fprintf(stderr, "poseidon-synth: built without CUDA\n");
    return 2;
#endif
  }
  const uint64_t job_iterations = absl::GetFlag(FLAGS_iterations);
  const uint64_t iterations = job_iterations > offset ? job_iterations - offset : 0;
  const bool verify = absl::GetFlag(FLAGS_verify);
  const uint64_t verify_from = absl::GetFlag(FLAGS_verify_from);
  const bool wfbp = absl::GetFlag(FLAGS_wfbp);
  uint64_t mismatches = 0, verified = 0;
  const auto L = static_cast<uint32_t>(layers.size());
  // --allow_shrink: the rank the results leave out (-1: none yet) and, per layer, the first
  // iteration that left it out (0: none).
  const bool allow_shrink = absl::GetFlag(FLAGS_allow_shrink);
  int64_t removed = -1;
  std::vector<uint64_t> left_out_from(L, 0), back_from(L, 0);
  auto wait_and_check = [&](uint32_t l, uint64_t t) {
    const float* result = layers[l].info.grad;
    if (cuda) {
#ifdef POSEIDON_HAVE_CUDA
      if (psd_status s = psd_cuda_wait_layer(ctx, l, t, timeout, stream); s != PSD_OK) {
        Die("wait", s);
      }
      if (verify) {  // read the result back on the stream, after the agent's copy
        Layer& layer = layers[l];
        auto st = static_cast<cudaStream_t>(stream);
        cudaMemcpyAsync(layer.staging.data(), layer.dev_grad, layer.info.elements * 4,
                        cudaMemcpyDeviceToHost, st);
        if (cudaStreamSynchronize(st) != cudaSuccess) {
          std::fprintf(stderr, "poseidon-synth: reading layer %u back failed\n", l);
          std::exit(1);
        }
        result = layer.staging.data();
      }
#endif
    } else if (psd_status s = psd_wait_layer(ctx, l, t, timeout); s != PSD_OK) {
      Die("wait", s);
    }
    if (verify && t + offset >= verify_from) {
      const uint64_t job_t = t + offset;
      if (!allow_shrink) {
        mismatches += Verify(layers[l], result, l, job_t, world);
      } else if (back_from[l] != 0) {  // back: every rank from then on
        mismatches += Verify(layers[l], result, l, job_t, world);
      } else if (left_out_from[l] != 0) {  // left out until it is back
        if (Verify(layers[l], result, l, job_t, world, removed, /*quiet=*/true) == 0) {
        } else if (Verify(layers[l], result, l, job_t, world, -1, /*quiet=*/true) == 0) {
          back_from[l] = job_t;
        } else {
          mismatches += Verify(layers[l], result, l, job_t, world, removed);
        }
      } else if (Verify(layers[l], result, l, job_t, world, -1, /*quiet=*/true) != 0) {
        bool matched = false;
        for (uint32_t d = 0; d < world && !matched; ++d) {
          if (d == rank || (removed >= 0 && d != removed)) continue;
          if (Verify(layers[l], result, l, job_t, world, d, /*quiet=*/true) == 0) {
            removed = d;
            left_out_from[l] = job_t;
            matched = true;
          }
        }
        if (!matched) mismatches += Verify(layers[l], result, l, job_t, world);
      }
      ++verified;
    }
  };
  // Writes layer l's input of iteration t: into the shared buffers, or with --cuda onto the GPU.
  uint64_t switches = 0;
  auto write_layer = [&](uint32_t l, uint64_t t) {
    Layer& layer = layers[l];
    uint32_t scheme = 0;
    if (psd_status s = psd_layer_scheme(ctx, l, t, &scheme); s != PSD_OK) Die("scheme", s);
    if (t > 1 && scheme != layer.scheme) {
      ++switches;
      if (absl::GetFlag(FLAGS_print_switches)) {
        std::printf("poseidon-synth rank %u: layer %u (%s) runs %s from iteration %llu\n", rank,
                    l, layer.name.c_str(),
                    scheme == PSD_SYNC_SFB         ? "SFB"
                    : scheme == PSD_SYNC_ALLREDUCE ? "AR"
                                                   : "PS",
                    static_cast<unsigned long long>(t));
        std::fflush(stdout);
      }
    }
    layer.scheme = scheme;
    float* grad = cuda ? layer.staging.data() : layer.info.grad;
    if (scheme == PSD_SYNC_SFB) {
      const uint64_t M = layer.shape[0], N = layer.shape[1];
      float* u = cuda ? layer.staging.data() : layer.info.u;
      float* v = cuda ? layer.staging.data() + K * M : layer.info.v;
      for (uint64_t k = 0; k < K; ++k) {
        for (uint64_t m = 0; m < M; ++m) u[k * M + m] = UValue(rank, t + offset, l, k, m);
        for (uint64_t n = 0; n < N; ++n) v[k * N + n] = VValue(rank, t + offset, l, k, n);
      }
#ifdef POSEIDON_HAVE_CUDA
      if (cuda) {
        auto st = static_cast<cudaStream_t>(stream);
        cudaMemcpyAsync(layer.dev_u, u, K * M * 4, cudaMemcpyHostToDevice, st);
        cudaMemcpyAsync(layer.dev_v, v, K * N * 4, cudaMemcpyHostToDevice, st);
        cudaStreamSynchronize(st);  // the staging vector is reused next iteration
      }
#endif
    } else {
      for (uint64_t i = 0; i < layer.info.elements; ++i) {
        grad[i] = GradValue(rank, t + offset, l, i);
      }
#ifdef POSEIDON_HAVE_CUDA
      if (cuda) {
        auto st = static_cast<cudaStream_t>(stream);
        cudaMemcpyAsync(layer.dev_grad, grad, layer.info.elements * 4, cudaMemcpyHostToDevice,
                        st);
        cudaStreamSynchronize(st);
      }
#endif
    }
  };
  auto post = [&](uint32_t l, uint64_t t) {
    const psd_status s =
        cuda ? psd_cuda_layer_ready(ctx, l, t, stream) : psd_layer_ready(ctx, l, t);
    if (s != PSD_OK) Die("ready", s);
  };
  const auto start = Clock::now();
  auto first_iteration_end = start;
  auto previous_end = start;
  const bool print_iterations = absl::GetFlag(FLAGS_print_iterations);
  for (uint64_t t = 1; t <= iterations; ++t) {
    for (uint32_t l = 0; l < L; ++l) {  // forward: each layer waits for its own last sync
      if (t > 1) wait_and_check(l, t - 1);
      Sleep(layers[l].forward_s);
    }
    for (uint32_t l = L; l-- > 0;) {  // backward, top layer first
      Sleep(layers[l].backward_s);
      write_layer(l, t);
      if (wfbp) post(l, t);
    }
    if (!wfbp) {
      for (uint32_t l = L; l-- > 0;) post(l, t);
    }
    const auto end = Clock::now();
    if (print_iterations) {
      const double unix_s =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      std::printf("poseidon-synth rank %u: iteration %llu ends at %.6f (%.6f s)\n", rank,
                  static_cast<unsigned long long>(t + offset), unix_s,
                  std::chrono::duration<double>(end - previous_end).count());
      std::fflush(stdout);
    }
    previous_end = end;
    if (t == 1) first_iteration_end = end;
  }
  if (iterations > 0) {
    for (uint32_t l = 0; l < L; ++l) wait_and_check(l, iterations);
  }
  const double total = std::chrono::duration<double>(Clock::now() - start).count();
  const double steady =
      iterations > 1 ? std::chrono::duration<double>(Clock::now() - first_iteration_end).count() /
                           static_cast<double>(iterations - 1)
                     : total;
  std::printf(
      "poseidon-synth rank %u/%u: %llu iterations of %s (%u layers, %d on SFB) in %.3f s, "
      "%.4f s per iteration after the first; %llu scheme switches; verified %llu results, %llu "
      "mismatches\n",
      rank, world, static_cast<unsigned long long>(iterations), spec->name().c_str(), L, sfb, total,
      steady, static_cast<unsigned long long>(switches), static_cast<unsigned long long>(verified),
      static_cast<unsigned long long>(mismatches));
  if (allow_shrink) {
    auto span = [](const std::vector<uint64_t>& at, uint64_t& first, uint64_t& last) {
      first = last = 0;
      for (uint64_t from : at) {
        if (from == 0) continue;
        first = first == 0 ? from : std::min(first, from);
        last = std::max(last, from);
      }
    };
    uint64_t left_first = 0, left_last = 0, back_first = 0, back_last = 0;
    span(left_out_from, left_first, left_last);
    span(back_from, back_first, back_last);
    uint32_t live_rank = 0, live_size = 0;
    uint64_t generation = 0;
    // The agent learns of the removal (and of the return) from the coordinator (at once when
    // the dead rank's agent said it left, else once its lease ran out; the replacement once it
    // registered), possibly after this rank's last iteration: waited for (at most 20 s) when
    // the results left a rank out.
    const uint64_t changes = (removed >= 0 ? 1 : 0) + (back_first != 0 ? 1 : 0);
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    do {
      if (psd_status s = psd_world(ctx, &live_rank, &live_size, &generation); s != PSD_OK) {
        Die("world", s);
      }
      if (generation >= changes) break;
      Sleep(0.1);
    } while (Clock::now() < deadline);
    if (removed >= 0) {
      std::printf("poseidon-synth rank %u: the results left out rank %lld from iterations %llu to "
                  "%llu (by layer)",
                  rank, static_cast<long long>(removed), static_cast<unsigned long long>(left_first),
                  static_cast<unsigned long long>(left_last));
      if (back_first != 0) {
        std::printf(" and counted it again from iterations %llu to %llu",
                    static_cast<unsigned long long>(back_first),
                    static_cast<unsigned long long>(back_last));
      }
      std::printf("; world now rank %u of %u (generation %llu)\n", live_rank, live_size,
                  static_cast<unsigned long long>(generation));
    } else {
      std::printf("poseidon-synth rank %u: no result left a rank out; world now rank %u of %u "
                  "(generation %llu)\n",
                  rank, live_rank, live_size, static_cast<unsigned long long>(generation));
    }
  }
  psd_detach(ctx);
  return mismatches == 0 ? 0 : 1;
}
