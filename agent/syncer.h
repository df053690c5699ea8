// A syncer synchronises the layers of one scheme (DESIGN.md, "Schemes"): PS push/pull of the
// plan's chunks, SFB broadcast of the sufficient factors, fused PS buckets, ring all-reduce. Each is one class in
// its own file, made through one row of the registration table (SyncerTable below); the agent
// hands each posted layer's iteration to the syncer its schedule names for that iteration and
// learns of completions through SyncEnv::finished. Adding a scheme: a file with the syncer, a
// row here, and the planner's cost row (coordinator/planner/cost_model.cc).
// Thread model: Post, CheckDeadlines and Waiting run on the agent's main thread; the work runs
// on the scheduler's workers and the transport's I/O threads (see each syncer). `finished` may
// be called from any thread, once per part of a posted iteration.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/agent.h"
#include "agent/device_stager.h"
#include "agent/layer_table.h"
#include "agent/scheduler.h"
#include "agent/shm_endpoint.h"
#include "agent/wire_guard.h"
#include "common/metrics.h"
#include "server/kv_client.h"
#include "transport/frame_server.h"

namespace poseidon::agent {

class Timeline;
class TelemetryReporter;
}  // namespace poseidon::agent
namespace gloo::rendezvous {
class Store;
}  // namespace gloo::rendezvous
namespace poseidon::agent {
struct GlooRing;

// Which other agents announced (PING) that they registered their model and can take our
// frames, or were removed from the job (SfbSyncer::PeerRemoved: not waited for). PINGs can
// arrive before this agent registered: the agent owns the gate from its start. Thread-safe.
class PeerGate {
 public:
  explicit PeerGate(uint32_t world_size) : ready_(world_size, false) {}
  void MarkReady(uint32_t rank);
  // Waits until every rank but `me` is ready (or Stop, or `timeout`); the ranks still missing.
  std::vector<uint32_t> Wait(uint32_t me, absl::Duration timeout);
  void Stop();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> ready_;
  bool stopping_ = false;
};

// Counters the syncers update (null when not collected).
struct SyncMetrics {
  std::vector<prometheus::Counter*> push_bytes, pull_bytes;  // by server index
  prometheus::Counter* sfb_sent_bytes = nullptr;
  prometheus::Counter* sfb_received_bytes = nullptr;
  prometheus::Counter* allreduce_bytes = nullptr;  // each all-reduce's gradient bytes
};

// A PS key's lossy wire (bfloat16 or fp16: LayerSpec::wire, from the plan or --wire): the
// error-feedback residual and the encoded push and pull payloads. One clock of a key is in
// flight at a time (BSP), so it needs no lock.
// The answer lands in the key's float32 values and is decoded in place. `exact`: the key fell
// back to float32 (this rank's divergence guard, agent/wire_guard.h, or the server's float32
// answer after another rank's), for the rest of the job; set by the syncer or a transport thread.
struct LossyWire {
  LossyWire(WireType t, size_t elements, std::string key_name)
      : type(t), name(std::move(key_name)), residual(elements, 0.0f), push(elements) {}
  WireType type;
  std::string name;  // the layer's or bucket's, for logs
  std::vector<uint32_t> layers;  // the layer, or the bucket's members (telemetry)
  std::vector<float> residual;
  std::vector<uint16_t> push;
  std::atomic<bool> exact{false};
  bool residual_released = false;  // after the fallback, the residual went out (PushPull only)
  size_t received = 0;             // the size of the pull's answer (the pull's callback)
};

// Replication of the PS keys (AgentConfig::replicas, DESIGN.md "Faults"): a chunk's key has the
// chain of servers primary, primary + 1, ... (mod the servers, every server once), the first
// 1 + replicas of which hold it from the start; the others stand by and adopt it when a primary
// gives a backup up (docs/server.md). The epoch of a primary's keys is the position in that chain
// that serves them now. When the server a request went to is lost (its connection broke or went
// silent) or fenced (Aborted), the epoch moves on and the request is sent again, from the same
// buffer (no copy: see PushPull), to the next server, which holds every clock the lost one
// answered. Built at registration; the epochs
// are atomics (transport threads), the rest is then only read.
struct SyncEnv;
// KV servers that joined the running job in place of lost ones (a replacement server the
// coordinator reports; kv.proto ring_servers): slot j is server ring + j, after the ring in every
// key's chain. A slot is written once, by the agent's plan watcher, before `count` is raised
// past it (release); any thread reads the slots below count (acquire).
struct JoinedServers {
  static constexpr uint32_t kMax = 16;
  std::array<std::shared_ptr<server::KvClient>, kMax> clients;
  std::array<std::string, kMax> addresses;
  std::atomic<uint32_t> count{0};
  uint32_t Count() const { return count.load(std::memory_order_acquire); }
  // The joined servers the coordinator listed (the heartbeat thread writes it), and whether
  // taking the next one up failed (none more will be, and nothing waits for it).
  std::atomic<uint32_t> announced{0};
  std::atomic<bool> stuck{false};
  // A request that failed at the last server of its chain while a joined server is announced
  // but not taken up yet (Replication::AwaitsJoin) waits for it: `retry` runs once count has
  // moved past `seen` or stuck is set (at once if that happened already). Thread-safe.
  void Park(uint32_t seen, std::function<void()> retry);
  // Runs what waits (after count rose or stuck was set).
  void Unpark();

