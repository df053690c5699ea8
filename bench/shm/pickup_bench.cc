// poseidon-bench-pickup: how long a layer-ready event takes from the training process's
// psd_layer_ready to the agent's pickup (ShmEndpoint::NextEvent returning), with the agent idle
// (asleep on the ring's futex) as it is between layers; against a raw futex wake-up between two
// threads measured in the same run (the floor for any sleeping consumer).
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agent/shm_endpoint.h"
#include "common/log.h"
#include "poseidon/poseidon.h"

namespace {

using Clock = std::chrono::steady_clock;

double Us(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

struct Stats {
  double p50, p99;
};

Stats Percentiles(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v[v.size() * 99 / 100]};
}

// Reference: producer stores a timestamp and FUTEX_WAKEs a sleeping consumer thread.
Stats RawFutex(int rounds) {
  alignas(64) std::atomic<uint32_t> word{0};
  std::atomic<int64_t> sent_ns{0};
  std::vector<double> lat;
  std::atomic<bool> sleeping{false};
  std::thread consumer([&] {
    for (int i = 1; i <= rounds; ++i) {
      while (word.load(std::memory_order_acquire) < static_cast<uint32_t>(i)) {
        sleeping = true;
        syscall(SYS_futex, &word, FUTEX_WAIT, static_cast<uint32_t>(i - 1), nullptr, nullptr, 0);
      }
      sleeping = false;
      lat.push_back(Us(Clock::now().time_since_epoch()) - sent_ns.load() / 1000.0);
    }
  });
  for (int i = 1; i <= rounds; ++i) {
    while (!sleeping.load()) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // let it sleep for real
    sent_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
                  .count();
    word.store(static_cast<uint32_t>(i), std::memory_order_release);
    syscall(SYS_futex, &word, FUTEX_WAKE, 1, nullptr, nullptr, 0);
    while (static_cast<int>(lat.size()) < i) std::this_thread::yield();
  }
  consumer.join();
  return Percentiles(lat);
}

}  // namespace

int main() {
  poseidon::InitLogging("poseidon-bench-pickup", spdlog::level::warn);
  const std::string name = absl::StrCat("/psd-pickup-", getpid());
  auto ep = poseidon::agent::ShmEndpoint::Create(name, 0, 1, 1);
  if (!ep.ok()) {
    std::fprintf(stderr, "%s\n", ep.status().ToString().c_str());
    return 1;
  }
  constexpr int kRounds = 2000;
  std::vector<Clock::time_point> picked(kRounds + 1);
  std::atomic<bool> stop{false};
  std::thread agent([&] {
    while (!stop.load()) {
      auto e = (*ep)->NextEvent(absl::Milliseconds(50));
      if (!e.ok() || !e->has_value()) continue;
      const auto ev = **e;
      if (ev.type == PSD_EVENT_REGISTER) {
        auto layers = (*ep)->ReadLayers();
        std::vector<poseidon::agent::LayerLayout> layout(1);
        (void)(*ep)->PublishLayout(*layers, layout, 4096);
      } else if (ev.type == PSD_EVENT_LAYER_READY && ev.iteration <= kRounds) {
        picked[ev.iteration] = Clock::now();
        (*ep)->LayerDone(ev.layer, ev.iteration);
      }
    }
  });
  psd_config config;
  psd_config_init(&config);
  config.segment = name.c_str();
  psd_context* ctx = nullptr;
  if (psd_attach(&config, &ctx) != PSD_OK) {
    std::fprintf(stderr, "attach: %s\n", psd_last_error());
    return 1;
  }
  const uint64_t shape[1] = {256};
  psd_layer_desc desc{"layer", PSD_LAYER_OTHER, PSD_FLOAT32, 1, shape, 0, 0};
  if (psd_register_layers(ctx, &desc, 1, 10000) != PSD_OK) {
    std::fprintf(stderr, "register: %s\n", psd_last_error());
    return 1;
  }
  std::vector<double> pickup, round_trip;
  for (int i = 1; i <= kRounds; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // the agent goes to sleep
    const auto t0 = Clock::now();
    psd_layer_ready(ctx, 0, static_cast<uint64_t>(i));
    psd_wait_layer(ctx, 0, static_cast<uint64_t>(i), 10000);
    const auto t1 = Clock::now();
    pickup.push_back(Us(picked[i] - t0));
    round_trip.push_back(Us(t1 - t0));
  }
  psd_detach(ctx);
  stop = true;
  agent.join();
  const Stats p = Percentiles(pickup), r = Percentiles(round_trip), f = RawFutex(kRounds);
  std::printf(
      "Layer-ready pickup over shared memory (%d events, agent asleep between events), "
      "%u hardware threads\n\n",
      kRounds, std::thread::hardware_concurrency());
  std::printf("%-44s %10s %10s\n", "", "p50 us", "p99 us");
  std::printf("%-44s %10.1f %10.1f\n", "psd_layer_ready -> agent pickup", p.p50, p.p99);
  std::printf("%-44s %10.1f %10.1f\n", "ready -> done -> psd_wait_layer returns", r.p50, r.p99);
  std::printf("%-44s %10.1f %10.1f\n", "reference: raw futex wake of a sleeping thread", f.p50,
              f.p99);
  std::printf("\npickup / raw futex (p50): %.2f   (target: pickup p50 <= 5 us)\n", p.p50 / f.p50);
  return 0;
}
