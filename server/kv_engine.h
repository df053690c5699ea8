// The KV engine of poseidon-server: per-job tables of keys (chunks), BSP aggregation of the
// pushes of all workers for each clock, the update rule, and pulls answered once their clock is
// complete. Each key is pinned to one worker thread, which alone touches its state: no global
// lock on the data path, and a key's pushes are summed in arrival order.
// Thread-safety: every public method may be called from any thread (transport I/O threads).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "poseidon/v1/kv.pb.h"
#include "server/buffer_pool.h"
#include "transport/frame.h"
#include "transport/frame_server.h"

#include "server/kv_client.h"  // KeyProgress

namespace poseidon::server {

// The state of one key, as saved in a checkpoint.
struct KeySnapshot {
  uint64_t key = 0;
  uint64_t completed_clock = 0;
  bool initialized = false;
  uint64_t optimizer_steps = 0;
  uint64_t exact_from = 0;  // a lossy key that fell back: its first float32 clock (Key::exact_from)
  std::vector<float> params;  // optimizer rules
  std::vector<float> result;  // sum rule: result of completed_clock
  std::vector<std::vector<float>> optimizer_state;
};

// A snapshot's KvEngine::Progress.
struct JobSnapshot;
uint64_t SnapshotProgress(const JobSnapshot& snapshot);

struct JobSnapshot {
  uint64_t job_id = 0;
  v1::RegisterTablesRequest spec;
  // Its label: the clock boundary every key completed (Snapshot), or the job's iteration rank 0's
  // agent asked at (SnapshotCompleted). No key's completed clock is past it.
  uint64_t clock = 0;
  std::vector<KeySnapshot> keys;
};

// How a primary reaches its backups (replication, DESIGN.md "Faults"): sends one REPLICATE frame
// (job, key, clock, epoch in `header`; the key's state in `payload`, valid until `done` runs) to
// server `to` of the job at `address`, authenticated as ServerRank(from), and runs `done` once
// with the backup's answer: OK (acknowledged), Aborted (the backup serves a later epoch of the
// key: this server is fenced), or why it is unreachable. `done` may run on any thread and must
// not block. Thread-safe.
class ReplicaSender {
 public:
  virtual ~ReplicaSender() = default;
  virtual void Send(uint64_t job_id, uint32_t from, uint32_t to, const std::string& address,
                    const transport::FrameHeader& header, std::vector<transport::ConstBuffer> payload,
                    std::function<void(absl::Status)> done) = 0;
  // Called once a job is registered, for each backup of the keys this server is the first
  // primary of: a sender may open the connection now, so that a backup that cannot be reached or
  // is silent (frozen) is found while the agents register the job, not at its first clock.
  virtual void Prepare(uint64_t /*job_id*/, uint32_t /*from*/, uint32_t /*to*/,
                       const std::string& /*address*/) {}
};

struct EngineOptions {
  int workers = 2;
  // A pull waits at most this long when the request names no timeout.
  absl::Duration default_pull_timeout = absl::Seconds(30);
  // Upper bound on one pull's own timeout.
  absl::Duration max_pull_timeout = absl::Minutes(10);
  // Every this many clocks (0: never) each job is snapshotted at the clock boundary and the
  // snapshot handed to on_periodic_snapshot (on an engine worker thread: hand it off quickly).
  uint64_t snapshot_every = 0;
  std::function<void(JobSnapshot)> on_periodic_snapshot;
  // A registration is refused (ResourceExhausted) when one key is larger than a frame may carry
  // (it could never be pushed), or when all jobs' tables would need more memory than this.
  uint64_t max_key_bytes = uint64_t{256} << 20;
  uint64_t max_memory_bytes = uint64_t{16} << 30;
  // Replication to backups (null: a registration asking for replicas is refused).
  std::shared_ptr<ReplicaSender> replica_sender;
};

// Counters the daemon exports (read with relaxed loads).
struct EngineStats {
  std::atomic<uint64_t> pushes{0};
  std::atomic<uint64_t> push_bytes{0};
  std::atomic<uint64_t> duplicate_pushes{0};
  std::atomic<uint64_t> pulls{0};
  std::atomic<uint64_t> pull_bytes{0};
  std::atomic<uint64_t> clocks_completed{0};
  std::atomic<uint64_t> request_errors{0};
  std::atomic<uint64_t> pull_timeouts{0};
  // Replication: clocks sent to backups and acknowledged, REPLICATE frames applied as a backup,
  // keys promoted to primary, keys fenced (a backup took them over), backups given up, keys
  // adopted.
  std::atomic<uint64_t> replicated{0};
  std::atomic<uint64_t> replicas_applied{0};
  std::atomic<uint64_t> promotions{0};
  std::atomic<uint64_t> fenced{0};
  std::atomic<uint64_t> backups_lost{0};
  std::atomic<uint64_t> adopted{0};  // standby keys this server took a copy of (a new backup)
};

// Data-plane bytes moved with one peer (a job's rank, over all its connections): push payloads
// received and pull-response payloads sent. Relaxed atomics; poseidon-server reports them to the
// coordinator as per-link telemetry.
struct PeerTraffic {
  std::atomic<uint64_t> received{0};
  std::atomic<uint64_t> sent{0};
  // Liveness (KvService): when the peer last sent a frame (CLOCK_MONOTONIC ns), whether it keeps
  // alive (it sent an empty PING: agents ping every few seconds, so silence means it is frozen
  // or cut off), and whether it was declared silent (KvEngine::RankLost) and not back yet.
  std::atomic<int64_t> last_frame_ns{0};
  std::atomic<bool> keeps_alive{false};
  std::atomic<bool> silenced{false};
};

// Where a request came from and how to answer it.
struct RequestContext {
  std::shared_ptr<transport::PeerSession> peer;
  transport::FrameHeader header;
  std::shared_ptr<PeerTraffic> traffic;  // the peer's byte counters; may be null
};

// What this server holds of one replicated job (ReplicationStatus; poseidon.v1.ReplicationTelemetry).
struct ReplicationCounts {
  uint64_t job_id = 0;
  uint64_t primary_keys = 0;
  uint64_t backup_keys = 0;
  uint64_t degraded_keys = 0;
  uint64_t replicating_keys = 0;
  uint64_t max_backup_lag_clocks = 0;
};

struct JobState;  // kv_engine.cc

class KvEngine {
 public:
  explicit KvEngine(EngineOptions options);
  ~KvEngine();  // stops the workers (pending pulls get Unavailable)

