// The fused-bucket syncer: consecutive small PS layers (LayerTable's buckets) go as one key once
// every member of the iteration is ready, and every member completes with it. Buckets are
// formed at registration from host-memory layers only (the framework marks them
// PSD_LAYER_FUSABLE); a member stays on PS whatever a later plan says.
// Thread model: Start on the main thread (the gathering state is its alone); the task on a
// scheduler worker; the completion on a transport thread.
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/syncer.h"
#include "common/status.h"
#include "agent/timeline.h"

namespace poseidon::agent {
namespace {

class BucketSyncer final : public Syncer {
 public:
  explicit BucketSyncer(SyncEnv& env) : env_(env), gathering_(env.table->buckets.size()) {}

  int Parts(uint32_t) const override { return 1; }

  absl::Status Ready() override {  // a resumed job: as PsSyncer::Ready
    for (size_t b = 0; b < gathering_.size(); ++b) {
      const BucketSpec& bucket = env_.table->buckets[b];
      ASSIGN_OR_RETURN(gathering_[b].clocks, RestoredClock(env_, bucket.name, {bucket.chunk}));
    }
    return absl::OkStatus();
  }

  void Start(const Post& post) override {
    const int b = env_.table->layers[post.layer].bucket;
    const BucketSpec& bucket = env_.table->buckets[static_cast<size_t>(b)];
    Gathering& g = gathering_[static_cast<size_t>(b)];
    if (g.iteration != post.iteration) {
      g.iteration = post.iteration;
      g.waiting = bucket.members.size();
    }
    if (--g.waiting != 0) return;
    const uint64_t count = ++g.clocks;
    const bool server_rule = env_.server_rule != 0;
    const uint64_t clock = server_rule ? count - 1 : count;
    const bool init = server_rule && clock == 0;
    Scheduler::Task task;
    task.priority =
        env_.config->priority ? env_.table->layers[bucket.members.front()].layout.priority : 0;
    task.bytes = bucket.chunk.length;
    const absl::Time queued = absl::Now();
    task.run = [this, b, iteration = post.iteration, clock, init,
                queued](std::shared_ptr<Credit> credit) {
      const BucketSpec& fused = env_.table->buckets[static_cast<size_t>(b)];
      const uint32_t first = fused.members.front();
      const absl::Time start = absl::Now();
      if (env_.timeline) {
        env_.timeline->Span("queue", first, fused.name, iteration, queued, start);
      }
      // The chunk is relative to the first member's gradient.
      std::span<float> values(env_.shm->Grad(first) + fused.chunk.offset / sizeof(float),
                              fused.chunk.length / sizeof(float));
      PushPull(env_, fused.chunk, values, clock, init, std::move(credit),
               [this, b, iteration, start](absl::Status s) {
                 const BucketSpec& done = env_.table->buckets[static_cast<size_t>(b)];
                 if (env_.timeline) {
                   env_.timeline->Span("push+pull", done.members.front(), done.name, iteration,
                                       start, absl::Now());
                 }
                 for (uint32_t m : done.members) env_.finished(m, iteration, 0, s);
               });
    };
    env_.scheduler->Submit(std::move(task));
  }

  std::string Waiting(uint32_t layer, uint64_t iteration,
                      const std::vector<uint8_t>&) const override {
    const int b = env_.table->layers[layer].bucket;
    const BucketSpec& bucket = env_.table->buckets[static_cast<size_t>(b)];
    const Gathering& g = gathering_[static_cast<size_t>(b)];
    std::string waiting =
        absl::StrCat("chunks [key ", bucket.chunk.key, " on ",
                     env_.ServerAddress(env_.replication.ServingNow(bucket.chunk.server)),
                     "] (bucket of layers ", bucket.members.front(), "..", bucket.members.back());
    if (g.iteration == iteration && g.waiting > 0) {
      absl::StrAppend(&waiting, "; ", g.waiting, " members not yet ready");
    }
    return waiting + ")";
  }

 private:
  struct Gathering {
    uint64_t iteration = 0;  // the iteration being gathered
    size_t waiting = 0;      // members of `iteration` not yet ready
    uint64_t clocks = 0;     // iterations the bucket started
  };
  SyncEnv& env_;
  std::vector<Gathering> gathering_;  // by bucket (main thread)
};

}  // namespace

std::unique_ptr<Syncer> MakeBucketSyncer(SyncEnv& env) {
  return std::make_unique<BucketSyncer>(env);
}

}  // namespace poseidon::agent
