// The parameter-server syncer: each chunk of a layer is pushed to the server the plan gives it
// and the clock's sum pulled back into the same buffer, one scheduler task per chunk. Keys are
// clocked per layer: a key's clock counts the iterations the layer ran on PS (so a layer that a
// plan change moves between PS and SFB resumes at the next clock of its keys, on every rank
// alike). On the GPU path each chunk is copied to the host before its task starts and back to
// the device as soon as its result is in.
// Thread model: Start on the main thread (clocks_ is its alone); tasks on the scheduler's
// workers; completions on transport threads.
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/syncer.h"
#include "common/status.h"
#include "agent/timeline.h"

namespace poseidon::agent {
namespace {

class PsSyncer final : public Syncer {
 public:
  explicit PsSyncer(SyncEnv& env) : env_(env), clocks_(env.table->layers.size(), 0) {}

  int Parts(uint32_t layer) const override {
    return static_cast<int>(env_.table->layers[layer].chunks.size());
  }

  // A resumed job: each layer's clock goes on from its keys' restored clock C (the first PS
  // iteration then is clock C + 1, or C again under a server-side rule: its answer is the
  // restored parameters).
  absl::Status Ready() override {
    for (uint32_t l = 0; l < clocks_.size(); ++l) {
      const LayerSpec& spec = env_.table->layers[l];
      if (spec.bucket >= 0) continue;  // the bucket syncer's key
      ASSIGN_OR_RETURN(clocks_[l],
                       RestoredClock(env_, spec.desc.name, spec.chunks, spec.desc.own_clock));
    }
    return absl::OkStatus();
  }

  void Start(const Post& post) override {
    const LayerSpec& spec = env_.table->layers[post.layer];
    // With a server-side rule, the layer's first PS iteration carries rank 0's initial
    // parameters (clock 0) and the t-th the gradient of clock t - 1; the answer is the updated
    // parameters.
    const uint64_t count = ++clocks_[post.layer];
    const bool server_rule = env_.server_rule != 0;
    const uint64_t clock = server_rule ? count - 1 : count;
    const bool init = server_rule && clock == 0;
    std::vector<Scheduler::Task> tasks;
    std::vector<DeviceRange> ranges;
    for (size_t c = 0; c < spec.chunks.size(); ++c) {
      tasks.push_back(ChunkTask(post, static_cast<int>(c), clock, init, absl::Now()));
      ranges.push_back({spec.layout.grad_offset + spec.chunks[c].offset, spec.chunks[c].length});
    }
    if (!post.on_device) {
      for (auto& t : tasks) env_.scheduler->Submit(std::move(t));
      return;
    }
    // Each chunk goes to the network as soon as its copy is on the host, while the next chunk
    // is being copied.
    auto staged = std::make_shared<std::vector<Scheduler::Task>>(std::move(tasks));
    DeviceStager* stager = env_.stager->load(std::memory_order_acquire);
    const absl::Status s =
        stager->StageOut(post.layer, ranges, [scheduler = env_.scheduler, staged](size_t i) {
          scheduler->Submit(std::move((*staged)[i]));
        });
    if (!s.ok()) {
      for (size_t c = 0; c < spec.chunks.size(); ++c) {
        env_.finished(post.layer, post.iteration, static_cast<int>(c), s);
      }
    }
  }

  std::string Waiting(uint32_t layer, uint64_t, const std::vector<uint8_t>& pending) const override {
    const LayerSpec& spec = env_.table->layers[layer];
    std::vector<std::string> keys;
    for (size_t c = 0; c < pending.size() && c < spec.chunks.size() && keys.size() < 8; ++c) {
      if (pending[c]) {
        keys.push_back(absl::StrCat(
            "key ", spec.chunks[c].key, " on ",
            env_.ServerAddress(env_.replication.ServingNow(spec.chunks[c].server))));
      }
    }
    return absl::StrCat("chunks [", absl::StrJoin(keys, ", "), "]");
  }

 private:
  Scheduler::Task ChunkTask(const Post& post, int c, uint64_t clock, bool init, absl::Time queued) {
    const PsChunk& chunk = env_.table->layers[post.layer].chunks[static_cast<size_t>(c)];
    Scheduler::Task task;
    task.priority = post.priority;
    task.bytes = chunk.length;
    task.run = [this, post, c, clock, init, queued, &chunk](std::shared_ptr<Credit> credit) {
      const LayerSpec& spec = env_.table->layers[post.layer];
      const absl::Time start = absl::Now();
      if (env_.timeline) {
        env_.timeline->Span("queue", post.layer, spec.desc.name, post.iteration, queued, start);
      }
      std::span<float> values(env_.shm->Grad(post.layer) + chunk.offset / sizeof(float),
                              chunk.length / sizeof(float));
      PushPull(env_, chunk, values, clock, init, std::move(credit),
               [this, post, c, start, &chunk](absl::Status s) {
                 const LayerSpec& layer = env_.table->layers[post.layer];
                 if (env_.timeline) {
                   env_.timeline->Span("push+pull", post.layer, layer.desc.name, post.iteration,
                                       start, absl::Now());
                 }
                 if (s.ok() && post.on_device) {
                   // The result goes back to the GPU now (before the completion, so that the
                   // layer's done event is recorded after every chunk's copy).
                   s = env_.stager->load(std::memory_order_acquire)
                           ->StageIn(post.layer, {layer.layout.grad_offset + chunk.offset,
                                                  chunk.length});
                 }
                 env_.finished(post.layer, post.iteration, c, s);
               });
    };
    return task;
  }

  SyncEnv& env_;
  std::vector<uint64_t> clocks_;  // per layer: PS iterations started (main thread)
};

}  // namespace

std::unique_ptr<Syncer> MakePsSyncer(SyncEnv& env) {
  return std::make_unique<PsSyncer>(env);
}

}  // namespace poseidon::agent
