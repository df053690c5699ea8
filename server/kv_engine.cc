#include "server/kv_engine.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <latch>
#include <limits>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/wire_codec.h"
#include "proto/wire_type.h"
#include "common/log.h"
#include "common/status.h"
#include "server/update_rules.h"
#include "transport/error_frame.h"

namespace poseidon::server {

using transport::FrameHeader;
using transport::FrameType;

namespace {

// A table's wire type (float32 for an unknown one: ValidateSpec refuses those first).
WireType WireOfTable(const v1::KvTableSpec& t) {
  return WireFromProto(t.wire_type()).value_or(WireType::kF32);
}

void SendError(const RequestContext& ctx, const absl::Status& status) {
  auto frame =
      std::make_shared<transport::ErrorFrame>(transport::MakeErrorFrame(ctx.header.job_id, status));
  frame->header.sequence = ctx.header.sequence;
  frame->header.clock = ctx.header.clock;
  std::vector<transport::ConstBuffer> payload;
  if (!frame->message.empty()) payload.emplace_back(std::as_bytes(std::span(frame->message)));
  ctx.peer->connection().Send(frame->header, std::move(payload), [frame](absl::Status) {});
}

void SendReply(const RequestContext& ctx, FrameType type, std::span<const std::byte> payload,
               uint8_t flags = 0) {
  FrameHeader h;
  h.type = type;
  h.flags = flags;
  h.job_id = ctx.header.job_id;
  h.epoch = ctx.header.epoch;
  h.key = ctx.header.key;
  h.clock = ctx.header.clock;
  h.sequence = ctx.header.sequence;
  h.payload_length = payload.size_bytes();
  std::vector<transport::ConstBuffer> buffers;
  if (!payload.empty()) buffers.emplace_back(payload);
  // The payload is the key's own result/parameter buffer, sent without a copy. Under BSP it
  // cannot change before this send completes: the next clock completes only after every rank,
  // this one included, has received this response and pushed again.
  ctx.peer->connection().Send(h, std::move(buffers), [peer = ctx.peer](absl::Status) {});
}

std::string RankList(const std::vector<uint8_t>& pushed) {
  std::vector<size_t> missing;
  for (size_t r = 0; r < pushed.size(); ++r) {
    if (!pushed[r]) missing.push_back(r);
  }
  return absl::StrJoin(missing, ", ");
}

// A checkpoint at a clock boundary being collected from the keys of one job.
struct PendingSnapshot {
  JobSnapshot snapshot;
  size_t expected_keys = 0;
  std::vector<std::function<void(absl::StatusOr<JobSnapshot>)>> waiters;
};

}  // namespace

// Shared by the keys of one job (across workers); touched only when a snapshot is pending.
struct JobState {
  uint64_t job_id = 0;
  v1::RegisterTablesRequest spec;
  size_t total_keys = 0;
  std::mutex mu;
  std::map<uint64_t, PendingSnapshot> snapshots;  // by target clock
  std::atomic<bool> any_pending{false};
  // Ranks gone from this server (their last connection closed), with why; under mu. any_lost
  // lets the data path skip the lock while every rank is here.
  std::map<uint32_t, std::string> lost;
  std::atomic<bool> any_lost{false};
  // Ranks removed from the job (spec.min_workers: the world shrank), with why; under mu.
  std::map<uint32_t, std::string> removed;
  std::map<uint32_t, uint64_t> readmitted;  // the clock each rank was last readmitted from
  // Replication (spec.replicas > 0): every server's address, this one's index; under mu, the
  // epochs this server was promoted to and the backups it gave up, each logged once.
  std::vector<std::string> servers;
  uint32_t self = 0;
  std::set<std::pair<uint32_t, uint32_t>> promotions_logged;  // (first primary, epoch)
  std::set<uint32_t> backups_lost;
  std::set<uint32_t> fenced_by;  // the servers that took keys over from this one
  std::set<uint32_t> adoptions_logged;  // first primaries whose keys this server adopted
  // Adoption takes memory (--max_memory) for all the standby keys of one first primary at once,
  // at the first of them: the agents move every key of one first primary together (one epoch),
  // so a server holds all of them or none. By first primary, under mu: the bytes, and whether
  // they were reserved (false: refused, no room).
  struct AdoptionRoom {
    uint64_t bytes = 0;
    bool reserved = false;
  };
  std::map<uint32_t, AdoptionRoom> adoption_room;
  // Replication: the tables this server stands by for (RegisterTablesRequest.standby_tables)
  // and the registration without any tables (what an adopted key is made from); set at
  // registration, then only read.
  std::vector<v1::KvTableSpec> standby_tables;
  v1::RegisterTablesRequest standby_spec;
  // Restored from a checkpoint and not registered since (under KvEngine::jobs_mu_): the first
  // registration may name the servers at new addresses (a resumed job's servers listen afresh).
  bool awaiting_addresses = false;
  std::string Server(uint32_t index) const {
    return index < servers.size() ? absl::StrCat("server ", index, " (", servers[index], ")")
                                  : absl::StrCat("server ", index);
  }
};

struct KvEngine::Key {
  std::shared_ptr<JobState> job;
  uint64_t key = 0;
  std::string table;
  size_t elements = 0;
  uint32_t workers = 1;
  float grad_scale = 1.0f;
  v1::UpdateRule rule = v1::UPDATE_RULE_SUM;
  std::unique_ptr<Optimizer> optimizer;
  bool init_pushed = false;  // initial value comes from rank 0
  bool initialized = true;
  std::vector<float> params, agg, result;
  // A server-side rule in a job that lets a rank rejoin (rejoin_timeout_ms): the parameters
  // before the latest completed clock's update, answered to a pull of that clock minus one (a
  // rejoining rank re-reads the parameters the iteration in flight was computed from, when its
  // key has moved on already). Empty otherwise.
  std::vector<float> prev_params;
  uint64_t prev_clock = std::numeric_limits<uint64_t>::max();  // whose parameters (none yet)
  bool HasPrevious(uint64_t clock) const { return !prev_params.empty() && prev_clock == clock; }
  // A lossy wire (bfloat16 or fp16, sum rule; common/wire_codec.h): pushes decoded into agg,
  // each result rounded into result_wire with error feedback (residual).
  WireType wire = WireType::kF32;
  std::vector<float> residual;
  std::vector<uint16_t> result_wire;
  bool LossyWire() const { return IsLossy(wire); }
  size_t WireBytes() const { return elements * WireElementBytes(wire); }
  // A lossy key that fell back to float32 (a rank pushed with kFlagExactWire): the first clock
  // whose result is float32 (0: still lossy). From then on pushes and pulls are float32.
  uint64_t exact_from = 0;
  bool ExactAt(uint64_t clock) const { return exact_from != 0 && clock >= exact_from; }
  uint64_t completed = 0;
  // Replication: the servers holding the key (indices into JobState::servers; the first primary
  // first; empty: not replicated), the assignment epoch this server knows (chain[epoch] is the
  // primary), whether a later epoch took it from this server, and the replication of the
  // completed clock in flight (its pulls wait for it).
  std::vector<uint32_t> chain;
  uint32_t epoch = 0;
  bool fenced = false;
  bool replicating = false;
  uint64_t replicating_clock = 0;
  // Every rank pushed the next clock while a replica was being sent: it completes once every
  // backup answered (the replica is sent from the key's own state, which completing changes).
  bool complete_deferred = false;
  int replicas_outstanding = 0;
  std::vector<uint8_t> backup_lost;  // by chain position: given up after a failed send
  uint32_t replicas = 0;             // the copies it keeps besides the primary's
  std::vector<size_t> round;         // the chain positions the replica in flight went to
  // Created for a REPLICATE frame that adopts it (a standby table's key), before that frame's
  // state is applied: it holds nothing yet.
  bool adopting = false;
  // The backups a primary at `epoch` replicates to: the next `replicas` servers of the chain it
  // has not given up, into `out` (reused: no allocation per clock once it has grown).
  void Backups(std::vector<size_t>& out) const {
    out.clear();
    for (size_t p = epoch + 1; p < chain.size() && out.size() < replicas; ++p) {
      if (!backup_lost[p]) out.push_back(p);
    }
  }
  uint64_t steps_wire = 0;           // the optimizer's step count as the REPLICATE frame's prefix
  std::vector<uint8_t> pushed;
  uint32_t count = 0;
  // The world shrinking (RegisterTablesRequest::min_workers): the ranks whose push each clock
  // needs, the ranks removed (by rank; empty while none is) and those whose push of the clock in
  // flight counts but who are removed from the next one on (Complete applies it). grad_scale
  // follows active when the job averages. The world growing again (readmit_from): a removed
  // rank's clock from which it counts again (0: none; Complete admits it once that clock is
  // in flight).
  uint32_t active = 1;
  bool average = false;
  std::vector<uint8_t> removed;
  std::vector<uint8_t> leaving;
  std::vector<uint64_t> join_at;
  bool Removed(uint32_t rank) const { return rank < removed.size() && removed[rank] != 0; }
  // Takes `rank` out of the ranks each clock needs (and the average's divisor).
  void Drop(uint32_t rank) {
    removed[rank] = 1;
    --active;
    if (average) grad_scale = 1.0f / static_cast<float>(active);
  }
  // Counts a removed `rank` again, from the clock in flight on.
  void Admit(uint32_t rank) {
    removed[rank] = 0;
    join_at[rank] = 0;
    ++active;
    if (average) grad_scale = 1.0f / static_cast<float>(active);
  }
  // Counts again the ranks readmitted from the clock after `completed` (or before it: a backup
  // follows the primary's clocks by replicas, an adopted key starts at the frame's clock).
  void AdmitReadmitted() {
    for (uint32_t r = 0; r < join_at.size(); ++r) {
      if (join_at[r] != 0 && join_at[r] <= completed + 1 && Removed(r)) Admit(r);
    }
  }
  void SizeMembership() {
    if (removed.empty()) {
      removed.assign(workers, 0);
      leaving.assign(workers, 0);
      join_at.assign(workers, 0);
    }
  }
  struct PendingPull {
    RequestContext ctx;
    absl::Time deadline;
  };
  std::vector<PendingPull> pulls;

  bool IsSum() const { return rule == v1::UPDATE_RULE_SUM; }
  bool Replicated() const { return !chain.empty(); }
  bool IsPrimary() const { return !Replicated() || chain[epoch] == job->self; }
  // A REPLICATE frame: sum rule: the result (and, on a lossy wire, the residual and the
  // rounded result); a server-side rule: the step count, the parameters and every state vector.
  uint64_t ReplicaBytes() const {
    if (IsSum()) return elements * (LossyWire() ? 10 : sizeof(float));
    return sizeof(uint64_t) +
           elements * sizeof(float) * (1 + static_cast<size_t>(optimizer ? optimizer->StateCount() : 0));
  }
  std::string Name() const {
    return absl::StrCat("key ", key, " (", table, ") of job ", job->job_id);
  }
  KeySnapshot Snap() const {
    KeySnapshot s;
    s.key = key;
    s.completed_clock = completed;
    s.initialized = initialized;
    s.exact_from = exact_from;
    s.params = params;
    s.result = result;
    if (optimizer) {
      s.optimizer_steps = optimizer->steps();
      for (int i = 0; i < optimizer->StateCount(); ++i) {
        auto st = optimizer->State(i);
        s.optimizer_state.emplace_back(st.begin(), st.end());
      }
    }
    return s;
  }
};

namespace {

// Why a pull of `clock` of `k` can never be answered: a rank whose push it needs is gone. Empty
// when none is (or the pull does not wait).
std::string LostBlocking(const KvEngine::Key& k, uint64_t clock);

}  // namespace

struct KvEngine::Worker {
  explicit Worker(KvEngine* e) : engine(e), thread([this] { Run(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_one();
    thread.join();
  }

  void Post(absl::AnyInvocable<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu);
      tasks.push_back(std::move(task));
    }
    cv.notify_one();
  }