  const EngineStats& stats() const { return stats_; }
  // The memory the tables this server holds take (every job's registered tables and the keys it
  // adopted), which --max_memory (EngineOptions::max_memory_bytes) bounds.
  uint64_t memory_used() const { return used_bytes_.load(std::memory_order_relaxed); }
  uint64_t max_memory() const { return options_.max_memory_bytes; }

  // The replication of every replicated job's keys on this server, by job id: each worker
  // counts its own keys (a task on its thread). Waits up to `timeout` for the workers; a worker
  // still busy then is left out (the counts are then partial: `complete` false). Any thread.
  std::vector<ReplicationCounts> ReplicationStatus(absl::Duration timeout,
                                                   bool* complete = nullptr);

  // Creates job `job_id`'s tables, or checks that `spec` equals the registered one (every rank
  // may register). Errors: InvalidArgument (bad spec), FailedPrecondition (differs; names the
  // first difference).
  absl::Status RegisterJob(uint64_t job_id, const v1::RegisterTablesRequest& spec);

  // A push of `data` (the payload, already received) for the key/clock/rank in ctx.header. The
  // engine answers the peer (PUSH_ACK or ERROR) and then runs `done` (on the worker thread).
  void Push(RequestContext ctx, PooledBuffer data, std::function<void()> done);

  // Before a push's payload is received (and memory taken for it): the key must exist and
  // `bytes` be its registered size. Any thread; lock-free (reads a snapshot of the key sizes).
  // `exact_wire`: the push carries kFlagExactWire (float32 on a lossy key).
  absl::Status CheckPushSize(uint64_t job_id, uint64_t key, uint64_t bytes,
                             bool exact_wire = false) const;

  // Replication, on a backup: a REPLICATE frame from the key's primary (ctx.header.sender_rank
  // is its ServerRank) carrying the key's state after clock ctx.header.clock at its assignment
  // epoch. Applied in clock order and acknowledged (REPLICATE_ACK); refused with Aborted when
  // this server holds a later epoch of the key (the sender is fenced), with FailedPrecondition
  // for a gap or a sender that is not the key's primary at that epoch. `done` as for Push.
  void Replicate(RequestContext ctx, PooledBuffer data, std::function<void()> done);
  // The size a REPLICATE frame of the key must have (before its payload is received).
  absl::Status CheckReplicaSize(uint64_t job_id, uint64_t key, uint64_t bytes) const;

  // A pull for the key/clock in ctx.header, answered with PULL_RESPONSE once the clock is
  // complete, or ERROR after `timeout` naming the ranks that have not pushed.
  void Pull(RequestContext ctx, absl::Duration timeout);

