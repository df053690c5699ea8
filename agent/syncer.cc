#include "agent/syncer.h"

#include <algorithm>
#include <limits>

#include "agent/telemetry_reporter.h"
#include "common/wire_codec.h"
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

uint32_t Replication::Epoch(uint32_t primary) const {
  return replicas == 0 ? 0 : epoch[primary].load(std::memory_order_acquire);
}

uint32_t Replication::ServerAt(uint32_t primary, uint32_t e) const {
  if (replicas == 0) return primary;
  // The ring from the first primary on, then the servers that joined (in join order).
  return e < servers ? static_cast<uint32_t>((primary + e) % servers) : e;
}

const std::string& SyncEnv::ServerAddress(uint32_t s) const {
  return s < config->servers.size() ? config->servers[s]
                                    : joined.addresses[s - config->servers.size()];
}

bool Replication::Lost(server::KvClient& lost, const absl::Status& why) const {
  // A lost connection (the server died, closed, or went silent), a fenced server (a backup
  // took its keys over) or one that holds no copy (NotFound: a standby no primary gave the keys
  // to, as when it had no room for them, or a server that lost its state): the next server of
  // the chain holds every clock answered (a backup from the start, or one that adopted the keys
  // when the primary gave up a backup); at the chain's end the error stands. Any other error is
  // the server's answer (a gone rank, a timeout) and stands.
  return replicas > 0 && !stopping.load(std::memory_order_acquire) &&
         (lost.Broken() || absl::IsAborted(why) || absl::IsNotFound(why));
}

bool Replication::AwaitsJoin(const SyncEnv& env, uint32_t e, server::KvClient& lost,
                             const absl::Status& why) const {
  const uint32_t taken = env.joined.Count();
  return Lost(lost, why) && e + 1 >= servers + taken &&
         env.joined.announced.load(std::memory_order_acquire) > taken &&
         !env.joined.stuck.load(std::memory_order_acquire);
}

void JoinedServers::Park(uint32_t seen, std::function<void()> retry) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (Count() == seen && !stuck.load(std::memory_order_acquire)) {
      parked_.push_back(std::move(retry));
      return;
    }
  }
  retry();
}

void JoinedServers::Unpark() {
  std::vector<std::function<void()>> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready.swap(parked_);
  }
  for (auto& retry : ready) retry();
}

bool Replication::Failover(const SyncEnv& env, uint32_t primary, uint32_t e,
                           server::KvClient& lost, const absl::Status& why) {
  if (e + 1 >= servers + env.joined.Count() || !Lost(lost, why)) return false;
  uint32_t expected = e;
  if (epoch[primary].compare_exchange_strong(expected, e + 1, std::memory_order_acq_rel)) {
    const uint32_t next = ServerAt(primary, e + 1);
    PSD_LOG_WARN("the keys first held by server {} ({}) move to server {} ({}), epoch {}: {}",
                 primary, env.ServerAddress(primary), next, env.ServerAddress(next), e + 1,
                 why.message());
  }
  return true;
}