  void Run() {
    std::deque<absl::AnyInvocable<void()>> batch;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu);
        const absl::Time next = NextDeadline();
        if (tasks.empty() && !stop) {
          if (next == absl::InfiniteFuture()) {
            cv.wait(lock);
          } else {
            cv.wait_for(lock, absl::ToChronoNanoseconds(
                                  std::max(next - absl::Now(), absl::ZeroDuration())));
          }
        }
        if (stop && tasks.empty()) break;
        batch.swap(tasks);
      }
      for (auto& task : batch) task();
      batch.clear();
      ExpirePulls();
    }
    // Shutting down: nobody will complete the pending pulls.
    for (auto& [id, k] : keys) {
      for (auto& p : k->pulls) {
        SendError(p.ctx, absl::UnavailableError("server is shutting down"));
      }
      k->pulls.clear();
    }
  }

  absl::Time NextDeadline() const {
    absl::Time next = absl::InfiniteFuture();
    for (const Key* k : keys_with_pulls) {
      for (const auto& p : k->pulls) next = std::min(next, p.deadline);
    }
    return next;
  }

  void ExpirePulls() {
    if (keys_with_pulls.empty()) return;
    const absl::Time now = absl::Now();
    for (Key* k : keys_with_pulls) {
      auto it = std::remove_if(k->pulls.begin(), k->pulls.end(), [&](const Key::PendingPull& p) {
        if (p.deadline > now) return false;
        engine->stats_.pull_timeouts.fetch_add(1, std::memory_order_relaxed);
        const uint64_t clock = p.ctx.header.clock;
        const std::string waiting =
            clock == 0 ? "rank 0 has not pushed the initial value"
                       : absl::StrCat("ranks [", RankList(k->pushed), "] have not pushed");
        SendError(p.ctx, absl::DeadlineExceededError(absl::StrCat(
                             "pull of ", k->Name(), " clock ", clock, " timed out: ", waiting,
                             " (server at clock ", k->completed, ")")));
        return true;
      });
      k->pulls.erase(it, k->pulls.end());
    }
    std::erase_if(keys_with_pulls, [](const Key* k) { return k->pulls.empty(); });
  }

  KvEngine* engine;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<absl::AnyInvocable<void()>> tasks;
  bool stop = false;
  // Worker-thread state.
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, std::unique_ptr<Key>> keys;
  std::vector<Key*> keys_with_pulls;
  std::thread thread;  // last: starts after everything above is constructed
};

namespace {

std::string LostBlocking(const KvEngine::Key& k, uint64_t clock) {
  JobState& j = *k.job;
  if (!j.any_lost.load(std::memory_order_acquire)) return "";
  std::lock_guard<std::mutex> lock(j.mu);
  if (clock == 0) {
    if (k.initialized) return "";
    const auto it = j.lost.find(0);
    if (it == j.lost.end()) return "";
    return absl::StrCat(it->second, "; ", k.Name(), " waits for its initial value from it");
  }
  if (clock != k.completed + 1) return "";
  for (const auto& [rank, why] : j.lost) {
    if (rank < k.pushed.size() && !k.pushed[rank]) {
      return absl::StrCat(why, "; clock ", clock, " of ", k.Name(),
                          " cannot complete without its push");
    }
  }
  return "";
}

}  // namespace

std::vector<ReplicationCounts> KvEngine::ReplicationStatus(absl::Duration timeout,
                                                           bool* complete) {
  struct Gather {
    std::mutex mu;
    std::condition_variable cv;
    size_t pending = 0;
    std::map<uint64_t, ReplicationCounts> by_job;
  };
  auto gather = std::make_shared<Gather>();
  gather->pending = workers_.size();
  for (auto& worker : workers_) {
    Worker* w = worker.get();
    w->Post([w, gather] {
      std::map<uint64_t, ReplicationCounts> mine;
      for (const auto& [id, key] : w->keys) {
        const Key& k = *key;
        if (!k.Replicated()) continue;
        ReplicationCounts& c = mine[id.first];
        c.job_id = id.first;
        if (k.fenced) continue;  // a later epoch took the key from this server
        if (!k.IsPrimary()) {
          ++c.backup_keys;
          continue;
        }
        ++c.primary_keys;
        std::vector<size_t> backups;
        k.Backups(backups);
        if (backups.size() < k.replicas) ++c.degraded_keys;
        if (k.replicating) {
          ++c.replicating_keys;
          // The live backups have the clock before the one being sent.
          c.max_backup_lag_clocks = std::max<uint64_t>(
              c.max_backup_lag_clocks,
              k.replicating_clock > 0 ? k.completed - (k.replicating_clock - 1) : 0);
        }
      }
      std::lock_guard<std::mutex> lock(gather->mu);
      for (const auto& [job, c] : mine) {
        ReplicationCounts& total = gather->by_job[job];
        total.job_id = job;
        total.primary_keys += c.primary_keys;
        total.backup_keys += c.backup_keys;
        total.degraded_keys += c.degraded_keys;
        total.replicating_keys += c.replicating_keys;
        total.max_backup_lag_clocks = std::max(total.max_backup_lag_clocks, c.max_backup_lag_clocks);
      }
      if (--gather->pending == 0) gather->cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(gather->mu);
  const bool done = gather->cv.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                                        [&] { return gather->pending == 0; });
  if (complete != nullptr) *complete = done;
  std::vector<ReplicationCounts> out;
  for (const auto& [job, c] : gather->by_job) out.push_back(c);
  return out;
}

std::shared_ptr<JobState> KvEngine::FindJob(uint64_t job_id) const {
  std::lock_guard<std::mutex> lock(jobs_mu_);
  const auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second;
}

absl::Duration KvEngine::RejoinTimeout(uint64_t job_id) const {
  std::lock_guard<std::mutex> lock(jobs_mu_);  // a resumed job's registration replaces the spec
  const auto it = jobs_.find(job_id);
  return it == jobs_.end() ? absl::ZeroDuration()
                           : absl::Milliseconds(it->second->spec.rejoin_timeout_ms());
}

void KvEngine::RankLost(uint64_t job_id, uint32_t rank, std::string why) {
  const std::shared_ptr<JobState> job = FindJob(job_id);
  if (job == nullptr) return;
  uint32_t workers = 0, min_workers = 0;
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);  // a resumed job's registration replaces the spec
    workers = job->spec.num_workers();
    min_workers = job->spec.min_workers();
  }
  {
    std::lock_guard<std::mutex> lock(job->mu);
    if (job->removed.contains(rank)) return;
    const auto left = static_cast<uint32_t>(workers - job->removed.size() - 1);
    if (min_workers > 0 && rank < workers && left >= min_workers) {
      PSD_LOG_WARN("job {}: {}: it is removed, the job goes on with {} of its {} workers "
                   "(min_workers {}); each key completes its clocks without it from the first "
                   "one it did not push",
                   job_id, why, left, workers, min_workers);
      job->removed[rank] = std::move(why);
      job->lost.erase(rank);
      job->any_lost.store(!job->lost.empty(), std::memory_order_release);
      for (auto& worker : workers_) {
        Worker* w = worker.get();
        w->Post([this, w, job_id, rank] {
          for (auto& [id, key] : w->keys) {
            if (id.first == job_id) RemoveRank(*w, *key, rank);
          }
        });
      }
      return;
    }
    if (min_workers > 0 && rank < workers) {
      why = absl::StrCat(why, " (the job cannot go on without it: ", left,
                         " ranks would be left, its min_workers is ", min_workers, ")");
    }
    job->lost[rank] = std::move(why);
    job->any_lost.store(true, std::memory_order_release);
  }
  for (auto& worker : workers_) {
    Worker* w = worker.get();
    w->Post([this, w, job_id] {
      size_t failed = 0;
      std::string first;
      for (auto& [id, key] : w->keys) {
        if (id.first != job_id || key->pulls.empty()) continue;
        const Key& k = *key;
        std::erase_if(key->pulls, [&](const Key::PendingPull& p) {
          const std::string blocked = LostBlocking(k, p.ctx.header.clock);
          if (blocked.empty()) return false;
          if (first.empty()) first = blocked;
          ++failed;
          stats_.request_errors.fetch_add(1, std::memory_order_relaxed);
          SendError(p.ctx, absl::UnavailableError(blocked));
          return true;
        });
      }
      std::erase_if(w->keys_with_pulls, [](const Key* k) { return k->pulls.empty(); });
      if (failed > 0) PSD_LOG_WARN("{} waiting pulls of job {} failed: {}", failed, job_id, first);
    });
  }
}

void KvEngine::RemoveRank(Worker& w, Key& k, uint32_t rank) {
  if (rank >= k.workers) return;
  k.SizeMembership();
  k.join_at[rank] = 0;  // a readmission still pending is off: it died again
  if (k.Removed(rank) || k.leaving[rank]) return;
  if (k.pushed[rank]) {  // its push of the clock in flight counts; removed from the next on
    k.leaving[rank] = 1;
    return;
  }
  k.Drop(rank);
  // Every rank left pushed the clock in flight already: it completes now.
  if (k.count > 0 && !k.complete_deferred) CompleteIfEveryRankPushed(w, k);
}

// A removed rank's replacement is counted again from clock `from` (see the proto's
// readmit_from). On the key's worker; the clock in flight is completed + 1.
void KvEngine::ReadmitRank(Worker& w, Key& k, uint32_t rank, uint64_t from) {
  if (rank >= k.workers || k.completed >= from) return;  // too late: the answer says so
  k.SizeMembership();
  const uint64_t in_flight = k.completed + 1;
  if (!k.Removed(rank)) {
    // A member of the clock in flight (never removed on this server — its rejoin timeout had
    // not run out here — or readmitted from it by an earlier try of this replacement), or one
    // whose push of it counts and who leaves after it.
    if (from == in_flight) {
      k.leaving[rank] = 0;  // stays: the replacement pushes this clock (again)
      k.join_at[rank] = 0;
      return;
    }
    if (k.pushed[rank] || k.leaving[rank]) {
      k.leaving[rank] = 1;  // its push of the clock in flight counts; out until `from`
    } else {
      k.Drop(rank);  // out until `from`: the clock in flight completes without it
    }
  }
  k.join_at[rank] = from;
  if (k.Removed(rank) && from == in_flight) {
    k.Admit(rank);
  } else if (k.count > 0 && !k.complete_deferred) {
    CompleteIfEveryRankPushed(w, k);
  }
}