  // A rank of a job is gone from this server (its last connection closed): every pull waiting
  // for its push is answered with an error saying `why` (who, from where) and what waits, and so
  // is every later pull that needs it, until RankBack. A clock the rank already pushed completes
  // as usual (a rank that finished and left blocks nothing). Any thread; asynchronous.
  void RankLost(uint64_t job_id, uint32_t rank, std::string why);
  // With the job's min_workers (RegisterTablesRequest) and that many ranks left without it, a
  // rank given up is removed instead: each key completes its clocks without it — from the clock
  // in flight if it had not pushed that, else from the next — its later pushes are refused, and
  // the sum is averaged over the ranks left (average_gradients).
  // The rank has a connection again.
  void RankBack(uint64_t job_id, uint32_t rank);
  // Whether `rank` was removed from the job on this server and not readmitted since.
  bool RankRemoved(uint64_t job_id, uint32_t rank) const;
  // The world grows again: `rank`'s replacement (after it was removed, or while this server
  // still waited for it) is counted from clock `from` on by every key of `spec` (the rank's
  // registration) that has not completed `from`; until then each leaves it out of the clocks it
  // had not counted. Returns every key's progress after it, in request order: a key at or
  // past `from` refused it (the replacement asks again). A key more than 3 clocks behind
  // `from` (a layer not posted lately) counts it from its own next clock. Needs min_workers.
  // Any thread but a key worker.
  absl::StatusOr<std::vector<KeyProgress>> Readmit(uint64_t job_id, uint32_t rank, uint64_t from,
                                                   const v1::RegisterTablesRequest& spec);
  // How long a rank of the job whose last connection closed is waited for before RankLost
  // (its registration's rejoin_timeout_ms; zero: not at all, or no such job). Any thread.
  absl::Duration RejoinTimeout(uint64_t job_id) const;

  // Snapshot of a job at a clock boundary: waits until every key of the job has completed the
  // same clock (at most `timeout`), then copies their state. Used for checkpoints.
  absl::StatusOr<JobSnapshot> Snapshot(uint64_t job_id, absl::Duration timeout);

  // Every key's completed state now (a clock half-aggregated is left out: it aggregates afresh
  // after a restore), labelled `iteration`. Consistent when asked by one rank between two of
  // its iterations: under BSP no key can complete a clock that rank has not pushed, so every key
  // is at the clock of that rank's last iteration (or earlier, if its layer did not run since).
  absl::StatusOr<JobSnapshot> SnapshotCompleted(uint64_t job_id, uint64_t iteration);
  // How far the job has come: the sum over its keys of the completed clock (+1 once
  // initialised). Changes whenever a key completes a clock.
  uint64_t Progress(uint64_t job_id);
  // Installs a restored job (at start, before serving). Errors if the job exists. Its first
  // registration may name the servers at new addresses (a resumed job); nothing else may differ.
  absl::Status Restore(const JobSnapshot& snapshot);
  // The progress of every key of `spec` (a registered job's), its tables' then its standby
  // tables', in the spec's order: all 0 for a new job, the restored state of a resumed one (the
  // registration's answer; a standby key's is 0 unless this server holds a copy: adopted, or
  // restored as adopted).
  std::vector<KeyProgress> KeyProgressOf(uint64_t job_id, const v1::RegisterTablesRequest& spec);

  // Job ids registered, for checkpoints.
  std::vector<uint64_t> Jobs() const;

  // Blocks until no clock is partially aggregated on any key (for graceful shutdown), at most
  // `timeout`. Returns false on timeout.
  bool WaitForQuiescence(absl::Duration timeout);

 public:
  struct Key;  // kv_engine.cc

