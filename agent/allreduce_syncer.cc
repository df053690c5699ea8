// The ring all-reduce syncer: a layer's gradient is summed in place among the agents by Gloo's
// ring all-reduce (reduce-scatter, then all-gather: every rank ends with the same bits), over
// Gloo's TCP transport, connected once at registration through the rendezvous store (the
// coordinator's, agent/gloo_store.h). Exact like PS: N ranks' sum of the same gradients.
//
// Concurrency: Gloo's collectives block. Each posted layer's all-reduce runs on a thread of its
// own (a pool that grows to the number of layers in flight, never beyond the layer count) with
// the layer's index as Gloo's tag, so collectives of different layers proceed side by side and
// the ranks need not post layers in one order (the framework's broadcast and buffer layers are
// posted outside backward's order, at iterations of their own). A layer has at most one
// iteration in flight, so its tag is unique among the collectives running. The ring uses the
// link whole: the scheduler's credit and priority do not apply to it.
//
// Thread model: Start and Waiting on the main thread; the collectives on the pool's threads; a
// CUDA layer's staging callback on the stager's thread. mu_ guards the queue, the pool's counts,
// the running set and the broken state (a leaf lock; never held in Gloo).
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agent/syncer.h"
#include "agent/telemetry_reporter.h"
#include "agent/timeline.h"
#include "common/log.h"
#include "common/status.h"
#include "gloo/allreduce.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/tcp/device.h"

namespace poseidon::agent {
namespace {

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// The step probes at connection (Ready) and their tag, above every layer's.
constexpr int kStepProbes = 15;
constexpr uint32_t kProbeTag = 0xffffffffu;

class AllreduceSyncer final : public Syncer {
 public:
  explicit AllreduceSyncer(SyncEnv& env) : env_(env) {}
  ~AllreduceSyncer() override { Stop(); }

  int Parts(uint32_t) const override { return 1; }

  absl::Status Ready() override {
    bool any = false;
    for (const LayerSpec& l : env_.table->layers) any |= l.allreduce_capable;
    if (!any || env_.rendezvous == nullptr || env_.config->world_size < 2) return absl::OkStatus();
    const uint32_t rank = env_.config->rank, world = env_.config->world_size;
    std::string host = env_.own_host.empty() ? "127.0.0.1" : env_.own_host;
    if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
    try {
      gloo::transport::tcp::attr attr;
      attr.hostname = host;
      device_ = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(static_cast<int>(rank),
                                                                 static_cast<int>(world));
      context->setTimeout(Millis(env_.config->sync_timeout));
      context->connectFullMesh(*env_.rendezvous, device_);
      context_ = std::move(context);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("all-reduce: connecting the Gloo ring of ", world, " ranks on ", host,
                       " (rendezvous through the coordinator): ", e.what()));
    }
    // The cost of one ring step, for the planner: the median of a few 1-element all-reduces
    // (every rank runs them at once, here) over their 2 (P - 1) steps. It holds Gloo's and the
    // threads' per-message overhead, which the network's round trip does not.
    std::vector<double> seconds;
    for (int i = 0; i < kStepProbes; ++i) {
      float one = 1;
      const absl::Time start = absl::Now();
      if (const absl::Status s = Sum(&one, 1, kProbeTag); !s.ok()) {
        return Annotate(s, absl::StrCat("all-reduce: measuring the Gloo ring of ", world,
                                        " ranks"));
      }
      if (one != static_cast<float>(world)) {
        return absl::InternalError(absl::StrCat("all-reduce: the ring's probe summed to ", one,
                                                ", not ", world));
      }
      seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    }
    std::nth_element(seconds.begin(), seconds.begin() + kStepProbes / 2, seconds.end());
    const absl::Duration step = absl::Seconds(seconds[kStepProbes / 2] / (2.0 * (world - 1)));
    if (env_.telemetry) env_.telemetry->SetAllreduceStep(step);
    PSD_LOG_INFO("all-reduce: Gloo ring of {} ranks connected ({}), {} per step", world, host,
                 absl::FormatDuration(step));
    return absl::OkStatus();
  }

  void Start(const Post& post) override {
    if (context_ == nullptr) {
      env_.finished(post.layer, post.iteration, 0,
                    absl::FailedPreconditionError(
                        "all-reduce is not connected (one rank, or no rendezvous store)"));
      return;
    }
    if (!post.on_device) {
      Launch(post);
      return;
    }
    const LayerSpec& spec = env_.table->layers[post.layer];
    DeviceStager* stager = env_.stager->load(std::memory_order_acquire);
    const std::vector<DeviceRange> ranges = {
        {spec.layout.grad_offset, spec.desc.elements * sizeof(float)}};
    const absl::Status s =
        stager->StageOut(post.layer, ranges, [this, post](size_t) { Launch(post); });
    if (!s.ok()) env_.finished(post.layer, post.iteration, 0, s);
  }