absl::StatusOr<std::vector<KeyProgress>> KvEngine::Readmit(uint64_t job_id, uint32_t rank,
                                                           uint64_t from,
                                                           const v1::RegisterTablesRequest& spec) {
  const std::shared_ptr<JobState> job = FindJob(job_id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("no job ", job_id, " on this server"));
  uint32_t workers = 0, min_workers = 0;
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    workers = job->spec.num_workers();
    min_workers = job->spec.min_workers();
  }
  if (min_workers == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " cannot shrink or grow (min_workers 0): rank ", rank,
        " has no place to be readmitted to (a replacement rejoins without readmit_from)"));
  }
  if (rank >= workers || from == 0) {
    return absl::InvalidArgumentError(absl::StrCat("readmission of rank ", rank, " from clock ",
                                                   from, " in a job of ", workers, " workers"));
  }
  // A replacement picks the highest completed clock it was told plus 2 (Agent::ReadmitToJob):
  // the keys of the layers posted every iteration are at most 3 behind it. A key further behind
  // (a layer not posted lately) counts the rank from its own next clock, which the rank's
  // first push of it is.
  if (from > std::numeric_limits<uint64_t>::max() / 2) {
    return absl::InvalidArgumentError(absl::StrCat("readmission of rank ", rank, " from clock ",
                                                   from, ": out of range"));
  }
  std::vector<uint64_t> keys;
  for (const auto& t : spec.tables()) {
    for (const auto& k : t.keys()) keys.push_back(k.key());
  }
  const size_t held = keys.size();
  // The keys this server adopted (a standby table's) count the rank again too, as the backups
  // held from the start do; the answer has their progress after the held tables' keys', as a
  // registration's (KeyProgressOf), and "too late" is of the held tables' keys.
  for (const auto& t : spec.standby_tables()) {
    for (const auto& k : t.keys()) keys.push_back(k.key());
  }
  std::vector<KeyProgress> progress(keys.size());
  RunOnAllWorkers([&](Worker& w) {  // each worker its own keys, as KeyProgressOf
    for (size_t i = 0; i < keys.size(); ++i) {
      if (&WorkerFor(job_id, keys[i]) != &w) continue;
      if (auto it = w.keys.find({job_id, keys[i]}); it != w.keys.end()) {
        Key& k = *it->second;
        ReadmitRank(w, k, rank, from > k.completed + 3 ? k.completed + 1 : from);
        progress[i] = {k.completed, k.exact_from};
      }
    }
  });
  // (A server that holds no table of the job, only standby ones, takes it: keys it adopts later
  // count the rank from `from`.)
  const auto held_end = progress.begin() + static_cast<std::ptrdiff_t>(held);
  if (held != 0 && std::none_of(progress.begin(), held_end,
                                [&](const KeyProgress& p) { return p.completed < from; })) {
    return progress;  // too late everywhere: the replacement asks again from a later clock
  }
  std::lock_guard<std::mutex> lock(job->mu);
  const bool was_removed = job->removed.erase(rank) > 0;
  if (job->lost.erase(rank) > 0) job->any_lost.store(!job->lost.empty(), std::memory_order_release);
  if (auto [it, fresh] = job->readmitted.try_emplace(rank, from); !fresh) {
    if (it->second == from) return progress;  // asked again (the replacement waits): logged
    it->second = from;
  }
  PSD_LOG_WARN("job {}: rank {} {} readmitted: each key counts it again from clock {} on (the "
               "job grows to {} of its {} workers)",
               job_id, rank, was_removed ? "was removed and is" : "is", from,
               workers - job->removed.size(), workers);
  return progress;
}

bool KvEngine::RankRemoved(uint64_t job_id, uint32_t rank) const {
  const std::shared_ptr<JobState> job = FindJob(job_id);
  if (job == nullptr) return false;
  std::lock_guard<std::mutex> lock(job->mu);
  return job->removed.contains(rank);
}

void KvEngine::RankBack(uint64_t job_id, uint32_t rank) {
  const std::shared_ptr<JobState> job = FindJob(job_id);
  if (job == nullptr) return;
  std::lock_guard<std::mutex> lock(job->mu);
  if (job->lost.erase(rank) > 0) job->any_lost.store(!job->lost.empty(), std::memory_order_release);
}

namespace {
// The servers the chains of a replicated job go round (RegisterTablesRequest.ring_servers).
uint32_t RingOf(const v1::RegisterTablesRequest& spec) {
  return spec.ring_servers() != 0 ? spec.ring_servers()
                                  : static_cast<uint32_t>(spec.servers_size());
}
// Where server `index` is in the chain of the keys first held by `primary`: its place in the
// ring from the primary on, or after the ring (a server that joined the running job).
uint32_t ChainPosition(const v1::RegisterTablesRequest& spec, uint32_t index, uint32_t primary) {
  const uint32_t ring = RingOf(spec);
  return index < ring ? (index + ring - primary) % ring : index;
}
// The chain of the keys first held by `primary`: every server of the ring from it on, then the
// servers that joined the running job, in order (ChainPosition's inverse).
std::vector<uint32_t> ChainOf(const v1::RegisterTablesRequest& spec, uint32_t primary) {
  const uint32_t ring = RingOf(spec);
  std::vector<uint32_t> chain;
  for (uint32_t i = 0; i < ring; ++i) chain.push_back((primary + i) % ring);
  for (auto i = ring; i < static_cast<uint32_t>(spec.servers_size()); ++i) chain.push_back(i);
  return chain;
}

// The memory a key of table `t` takes on a server that holds it (--max_memory counts it): per
// element, the aggregation buffer plus the result (sum) or the parameters and the optimizer's
// state.
uint64_t KeyMemory(const v1::KvTableSpec& t, const v1::RegisterTablesRequest& spec,
                   uint64_t elements) {
  const v1::UpdateRule rule = t.update_rule().rule();
  // A lossy wire: a residual (a float each) and the encoded result (half a float each) besides.
  const bool server_rule = rule != v1::UPDATE_RULE_SUM && rule != v1::UPDATE_RULE_UNSPECIFIED;
  // A server-side rule of a job that lets ranks rejoin keeps the parameters of the clock
  // before too (Key::prev_params).
  const uint64_t copies = (rule == v1::UPDATE_RULE_ADAM       ? 4
                           : rule == v1::UPDATE_RULE_MOMENTUM ? 3
                           : IsLossy(WireOfTable(t))          ? 4
                                                              : 2) +
                          (server_rule && spec.rejoin_timeout_ms() > 0 ? 1 : 0);
  return elements * sizeof(float) * copies;
}

// Validates a registration and returns the memory its held tables need.
absl::StatusOr<uint64_t> ValidateSpec(const v1::RegisterTablesRequest& spec,
                                      const EngineOptions& options) {
  uint64_t bytes = 0;
  if (spec.num_workers() == 0 || spec.num_workers() > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers must be in [1, 65536], got ", spec.num_workers()));
  }
  if (spec.consistency().model() == v1::CONSISTENCY_MODEL_SSP) {
    return absl::UnimplementedError(
        "SSP consistency is not supported by this server yet (BSP only)");
  }
  if (spec.tables_size() == 0 && spec.standby_tables_size() == 0) {
    return absl::InvalidArgumentError("no tables to register");
  }
  if (spec.min_workers() > spec.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat("min_workers (", spec.min_workers(),
                                                   ") exceeds num_workers (", spec.num_workers(),
                                                   ")"));
  }
  if (spec.rejoin_timeout_ms() > 3'600'000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rejoin_timeout_ms must be at most an hour (3600000), got ", spec.rejoin_timeout_ms()));
  }
  absl::flat_hash_map<uint64_t, std::string> seen;
  // The tables this server holds, then those it stands by for (whose memory it takes only if
  // it adopts their keys).
  std::vector<std::pair<const v1::KvTableSpec*, bool>> all;
  for (const auto& t : spec.tables()) all.emplace_back(&t, true);
  for (const auto& t : spec.standby_tables()) all.emplace_back(&t, false);
  for (const auto& [table, held] : all) {
    const v1::KvTableSpec& t = *table;
    if (t.name().empty()) return absl::InvalidArgumentError("a table has no name");
    if (t.element_type() != v1::ELEMENT_TYPE_F32 &&
        t.element_type() != v1::ELEMENT_TYPE_UNSPECIFIED) {
      return absl::UnimplementedError(
          absl::StrCat("table ", t.name(), ": only float32 tables are supported"));
    }
    if (auto hp = HyperParamsFromSpec(t.update_rule()); !hp.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("table ", t.name(), ": ", hp.status().message()));
    }
    if (!WireFromProto(t.wire_type()).has_value()) {
      return absl::UnimplementedError(absl::StrCat(
          "table ", t.name(), ": wire type ", v1::ElementType_Name(t.wire_type()),
          " (float32, bfloat16 and float16 are supported)"));
    }
    if (IsLossy(WireOfTable(t)) &&
        t.update_rule().rule() != v1::UPDATE_RULE_SUM &&
        t.update_rule().rule() != v1::UPDATE_RULE_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table ", t.name(), ": a lossy (", WireName(WireOfTable(t)),
          ") wire needs the sum rule (pulls of a server-side "
          "rule return parameters, which must stay exact)"));
    }
    if (t.keys_size() == 0) {
      return absl::InvalidArgumentError(absl::StrCat("table ", t.name(), " has no keys"));
    }
    for (const auto& k : t.keys()) {
      if (k.elements() == 0 || k.elements() > options.max_key_bytes / sizeof(float)) {
        return absl::ResourceExhaustedError(
            absl::StrCat("table ", t.name(), " key ", k.key(), ": ", k.elements(),
                         " elements (a key may hold at most ", options.max_key_bytes, " bytes)"));
      }
      if (held) bytes += KeyMemory(t, spec, k.elements());
      if (bytes > options.max_memory_bytes) {
        return absl::ResourceExhaustedError(absl::StrCat("the tables need more than this server's ",
                                                         options.max_memory_bytes, " bytes"));
      }
      auto [it, inserted] = seen.emplace(k.key(), t.name());
      if (!inserted) {
        return absl::InvalidArgumentError(
            absl::StrCat("key ", k.key(), " appears in tables ", it->second, " and ", t.name()));
      }
    }
  }
  // Replication: this server must be in the chain of every table it is given.
  const auto n = static_cast<uint32_t>(spec.servers_size());
  if (spec.replicas() == 0) {
    if (n > 0) return absl::InvalidArgumentError("servers are listed but replicas is 0");
    if (spec.standby_tables_size() > 0) {
      return absl::InvalidArgumentError("standby tables are listed but replicas is 0");
    }
    for (const auto& t : spec.tables()) {
      if (t.primary() != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("table ", t.name(), " names a primary but replicas is 0"));
      }
    }
    return bytes;
  }
  // The servers after the ring joined the running job (ring_servers).
  if (spec.ring_servers() > n) {
    return absl::InvalidArgumentError(absl::StrCat("ring_servers ", spec.ring_servers(),
                                                   " exceeds the ", n, " servers listed"));
  }
  const uint32_t ring = RingOf(spec);
  if (spec.replicas() >= ring) {
    return absl::InvalidArgumentError(absl::StrCat(
        spec.replicas(), " replicas need more than the ", ring, " servers of the ring"));
  }
  if (spec.server_index() >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("server_index ", spec.server_index(), " is not one of the ", n, " servers"));
  }
  for (const auto& addr : spec.servers()) {
    if (addr.empty() || addr.size() > 512) {
      return absl::InvalidArgumentError("a server address is empty or longer than 512 bytes");
    }
  }
  auto position = [&](uint32_t primary) {
    return ChainPosition(spec, spec.server_index(), primary);
  };
  for (const auto& t : spec.tables()) {
    if (t.primary() >= ring) {
      return absl::InvalidArgumentError(absl::StrCat("table ", t.name(), ": primary ", t.primary(),
                                                     " is not one of the ", ring,
                                                     " servers of the ring"));
    }
    if (position(t.primary()) > spec.replicas()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table ", t.name(), ": server ", spec.server_index(), " holds no copy of it (primary ",
          t.primary(), ", ", spec.replicas(), " replicas)"));
    }
  }
  for (const auto& t : spec.standby_tables()) {
    if (t.primary() >= ring) {
      return absl::InvalidArgumentError(absl::StrCat("standby table ", t.name(), ": primary ",
                                                     t.primary(), " is not one of the ", ring,
                                                     " servers of the ring"));
    }
    if (position(t.primary()) <= spec.replicas()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "standby table ", t.name(), ": server ", spec.server_index(),
          " holds a copy of it from the start (primary ", t.primary(), ", ", spec.replicas(),
          " replicas): it belongs in tables"));
    }
  }
  return bytes;
}

}  // namespace

