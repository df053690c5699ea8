#include "agent/syncer.h"

#include "agent/telemetry_reporter.h"
#include "common/bf16.h"
#include "common/log.h"

namespace poseidon::agent {

const std::vector<SyncerRow>& SyncerTable() {
  static const std::vector<SyncerRow> table = {
      {SyncerKind::kPs, "ps", &MakePsSyncer},
      {SyncerKind::kSfb, "sfb", &MakeSfbSyncer},
      {SyncerKind::kBucket, "bucket", &MakeBucketSyncer},
      {SyncerKind::kAllreduce, "allreduce", &MakeAllreduceSyncer},
  };
  return table;
}

void PeerGate::MarkReady(uint32_t rank) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (rank < ready_.size()) ready_[rank] = true;
  }
  cv_.notify_all();
}

std::vector<uint32_t> PeerGate::Wait(uint32_t me, absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto missing = [&] {
    std::vector<uint32_t> out;
    for (uint32_t p = 0; p < ready_.size(); ++p) {
      if (p != me && !ready_[p]) out.push_back(p);
    }
    return out;
  };
  cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
               [&] { return stopping_ || missing().empty(); });
  return missing();
}

void PeerGate::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

void PushPull(SyncEnv& env, const PsChunk& chunk, std::span<float> values, uint64_t clock,
              bool init, std::shared_ptr<Credit> credit, std::function<void(absl::Status)> done) {
  server::KvClient& kv = *env.servers[chunk.server];
  const uint32_t server = chunk.server;
  const auto wire = env.bf16.find(chunk.key);
  Bf16Wire* bf16 = wire == env.bf16.end() ? nullptr : wire->second.get();
  const uint64_t bytes = bf16 != nullptr ? chunk.length / 2 : chunk.length;
  std::optional<server::Ticket> push;
  server::Ticket pull;
  if (bf16 != nullptr) {
    // Encoded with error feedback; the answer lands in the pull buffer and is decoded into the
    // gradient before the layer is told (a sum-rule key: no initial push).
    EncodeBf16WithFeedback(values, bf16->residual, bf16->push);
    push = kv.PushBytes(chunk.key, clock, std::as_bytes(std::span(bf16->push)));
    pull = kv.PullBytes(chunk.key, clock, std::as_writable_bytes(std::span(bf16->pull)),
                        env.config->sync_timeout);
  } else {
    if (!init || env.config->rank == 0) push = kv.Push(chunk.key, clock, values, init);
    // The pull's answer overwrites the gradient in place: the server answers only once every
    // rank's push of this clock, ours included, has been received.
    pull = kv.Pull(chunk.key, clock, values, env.config->sync_timeout);
  }
  SyncEnv* e = &env;
  if (push) {
    kv.OnDone(*push, [e, credit, server, bytes, key = chunk.key](absl::Status pushed) {
      if (pushed.ok()) {
        if (e->metrics.push_bytes[server]) e->metrics.push_bytes[server]->Increment(bytes);
        if (e->telemetry) e->telemetry->AddServerBytes(server, bytes, 0);
      } else {
        // The pull fails too (the server never gets our push); say why now.
        PSD_LOG_ERROR("push of key {} to server {}: {}", key, server, pushed.message());
      }
      credit->Park();  // our part is on the server: what is left waits for the other ranks
    });
  } else {
    credit->Park();
  }
  kv.OnDone(pull, [e, credit = std::move(credit), server, bytes, bf16, values,
                   done = std::move(done)](absl::Status s) mutable {
    if (s.ok() && bf16 != nullptr) DecodeBf16(bf16->pull, values);
    if (s.ok()) {
      if (e->metrics.pull_bytes[server]) e->metrics.pull_bytes[server]->Increment(bytes);
      if (e->telemetry) e->telemetry->AddServerBytes(server, 0, bytes);
    }
    credit.reset();  // the transfer is complete: the next task may start
    done(s);
  });
}

}  // namespace poseidon::agent
