#include "server/kv_service.h"

#include <atomic>
#include <cstring>
#include <ctime>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/log.h"
#include "server/kv_client.h"  // kMaxProbeBytes: the protocol's bound
#include "transport/error_frame.h"

namespace poseidon::server {

using transport::FrameHeader;
using transport::PeerIdentity;
using transport::FrameType;
using transport::PayloadTarget;
using transport::PeerSession;

struct KvService::PeerState {
  std::mutex mu;
  int in_flight = 0;
  bool paused = false;
  PooledBuffer push_buffer;              // the push being received
  absl::Status push_error;               // its refusal, found at its header (reading thread)
  std::vector<std::byte> small;          // pull / register payloads
  std::shared_ptr<PeerTraffic> traffic;  // shared by the peer's (job, rank) connections
  // Counted among its rank's connections (from its first frame other than a PING: an agent's
  // start-up probe connection carries PINGs only, and its close must not look like the rank's).
  std::atomic<bool> counted{false};
  std::atomic<bool> closed{false};
};

namespace {

int64_t MonotonicNs() { return static_cast<int64_t>(poseidon::MonotonicNs()); }

void Reply(const std::shared_ptr<PeerSession>& peer, const FrameHeader& request, FrameType type) {
  FrameHeader h;
  h.type = type;
  h.job_id = request.job_id;
  h.key = request.key;
  h.clock = request.clock;
  h.sequence = request.sequence;
  peer->connection().Send(h, {}, [](absl::Status) {});
}

void ReplyError(const std::shared_ptr<PeerSession>& peer, const FrameHeader& request,
                const absl::Status& status) {
  auto frame =
      std::make_shared<transport::ErrorFrame>(transport::MakeErrorFrame(request.job_id, status));
  frame->header.sequence = request.sequence;
  frame->header.clock = request.clock;
  std::vector<transport::ConstBuffer> payload;
  if (!frame->message.empty()) payload.emplace_back(std::as_bytes(std::span(frame->message)));
  peer->connection().Send(frame->header, std::move(payload), [frame](absl::Status) {});
}

}  // namespace

KvService::KvService(std::shared_ptr<KvEngine> engine, std::shared_ptr<BufferPool> pool,
                     KvServiceOptions options, std::function<absl::Status(uint64_t, uint64_t)> checkpoint)
    : engine_(std::move(engine)),
      pool_(std::move(pool)),
      options_(options),
      checkpoint_(std::move(checkpoint)) {}

std::shared_ptr<KvService::PeerState> KvService::StateOf(const std::shared_ptr<PeerSession>& peer) {
  auto state = peer->handler_state<PeerState>();
  if (!state) {
    state = std::make_shared<PeerState>();
    {
      std::lock_guard<std::mutex> lock(traffic_mu_);
      TrafficEntry& entry = traffic_[{peer->identity().job_id, peer->identity().rank}];
      if (!entry.traffic) entry.traffic = std::make_shared<PeerTraffic>();
      ++entry.connections;
      state->traffic = entry.traffic;
    }
    peer->set_handler_state(state);
  }
  return state;
}

void KvService::Count(const std::shared_ptr<PeerSession>& peer, PeerState& state) {
  std::lock_guard<std::mutex> lock(traffic_mu_);
  TrafficEntry& entry = traffic_[{peer->identity().job_id, peer->identity().rank}];
  if (entry.data_connections++ == 0) {
    gone_.erase({peer->identity().job_id, peer->identity().rank});
    if (entry.gone_deadline_ns != 0) {
      PSD_LOG_INFO("job {}: rank {} rejoined from {} ({} ms after its last connection closed)",
                   peer->identity().job_id, peer->identity().rank, peer->address(),
                   (MonotonicNs() - entry.gone_since_ns) / 1'000'000);
      entry.gone_deadline_ns = 0;
    }
    engine_->RankBack(peer->identity().job_id, peer->identity().rank);
  }
  entry.address = peer->address();
  state.counted.store(true);
}

void KvService::OnClose(const std::shared_ptr<PeerSession>& peer, const absl::Status& reason) {
  const auto state = peer->handler_state<PeerState>();
  // Never sent a frame: never counted. Closed once only.
  if (!state || state->closed.exchange(true)) return;
  const PeerIdentity& who = peer->identity();
  {
    std::lock_guard<std::mutex> lock(traffic_mu_);
    const auto it = traffic_.find({who.job_id, who.rank});
    if (it == traffic_.end()) return;
    if (it->second.connections > 0) --it->second.connections;
    // Only a connection that carried data is one of the rank's (a start-up probe's is not).
    if (!state->counted.load() || it->second.data_connections == 0 ||
        --it->second.data_connections > 0) {
      return;
    }
    // Its last connection: a rank that finished blocks nothing; one that died mid-clock would
    // leave the others waiting for their pull timeout. The engine tells them now, naming it —
    // or, when the job lets a restarted rank rejoin, once it has not within the job's timeout
    // (CheckSilence). (Under traffic_mu_, so that a reconnect's RankBack cannot overtake this.)
    if (!transport::IsServerRank(who.rank)) gone_[{who.job_id, who.rank}] = MonotonicNs();
    std::string why = absl::StrCat("rank ", who.rank, " (", peer->address(),
                                   ") is gone: its last connection to this server closed (",
                                   reason.ok() ? "by the peer" : reason.message(), ")");
    if (const absl::Duration rejoin = engine_->RejoinTimeout(who.job_id);
        rejoin > absl::ZeroDuration() && !transport::IsServerRank(who.rank)) {
      it->second.gone_silent = false;
      it->second.gone_since_ns = MonotonicNs();
      it->second.gone_deadline_ns = it->second.gone_since_ns + absl::ToInt64Nanoseconds(rejoin);
      it->second.gone_why = absl::StrCat(std::move(why), " and it did not rejoin within ",
                                         absl::FormatDuration(rejoin));
      PSD_LOG_INFO("job {}: rank {}'s last connection closed; waiting up to {} for it to rejoin",
                   who.job_id, who.rank, absl::FormatDuration(rejoin));
      return;
    }
    engine_->RankLost(who.job_id, who.rank, std::move(why));
  }
}

void KvService::CheckSilence() {
  const int64_t now = MonotonicNs();
  std::lock_guard<std::mutex> lock(traffic_mu_);
  for (auto& [who, entry] : traffic_) {
    // A rank the job waits for (its rejoin timeout): back (a connection again; a silent one
    // spoke), or given up once the timeout is over.
    if (entry.gone_deadline_ns == 0) continue;
    const bool gone = entry.gone_silent ? entry.traffic->silenced.load(std::memory_order_relaxed)
                                        : entry.data_connections == 0;
    if (!gone) {
      entry.gone_deadline_ns = 0;
    } else if (now >= entry.gone_deadline_ns) {
      entry.gone_deadline_ns = 0;
      engine_->RankLost(who.first, who.second, std::move(entry.gone_why));
    }
  }
  if (options_.peer_timeout <= absl::ZeroDuration()) return;
  const int64_t limit = absl::ToInt64Nanoseconds(options_.peer_timeout);
  for (auto& [who, entry] : traffic_) {
    PeerTraffic& t = *entry.traffic;
    if (entry.data_connections == 0 || !t.keeps_alive.load(std::memory_order_relaxed) ||
        t.silenced.load(std::memory_order_relaxed)) {
      continue;
    }
    const int64_t last = t.last_frame_ns.load(std::memory_order_relaxed);
    if (last == 0 || now - last < limit) continue;
    t.silenced.store(true, std::memory_order_relaxed);
    if (!transport::IsServerRank(who.second)) gone_[who] = now;
    std::string why =
        absl::StrCat("rank ", who.second, " (", entry.address, ") is silent: nothing on its ",
                     entry.data_connections, " connection(s) for ",
                     absl::FormatDuration(absl::Trunc(absl::Nanoseconds(now - last),
                                                      absl::Milliseconds(100))),
                     " (it pings every few seconds: frozen, or its network is cut)");
    // A frozen rank may be replaced (killed, restarted with --rejoin): waited for as a closed one.
    if (const absl::Duration rejoin = engine_->RejoinTimeout(who.first);
        rejoin > absl::ZeroDuration() && !transport::IsServerRank(who.second)) {
      entry.gone_silent = true;
      entry.gone_since_ns = now;
      entry.gone_deadline_ns = now + absl::ToInt64Nanoseconds(rejoin);
      entry.gone_why = absl::StrCat(std::move(why), ", and it did not come back within ",
                                    absl::FormatDuration(rejoin));
      PSD_LOG_INFO("job {}: rank {} is silent; waiting up to {} for it (or a replacement)",
                   who.first, who.second, absl::FormatDuration(rejoin));
      continue;
    }
    engine_->RankLost(who.first, who.second, std::move(why));
  }
}

std::map<uint64_t, std::vector<uint32_t>> KvService::RanksGone(absl::Duration within) {
  const int64_t since = MonotonicNs() - absl::ToInt64Nanoseconds(within);
  std::map<uint64_t, std::vector<uint32_t>> out;
  std::lock_guard<std::mutex> lock(traffic_mu_);
  for (auto it = gone_.begin(); it != gone_.end();) {
    if (it->second < since) {
      it = gone_.erase(it);
      continue;
    }
    out[it->first.first].push_back(it->first.second);
    ++it;
  }
  return out;
}

std::vector<PeerTrafficTotals> KvService::TakeTraffic() {
  std::vector<PeerTrafficTotals> out;
  std::lock_guard<std::mutex> lock(traffic_mu_);
  for (auto it = traffic_.begin(); it != traffic_.end();) {
    if (transport::IsServerRank(it->first.second)) {  // replication: not a rank's link
      it = it->second.connections == 0 ? traffic_.erase(it) : std::next(it);
      continue;
    }
    PeerTrafficTotals totals;
    totals.job_id = it->first.first;
    totals.rank = it->first.second;
    totals.received = it->second.traffic->received.load(std::memory_order_relaxed);
    totals.sent = it->second.traffic->sent.load(std::memory_order_relaxed);
    totals.connections = it->second.connections;
    out.push_back(totals);
    // A rank the job waits for (its rejoin timeout) is kept until it is back or given up.
    it = it->second.connections == 0 && it->second.gone_deadline_ns == 0 ? traffic_.erase(it)
                                                                         : std::next(it);
  }
  return out;
}

absl::StatusOr<PayloadTarget> KvService::OnHeader(const std::shared_ptr<PeerSession>& peer,
                                                  const FrameHeader& header) {
  auto state = StateOf(peer);
  PeerTraffic& traffic = *state->traffic;
  traffic.last_frame_ns.store(MonotonicNs(), std::memory_order_relaxed);
  if (traffic.silenced.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> lock(traffic_mu_);
    if (traffic.silenced.exchange(false)) {
      gone_.erase({peer->identity().job_id, peer->identity().rank});
      engine_->RankBack(peer->identity().job_id, peer->identity().rank);
    }
  }
  switch (header.type) {
    case FrameType::kPush: {
      if (header.payload_length == 0) return absl::InvalidArgumentError("an empty push");
      // The declared length against the key's registered size before any memory is taken: a
      // wrong one is read off the wire into nothing and answered with an error (the connection
      // lives, as for any refused push).
      if (absl::Status s = engine_->CheckPushSize(
              header.job_id, header.key, header.payload_length,
              (header.flags & transport::kFlagExactWire) != 0);
          !s.ok()) {
        state->push_error = std::move(s);
        return PayloadTarget::Discard();
      }
      state->push_buffer = pool_->Get(header.payload_length);
      if (state->push_buffer.size() != header.payload_length) {
        return absl::ResourceExhaustedError("server is out of memory for push buffers");
      }
      return PayloadTarget::Into(state->push_buffer.bytes());
    }
    case FrameType::kReplicate: {
      // Only another server of the job (it proved ServerRank's key, which no agent holds).
      if (!transport::IsServerRank(peer->identity().rank)) {
        return absl::PermissionDeniedError(absl::StrCat(
            "rank ", peer->identity().rank, " sent a REPLICATE frame: only servers replicate"));
      }
      if (absl::Status s =
              engine_->CheckReplicaSize(header.job_id, header.key, header.payload_length);
          !s.ok()) {
        state->push_error = std::move(s);
        return PayloadTarget::Discard();
      }
      state->push_buffer = pool_->Get(header.payload_length);
      if (state->push_buffer.size() != header.payload_length) {
        return absl::ResourceExhaustedError("server is out of memory for replica buffers");
      }
      return PayloadTarget::Into(state->push_buffer.bytes());
    }
    case FrameType::kPull:
      if (header.payload_length != 0 && header.payload_length != 8) {
        return absl::InvalidArgumentError("pull payload must be empty or an 8-byte timeout");
      }
      state->small.resize(header.payload_length);
      return PayloadTarget::Into(state->small);
    case FrameType::kRegisterTables:
      if (header.payload_length > options_.max_register_bytes) {
        return absl::ResourceExhaustedError(
            absl::StrCat("table registration of ", header.payload_length,
                         " bytes exceeds the maximum of ", options_.max_register_bytes));
      }
      state->small.resize(header.payload_length);
      return PayloadTarget::Into(state->small);
    case FrameType::kCheckpoint:
    case FrameType::kPing:
      // A payload is a bandwidth probe (KvClient::MeasureBandwidth): read and dropped, never
      // stored, and bounded.
      if (header.payload_length > kMaxProbeBytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a PING carries at most ", kMaxProbeBytes, " bytes (a bandwidth probe), not ",
            header.payload_length));
      }
      return PayloadTarget::Discard();
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "a KV server does not take ", transport::FrameTypeName(header.type), " frames"));
  }
}