KvEngine::KvEngine(EngineOptions options) : options_(options) {
  const int n = std::max(1, options_.workers);
  for (int i = 0; i < n; ++i) workers_.push_back(std::make_unique<Worker>(this));
}

KvEngine::~KvEngine() {
  workers_.clear();
}

KvEngine::Worker& KvEngine::WorkerFor(uint64_t job, uint64_t key) {
  const size_t h = absl::HashOf(job, key);
  return *workers_[h % workers_.size()];
}

void KvEngine::RunOnAllWorkers(const std::function<void(Worker&)>& fn) {
  std::latch done(static_cast<std::ptrdiff_t>(workers_.size()));
  for (auto& w : workers_) {
    Worker* worker = w.get();
    worker->Post([&fn, &done, worker] {
      fn(*worker);
      done.count_down();
    });
  }
  done.wait();
}

void KvEngine::WithWorkersPaused(const std::function<void()>& fn) {
  const auto n = static_cast<std::ptrdiff_t>(workers_.size());
  std::latch arrived(n), released(1), left(n);
  for (auto& w : workers_) {
    w->Post([&] {
      arrived.count_down();
      released.wait();
      left.count_down();
    });
  }
  arrived.wait();
  fn();
  released.count_down();
  left.wait();  // the latches live on this stack
}

namespace {
// A registration with the servers' addresses left out (what a resumed job may change).
std::string WithoutAddresses(const v1::RegisterTablesRequest& spec) {
  v1::RegisterTablesRequest copy = spec;
  copy.clear_servers();
  return copy.SerializeAsString();
}
// The registration a checkpoint keeps: without the servers that joined the running job (a
// resumed job's servers start afresh, none joined; its keys' chains are the ring's), unless
// this server is one of them.
v1::RegisterTablesRequest RingOnly(const v1::RegisterTablesRequest& spec) {
  const uint32_t ring = RingOf(spec);
  if (spec.ring_servers() == 0 || spec.server_index() >= ring) return spec;
  v1::RegisterTablesRequest copy = spec;
  copy.mutable_servers()->DeleteSubrange(static_cast<int>(ring),
                                         spec.servers_size() - static_cast<int>(ring));
  copy.clear_ring_servers();
  return copy;
}
// Whether `a` is `b` with fewer (or the same) servers joined after the ring: the same job, the
// same ring, `a.servers` a prefix of `b.servers`.
bool JoinedFewer(const v1::RegisterTablesRequest& a, const v1::RegisterTablesRequest& b) {
  if (a.replicas() == 0 || RingOf(a) != RingOf(b) || a.servers_size() > b.servers_size()) {
    return false;
  }
  for (int i = 0; i < a.servers_size(); ++i) {
    if (a.servers(i) != b.servers(i)) return false;
  }
  v1::RegisterTablesRequest x = a, y = b;
  x.clear_servers();
  x.clear_ring_servers();
  y.clear_servers();
  y.clear_ring_servers();
  return x.SerializeAsString() == y.SerializeAsString();
}
}  // namespace

// Servers joined the running job (a registration whose server list extends the job's): each
// replicated key's chain goes on to them, so a primary short of backups (lost ones, none left
// to adopt its keys) gives them a copy at its next clock. Every key worker is paused while the
// job's lists and the chains change: they read them on every replica sent. Under jobs_mu_.
void KvEngine::JoinServers(JobState& job, const v1::RegisterTablesRequest& spec) {
  const size_t before = job.servers.size();
  WithWorkersPaused([&] {
    {
      std::lock_guard<std::mutex> lock(job.mu);
      job.spec = spec;
    }
    job.servers.assign(spec.servers().begin(), spec.servers().end());
    job.standby_spec.set_ring_servers(RingOf(spec));
    *job.standby_spec.mutable_servers() = spec.servers();
    for (auto& w : workers_) {
      for (auto& [id, k] : w->keys) {
        if (k->job.get() != &job || !k->Replicated()) continue;
        k->chain = ChainOf(spec, k->chain[0]);  // the same chain, longer
        k->backup_lost.resize(k->chain.size(), 0);
      }
    }
  });
  std::vector<std::string> joined;
  for (size_t i = before; i < job.servers.size(); ++i) joined.push_back(job.Server(i));
  PSD_LOG_WARN("job {}: {} joined the running job: the keys short of backups copy their state "
               "there at their next clock",
               job.job_id, absl::StrJoin(joined, ", "));
}

void KvEngine::PrepareReplicas(const JobState& job, const v1::RegisterTablesRequest& spec) {
  if (spec.replicas() == 0 || options_.replica_sender == nullptr) return;
  bool first_primary = false;
  for (const auto& t : spec.tables()) first_primary |= t.primary() == job.self && t.keys_size() > 0;
  if (!first_primary) return;
  const std::vector<uint32_t> chain = ChainOf(spec, job.self);
  for (size_t p = 1; p < chain.size() && p <= spec.replicas(); ++p) {
    if (chain[p] < job.servers.size()) {
      options_.replica_sender->Prepare(job.job_id, job.self, chain[p], job.servers[chain[p]]);
    }
  }
}

namespace {
// A key of table `t` of a job registered with `spec`, in its initial state.
std::unique_ptr<KvEngine::Key> NewKey(const std::shared_ptr<JobState>& job,
                                      const v1::RegisterTablesRequest& spec,
                                      const v1::KvTableSpec& t, const v1::KvKey& kspec) {
  auto k = std::make_unique<KvEngine::Key>();
  k->job = job;
  k->key = kspec.key();
  k->table = t.name();
  k->elements = kspec.elements();
  k->workers = spec.num_workers();
  k->active = k->workers;
  k->average = spec.average_gradients() || t.average();
  k->rule = t.update_rule().rule();
  k->grad_scale = k->average ? 1.0f / static_cast<float>(spec.num_workers()) : 1.0f;
  k->optimizer = MakeOptimizer(k->rule, *HyperParamsFromSpec(t.update_rule()), k->elements);
  k->init_pushed = t.initial_value() == v1::INITIAL_VALUE_PUSHED_BY_RANK0;
  k->initialized = !k->init_pushed;
  if (!k->IsSum()) k->params.assign(k->elements, 0.0f);
  if (!k->IsSum() && spec.rejoin_timeout_ms() > 0) k->prev_params.assign(k->elements, 0.0f);
  k->agg.assign(k->elements, 0.0f);
  if (k->IsSum()) k->result.assign(k->elements, 0.0f);
  k->wire = WireOfTable(t);
  if (k->LossyWire()) {
    k->residual.assign(k->elements, 0.0f);
    k->result_wire.assign(k->elements, 0);
  }
  k->pushed.assign(k->workers, 0);
  if (spec.replicas() > 0) {
    // The chain is every server of the ring from the first primary on, then the servers that
    // joined the running job: the first 1 + replicas hold the key from the start, the later ones
    // adopt it when a backup is given up.
    k->chain = ChainOf(spec, t.primary());
    k->backup_lost.assign(k->chain.size(), 0);
    k->replicas = spec.replicas();
  }
  return k;
}
}  // namespace

absl::Status KvEngine::RegisterJob(uint64_t job_id, const v1::RegisterTablesRequest& spec) {
  ASSIGN_OR_RETURN(const uint64_t bytes, ValidateSpec(spec, options_));
  std::lock_guard<std::mutex> lock(jobs_mu_);
  if (auto it = jobs_.find(job_id); it != jobs_.end()) {
    JobState& job = *it->second;
    if (job.spec.SerializeAsString() == spec.SerializeAsString()) {
      job.awaiting_addresses = false;
      return absl::OkStatus();
    }
    // Replacement servers joined the running job (ring_servers): a rank that has not heard of
    // them registers the list without them, one that has the list with them.
    if (!job.awaiting_addresses && JoinedFewer(spec, job.spec)) return absl::OkStatus();
    if (!job.awaiting_addresses && JoinedFewer(job.spec, spec)) {
      JoinServers(job, spec);
      return absl::OkStatus();
    }
    if (job.awaiting_addresses && WithoutAddresses(job.spec) == WithoutAddresses(spec)) {
      // A resumed job: the same tables on servers that listen at new addresses. The key workers
      // read the addresses (replication) only for this job's requests, which come after this
      // registration; the posts below order the write before them.
      job.servers.assign(spec.servers().begin(), spec.servers().end());
      job.spec = spec;
      job.awaiting_addresses = false;
      RunOnAllWorkers([](Worker&) {});
      PSD_LOG_INFO("job {} resumed: its servers are at {}", job_id,
                   absl::StrJoin(job.servers, ", "));
      PrepareReplicas(job, spec);
      return absl::OkStatus();
    }
    // Name the first difference.
    const auto& old = it->second->spec;
    if (old.rejoin_timeout_ms() != spec.rejoin_timeout_ms()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " is registered with a rejoin timeout of ", old.rejoin_timeout_ms(),
          " ms, not ", spec.rejoin_timeout_ms(),
          " (every rank's agent needs the same --rejoin_timeout)"));
    }
    if (old.min_workers() != spec.min_workers()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " is registered with min_workers ", old.min_workers(), ", not ",
          spec.min_workers(), " (every rank's agent needs the same --min_workers)"));
    }
    if (old.num_workers() != spec.num_workers()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is registered with ",
                                                        old.num_workers(), " workers, not ",
                                                        spec.num_workers()));
    }
    for (int i = 0; i < std::min(old.tables_size(), spec.tables_size()); ++i) {
      if (old.tables(i).SerializeAsString() != spec.tables(i).SerializeAsString()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job ", job_id, " table ", old.tables(i).name(), " is registered differently"));
      }
    }
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " is registered with a different table set"));
  }
  if (spec.replicas() > 0 && options_.replica_sender == nullptr) {
    return absl::FailedPreconditionError("this server cannot replicate (no replica sender)");
  }
  if (!ReserveMemory(bytes)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("job ", job_id, " needs ", bytes, " bytes of tables; this server has ",
                     MemoryLeft(), " of its ", options_.max_memory_bytes, " left"));
  }
  auto job = std::make_shared<JobState>();
  job->job_id = job_id;
  job->spec = spec;
  job->servers.assign(spec.servers().begin(), spec.servers().end());
  job->self = spec.server_index();
  for (const auto& t : spec.tables()) job->total_keys += t.keys_size();
  job->standby_tables.assign(spec.standby_tables().begin(), spec.standby_tables().end());
  job->standby_spec = spec;
  job->standby_spec.clear_tables();
  job->standby_spec.clear_standby_tables();
  jobs_[job_id] = job;
  // Create each key on its worker.
  std::latch created(static_cast<std::ptrdiff_t>(job->total_keys));
  for (const auto& t : spec.tables()) {
    for (const auto& kspec : t.keys()) {
      Worker& w = WorkerFor(job_id, kspec.key());
      w.Post([&w, &created, job, &t, kspec, &spec, job_id] {
        w.keys[{job_id, kspec.key()}] = NewKey(job, spec, t, kspec);
        created.count_down();
      });
    }
  }
  created.wait();
  auto sizes = std::make_shared<KeySizes>(*key_sizes_.load());
  // Standby keys too: a REPLICATE frame that adopts one is checked before its key exists.
  for (const auto* tables : {&spec.tables(), &spec.standby_tables()}) {
    for (int ti = 0; ti < tables->size(); ++ti) {
      const v1::KvTableSpec& t = (*tables)[ti];
      const bool lossy = IsLossy(WireOfTable(t));
      // The same count the keys' optimizers report (KvEngine::Key::ReplicaBytes).
      const std::unique_ptr<Optimizer> rule = MakeOptimizer(
          t.update_rule().rule(), *HyperParamsFromSpec(t.update_rule()), 0);
      const bool sum = rule == nullptr;
      const int states = sum ? 0 : rule->StateCount();
      for (int ki = 0; ki < t.keys_size(); ++ki) {
        const v1::KvKey& kspec = t.keys(ki);
        KeySize& size = (*sizes)[{job_id, kspec.key()}];
        if (tables == &spec.standby_tables()) size = {.standby_job = job, .table = ti, .index = ki};
        size.push = kspec.elements() * (lossy ? 2 : sizeof(float));
        size.float_push = kspec.elements() * sizeof(float);
        if (spec.replicas() > 0) {
          size.replica = sum ? kspec.elements() * (lossy ? 10 : sizeof(float))
                             : sizeof(uint64_t) + kspec.elements() * sizeof(float) * (1 + states);
        }
      }
    }
  }
  key_sizes_.store(std::shared_ptr<const KeySizes>(std::move(sizes)));
  PSD_LOG_INFO("job {} registered: {} tables, {} keys, {} workers", job_id, spec.tables_size(),
               job->total_keys, spec.num_workers());
  PrepareReplicas(*job, spec);
  return absl::OkStatus();
}