 private:
  struct Worker;
  std::shared_ptr<JobState> FindJob(uint64_t job_id) const;  // null: not registered
  void Complete(Worker& w, Key& k);
  // Completes the clock in flight once every rank it needs pushed (deferred while a replica is
  // being sent).
  void CompleteIfEveryRankPushed(Worker& w, Key& k);
  // Removes `rank` from the key's clocks (the world shrank; KvEngine::RankLost): completes the
  // clock in flight when every rank left has pushed it.
  void RemoveRank(Worker& w, Key& k, uint32_t rank);
  // Readmit's part on the key's worker.
  void ReadmitRank(Worker& w, Key& k, uint32_t rank, uint64_t from);
  // Replication of the key's completed state (its clock, or 0 for the initial value) to its live
  // backups; false when it has none (answer the pulls now). Pulls wait until every backup
  // acknowledged or was given up (OnReplicated).
  bool StartReplication(Worker& w, Key& k, uint64_t clock);
  // Sends the key's state at `clock` to the server at `position` of its chain (a backup).
  void SendReplica(Worker& w, Key& k, size_t position, uint64_t clock);
  void OnReplicated(Worker& w, Key& k, size_t position, uint64_t clock, const absl::Status& s);
  // A REPLICATE frame for a key this server stands by for (a standby table's): checks that this
  // server is further down the chain than the frame's epoch, then creates the key
  // (Key::adopting until the frame's state is applied; Replicate checks the sender and the
  // state as for any backup, and a key whose frame fails is dropped). On the key's worker.
  absl::StatusOr<Key*> Adopt(Worker& w, const transport::FrameHeader& h);
  // The memory for every key of `first_primary`'s that this server stands by for in `job`,
  // taken (or refused: ResourceExhausted, logged once) at the first of them by an adoption or a
  // restore: it holds all of them or none. Under job.mu.
  absl::Status ReserveAdoption(JobState& job, uint32_t first_primary);
  // Why a request names a key this server does not hold (NotFound; FailedPrecondition for a key
  // it stands by for but was never given).
  absl::Status NoKey(const transport::FrameHeader& h) const;
  // The assignment epoch of an agent's push or pull against the key's: OK when this server is
  // the key's primary at it (promoting a backup whose epoch has come), else why not.
  absl::Status CheckEpoch(Key& k, const transport::FrameHeader& h);
  void FailPulls(Key& k, const absl::Status& why);
  // Runs body(worker, key, ctx, data, done, fail) on the key's worker thread; a request for a key
  // this server does not hold is answered NotFound there (fail: count, send ERROR, run done),
  // unless `adopt` (a REPLICATE frame) and this server stands by for it (Adopt).
  template <typename Body>
  void OnKeyWorker(RequestContext ctx, PooledBuffer data, std::function<void()> done, bool adopt,
                   Body body);
  void AnswerPulls(Worker& w, Key& k);
  // previous: Key::prev_params (a rejoining rank's re-read of the clock before the latest).
  void RespondPull(const RequestContext& ctx, Key& k, bool previous = false);
  void ContributeSnapshot(Key& k);
  void MaybeSchedulePeriodicSnapshot(Key& k);

  Worker& WorkerFor(uint64_t job, uint64_t key);
  void RunOnAllWorkers(const std::function<void(Worker&)>& fn);
  // Runs fn on the calling thread while every key worker waits (between two of its tasks).
  void WithWorkersPaused(const std::function<void()>& fn);
  // Servers that joined the running job (RegisterTablesRequest.ring_servers) go on every
  // chain; under jobs_mu_.
  void JoinServers(JobState& job, const v1::RegisterTablesRequest& spec);
  // Asks the replica sender for the connections to the backups of the keys this server is the
  // first primary of (ReplicaSender::Prepare).
  void PrepareReplicas(const JobState& job, const v1::RegisterTablesRequest& spec);

  EngineOptions options_;
  EngineStats stats_;
  std::vector<std::unique_ptr<Worker>> workers_;
  mutable std::mutex jobs_mu_;                          // registration only, never on the data path
  std::map<uint64_t, std::shared_ptr<JobState>> jobs_;  // JobState holds the registered spec
  // The memory the held tables take (registrations, adoptions): --max_memory bounds it. Taken
  // by registration (under jobs_mu_) and by adoption (on a key worker), so lock-free.
  std::atomic<uint64_t> used_bytes_{0};
  bool ReserveMemory(uint64_t bytes);
  uint64_t MemoryLeft() const;
  // (job, key) -> registered bytes; replaced (copy on write, under jobs_mu_) by RegisterJob and
  // read without a lock by CheckPushSize.
  // (and, for a replicated key, the size of its REPLICATE frames; 0: not replicated).
  struct KeySize {
    uint64_t push = 0;
    uint64_t float_push = 0;  // a float32 push (kFlagExactWire on a lossy key)
    uint64_t replica = 0;
    // A key of a table this server stands by for: its job (read by the key workers, which may
    // not take jobs_mu_: RegisterJob holds it while it waits for them) and its indices in
    // JobState::standby_tables.
    std::shared_ptr<JobState> standby_job;
    int table = -1;
    int index = -1;
  };
  using KeySizes = std::map<std::pair<uint64_t, uint64_t>, KeySize>;
  std::atomic<std::shared_ptr<const KeySizes>> key_sizes_{std::make_shared<const KeySizes>()};
};

}  // namespace poseidon::server