  std::string Waiting(uint32_t layer, uint64_t, const std::vector<uint8_t>&) const override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return absl::StrCat("all-reduce (the ring failed: ", broken_.message(), ")");
    if (running_.count(layer) != 0) {
      return absl::StrCat("all-reduce in the Gloo ring of ", env_.config->world_size,
                          " ranks (this rank's neighbours: ranks ", Left(), " and ", Right(),
                          "; ", running_.size(), " layers in the ring)");
    }
    return "all-reduce (queued for a thread)";
  }

  void Stop() override {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      threads.swap(threads_);
    }
    cv_.notify_all();
    for (auto& t : threads) t.join();
  }

 private:
  uint32_t Left() const {
    const uint32_t w = env_.config->world_size;
    return (env_.config->rank + w - 1) % w;
  }
  uint32_t Right() const { return (env_.config->rank + 1) % env_.config->world_size; }

  // Queues the layer for a pool thread; a new thread when every one is busy.
  void Launch(const Post& post) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      queue_.push_back(post);
      if (queue_.size() > idle_) threads_.emplace_back([this] { Loop(); });
    }
    cv_.notify_one();
  }

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ++idle_;
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      --idle_;
      if (stopping_) return;
      const Post post = queue_.front();
      queue_.pop_front();
      running_.insert(post.layer);
      const absl::Status broken = broken_;
      lock.unlock();

      const absl::Time start = absl::Now();
      absl::Status s = broken.ok() ? Reduce(post) : broken;
      const LayerSpec& spec = env_.table->layers[post.layer];
      const uint64_t bytes = spec.desc.elements * sizeof(float);
      if (env_.timeline) {
        env_.timeline->Span("allreduce", post.layer, spec.desc.name, post.iteration, start,
                            absl::Now());
      }
      if (s.ok() && env_.metrics.allreduce_bytes) {
        env_.metrics.allreduce_bytes->Increment(static_cast<double>(bytes));
      }
      if (s.ok() && env_.telemetry) {
        // The ring's bytes: 2 (P - 1) / P of the gradient to the right neighbour, as much from
        // the left (`poseidon status`'s peer links).
        const uint32_t w = env_.config->world_size;
        const uint64_t moved = 2 * (w - 1) * bytes / w;
        env_.telemetry->AddPeerBytes(Right(), moved, 0);
        env_.telemetry->AddPeerBytes(Left(), 0, moved);
      }
      if (s.ok() && post.on_device) {
        s = env_.stager->load(std::memory_order_acquire)
                ->StageIn(post.layer, {spec.layout.grad_offset, bytes});
      }
      {
        std::lock_guard<std::mutex> relock(mu_);
        running_.erase(post.layer);
        // After a failed collective the ring's state is unknown: every later one fails too.
        if (!s.ok() && broken_.ok()) broken_ = s;
      }
      env_.finished(post.layer, post.iteration, 0, s);
      lock.lock();
    }
  }

  // One Gloo all-reduce (sum) of `count` floats in place, bounded by sync_timeout; Gloo's
  // exception as UNAVAILABLE.
  absl::Status Sum(float* data, size_t count, uint32_t tag) {
    try {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(data, count);
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setTag(tag);
      opts.setTimeout(Millis(env_.config->sync_timeout));
      gloo::allreduce(opts);
    } catch (const std::exception& e) {
      return absl::UnavailableError(e.what());
    }
    return absl::OkStatus();
  }

  absl::Status Reduce(const Post& post) {
    const LayerSpec& spec = env_.table->layers[post.layer];
    // The layer is the tag: unique among the collectives running (one iteration a layer).
    return Annotate(Sum(env_.shm->Grad(post.layer), spec.desc.elements, post.layer),
                    absl::StrCat("all-reduce of layer ", post.layer, " (", spec.desc.name,
                                 ") iteration ", post.iteration, " in the Gloo ring of ",
                                 env_.config->world_size, " ranks (neighbours: ranks ", Left(),
                                 " and ", Right(), ")"));
  }

  SyncEnv& env_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;  // set in Ready, before any layer is posted

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Post> queue_;           // posted, waiting for a thread
  std::vector<std::thread> threads_;  // the pool (grows; joined by Stop)
  size_t idle_ = 0;                  // threads waiting for work
  std::set<uint32_t> running_;       // layers in the ring now
  absl::Status broken_;              // the first failure: every later all-reduce fails with it
  bool stopping_ = false;
};

}  // namespace

std::unique_ptr<Syncer> MakeAllreduceSyncer(SyncEnv& env) {
  return std::make_unique<AllreduceSyncer>(env);
}

}  // namespace poseidon::agent