bool KvEngine::ReserveMemory(uint64_t bytes) {
  uint64_t used = used_bytes_.load(std::memory_order_relaxed);
  do {
    if (bytes > options_.max_memory_bytes || used > options_.max_memory_bytes - bytes) return false;
  } while (!used_bytes_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return true;
}

uint64_t KvEngine::MemoryLeft() const {
  const uint64_t used = used_bytes_.load(std::memory_order_relaxed);
  return used >= options_.max_memory_bytes ? 0 : options_.max_memory_bytes - used;
}

absl::Status KvEngine::CheckPushSize(uint64_t job_id, uint64_t key, uint64_t bytes,
                                     bool exact_wire) const {
  const std::shared_ptr<const KeySizes> sizes = key_sizes_.load();
  const auto it = sizes->find({job_id, key});
  if (it == sizes->end()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has no key ", key, " on this server"));
  }
  const uint64_t expected = exact_wire ? it->second.float_push : it->second.push;
  if (bytes != expected) {
    return absl::InvalidArgumentError(absl::StrCat("push for key ", key, " of job ", job_id,
                                                   " declares ", bytes, " bytes, expected ",
                                                   expected));
  }
  return absl::OkStatus();
}

absl::Status KvEngine::CheckReplicaSize(uint64_t job_id, uint64_t key, uint64_t bytes) const {
  const std::shared_ptr<const KeySizes> sizes = key_sizes_.load();
  const auto it = sizes->find({job_id, key});
  if (it == sizes->end()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has no key ", key, " on this server"));
  }
  if (it->second.replica == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("key ", key, " of job ", job_id, " is not replicated"));
  }
  if (bytes != it->second.replica) {
    return absl::InvalidArgumentError(absl::StrCat("replica of key ", key, " of job ", job_id,
                                                   " declares ", bytes, " bytes, expected ",
                                                   it->second.replica));
  }
  return absl::OkStatus();
}

template <typename Body>
void KvEngine::OnKeyWorker(RequestContext ctx, PooledBuffer data, std::function<void()> done,
                           bool adopt, Body body) {
  Worker& w = WorkerFor(ctx.header.job_id, ctx.header.key);
  w.Post([this, &w, ctx = std::move(ctx), data = std::move(data), done = std::move(done), adopt,
          body = std::move(body)]() mutable {
    const FrameHeader& h = ctx.header;
    auto fail = [&](absl::Status s) {
      stats_.request_errors.fetch_add(1, std::memory_order_relaxed);
      SendError(ctx, s);
      done();
    };
    auto it = w.keys.find({h.job_id, h.key});
    if (it == w.keys.end() && adopt) {
      absl::StatusOr<Key*> adopted = Adopt(w, h);
      if (!adopted.ok()) return fail(adopted.status());
      it = w.keys.find({h.job_id, h.key});
    }
    if (it == w.keys.end()) return fail(NoKey(h));
    Key& k = *it->second;
    body(w, k, ctx, data, done, fail);
    // A key created for a frame that could not be applied holds nothing: it is not kept.
    if (k.adopting) w.keys.erase({h.job_id, h.key});
  });
}

absl::Status KvEngine::NoKey(const FrameHeader& h) const {
  const std::shared_ptr<const KeySizes> sizes = key_sizes_.load();
  const auto it = sizes->find({h.job_id, h.key});
  const std::shared_ptr<JobState> job = it == sizes->end() ? nullptr : it->second.standby_job;
  if (job != nullptr) {
    // NotFound, as a key of no table: an agent walks on to the next server of the chain.
    return absl::NotFoundError(absl::StrCat(
        "key ", h.key, " of job ", h.job_id, ": this server (", job->Server(job->self),
        ") holds no copy of it: it stands by for it, and no primary gave it a copy (the servers "
        "that held it were lost before one could, or this server had no room for it)"));
  }
  return absl::NotFoundError(absl::StrCat("job ", h.job_id, " has no key ", h.key, " on this server"));
}

absl::StatusOr<KvEngine::Key*> KvEngine::Adopt(Worker& w, const FrameHeader& h) {
  const std::shared_ptr<const KeySizes> sizes = key_sizes_.load();
  const auto it = sizes->find({h.job_id, h.key});
  if (it == sizes->end() || it->second.standby_job == nullptr) return NoKey(h);
  const std::shared_ptr<JobState>& job = it->second.standby_job;
  const v1::KvTableSpec& t = job->standby_tables[it->second.table];
  const v1::RegisterTablesRequest& spec = job->standby_spec;
  // Who sent it, at which epoch, and what it carries are the Replicate body's checks, as for any
  // backup (a key whose frame fails them is dropped again); only a primary before this server in
  // the chain may hand it a copy.
  if (ChainPosition(spec, job->self, t.primary()) <= h.epoch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a replica of key ", h.key, " (", t.name(), ") of job ", h.job_id, " at epoch ", h.epoch,
        ": this server (", job->Server(job->self), ") is not after that epoch's primary in the "
        "key's chain"));
  }
  RETURN_IF_ERROR(ReserveAdoption(*job, t.primary()));
  std::unique_ptr<Key> k = NewKey(job, spec, t, t.keys(it->second.index));
  k->initialized = false;  // the frame's state is what it holds
  k->adopting = true;
  {
    std::lock_guard<std::mutex> lock(job->mu);
    // The world as it is now, as the keys held from the start have it: the removed ranks, and
    // those readmitted from a clock after the frame's next one (Replicate admits them there).
    if (!job->removed.empty() || !job->readmitted.empty()) k->SizeMembership();
    for (const auto& [rank, why] : job->removed) {
      if (rank < k->workers) k->Drop(rank);
    }
    for (const auto& [rank, from] : job->readmitted) {
      if (rank < k->workers && !k->Removed(rank) && from > h.clock + 1) {
        k->Drop(rank);
        k->join_at[rank] = from;
      }
    }
  }
  Key* key = k.get();
  w.keys[{h.job_id, h.key}] = std::move(k);
  return key;
}

absl::Status KvEngine::ReserveAdoption(JobState& job, uint32_t first_primary) {
  std::lock_guard<std::mutex> lock(job.mu);
  auto [room, first] = job.adoption_room.try_emplace(first_primary);
  if (first) {
    for (const v1::KvTableSpec& other : job.standby_tables) {
      if (other.primary() != first_primary) continue;
      for (const auto& k : other.keys()) {
        room->second.bytes += KeyMemory(other, job.standby_spec, k.elements());
      }
    }
    room->second.reserved = ReserveMemory(room->second.bytes);
  }
  if (room->second.reserved) return absl::OkStatus();
  absl::Status refused = absl::ResourceExhaustedError(absl::StrCat(
      "this server (", job.Server(job.self), ") has no room to adopt the keys of job ",
      job.job_id, " first held by ", job.Server(first_primary), " (", room->second.bytes,
      " bytes; its --max_memory is ", options_.max_memory_bytes, ", ", MemoryLeft(),
      " bytes left): the next server of their chain is asked instead"));
  if (first) PSD_LOG_WARN("{}", refused.message());
  return refused;
}