namespace {

// One PushPull, re-sent to the next server of its keys' chain when the one it went to is lost.
struct PushPullOp {
  SyncEnv* env;
  const PsChunk* chunk;
  std::span<float> values;
  uint64_t clock;
  bool init;
  std::shared_ptr<Credit> credit;
  std::function<void(absl::Status)> done;
  LossyWire* lossy;
  // A re-send whose earlier answer had begun to overwrite `values` (the lost server had
  // completed the clock, so its backup holds it): pushed with kFlagReplay, never summed.
  bool replay = false;
  // A lossy key's push of this clock is float32 (the key fell back).
  bool exact_push = false;
};

// A pull's answer (or failure) on a transport thread: done, sent on along the chain, or parked
// until a joined server is taken up.
void Pulled(SyncEnv* e, std::shared_ptr<PushPullOp> op, uint32_t epoch, uint32_t server,
            uint64_t bytes, std::shared_ptr<server::KvClient> kv, absl::Status s);

void Attempt(std::shared_ptr<PushPullOp> op) {
  SyncEnv& env = *op->env;
  const PsChunk& chunk = *op->chunk;
  const uint32_t epoch = env.replication.Epoch(chunk.server);
  const uint32_t server = env.replication.ServerAt(chunk.server, epoch);
  std::shared_ptr<server::KvClient> kv = env.ServerPtr(server);
  const bool pushes = !op->init || env.config->rank == 0;
  // A lossy key's push goes as 16 bits until it falls back (PushPull decided, once per clock).
  const bool sixteen = op->lossy != nullptr && !op->exact_push;
  const uint64_t bytes = sixteen ? chunk.length / 2 : chunk.length;
  std::optional<server::Ticket> push;
  server::Ticket pull;
  if (op->lossy != nullptr) {
    // Encoded with error feedback (once: a re-send sends the same bytes), or float32 after a
    // fallback (kFlagExactWire); the answer, 16-bit or float32 (the key fell back), lands in
    // the gradient's buffer and is decoded there before the layer is told (a sum-rule key: no
    // initial push).
    push = sixteen ? kv->PushBytes(chunk.key, op->clock, std::as_bytes(std::span(op->lossy->push)),
                                   epoch, false, op->replay)
                   : kv->PushBytes(chunk.key, op->clock, std::as_bytes(op->values), epoch, false,
                                   op->replay, /*exact_wire=*/true);
    pull = kv->PullBytes(chunk.key, op->clock, std::as_writable_bytes(op->values),
                         env.config->sync_timeout, epoch, chunk.length / 2,
                         &op->lossy->received);
  } else {
    if (pushes) {
      // A re-send pushes `values` again: the server answers a clock only once every rank's
      // push of it is in (and, replicated, on the backups), so until an answer begins to arrive
      // they still hold our gradient.
      push = kv->PushBytes(chunk.key, op->clock, std::as_bytes(op->values), epoch, op->init,
                           op->replay);
    }
    // The pull's answer overwrites the gradient in place: the server answers only once every
    // rank's push of this clock, ours included, has been received.
    pull = kv->Pull(chunk.key, op->clock, op->values, env.config->sync_timeout, epoch);
  }
  SyncEnv* e = &env;
  if (push) {
    kv->OnDone(*push, [e, op, server, bytes, kv](absl::Status pushed) {
      if (pushed.ok()) {
        if (server < e->metrics.push_bytes.size() && e->metrics.push_bytes[server]) {
          e->metrics.push_bytes[server]->Increment(bytes);
        }
        if (e->telemetry) e->telemetry->AddServerBytes(server, bytes, 0);
      } else if (e->replication.replicas == 0 || !kv->Broken()) {
        // The pull fails too (the server never gets our push); say why now.
        PSD_LOG_ERROR("push of key {} to server {}: {}", op->chunk->key, server,
                      pushed.message());
      }
      op->credit->Park();  // our part is on the server: what is left waits for the other ranks
    });
  } else {
    op->credit->Park();
  }
  kv->OnDone(pull, [e, op, epoch, server, bytes, kv](absl::Status s) {
    Pulled(e, op, epoch, server, bytes, kv, std::move(s));
  });
}

void Pulled(SyncEnv* e, std::shared_ptr<PushPullOp> op, uint32_t epoch, uint32_t server,
            uint64_t bytes, std::shared_ptr<server::KvClient> kv, absl::Status s) {
  if (!s.ok()) {
    if (e->replication.Failover(*e, op->chunk->server, epoch, *kv, s)) {
      if (s.GetPayload(server::KvClient::kAnswerStarted).has_value()) op->replay = true;
      return Attempt(op);  // only queues requests: fine on this transport thread
    }
    const uint32_t seen = e->joined.Count();
    if (e->replication.AwaitsJoin(*e, epoch, *kv, s)) {
      // The chain's last server as this agent knows it is lost, and a server that joined the
      // running job is being taken up (JoinNewServers): decided again once it is. The status
      // goes as its parts (the retry may run on another thread).
      static std::atomic<bool> said{false};
      if (!said.exchange(true)) {
        PSD_LOG_WARN("key {} clock {}: the last server of its chain ({}) is lost; waiting for "
                     "the server that joined the running job to be taken up",
                     op->chunk->key, op->clock, e->ServerAddress(server));
      }
      const bool started = s.GetPayload(server::KvClient::kAnswerStarted).has_value();
      e->joined.Park(seen, [e, op, epoch, server, bytes, kv, code = s.code(),
                            message = std::string(s.message()), started] {
        absl::Status again(code, message);
        if (started) again.SetPayload(server::KvClient::kAnswerStarted, absl::Cord("1"));
        Pulled(e, op, epoch, server, bytes, kv, std::move(again));
      });
      return;
    }
  } else {
    if (op->lossy != nullptr) {
      LossyWire& wire = *op->lossy;
      if (wire.received == op->chunk->length / 2) {
        DecodeWire16InPlace(wire.type, op->values);
      } else if (!wire.exact.exchange(true)) {
        // Another rank's guard: the server answered this clock in float32, and from the next
        // one on every rank pushes float32.
        if (e->telemetry) {
          for (uint32_t l : wire.layers) e->telemetry->LayerWireFellBack(l);
        }
        PSD_LOG_WARN("{} (key {}): the server answered clock {} in float32: another rank's "
                     "divergence guard fell back from the {} wire; float32 from now on",
                     wire.name, op->chunk->key, op->clock, WireName(wire.type));
      }
    }
    if (server < e->metrics.pull_bytes.size() && e->metrics.pull_bytes[server]) {
      e->metrics.pull_bytes[server]->Increment(bytes);
    }
    if (e->telemetry) e->telemetry->AddServerBytes(server, 0, bytes);
  }
  op->credit.reset();  // the transfer is complete: the next task may start
  auto done = std::move(op->done);
  done(s);
}

}  // namespace