 private:
  std::mutex mu_;
  std::vector<std::function<void()>> parked_;
};

struct Replication {
  uint32_t replicas = 0;  // backups per key (0: off)
  size_t servers = 0;     // the ring: the plan's servers (those that joined later come after)
  std::unique_ptr<std::atomic<uint32_t>[]> epoch;  // by first primary (plan server index)
  std::atomic<bool> stopping{false};                // the agent stops: no more re-sends
  uint32_t Epoch(uint32_t primary) const;
  uint32_t ServerAt(uint32_t primary, uint32_t epoch) const;
  uint32_t ServingNow(uint32_t primary) const { return ServerAt(primary, Epoch(primary)); }
  // Whether a request of the keys of `primary` that failed with `why` on `lost` at `epoch` goes
  // again to the next server (moving the epoch on, once, logged); false: the error stands.
  bool Failover(const SyncEnv& env, uint32_t primary, uint32_t epoch, server::KvClient& lost,
                const absl::Status& why);
  // Whether such a request, at the last server its chain has now, waits for a server that
  // joined the running job (announced by the coordinator, not yet taken up) instead of failing.
  bool AwaitsJoin(const SyncEnv& env, uint32_t epoch, server::KvClient& lost,
                  const absl::Status& why) const;

 private:
  // Whether `why` on `lost` is a loss (the next server of the chain holds every clock).
  bool Lost(server::KvClient& lost, const absl::Status& why) const;
};

// The connection this agent's frames to each other agent go out on, by rank (null for itself).
// A restarted agent taking up the running job (--rejoin) connects to every other and sends its
// PING with the iteration it takes up; the others' frames to that rank then go on its connection
// (their own to the rank it replaces is dead), which it reads (FrameServer::Serve). Thread-safe.
class PeerLinks {
 public:
  void Reset(size_t world) {
    std::lock_guard<std::mutex> lock(mu_);
    links_.assign(world, nullptr);
  }
  void Clear() { Reset(0); }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return links_.size();
  }
  std::shared_ptr<transport::Connection> Get(uint32_t rank) const {
    std::lock_guard<std::mutex> lock(mu_);
    return rank < links_.size() ? links_[rank] : nullptr;
  }
  // The previous connection (null if none).
  std::shared_ptr<transport::Connection> Set(uint32_t rank,
                                             std::shared_ptr<transport::Connection> link) {
    std::lock_guard<std::mutex> lock(mu_);
    if (rank >= links_.size()) return nullptr;
    links_[rank].swap(link);
    return link;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<transport::Connection>> links_;
};

// What the syncers share: the agent's parts they work with. Filled before the first Post and
// fixed afterwards, except `stager` (set once when the framework attaches CUDA, an atomic).
struct SyncEnv {
  const AgentConfig* config = nullptr;
  const LayerTable* table = nullptr;
  ShmEndpoint* shm = nullptr;
  Scheduler* scheduler = nullptr;
  Timeline* timeline = nullptr;            // null: off
  TelemetryReporter* telemetry = nullptr;  // null: off
  SyncMetrics metrics;
  std::atomic<DeviceStager*>* stager = nullptr;
  PeerGate* peer_gate = nullptr;
  // Server-side update rule (0: sum): iteration 1 then carries rank 0's initial parameters.
  uint32_t server_rule = 0;
  std::vector<std::shared_ptr<server::KvClient>> servers;      // plan order
  JoinedServers joined;  // after `servers` in every key's chain
  // Server `s` of the chains (a plan server, or one that joined: Replication::ServerAt).
  server::KvClient& Server(uint32_t s) const {
    return s < servers.size() ? *servers[s] : *joined.clients[s - servers.size()];
  }
  std::shared_ptr<server::KvClient> ServerPtr(uint32_t s) const {
    return s < servers.size() ? servers[s] : joined.clients[s - servers.size()];
  }
  const std::string& ServerAddress(uint32_t s) const;
  // Every PS key's progress as its servers answered the registration (all 0 for a new job; a
  // resumed job's restored state): the PS and bucket syncers' clocks start there (Ready).
  std::map<uint64_t, server::KeyProgress> restored;
  // A rank rejoining a running job (AgentConfig::rejoin): the highest completed clock of the
  // job's keys. A layer or bucket whose keys are there or one behind (it runs every iteration)
  // starts one below it, so that the process's iteration 1 is that clock's; one further behind
  // (not posted lately) goes on from its own (Agent::TakeUpRunningJob).
  std::optional<uint64_t> rejoin_top;
  // That rank's KV servers had removed it (the world shrank without it): it is readmitted
  // (Agent::ReadmitToJob), and a ring answers it once its agents removed it too.
  bool removed_by_servers = false;
  // The PS keys on a lossy wire (the chunks and bucket keys of layers whose LayerSpec::wire is
  // not float32). Built at registration, then only read.
  std::map<uint64_t, std::unique_ptr<LossyWire>> lossy;
  WireGuardOptions wire_guard;
  Replication replication;
  PeerLinks peers;
  // SFB frames carry the job's iteration: the process's + clock_base (resumed_iteration - 1 in a
  // resumed job and for a rank that took up the running job, 0 otherwise), so that a restarted
  // rank's and the others' iterations meet. Set at registration.
  uint64_t clock_base = 0;
  // All-reduce: Gloo's rendezvous store (the agent's, over the coordinator; null: no
  // all-reduce) and the host the other agents reach this one at.
  gloo::rendezvous::Store* rendezvous = nullptr;
  // The world's keys in that store are under this prefix (the coordinator's membership epoch the
  // world formed at: a later world of the job rendezvouses afresh); a returning rank's question
  // is outside it (its own world's epoch differs), AllreduceSyncer::ComeBack.
  std::string ring_world = "0";
  std::string own_host;
  // The Gloo ring the agent connected before registering its model (agent/gloo_ring.h; the
  // all-reduce syncer takes it over), or null: the syncer connects one through `rendezvous`.
  GlooRing* ring = nullptr;
  // Tests only (null in the agent): called on a unit's pool thread after each of its all-reduces
  // in an elastic job completed in the ring; a non-OK status makes it count as failed on this
  // rank (as when its last receive broke after the other ranks had completed).
  std::function<absl::Status(uint32_t unit, uint64_t iteration)> allreduce_fault;
  // Part `part` of the layer's iteration completed (PS: chunk index; SFB and buckets: 0). For a
  // PS part on the device, the result is already on its way back to the GPU.
  std::function<void(uint32_t layer, uint64_t iteration, int part, const absl::Status&)> finished;
};

// One posted iteration of a layer.
struct Post {
  uint32_t layer = 0;
  uint64_t iteration = 0;
  bool on_device = false;  // the input is in the CUDA arena
  uint32_t priority = 0;   // the plan's (0 without priority)
  absl::Time ready_at;
};

class Syncer {
 public:
  virtual ~Syncer() = default;
  // Parts an iteration of `layer` completes in (each reported once to SyncEnv::finished).
  virtual int Parts(uint32_t layer) const = 0;
  // Starts the iteration (main thread; never blocks).
  virtual void Start(const Post& post) = 0;
  // What the iteration still waits for, given its parts not yet complete (the stall detector;
  // main thread).
  virtual std::string Waiting(uint32_t layer, uint64_t iteration,
                              const std::vector<uint8_t>& pending) const = 0;
  // Main thread, periodically: fails what waited past its deadline.
  virtual void CheckDeadlines(absl::Time /*now*/) {}
  // Main thread, when it changes: the other ranks whose connections to this agent all closed,
  // with why (a rank that reconnects leaves the set). What waits for one of them fails at the
  // next CheckDeadlines instead of at its deadline.
  virtual void PeersGone(const std::map<uint32_t, std::string>& /*gone*/) {}
  // A restarted agent took up `rank` at the job's iteration `clock` (its PING; transport I/O
  // thread): send it again what it needs of that iteration on and had gone to the agent it
  // replaces (SyncEnv::peers already leads to it).
  virtual void PeerBack(uint32_t /*rank*/, uint64_t /*clock*/) {}
  // `rank` was removed from the job (--min_workers; main thread, or an I/O thread where the
  // rank's replacement asks to come back first): nothing more comes from it. The agents agree
  // on the last iteration of each layer that counts it.
  virtual void PeerRemoved(uint32_t /*rank*/) {}
  // A replacement of `rank` registered with the coordinator (its heartbeat's `replaced`; main
  // thread, once per replacement): a scheme that needs the others to make room for it before it
  // asks (a new Gloo ring) starts listening for its question now.
  virtual void PeerReturning(uint32_t /*rank*/) {}
  // This rank was removed from the job and comes back (Agent::ReadmitToJob; main thread, peers
  // connected, blocks until `deadline`): the earliest iteration from which every peer can count
  // it again on this scheme's layers (0: any). The peers hold those layers from the iteration
  // after where they are until this agent's PING names the iteration it takes up (PeerBack).
  virtual absl::StatusOr<uint64_t> ComeBack(absl::Time /*deadline*/) { return uint64_t{0}; }
  // This rank takes up the job at iteration `from` after ComeBack (main thread, before Ready;
  // before it waits for the others to reach `from` - 1): a scheme whose peers hold their layers
  // until they know it tells them now.
  virtual absl::Status TakeUpAt(uint64_t /*from*/) { return absl::OkStatus(); }
  // Frames from the other agents, when the scheme uses them (null: none).
  virtual transport::FrameHandler* peer_handler() { return nullptr; }
  // Called once peers are connected and every layer exists (registration, main thread).
  virtual absl::Status Ready() { return absl::OkStatus(); }
  // The framework attached its CUDA arena (main thread, before any layer is posted on it).
  virtual void AttachDevice(DeviceStager& /*stager*/) {}
  // The agent stops: wake whatever waits (main thread, before the scheduler stops).
  virtual void Stop() {}
};

// The registration table: one row per syncer.
enum class SyncerKind { kPs, kSfb, kBucket, kAllreduce };
struct SyncerRow {
  SyncerKind kind;
  const char* name;
  std::unique_ptr<Syncer> (*make)(SyncEnv& env);
};
const std::vector<SyncerRow>& SyncerTable();

// The rows' factories (one per syncer file).
std::unique_ptr<Syncer> MakePsSyncer(SyncEnv& env);
std::unique_ptr<Syncer> MakeSfbSyncer(SyncEnv& env);
// Threads of one host-side SFB rebuild (OpenBLAS's, process-wide; at least 1).
void SetHostBlasThreads(int threads);
std::unique_ptr<Syncer> MakeBucketSyncer(SyncEnv& env);
std::unique_ptr<Syncer> MakeAllreduceSyncer(SyncEnv& env);

// Push `values` as this rank's contribution to `chunk` at `clock` and pull the clock's result into
// them (PS and buckets). Both complete on transport threads; `credit` is parked once the push is
// out and returned with the pull; `done` runs once with the pull's result. With init (a
// server-side rule's clock 0) only rank 0 pushes.
void PushPull(SyncEnv& env, const PsChunk& chunk, std::span<float> values, uint64_t clock,
              bool init, std::shared_ptr<Credit> credit, std::function<void(absl::Status)> done);

// The clock a PS layer's or bucket's keys were restored at (SyncEnv::restored; 0 for a
// new job). A layer whose chunks were restored at different clocks is an error naming it.
// A rank taking up the running job (rejoin_top): one below the job's highest clock, or the
// layer's own if lower; a layer of its own iterations (own_clock: PSD_LAYER_OWN_CLOCK) one
// below its own, so that its first post is a retransmission of its last completed clock.
absl::StatusOr<uint64_t> RestoredClock(const SyncEnv& env, const std::string& name,
                                       const std::vector<PsChunk>& chunks,
                                       bool own_clock = false);

}  // namespace poseidon::agent