void KvEngine::Push(RequestContext request, PooledBuffer payload,
                    std::function<void()> finished) {
  OnKeyWorker(std::move(request), std::move(payload), std::move(finished), /*adopt=*/false,
              [this](Worker& w, Key& k, const RequestContext& ctx, PooledBuffer& data,
                     std::function<void()>& done, const auto& fail) {
    const FrameHeader& h = ctx.header;
    // A float32 push on a lossy key: a rank's fallback (kFlagExactWire).
    const bool exact_push = (h.flags & transport::kFlagExactWire) != 0 || !k.LossyWire();
    const size_t expected = exact_push ? k.elements * sizeof(float) : k.WireBytes();
    if (data.size() != expected) {
      return fail(absl::InvalidArgumentError(absl::StrCat("push for ", k.Name(), " carries ",
                                                          data.size(), " bytes, expected ",
                                                          expected)));
    }
    if (h.sender_rank >= k.workers) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "rank ", h.sender_rank, " is out of range for a job of ", k.workers, " workers")));
    }
    if (absl::Status s = CheckEpoch(k, h); !s.ok()) return fail(std::move(s));
    if (k.Removed(h.sender_rank)) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "rank ", h.sender_rank, " was removed from job ", k.job->job_id,
          " (it was given up and the world shrank to ", k.active,
          " workers, its min_workers): its push of clock ", h.clock, " of ", k.Name(),
          " is refused")));
    }
    if ((h.flags & transport::kFlagReplay) != 0) {
      // Re-sent after a lost server had begun to answer the clock: the payload may be
      // overwritten, so it is only acknowledged if this server holds the clock already.
      const bool held = (h.flags & transport::kFlagInit) != 0 ? k.initialized : h.clock <= k.completed;
      if (!held) {
        return fail(absl::DataLossError(absl::StrCat(
            "rank ", h.sender_rank, "'s push of clock ", h.clock, " of ", k.Name(),
            " is lost: its server was lost while answering that clock, and this server (",
            k.job->Server(k.job->self), ") is at clock ", k.completed,
            " (a backup that was given up?)")));
      }
    }
    auto ack = [&] {
      SendReply(ctx, FrameType::kPushAck, {});
      done();
    };
    if ((h.flags & transport::kFlagInit) != 0) {
      if (h.sender_rank != 0) {
        return fail(absl::InvalidArgumentError("only rank 0 pushes initial values"));
      }
      if (k.IsSum()) {
        return fail(absl::FailedPreconditionError(
            absl::StrCat(k.Name(), " uses the sum rule: it holds no parameters to initialise")));
      }
      if (k.completed > 0) {
        return fail(absl::FailedPreconditionError(absl::StrCat(
            "initial value for ", k.Name(), " after training started (clock ", k.completed, ")")));
      }
      if (k.initialized && k.init_pushed) {
        stats_.duplicate_pushes.fetch_add(1, std::memory_order_relaxed);
        return ack();
      }
      std::memcpy(k.params.data(), data.bytes().data(), data.size());
      k.initialized = true;
      ack();
      if (!StartReplication(w, k, 0)) AnswerPulls(w, k);
      return;
    }
    if (h.clock == 0) return fail(absl::InvalidArgumentError("push clocks start at 1"));
    if (h.clock <= k.completed) {
      // Every rank pushed it: a retransmission (a rejoining rank's re-read of the clock before,
      // under a server-side rule that keeps it, too).
      if (h.clock == k.completed || k.HasPrevious(h.clock)) {
        stats_.duplicate_pushes.fetch_add(1, std::memory_order_relaxed);
        return ack();
      }
      return fail(absl::FailedPreconditionError(absl::StrCat("push for finished clock ", h.clock,
                                                             " of ", k.Name(), " (server at clock ",
                                                             k.completed, ")")));
    }
    if (h.clock > k.completed + 1) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "push for clock ", h.clock, " of ", k.Name(), " while clock ", k.completed + 1,
          " is incomplete (BSP): ranks [", RankList(k.pushed), "] have not pushed it")));
    }
    if (k.pushed[h.sender_rank]) {
      stats_.duplicate_pushes.fetch_add(1, std::memory_order_relaxed);
      return ack();
    }
    if (k.LossyWire() && !exact_push && k.ExactAt(h.clock - 1)) {
      // Every rank switched once it pulled clock exact_from (answered in float32).
      return fail(absl::FailedPreconditionError(absl::StrCat(
          k.Name(), " fell back to float32 at clock ", k.exact_from,
          " (a rank's divergence guard): rank ", h.sender_rank, "'s 16-bit push of clock ",
          h.clock, " is refused")));
    }
    if (k.LossyWire() && exact_push && k.exact_from == 0) {
      k.exact_from = h.clock;
      PSD_LOG_WARN("{}: rank {} pushed clock {} in float32 (its divergence guard): the key's "
                   "{} wire falls back to float32 from this clock on",
                   k.Name(), h.sender_rank, h.clock, WireName(k.wire));
    }
    if (k.LossyWire() && !exact_push) {
      const std::span<const uint16_t> grad(reinterpret_cast<const uint16_t*>(data.bytes().data()),
                                           k.elements);
      if (k.count == 0) {
        DecodeWire16(k.wire, grad, k.agg);
      } else {
        AddWire16Into(k.wire, k.agg, grad);
      }
    } else {
      const std::span<const float> grad = data.floats();
      if (k.count == 0) {
        std::memcpy(k.agg.data(), grad.data(), data.size());
      } else {
        AddInto(k.agg, grad);
      }
    }
    k.pushed[h.sender_rank] = 1;
    ++k.count;
    stats_.pushes.fetch_add(1, std::memory_order_relaxed);
    stats_.push_bytes.fetch_add(data.size(), std::memory_order_relaxed);
    data = PooledBuffer();  // back to the pool before the reply
    ack();
    CompleteIfEveryRankPushed(w, k);
  });
}

void KvEngine::CompleteIfEveryRankPushed(Worker& w, Key& k) {
  if (k.count != k.active) return;
  if (k.replicating) {
    k.complete_deferred = true;  // once every backup answered (OnReplicated)
  } else {
    Complete(w, k);
  }
}

void KvEngine::Complete(Worker& w, Key& k) {
  if (k.grad_scale != 1.0f) Scale(k.agg, k.grad_scale);
  if (k.IsSum()) {
    std::swap(k.result, k.agg);
    if (k.LossyWire() && k.ExactAt(k.completed + 1)) {
      // The clock the key falls back at releases what the rounding held back.
      if (k.exact_from == k.completed + 1) {
        AddInto(k.result, k.residual);
        std::fill(k.residual.begin(), k.residual.end(), 0.0f);
      }
    } else if (k.LossyWire()) {
      EncodeWithFeedback(k.wire, k.result, k.residual, k.result_wire);
    }
  } else {
    if (!k.prev_params.empty()) {
      k.prev_params = k.params;
      k.prev_clock = k.completed;
    }
    k.optimizer->Step(k.params, k.agg);
  }
  ++k.completed;
  k.count = 0;
  MaybeSchedulePeriodicSnapshot(k);
  std::fill(k.pushed.begin(), k.pushed.end(), 0);
  for (uint32_t r = 0; r < k.leaving.size(); ++r) {
    if (k.leaving[r]) {  // its push of this clock counted: removed from the next on
      k.leaving[r] = 0;
      k.Drop(r);
    }
  }
  k.AdmitReadmitted();  // readmitted from the next
  stats_.clocks_completed.fetch_add(1, std::memory_order_relaxed);
  if (!StartReplication(w, k, k.completed)) AnswerPulls(w, k);
  if (k.job->any_pending.load(std::memory_order_acquire)) ContributeSnapshot(k);
}

bool KvEngine::StartReplication(Worker& w, Key& k, uint64_t clock) {
  if (!k.Replicated() || !k.IsPrimary()) return false;
  k.Backups(k.round);
  if (k.round.empty()) return false;
  k.replicating = true;
  k.replicating_clock = clock;
  k.replicas_outstanding = static_cast<int>(k.round.size());
  for (size_t p : k.round) SendReplica(w, k, p, clock);
  return true;
}

void KvEngine::SendReplica(Worker& w, Key& k, size_t position, uint64_t clock) {
  FrameHeader h;
  h.type = FrameType::kReplicate;
  h.job_id = k.job->job_id;
  h.epoch = k.epoch;
  h.key = k.key;
  h.clock = clock;
  if (k.LossyWire() && k.ExactAt(clock)) h.flags = transport::kFlagExactWire;
  // The key's own buffers, without a copy: nothing changes them before every backup answered
  // (the pulls of this clock wait for that, and no rank pushes the next clock before its pull;
  // the initial value's replica is pulled by no one, so a clock that completes while it is
  // still being sent waits for it: Key::complete_deferred).
  std::vector<transport::ConstBuffer> payload;
  if (k.IsSum()) {
    payload.emplace_back(std::as_bytes(std::span<const float>(k.result)));
    if (k.LossyWire()) {
      payload.emplace_back(std::as_bytes(std::span<const float>(k.residual)));
      payload.emplace_back(std::as_bytes(std::span<const uint16_t>(k.result_wire)));
    }
  } else {
    k.steps_wire = k.optimizer->steps();
    payload.emplace_back(std::as_bytes(std::span<const uint64_t>(&k.steps_wire, 1)));
    payload.emplace_back(std::as_bytes(std::span<const float>(k.params)));
    for (int i = 0; i < k.optimizer->StateCount(); ++i) {
      payload.emplace_back(std::as_bytes(std::span<const float>(k.optimizer->State(i))));
    }
  }
  Worker* worker = &w;
  Key* key = &k;
  options_.replica_sender->Send(
      k.job->job_id, k.job->self, k.chain[position], k.job->servers[k.chain[position]], h,
      std::move(payload),
      [this, worker, key, position, clock](const absl::Status& s) {
        // A status of its own for the worker thread: a shared one's reference count lives in
        // Abseil (not built with ThreadSanitizer), so its release on this thread and the
        // worker's read of the message look racy.
        worker->Post([this, worker, key, position, clock, code = s.code(),
                      message = std::string(s.message())] {
          OnReplicated(*worker, *key, position, clock, absl::Status(code, message));
        });
      });
}

void KvEngine::OnReplicated(Worker& w, Key& k, size_t position, uint64_t clock,
                            const absl::Status& s) {
  if (s.ok()) stats_.replicated.fetch_add(1, std::memory_order_relaxed);
  // An earlier clock's answer (the initial value's, overtaken by clock 1's replication): the
  // pulls wait for the latest only.
  if (!k.replicating || k.replicating_clock != clock) return;
  JobState& j = *k.job;
  const uint32_t backup = k.chain[position];
  if (absl::IsAborted(s)) {
    // The backup serves a later epoch: the key is no longer ours. Whoever waits moves on.
    if (!k.fenced) stats_.fenced.fetch_add(1, std::memory_order_relaxed);
    k.fenced = true;
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(j.mu);
      first = j.fenced_by.insert(backup).second;
    }
    if (first) {
      PSD_LOG_WARN("job {}: {} took over the keys this server was the primary of (first {}): "
                   "fenced, it answers none of them ({})",
                   j.job_id, j.Server(backup), k.Name(), s.message());
    }
  } else if (!s.ok()) {
    // The backup is unreachable: serve on without it rather than stop (it is given up for good,
    // so a stale copy can never be promoted unnoticed: its clock lags, and BSP refuses it).
    k.backup_lost[position] = 1;
    stats_.backups_lost.fetch_add(1, std::memory_order_relaxed);
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(j.mu);
      first = j.backups_lost.insert(backup).second;
    }
    if (first) {
      PSD_LOG_WARN("job {}: backup {} given up ({}); the keys it backed up are copied to the "
                   "next server of their chains instead, where one is left",
                   j.job_id, j.Server(backup), s.message());
    }
    // The replication factor is restored at once: this clock's state also goes to the next
    // server of the chain not in this round, which adopts the key (a standby table's) or, a
    // copy that held it already, takes it as the next clock.
    std::vector<size_t> backups;
    k.Backups(backups);
    for (size_t p : backups) {
      if (std::find(k.round.begin(), k.round.end(), p) != k.round.end()) continue;
      k.round.push_back(p);
      ++k.replicas_outstanding;
      SendReplica(w, k, p, clock);
    }
  }
  if (--k.replicas_outstanding > 0) return;
  k.replicating = false;
  if (k.fenced) {
    k.complete_deferred = false;  // a later epoch's primary aggregates it
    FailPulls(k, absl::AbortedError(absl::StrCat(
                     k.Name(), " moved off this server (", j.Server(j.self), ", epoch ", k.epoch,
                     "): a later epoch's primary serves it")));
    return;
  }
  AnswerPulls(w, k);
  if (k.complete_deferred) {
    k.complete_deferred = false;
    Complete(w, k);
  }
}

void KvEngine::FailPulls(Key& k, const absl::Status& why) {
  for (auto& p : k.pulls) {
    stats_.request_errors.fetch_add(1, std::memory_order_relaxed);
    SendError(p.ctx, why);
  }
  k.pulls.clear();  // the worker drops the key from keys_with_pulls at its next sweep
}