absl::StatusOr<uint64_t> RestoredClock(const SyncEnv& env, const std::string& name,
                                       const std::vector<PsChunk>& chunks, bool own_clock) {
  auto clock_of = [&](uint64_t key) {
    const auto it = env.restored.find(key);
    return it == env.restored.end() ? uint64_t{0} : it->second.completed;
  };
  if (env.rejoin_top.has_value()) {
    uint64_t own = std::numeric_limits<uint64_t>::max();
    for (const PsChunk& c : chunks) own = std::min(own, clock_of(c.key));
    if (chunks.empty()) return 0;
    if (own_clock) return own == 0 ? 0 : own - 1;
    if (*env.rejoin_top == 0) return 0;
    return std::min(own, *env.rejoin_top - 1);
  }
  const uint64_t clock = chunks.empty() ? 0 : clock_of(chunks.front().key);
  for (const PsChunk& c : chunks) {
    if (clock_of(c.key) != clock) {
      return absl::FailedPreconditionError(absl::StrCat(
          name, ": its keys were restored at clocks ", clock, " and ", clock_of(c.key),
          " (key ", c.key, "): a resumed job needs every key of a layer at one clock"));
    }
  }
  return clock;
}

void PushPull(SyncEnv& env, const PsChunk& chunk, std::span<float> values, uint64_t clock,
              bool init, std::shared_ptr<Credit> credit, std::function<void(absl::Status)> done) {
  auto op = std::make_shared<PushPullOp>();
  op->env = &env;
  op->chunk = &chunk;
  op->values = values;
  op->clock = clock;
  op->init = init;
  op->credit = std::move(credit);
  op->done = std::move(done);
  const auto found = env.lossy.find(chunk.key);
  op->lossy = found == env.lossy.end() ? nullptr : found->second.get();
  if (op->lossy != nullptr) {
    LossyWire& wire = *op->lossy;
    if (!wire.exact.load(std::memory_order_acquire)) {
      EncodeWithFeedback(wire.type, values, wire.residual, wire.push);
      // The divergence guard, on sampled clocks: what goes out against the exact gradient.
      if (ShouldCheckWire(env.wire_guard, clock)) {
        const double error = RelativeWireError(wire.type, values, wire.push);
        if (WireDiverged(env.wire_guard, error)) {
          PSD_LOG_WARN("{} (key {}): the {} wire's error is {:.3g} of the gradient's norm at "
                       "clock {} (limit {}): falling back to float32 (exact) for the rest of "
                       "the job",
                       wire.name, chunk.key, WireName(wire.type), error, clock,
                       env.wire_guard.max_error);
          wire.exact.store(true, std::memory_order_release);
          if (env.telemetry) {
            for (uint32_t l : wire.layers) env.telemetry->LayerWireFellBack(l);
          }
        }
      }
      if (wire.exact.load(std::memory_order_relaxed)) {
        // This clock goes as float32: the gradient plus what earlier roundings held back
        // (decode(push) + new residual = gradient + previous residual).
        for (size_t i = 0; i < values.size(); ++i) {
          values[i] = FromWire16(wire.type, wire.push[i]) + wire.residual[i];
        }
        std::fill(wire.residual.begin(), wire.residual.end(), 0.0f);
        wire.residual_released = true;
      }
    } else if (!wire.residual_released) {
      // Fallen back by the server's float32 answer: what this rank's roundings held back goes
      // with its first float32 push.
      for (size_t i = 0; i < values.size(); ++i) values[i] += wire.residual[i];
      std::fill(wire.residual.begin(), wire.residual.end(), 0.0f);
      wire.residual_released = true;
    }
    op->exact_push = wire.exact.load(std::memory_order_acquire);
  }
  Attempt(std::move(op));
}

}  // namespace poseidon::agent