void KvService::OnFrame(const std::shared_ptr<PeerSession>& peer, const FrameHeader& header,
                        transport::MutableBuffer payload) {
  auto state = StateOf(peer);
  // A server replicating to us is not one of the job's ranks: never counted (nor lost).
  if (header.type != FrameType::kPing && !state->counted.load(std::memory_order_relaxed) &&
      !transport::IsServerRank(peer->identity().rank)) {
    Count(peer, *state);
  }
  switch (header.type) {
    case FrameType::kPush: {
      if (!state->push_error.ok()) {
        ReplyError(peer, header, state->push_error);
        state->push_error = absl::OkStatus();
        return;
      }
      {
        std::lock_guard<std::mutex> lock(state->mu);
        if (++state->in_flight >= options_.max_pushes_in_flight && !state->paused) {
          state->paused = true;
          peer->PauseReading();
        }
      }
      state->traffic->received.fetch_add(header.payload_length, std::memory_order_relaxed);
      const int max = options_.max_pushes_in_flight;
      engine_->Push(RequestContext{peer, header, state->traffic}, std::move(state->push_buffer),
                    [state, peer, max] {
                      bool resume = false;
                      {
                        std::lock_guard<std::mutex> lock(state->mu);
                        --state->in_flight;
                        if (state->paused && state->in_flight < max) {
                          state->paused = false;
                          resume = true;
                        }
                      }
                      if (resume) peer->ResumeReading();
                    });
      return;
    }
    case FrameType::kReplicate: {
      if (!state->push_error.ok()) {
        ReplyError(peer, header, state->push_error);
        state->push_error = absl::OkStatus();
        return;
      }
      state->traffic->received.fetch_add(header.payload_length, std::memory_order_relaxed);
      engine_->Replicate(RequestContext{peer, header, state->traffic},
                         std::move(state->push_buffer), [] {});
      return;
    }
    case FrameType::kPull: {
      absl::Duration timeout = absl::InfiniteDuration();
      if (payload.size() == 8) {
        uint64_t ms = 0;
        for (int i = 0; i < 8; ++i) ms |= uint64_t{std::to_integer<uint8_t>(payload[i])} << (8 * i);
        timeout = absl::Milliseconds(static_cast<int64_t>(std::min<uint64_t>(ms, 1ull << 40)));
      }
      if (timeout == absl::InfiniteDuration()) timeout = absl::Seconds(30);
      engine_->Pull(RequestContext{peer, header, state->traffic}, timeout);
      return;
    }
    case FrameType::kRegisterTables: {
      v1::RegisterTablesRequest request;
      if (!request.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
        ReplyError(peer, header, absl::InvalidArgumentError("malformed table registration"));
        return;
      }
      // A replacement's readmission (the world grows again) is that rank's registration plus
      // the clock it counts from: the job's spec is the request without it.
      const uint64_t readmit_from = request.readmit_from();
      request.clear_readmit_from();
      absl::Status s = engine_->RegisterJob(header.job_id, request);
      absl::StatusOr<std::vector<KeyProgress>> progress;
      if (s.ok() && readmit_from != 0) {
        const uint32_t rank = peer->identity().rank;
        progress = transport::IsServerRank(rank)
                       ? absl::PermissionDeniedError("a KV server cannot be readmitted to a job")
                       : engine_->Readmit(header.job_id, rank, readmit_from, request);
        s = progress.status();
      } else if (s.ok()) {
        progress = engine_->KeyProgressOf(header.job_id, request);
      }
      if (s.ok()) {
        // The answer: every key's progress, in request order (docs/wire.md; all 0 but for a
        // resumed job), from which the agents' clocks and wires go on.
        auto clocks = std::make_shared<std::vector<KeyProgress>>(*std::move(progress));
        FrameHeader h;
        h.type = FrameType::kRegisterTablesAck;
        h.job_id = header.job_id;
        h.sequence = header.sequence;
        h.key = engine_->RankRemoved(header.job_id, peer->identity().rank) ? kRankRemoved : 0;
        h.payload_length = clocks->size() * sizeof(KeyProgress);
        std::vector<transport::ConstBuffer> answer;
        if (!clocks->empty()) answer.emplace_back(std::as_bytes(std::span(*clocks)));
        peer->connection().Send(h, std::move(answer), [clocks](absl::Status) {});
      } else {
        ReplyError(peer, header, s);
      }
      return;
    }
    case FrameType::kCheckpoint: {
      if (!checkpoint_) {
        ReplyError(
            peer, header,
            absl::FailedPreconditionError("this server has no checkpoint directory configured"));
        return;
      }
      // Writing may wait for a clock boundary: never block the I/O thread on it.
      std::thread([checkpoint = checkpoint_, peer, header] {
        // clock 0: at the next clock boundary; else an agent's "every key's completed state
        // now, after my iteration `clock`" (KvEngine::SnapshotCompleted).
        const absl::Status s = checkpoint(header.job_id, header.clock);
        if (s.ok()) {
          Reply(peer, header, FrameType::kCheckpointAck);
        } else {
          ReplyError(peer, header, s);
        }
      }).detach();
      return;
    }
    case FrameType::kPing:
      if (header.payload_length == 0) state->traffic->keeps_alive.store(true, std::memory_order_relaxed);
      Reply(peer, header, FrameType::kPong);
      return;
    default:
      return;
  }
}

}  // namespace poseidon::server