absl::Status KvEngine::CheckEpoch(Key& k, const FrameHeader& h) {
  if (!k.Replicated()) return absl::OkStatus();  // epochs are not used
  JobState& j = *k.job;
  if (h.epoch >= k.chain.size()) {
    return absl::InvalidArgumentError(absl::StrCat("epoch ", h.epoch, " of ", k.Name(), ": it has ",
                                                   k.chain.size(), " servers (epochs 0..",
                                                   k.chain.size() - 1, ")"));
  }
  if (h.epoch < k.epoch || (h.epoch == k.epoch && k.fenced)) {
    return absl::AbortedError(absl::StrCat(k.Name(), " moved: this server (", j.Server(j.self),
                                           ") is at epoch ", k.epoch,
                                           k.fenced ? " and fenced" : "", ", the request at ",
                                           h.epoch));
  }
  if (k.chain[h.epoch] != j.self) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this server (", j.Server(j.self), ") is not the primary of ", k.Name(), " at epoch ",
        h.epoch, ": ", j.Server(k.chain[h.epoch]), " is"));
  }
  if (h.epoch > k.epoch) {
    // Promotion: the agents lost the primaries before us; we hold every clock they answered.
    k.epoch = h.epoch;
    stats_.promotions.fetch_add(1, std::memory_order_relaxed);
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(j.mu);
      first = j.promotions_logged.insert({k.chain[0], h.epoch}).second;
    }
    if (first) {
      PSD_LOG_WARN("job {}: {} is now the primary of the keys first held by {} (epoch {}, from "
                   "clock {} of {})",
                   j.job_id, j.Server(j.self), j.Server(k.chain[0]), h.epoch, k.completed,
                   k.Name());
    }
  }
  return absl::OkStatus();
}

void KvEngine::Replicate(RequestContext request, PooledBuffer payload,
                    std::function<void()> finished) {
  OnKeyWorker(std::move(request), std::move(payload), std::move(finished), /*adopt=*/true,
              [this](Worker&, Key& k, const RequestContext& ctx, PooledBuffer& data,
                     std::function<void()>& done, const auto& fail) {
    const FrameHeader& h = ctx.header;
    JobState& j = *k.job;
    if (!k.Replicated()) {
      return fail(absl::FailedPreconditionError(absl::StrCat(k.Name(), " is not replicated")));
    }
    if (data.size() != k.ReplicaBytes()) {
      return fail(absl::InvalidArgumentError(absl::StrCat("replica of ", k.Name(), " carries ",
                                                          data.size(), " bytes, expected ",
                                                          k.ReplicaBytes())));
    }
    const uint32_t from = h.sender_rank - transport::kServerRankBase;
    if (!transport::IsServerRank(h.sender_rank) || h.epoch >= k.chain.size() ||
        k.chain[h.epoch] != from) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "a replica of ", k.Name(), " at epoch ", h.epoch, " from ", j.Server(from),
          ", which is not its primary at that epoch")));
    }
    if (h.epoch < k.epoch || (h.epoch == k.epoch && k.IsPrimary())) {
      return fail(absl::AbortedError(absl::StrCat(j.Server(j.self), " serves ", k.Name(),
                                                  " at epoch ", k.epoch, "; ", j.Server(from),
                                                  " is fenced")));
    }
    k.epoch = h.epoch;  // a later primary of the chain replicates to us now
    const bool init = h.clock == 0;
    if (init && k.IsSum()) {
      return fail(absl::FailedPreconditionError(
          absl::StrCat(k.Name(), " uses the sum rule: it has no initial value to replicate")));
    }
    if (init ? k.initialized : h.clock <= k.completed) {
      SendReply(ctx, FrameType::kReplicateAck, {});  // a retransmission
      return done();
    }
    if (!init && !k.adopting && h.clock != k.completed + 1) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "replica of ", k.Name(), " clock ", h.clock, " while this backup is at clock ",
          k.completed, " (a gap: it cannot take the key over)")));
    }
    const std::byte* in = data.bytes().data();
    auto take = [&in](std::span<float> dst) {
      std::memcpy(dst.data(), in, dst.size_bytes());
      in += dst.size_bytes();
    };
    if (k.LossyWire() && (h.flags & transport::kFlagExactWire) != 0 && k.exact_from == 0) {
      k.exact_from = h.clock;  // the primary's key fell back at this clock
    }
    if (k.IsSum()) {
      take(k.result);
      if (k.LossyWire()) {
        take(k.residual);
        std::memcpy(k.result_wire.data(), in, k.result_wire.size() * sizeof(uint16_t));
      }
    } else {
      uint64_t steps = 0;
      std::memcpy(&steps, in, sizeof(steps));
      in += sizeof(steps);
      take(k.params);
      for (int i = 0; i < k.optimizer->StateCount(); ++i) take(k.optimizer->State(i));
      k.optimizer->set_steps(steps);
    }
    k.initialized = true;
    stats_.replicas_applied.fetch_add(1, std::memory_order_relaxed);
    if (k.adopting) {
      k.adopting = false;
      stats_.adopted.fetch_add(1, std::memory_order_relaxed);
      bool first = false;
      {
        std::lock_guard<std::mutex> lock(j.mu);
        first = j.adoptions_logged.insert(k.chain[0]).second;
        // It joins the job's keys: the snapshots it will reach count it.
        ++j.total_keys;
        for (auto& [clock, pending] : j.snapshots) {
          if (clock >= h.clock) ++pending.expected_keys;
        }
      }
      if (first) {
        PSD_LOG_WARN("job {}: {} adopts the keys first held by {} from {} (first {} at clock {}): "
                     "it is one of their backups now",
                     j.job_id, j.Server(j.self), j.Server(k.chain[0]), j.Server(from), k.Name(),
                     h.clock);
      }
    }
    data = PooledBuffer();
    SendReply(ctx, FrameType::kReplicateAck, {});
    done();
    if (init) return;
    k.completed = h.clock;
    k.AdmitReadmitted();  // as Complete on the primary: a backup promoted later needs its pushes
    MaybeSchedulePeriodicSnapshot(k);
    if (k.job->any_pending.load(std::memory_order_acquire)) ContributeSnapshot(k);
  });
}

void KvEngine::AnswerPulls(Worker& /*w*/, Key& k) {
  if (k.pulls.empty()) return;
  auto it = std::remove_if(k.pulls.begin(), k.pulls.end(), [&](const Key::PendingPull& p) {
    const uint64_t clock = p.ctx.header.clock;
    const bool ready = clock == 0 ? k.initialized : clock == k.completed;
    if (!ready || k.replicating) return false;
    RespondPull(p.ctx, k);
    return true;
  });
  k.pulls.erase(it, k.pulls.end());
}

void KvEngine::RespondPull(const RequestContext& ctx, Key& k, bool previous) {
  // A lossy key that fell back answers its float32 result, flagged, to pulls that accept it.
  const bool fell_back = k.LossyWire() && k.ExactAt(k.completed);
  if (fell_back && (ctx.header.flags & transport::kFlagExactWire) == 0) {
    stats_.request_errors.fetch_add(1, std::memory_order_relaxed);
    SendError(ctx, absl::FailedPreconditionError(absl::StrCat(
                       k.Name(), " fell back to float32 at clock ", k.exact_from,
                       " and this pull does not accept a float32 answer (kFlagExactWire)")));
    return;
  }
  const std::span<const std::byte> value =
      k.LossyWire() && !fell_back ? std::as_bytes(std::span<const uint16_t>(k.result_wire))
      : k.IsSum()                 ? std::as_bytes(std::span<const float>(k.result))
      : previous                  ? std::as_bytes(std::span<const float>(k.prev_params))
                                  : std::as_bytes(std::span<const float>(k.params));
  stats_.pulls.fetch_add(1, std::memory_order_relaxed);
  stats_.pull_bytes.fetch_add(value.size_bytes(), std::memory_order_relaxed);
  if (ctx.traffic) ctx.traffic->sent.fetch_add(value.size_bytes(), std::memory_order_relaxed);
  SendReply(ctx, FrameType::kPullResponse, value, fell_back ? transport::kFlagExactWire : 0);
}

void KvEngine::Pull(RequestContext ctx, absl::Duration timeout) {
  timeout = std::min(timeout, options_.max_pull_timeout);
  Worker& w = WorkerFor(ctx.header.job_id, ctx.header.key);
  w.Post([this, &w, ctx = std::move(ctx), timeout]() mutable {
    const FrameHeader& h = ctx.header;
    auto fail = [&](absl::Status s) {
      stats_.request_errors.fetch_add(1, std::memory_order_relaxed);
      SendError(ctx, s);
    };
    auto it = w.keys.find({h.job_id, h.key});
    if (it == w.keys.end()) return fail(NoKey(h));
    Key& k = *it->second;
    if (absl::Status s = CheckEpoch(k, h); !s.ok()) return fail(std::move(s));
    bool ready = false;
    if (h.clock == 0) {
      if (k.IsSum()) {
        return fail(absl::FailedPreconditionError(
            absl::StrCat(k.Name(), " uses the sum rule: there is no value at clock 0")));
      }
      ready = k.initialized;
    } else if (h.clock == k.completed) {
      ready = true;
    } else if (k.HasPrevious(h.clock)) {
      // A rejoining rank's re-read of the parameters before the latest update.
      RespondPull(ctx, k, /*previous=*/true);
      return;
    } else if (h.clock < k.completed) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "clock ", h.clock, " of ", k.Name(), " is gone (server at clock ", k.completed, ")")));
    } else if (h.clock > k.completed + 1) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "pull for clock ", h.clock, " of ", k.Name(), ": the server is at clock ", k.completed,
          " and under BSP only clock ", k.completed + 1, " may be waited for")));
    }
    if (ready && !k.replicating) {
      RespondPull(ctx, k);
      return;
    }
    if (std::string lost = LostBlocking(k, h.clock); !lost.empty()) {
      return fail(absl::UnavailableError(lost));
    }
    if (k.pulls.empty()) w.keys_with_pulls.push_back(&k);
    k.pulls.push_back({std::move(ctx), absl::Now() + timeout});
  });
}

void KvEngine::ContributeSnapshot(Key& k) {
  JobState& j = *k.job;
  std::vector<std::function<void(absl::StatusOr<JobSnapshot>)>> waiters;
  std::optional<JobSnapshot> finished;
  {
    std::lock_guard<std::mutex> lock(j.mu);
    auto it = j.snapshots.find(k.completed);
    if (it == j.snapshots.end()) return;
    it->second.snapshot.keys.push_back(k.Snap());
    if (it->second.snapshot.keys.size() == it->second.expected_keys) {
      finished = std::move(it->second.snapshot);
      waiters = std::move(it->second.waiters);
      j.snapshots.erase(it);
      j.any_pending.store(!j.snapshots.empty(), std::memory_order_release);
    }
  }
  if (finished) {
    std::sort(finished->keys.begin(), finished->keys.end(),
              [](const KeySnapshot& a, const KeySnapshot& b) { return a.key < b.key; });
    for (auto& waiter : waiters) waiter(*finished);
  }
}

namespace {
// Pending snapshots of clocks before `before` are dropped (with j.mu held): a key that is not
// pushed every clock (a layer that ran once, or by SFB) never reaches them, and each holds a
// copy of every key that did.
void PruneSnapshots(JobState& j, uint64_t before) {
  while (!j.snapshots.empty() && j.snapshots.begin()->first < before) {
    auto node = j.snapshots.extract(j.snapshots.begin());
    const PendingSnapshot& p = node.mapped();
    const std::string why = absl::StrCat(
        "job ", j.job_id, ": no snapshot at clock ", node.key(), ": only ", p.snapshot.keys.size(),
        " of its ", p.expected_keys, " keys reached that clock (keys not pushed every clock; "
        "checkpoint between iterations instead: KvClient::Checkpoint with an iteration)");
    PSD_LOG_WARN("{}", why);
    for (const auto& waiter : p.waiters) waiter(absl::FailedPreconditionError(why));
  }
  j.any_pending.store(!j.snapshots.empty(), std::memory_order_release);
}
}  // namespace

void KvEngine::MaybeSchedulePeriodicSnapshot(Key& k) {
  if (options_.snapshot_every == 0 || !options_.on_periodic_snapshot) return;
  const uint64_t next = k.completed + 1;
  if (next % options_.snapshot_every != 0) return;
  JobState& j = *k.job;
  std::lock_guard<std::mutex> lock(j.mu);
  auto [it, inserted] = j.snapshots.try_emplace(next);
  if (inserted) {
    if (next > options_.snapshot_every) PruneSnapshots(j, next - options_.snapshot_every);
    it->second.expected_keys = j.total_keys;
    it->second.snapshot.job_id = j.job_id;
    it->second.snapshot.spec = RingOnly(j.spec);
    it->second.snapshot.clock = next;
    it->second.waiters.push_back(
        [cb = options_.on_periodic_snapshot](absl::StatusOr<JobSnapshot> s) {
          if (s.ok()) cb(std::move(*s));
        });
    j.any_pending.store(true, std::memory_order_release);
  }
}

absl::StatusOr<JobSnapshot> KvEngine::Snapshot(uint64_t job_id, absl::Duration timeout) {
  std::shared_ptr<JobState> job;
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job ", job_id));
    job = it->second;
  }
  // Quiet job (no clock half-aggregated, every key at the same clock): copy it now.
  std::mutex mu;
  std::vector<KeySnapshot> keys;
  bool quiet = true;
  uint64_t max_clock = 0, min_clock = ~uint64_t{0};
  RunOnAllWorkers([&](Worker& w) {
    for (auto& [id, k] : w.keys) {
      if (id.first != job_id) continue;
      std::lock_guard<std::mutex> lock(mu);
      if (k->count != 0) quiet = false;
      max_clock = std::max(max_clock, k->completed);
      min_clock = std::min(min_clock, k->completed);
      keys.push_back(k->Snap());
    }
  });
  if (quiet && max_clock == min_clock) {
    JobSnapshot s;
    s.job_id = job_id;
    {
      std::lock_guard<std::mutex> lock(job->mu);  // servers joining change it (JoinServers)
      s.spec = RingOnly(job->spec);
    }
    s.clock = max_clock;
    s.keys = std::move(keys);
    std::sort(s.keys.begin(), s.keys.end(),
              [](const KeySnapshot& a, const KeySnapshot& b) { return a.key < b.key; });
    return s;
  }
  // Training is running: take it at a clock boundary no key has reached yet.
  const uint64_t target = max_clock + 2;
  auto promise = std::make_shared<std::promise<absl::StatusOr<JobSnapshot>>>();
  auto future = promise->get_future();
  {
    std::lock_guard<std::mutex> lock(job->mu);
    auto [it, inserted] = job->snapshots.try_emplace(target);
    if (inserted) {
      PruneSnapshots(*job, target - 1);
      it->second.expected_keys = job->total_keys;
      it->second.snapshot.job_id = job_id;
      it->second.snapshot.spec = RingOnly(job->spec);
      it->second.snapshot.clock = target;
    }
    it->second.waiters.push_back(
        [promise](absl::StatusOr<JobSnapshot> s) { promise->set_value(std::move(s)); });
    job->any_pending.store(true, std::memory_order_release);
  }
  if (future.wait_for(absl::ToChronoNanoseconds(timeout)) != std::future_status::ready) {
    return absl::DeadlineExceededError(
        absl::StrCat("job ", job_id, " did not complete clock ", target, " within ",
                     absl::FormatDuration(timeout), " for the snapshot (is training running?)"));
  }
  return future.get();
}

absl::StatusOr<JobSnapshot> KvEngine::SnapshotCompleted(uint64_t job_id, uint64_t iteration) {
  JobSnapshot s;
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job ", job_id));
    s.spec = RingOnly(it->second->spec);
  }
  s.job_id = job_id;
  s.clock = iteration;
  std::mutex mu;
  RunOnAllWorkers([&](Worker& w) {
    for (auto& [id, k] : w.keys) {
      if (id.first != job_id) continue;
      KeySnapshot snap = k->Snap();
      std::lock_guard<std::mutex> lock(mu);
      s.keys.push_back(std::move(snap));
    }
  });
  std::sort(s.keys.begin(), s.keys.end(),
            [](const KeySnapshot& a, const KeySnapshot& b) { return a.key < b.key; });
  return s;
}

uint64_t SnapshotProgress(const JobSnapshot& snapshot) {
  uint64_t total = 0;
  for (const KeySnapshot& k : snapshot.keys) total += k.completed_clock + (k.initialized ? 1 : 0);
  return total;
}

uint64_t KvEngine::Progress(uint64_t job_id) {
  std::atomic<uint64_t> total{0};
  RunOnAllWorkers([&](Worker& w) {
    uint64_t mine = 0;
    for (auto& [id, k] : w.keys) {
      if (id.first == job_id) mine += k->completed + (k->initialized ? 1 : 0);
    }
    total.fetch_add(mine, std::memory_order_relaxed);
  });
  return total.load();
}

absl::Status KvEngine::Restore(const JobSnapshot& snapshot) {
  if (auto s = ValidateSpec(snapshot.spec, options_); !s.ok()) return s.status();
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    if (jobs_.contains(snapshot.job_id)) {
      return absl::AlreadyExistsError(absl::StrCat("job ", snapshot.job_id, " already exists"));
    }
  }
  if (auto s = RegisterJob(snapshot.job_id, snapshot.spec); !s.ok()) return s;
  std::shared_ptr<JobState> job;
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    job = jobs_[snapshot.job_id];
    job->awaiting_addresses = true;
  }
  absl::flat_hash_map<uint64_t, const KeySnapshot*> by_key;
  for (const auto& k : snapshot.keys) by_key[k.key] = &k;
  const std::shared_ptr<const KeySizes> sizes = key_sizes_.load();
  std::mutex mu;
  absl::Status status;
  // One key's state from its snapshot; false (status set) when they do not match.
  auto apply = [&](Key& k, const KeySnapshot& s) {
    const bool sizes_ok = (k.IsSum() ? s.result.size() == k.elements && s.params.empty()
                                     : s.params.size() == k.elements && s.result.empty()) &&
                          s.optimizer_state.size() ==
                              static_cast<size_t>(k.optimizer ? k.optimizer->StateCount() : 0);
    if (!sizes_ok) {
      status = absl::DataLossError(
          absl::StrCat("snapshot of job ", snapshot.job_id, " key ", s.key, " has wrong sizes"));
      return false;
    }
    k.completed = s.completed_clock;
    k.initialized = s.initialized;
    k.exact_from = k.LossyWire() ? s.exact_from : 0;
    k.params = s.params;
    if (k.IsSum()) k.result = s.result;
    // The residual is not checkpointed: a restored key rounds its last result afresh.
    if (k.LossyWire()) EncodeWire16(k.wire, k.result, k.result_wire);
    if (k.optimizer) {
      k.optimizer->set_steps(s.optimizer_steps);
      for (int i = 0; i < k.optimizer->StateCount(); ++i) {
        auto dst = k.optimizer->State(i);
        if (s.optimizer_state[i].size() != dst.size()) {
          status = absl::DataLossError("optimizer state size mismatch");
          return false;
        }
        std::copy(s.optimizer_state[i].begin(), s.optimizer_state[i].end(), dst.begin());
      }
    }
    return true;
  };
  RunOnAllWorkers([&](Worker& w) {
    for (auto& [id, k] : w.keys) {
      if (id.first != snapshot.job_id) continue;
      auto it = by_key.find(id.second);
      std::lock_guard<std::mutex> lock(mu);
      if (it == by_key.end()) {
        status = absl::DataLossError(
            absl::StrCat("snapshot of job ", snapshot.job_id, " lacks key ", id.second));
        continue;
      }
      apply(*k, *it->second);
    }
    // The keys this server had adopted (a standby table's, copied to it when one of their
    // backups was lost) come back as adopted ones, with the memory an adoption takes (all of a
    // first primary's or none: one refused for room is left out, and the agents walk past this
    // server as past any that holds no copy).
    for (const KeySnapshot& s : snapshot.keys) {
      if (&WorkerFor(snapshot.job_id, s.key) != &w || w.keys.contains({snapshot.job_id, s.key})) {
        continue;
      }
      const auto size = sizes->find({snapshot.job_id, s.key});
      std::lock_guard<std::mutex> lock(mu);
      if (size == sizes->end() || size->second.standby_job != job) {
        status = absl::DataLossError(absl::StrCat("snapshot of job ", snapshot.job_id,
                                                  " holds key ", s.key, ", of no table of it"));
        continue;
      }
      const v1::KvTableSpec& t = job->standby_tables[size->second.table];
      if (!ReserveAdoption(*job, t.primary()).ok()) continue;
      std::unique_ptr<Key> k = NewKey(job, job->standby_spec, t, t.keys(size->second.index));
      if (apply(*k, s)) w.keys[{snapshot.job_id, s.key}] = std::move(k);
    }
  });
  return status;
}

std::vector<KeyProgress> KvEngine::KeyProgressOf(uint64_t job_id,
                                                const v1::RegisterTablesRequest& spec) {
  // The tables' keys, then the standby tables' (0 where this server holds no copy).
  std::vector<uint64_t> keys;
  for (const auto* tables : {&spec.tables(), &spec.standby_tables()}) {
    for (const auto& t : *tables) {
      for (const auto& k : t.keys()) keys.push_back(k.key());
    }
  }
  std::vector<KeyProgress> progress(keys.size());
  RunOnAllWorkers([&](Worker& w) {  // each worker fills its own keys' entries
    for (size_t i = 0; i < keys.size(); ++i) {
      if (&WorkerFor(job_id, keys[i]) != &w) continue;
      if (auto it = w.keys.find({job_id, keys[i]}); it != w.keys.end()) {
        progress[i] = {it->second->completed, it->second->exact_from};
      }
    }
  });
  return progress;
}

std::vector<uint64_t> KvEngine::Jobs() const {
  std::lock_guard<std::mutex> lock(jobs_mu_);
  std::vector<uint64_t> ids;
  for (const auto& [id, job] : jobs_) ids.push_back(id);
  return ids;
}

bool KvEngine::WaitForQuiescence(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::atomic<bool> busy{false};
    RunOnAllWorkers([&](Worker& w) {
      for (auto& [id, k] : w.keys) {
        if (k->count != 0) busy = true;
      }
    });
    if (!busy) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

}  // namespace poseidon::server
