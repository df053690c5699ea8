// The agent: lifecycle, the framework's events, registration (plan, layer table, connections),
// each layer's progress through its iteration, plan changes, and the watchdogs. The work of
// synchronising is the syncers' (agent/syncer.h), the order and the credit the scheduler's
// (agent/scheduler.h). Thread model: docs/thread_model.md, "agent/".
#include "agent/agent.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/connect_fallback.h"
#include "agent/device_stager.h"
#include "agent/gloo_ring.h"
#include "agent/gloo_store.h"
#include "agent/layer_table.h"
#include "agent/scheduler.h"
#include "agent/shm_endpoint.h"
#include "agent/syncer.h"
#include "agent/telemetry_reporter.h"
#include "agent/timeline.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/periodic.h"
#include "common/status.h"
#include "coordinator/client.h"
#include "coordinator/endpoint_choice.h"
#include "coordinator/planner/planner.h"
#include "proto/wire_type.h"
#include "server/kv_client.h"
#include "transport/frame_server.h"
#include "transport/credentials.h"
#include "transport/handshake.h"
#include "transport/rdma/rdma_context.h"
#include "transport/tcp/tcp_context.h"

namespace poseidon::agent {
namespace {

int64_t SteadyNs() { return static_cast<int64_t>(MonotonicNs()); }

// Set from a signal handler (the one process-wide flag: a signal cannot reach a context object).
std::atomic<bool> stop_requested{false};

using transport::FrameHeader;
using transport::FrameType;

// Pull responses at least this large feed the links' capacity estimates (smaller ones measure
// latency more than rate).
constexpr uint64_t kCapacityTransferBytes = uint64_t{32} << 10;

// The longest wait for a KV server's answer to a table registration. A frozen server is
// taken as lost sooner, once it said nothing for peer_timeout (KvClient::WaitAlive pings it).
constexpr absl::Duration kRegistrationTimeout = absl::Seconds(30);

// Whether a server's failed table registration means the server is lost (its connection closed
// or broke, or it answered nothing in time) rather than its refusal (a table that differs, no
// room), which stands.
bool RegistrationLost(server::KvClient& client, const absl::Status& why) {
  return client.Broken() || absl::IsDeadlineExceeded(why);
}

// The transport kind of a connected link, as telemetry reports it.
v1::TransportKind LinkKind(bool rdma) {
  return rdma ? v1::TRANSPORT_KIND_RDMA : v1::TRANSPORT_KIND_TCP;
}

// The host part of "host:port" or "[v6]:port".
std::string HostOf(const std::string& address) {
  if (!address.empty() && address.front() == '[') return address.substr(0, address.find(']') + 1);
  return address.substr(0, address.rfind(':'));
}

// Which servers measure the network: the ones on other hosts when there are any (a server on
// our own host is reached over loopback, whose rate says nothing of the links), else all.
std::vector<bool> MeasuredServers(const std::vector<std::string>& addresses,
                                  const std::string& own_host) {
  std::vector<bool> remote(addresses.size());
  bool any = false;
  for (size_t s = 0; s < addresses.size(); ++s) {
    remote[s] = own_host.empty() || HostOf(addresses[s]) != own_host;
    any |= remote[s];
  }
  if (!any) remote.assign(addresses.size(), true);
  return remote;
}

// One layer's progress through the iteration being synchronised (guarded by Agent::layers_mu_).
struct LayerProgress {
  uint64_t posted = 0;       // last iteration posted ready
  uint64_t in_progress = 0;  // iteration being synchronised (0: none)
  int remaining = 0;         // parts left of in_progress
  bool failed = false;
  std::string failure;
  absl::Time ready_at;           // when in_progress was posted
  std::vector<uint8_t> pending;  // parts of in_progress not yet complete
  bool stall_reported = false;
  bool on_device = false;     // in_progress was posted on the GPU (its buffers are in the arena)
  Syncer* syncer = nullptr;   // of in_progress
  prometheus::Histogram* sync_seconds = nullptr;
  prometheus::Gauge* scheme_gauge = nullptr;
};

// A plan change not yet written into a layer's schedule (ComposeSchedule deferred it).
struct DeferredChange {
  uint32_t scheme;
  uint64_t switch_at;
  uint64_t epoch;
};

class Agent : public transport::FrameHandler, public std::enable_shared_from_this<Agent> {
 public:
  explicit Agent(AgentConfig config) : config_(std::move(config)) {}

  int Run();

  // Frames from the other agents (transport I/O threads): handed to the syncer that uses them.
  absl::StatusOr<transport::PayloadTarget> OnHeader(
      const std::shared_ptr<transport::PeerSession>& peer, const FrameHeader& header) override;
  void OnFrame(const std::shared_ptr<transport::PeerSession>& peer, const FrameHeader& header,
               transport::MutableBuffer payload) override;
  // A peer's connection closed: when it was that rank's last, the rank is gone (peers_mu_), and
  // the main loop tells the syncers (PassGonePeers), which fail what waits for it.
  void OnClose(const std::shared_ptr<transport::PeerSession>& peer,
               const absl::Status& reason) override;

 private:
  void PassGonePeers();
  absl::Status JoinCoordinator(const std::string& listen);
  void ProbeServers(const coordinator::World& world);
  absl::Status Register();
  absl::Status ConnectServers();
  absl::Status StartAtBackups(const std::map<uint32_t, absl::Status>& unreachable);
  absl::Status TakeUpRunningJob();
  absl::Status ReadmitToJob(uint64_t highest, uint64_t ring_from);
  // Checkpoints (AgentConfig::checkpoint_every): the job's label of this process's iteration,
  // and the request to every server once the iteration is complete on every layer.
  uint64_t JobIteration(uint64_t iteration) const {
    return iteration + std::max<uint64_t>(config_.resumed_iteration, 1) - 1;
  }
  // The coordinator hears of and plans in the job's iterations (a rank that took up the job,
  // or a resumed job, counts its process's from 1; SyncEnv::clock_base).
  std::atomic<uint64_t> iteration_base_{0};
  uint64_t ReportedIteration() const {
    const uint64_t done = last_iteration_.load();
    return done == 0 ? 0 : done + iteration_base_.load();
  }
  void MaybeCheckpoint(uint64_t next_iteration, bool final);
  // The copies servers hold of keys they stand by for (adopted before the checkpoint a job
  // resumes from, and restored as adopted), by key: its first primary and each server's progress.
  struct StandbyCopies {
    uint32_t primary = 0;
    std::string table;
    std::map<uint32_t, server::KeyProgress> at;
  };
  absl::Status NoteRestoredClocks(size_t server, const v1::RegisterTablesRequest& request,
                                  const std::vector<server::KeyProgress>& progress,
                                  std::map<uint64_t, uint32_t>& restored_at,
                                  std::map<uint64_t, StandbyCopies>* standby = nullptr);
  void NoteFallback(uint64_t key, const server::KeyProgress& p);
  void TakeStandbyCopies(const std::map<uint64_t, StandbyCopies>& standby);
  absl::Status ConnectPeers();
  // Whether this agent exchanges SFB factors with the others (a layer that can go by SFB, in a
  // world of several ranks): it connects to every peer agent at registration.
  bool ExchangesFactors() const {
    return config_.world_size > 1 &&
           std::any_of(table_.layers.begin(), table_.layers.end(),
                       [](const LayerSpec& st) { return st.sfb_capable; });
  }
  void OnReady(const Event& event);
  void Finished(uint32_t layer, uint64_t iteration, int part, const absl::Status& status);
  void AttachCuda();
  void Fatal(const std::string& why);
  void SetUpMetrics();
  void CheckStalls();
  void CountError(const std::string& kind);
  // Plan changes (main thread): the watcher thread hands new epochs over, ApplyPlan writes the
  // layers' schedules.
  void WatchPlans();
  // The KV servers the coordinator reports joined the running job go on every key's chain
  // (plan watcher thread; a rank taking up the running job: the main thread, before the
  // watcher starts, noting the copies they hold).
  void JoinNewServers(bool note_copies = false);
  void NoteJoinedCopies(const std::vector<server::KeyProgress>& progress);
  // `progress` (optional): the joined server's answer for its standby tables, in their order.
  absl::Status JoinServer(uint32_t slot, const std::vector<v1::PlanServer>& joined,
                          std::vector<server::KeyProgress>* progress = nullptr);
  // A rank taking up the running job (--rejoin), before it connects its servers: the
  // coordinator's word on the job's servers (declared dead, joined), from one heartbeat answer.
  void AwaitHeartbeatAnswer();
  void ApplyPendingPlan();
  // A world member the coordinator declared dead: every layer waiting, and every later one,
  // fails at once naming it (the iteration cannot complete without it).
  void CheckLostMembers();
  void FailDeclaredDeadServer(const v1::LostMember& m);
  absl::Status ApplyPlan(const v1::Plan& plan);
  void ApplyChange(uint32_t layer, uint32_t scheme, uint64_t switch_at, uint64_t epoch);
  uint32_t PlannedScheme(const v1::LayerPlan& lp, const LayerSpec& spec) const;
  // Ring all-reduce can run: several ranks, a coordinator for Gloo's rendezvous, the scheme not
  // forced to PS (which a server-side rule does) or SFB, no data_tls (Gloo's transport has
  // no TLS: no tensor may cross the network in clear), and a job that takes restarted ranks
  // back (--rejoin_timeout, --rejoin) only if it may shrink (--min_workers: a Gloo context
  // cannot change its members, but such a job's ring goes on in new rings — of the ranks left,
  // and with a rank coming back); the planner, told at registration, gives those layers PS or
  // SFB otherwise.
  bool AllreducePossible() const {
    return config_.allreduce && !config_.data_tls.enabled && coord_ != nullptr &&
           config_.world_size > 1 &&
           (config_.min_workers > 0 ||
            (config_.rejoin_timeout == absl::ZeroDuration() && !config_.rejoin)) &&
           (config_.scheme == "auto" || config_.scheme == "allreduce");
  }
  uint64_t RunningEpoch() const;

  AgentConfig config_;
  std::unique_ptr<coordinator::CoordinatorClient> coord_;
  std::unique_ptr<coordinator::HeartbeatLoop> heartbeats_;
  // With a coordinator: per-link bytes and per-layer sync times, reported periodically. Set in
  // JoinCoordinator, before any data-path thread can use it.
  std::unique_ptr<TelemetryReporter> telemetry_;
  std::atomic<uint64_t> last_iteration_{0};
  std::string own_host_;  // the host part of our listen address (empty: none)
  uint64_t membership_epoch_ = 0;  // the world's (from the rendezvous)
  std::unique_ptr<CoordinatorStore> rendezvous_;  // Gloo's, for all-reduce (null: none)
  std::unique_ptr<CoordinatorStore> ring_store_;  // the job's, for the all-reduce syncer
  // Replacements (node ids) the syncers heard of (PeerReturning); those already there when this
  // agent registered are not news (main thread).
  std::set<std::string> returning_told_;
  bool returning_baseline_ = false;
  // The Gloo ring, connected before the model's registration (its step goes with it; the
  // all-reduce syncer takes it over).
  std::optional<GlooRing> ring_;
  std::unique_ptr<ShmEndpoint> shm_;
  // The GPU path, once the training process has attached its CUDA arena. Owned here (main
  // thread); the syncers read the pointer (set once, before any layer is posted on the device;
  // destroyed after the workers and the transport stopped).
  std::unique_ptr<DeviceStager> stager_owner_;
  std::atomic<DeviceStager*> stager_{nullptr};
  // Observability: metrics (always collected; served when metrics_listen is set), timeline.
  MetricsRegistry metrics_;
  std::unique_ptr<MetricsExposer> exposer_;
  std::unique_ptr<Timeline> timeline_;
  prometheus::Histogram* iteration_seconds_ = nullptr;
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* credit_in_use_ = nullptr;
  prometheus::Gauge* plan_epoch_ = nullptr;
  prometheus::Gauge* peers_alive_ = nullptr;
  std::mutex iteration_mu_;
  std::map<uint64_t, size_t> layers_done_;  // iteration -> layers completed
  absl::Time last_iteration_end_;
  // The data plane's contexts (--transport, docs/operations.md "Transport"): TCP, RDMA, or both
  // (transports_.rdma is set only when viable). Set in Run, before any connection.
  transport::TransportSet transports_;
  // Whether each server (config_.servers' order) and each peer (rank order) is reached by RDMA:
  // its endpoint chosen by kind (coordinator::ChooseEndpoint), or all false without a
  // coordinator unless --transport=rdma.
  std::vector<bool> server_rdma_, peer_rdma_;
  // The TCP endpoint of a server or peer reached by RDMA, if RDMA fails (connect_fallback.h).
  std::vector<std::string> server_tcp_fallback_, peer_tcp_fallback_;
  std::vector<std::string> peer_unusable_;  // by rank: why no endpoint of that peer fits
  // The servers' addresses for each other, sent to them for replication
  // (coordinator::ServerToServerAddresses; config_.servers without a coordinator).
  std::vector<std::string> replication_servers_;
  std::string rdma_listen_;  // our RDMA listener's address when we serve both kinds
  std::shared_ptr<transport::FrameServer> sfb_server_rdma_;
  prometheus::Gauge* links_tcp_ = nullptr;   // poseidon_agent_links{transport="tcp"}
  prometheus::Gauge* links_rdma_ = nullptr;  // poseidon_agent_links{transport="rdma"}
  coordinator::LocalTransports Local() const {
    return {transports_.tcp != nullptr, transports_.rdma != nullptr};
  }
  transport::Context& ContextFor(bool rdma) const {
    transport::Context* c = transports_.For(rdma);
    return c != nullptr ? *c : transports_.Primary();
  }
  void CountLink(bool rdma) {
    if (prometheus::Gauge* g = rdma ? links_rdma_ : links_tcp_) g->Increment();
  }
  // One connect attempt's handshake with a server or a peer agent: a live one answers it at once
  // (its I/O threads run from its start), so one that took the connection but is silent for
  // peer_timeout is frozen (at most 10 s an attempt, as without peer_timeout), and the tries end
  // there (GiveUpWhenSilent) rather than after connect_timeout.
  absl::Duration HandshakeTimeout() const {
    return transport::HandshakeTimeoutFor(config_.peer_timeout, absl::Seconds(10));
  }
  bool GiveUpWhenSilent() const { return config_.peer_timeout > absl::ZeroDuration(); }
  transport::Credentials creds_;  // from the secret or the keyring (Run, before any connection)
  std::shared_ptr<transport::FrameServer> sfb_server_;

  // Fixed at registration (before any data-path thread reads them).
  LayerTable table_;
  std::unique_ptr<LayerSchedules> schedules_;
  std::unique_ptr<Scheduler> scheduler_;
  SyncEnv env_;
  std::map<SyncerKind, std::unique_ptr<Syncer>> syncers_;
  std::unique_ptr<PeerGate> peer_gate_;
  // The syncer taking the other agents' frames, published before our PING tells them to send.
  std::atomic<transport::FrameHandler*> peer_handler_{nullptr};
  std::atomic<bool> registered_{false};
  ShmEndpoint::ServerRule server_rule_;  // rule 0: sum (the framework's optimizer steps)

  std::mutex layers_mu_;
  std::vector<LayerProgress> progress_;
  // Checkpoints (main thread): the highest iteration an event named, the last one checkpointed.
  uint64_t last_iteration_seen_ = 0;
  uint64_t last_checkpoint_ = 0;

  // Plan epochs. The watcher thread puts the newest plan in pending_plan_ (under plan_mu_); the
  // main thread applies it. applied_* and deferred_ are the main thread's.
  std::mutex plan_mu_;
  std::optional<v1::Plan> pending_plan_;
  // Under plan_mu_: the newest plan received (registration, watcher), applied or not yet.
  std::optional<v1::Plan> latest_plan_;
  // Set once ConnectServers filled env_.servers (read by the heartbeat thread after).
  std::atomic<bool> servers_connected_{false};
  bool watcher_stop_ = false;
  std::thread watcher_;
  std::atomic<uint64_t> applied_epoch_{0};
  std::atomic<uint64_t> previous_epoch_{0};
  std::atomic<uint64_t> applied_at_{0};  // the applied epoch's effective iteration
  std::vector<std::vector<DeferredChange>> deferred_;  // by layer

  // Members of the world declared dead, from the heartbeat thread (lost_mu_); lost_why_ is the
  // main thread's once it acted on them.
  std::mutex lost_mu_;
  std::vector<v1::LostMember> lost_;
  std::vector<v1::LostMember> departed_;  // world agents that left with an error
  std::string lost_why_;
  std::set<std::string> servers_reported_lost_;  // main thread: lost servers failover covers
  std::set<std::string> ranks_awaited_;  // main thread: dead agents waited for (rejoin_timeout)
  std::set<uint32_t> ranks_removed_;       // main thread: dead ranks the job goes on without
  std::set<std::string> nodes_removed_;    // main thread: the agents whose rank was removed
  // The world trained with now (ranks, removals and returns so far): written by the main thread
  // (psd_world), read by the heartbeat thread (poseidon status).
  std::atomic<uint32_t> live_world_{0};
  std::atomic<uint64_t> took_up_at_{0};  // the job's iteration this rank took up (--rejoin)
  std::atomic<uint64_t> world_generation_{0};
  std::set<uint32_t> replaced_;  // under lost_mu_: ranks held by a live replacement (heartbeat)
  std::map<std::string, uint32_t> replaced_by_;  // under lost_mu_: those replacements' nodes
  // Under lost_mu_: heartbeat answers so far, and how many had come when this agent registered
  // (the replacements listed in the first answer after are the ones it found, not news).
  uint64_t heartbeat_seq_ = 0;
  uint64_t heartbeat_seq_at_register_ = 0;
  uint64_t replaced_by_version_ = 0;  // under lost_mu_: bumped when replaced_by_ changes
  uint64_t replaced_by_seen_ = 0;     // main thread: the version its syncers were told of
  // Under lost_mu_: the KV servers that joined the running job (heartbeat), in join order.
  std::vector<v1::PlanServer> joined_servers_;
  bool joined_mismatch_logged_ = false;  // under lost_mu_
  bool checkpoint_refused_logged_ = false;  // main thread
  // The plan's servers (replication: the joined ones' server-to-server addresses are chosen
  // with them). Fixed at registration.
  google::protobuf::RepeatedPtrField<v1::PlanServer> plan_servers_;
  // The plan watcher's: joined servers it gave up on (no usable endpoint, unreachable), logged
  // once; a later one cannot take a slot after it (the chains are in join order).
  bool joining_stuck_ = false;
  // Each server's registration (plan order) and the servers whose answer said this rank is out
  // of the job (removed while it was away): its replacement asks to be readmitted.
  std::vector<v1::RegisterTablesRequest> registrations_;
  std::set<size_t> removed_on_;

  // Inbound peer connections by rank (counted from their first frame) and the ranks whose last
  // one closed, with why; gone_version_ counts changes so the main loop passes them on once.
  std::mutex peers_mu_;
  std::map<uint32_t, int> peer_connections_;
  std::map<uint32_t, std::string> gone_peers_;
  std::map<uint32_t, std::string> peer_address_;  // of its latest inbound connection
  std::set<uint32_t> silent_peers_;                // gone for silence (back at their next frame)
  std::map<uint32_t, absl::Time> took_up_;         // when a restarted agent last took up a rank
  std::atomic<bool> silent_any_{false};            // !silent_peers_.empty(), read without a lock
  uint64_t gone_version_ = 0;
  uint64_t gone_passed_ = 0;  // main thread: the version the syncers have
  // Main thread, with --rejoin_timeout: since when each gone rank has been waited for (a
  // restarted agent may take it up), and what the syncers were last told.
  std::map<uint32_t, absl::Time> gone_since_;
  std::map<uint32_t, std::string> gone_told_;
  // When each rank's last frame reached us (steady ns; 0: none yet), written by transport
  // threads without a lock.
  std::unique_ptr<std::atomic<int64_t>[]> peer_last_ns_;
  absl::Time next_keepalive_ = absl::InfinitePast();  // main thread
  void SendKeepalives(absl::Time now);
};

void Agent::Fatal(const std::string& why) {
  PSD_LOG_ERROR("{}", why);
  if (shm_) shm_->SetState(PSD_AGENT_FAILED, why);
}

int Agent::Run() {
  if (config_.keyring.empty() == config_.secret.empty()) {
    PSD_LOG_ERROR("give the agent either the job's secret or its keyring (not {})",
                  config_.secret.empty() ? "neither" : "both");
    return 2;
  }
  if (config_.keyring.empty()) {
    creds_ = transport::Credentials::FromSecret(config_.secret, config_.job_id, config_.rank,
                                                config_.world_size);
  } else {
    auto creds = transport::Credentials::FromKeyring(config_.keyring, config_.job_id, config_.rank,
                                                     config_.world_size);
    if (!creds.ok()) {
      PSD_LOG_ERROR("bad keyring: {}", creds.status().message());
      return 2;
    }
    creds_ = *std::move(creds);
  }
  config_.secret.clear();  // from here on only the derived keys exist
  {
    transport::TcpOptions tcp;
    tcp.io_threads = 2;
    tcp.tls = config_.data_tls;
    transport::RdmaOptions rdma;
    // Without a coordinator the address lists (--servers, --peers) are of one kind: TCP unless
    // --transport=rdma.
    const bool lists_only = config_.coordinator.empty() && config_.transport == "auto";
    auto set = transport::MakeTransportSet(lists_only ? "tcp" : config_.transport, tcp, rdma);
    if (!set.ok()) {
      PSD_LOG_ERROR("refusing to start: {}", set.status().message());
      return 2;
    }
    transports_ = *std::move(set);
    PSD_LOG_INFO("transport: {}{}",
                 lists_only ? std::string("tcp (--transport=auto without a coordinator: --servers "
                                          "and --peers are TCP addresses)")
                            : transports_.choice,
                 tcp.tls.enabled && transports_.tcp
                     ? "; TCP with TLS (data_tls; ring all-reduce off: Gloo has no TLS)"
                     : "");
    const bool rdma_only = transports_.tcp == nullptr;
    server_rdma_.assign(config_.servers.size(), rdma_only);
    peer_rdma_.assign(config_.world_size, rdma_only);
    server_tcp_fallback_.assign(config_.servers.size(), "");
    peer_tcp_fallback_.assign(config_.world_size, "");
    peer_unusable_.assign(config_.world_size, "");
    replication_servers_ = config_.servers;
  }
  if (config_.segment.empty()) {
    config_.segment = absl::StrCat("/poseidon-", config_.job_id, "-", config_.rank);
  }
  auto shm = ShmEndpoint::Create(config_.segment, config_.rank, config_.world_size, config_.job_id);
  if (!shm.ok()) {
    PSD_LOG_ERROR("cannot create the shared-memory segment: {}", shm.status().message());
    return 1;
  }
  shm_ = std::move(*shm);
  shm_->SetRejoinTimeout(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(config_.rejoin_timeout)));
  // The heartbeat says "this agent process is alive" on its own thread: the main loop can be
  // busy for seconds (connecting to servers and peers during registration on a loaded machine),
  // and a training process must not take that for a dead agent.
  PeriodicThread heartbeat;
  heartbeat.Start(absl::Milliseconds(100), [shm = shm_.get()] { shm->Heartbeat(); },
                  /*run_now=*/true);
  SetUpMetrics();
  peer_gate_ = std::make_unique<PeerGate>(config_.world_size);
  peer_last_ns_ = std::make_unique<std::atomic<int64_t>[]>(config_.world_size);
  SchedulerOptions so;
  so.credit_bytes = config_.credit_bytes;
  so.priority = config_.priority;
  so.threads = config_.sync_threads;
  scheduler_ = std::make_unique<Scheduler>(
      so, Scheduler::Observers{
              [g = queue_depth_](size_t n) { g->Set(static_cast<double>(n)); },
              [g = credit_in_use_](uint64_t n) { g->Set(static_cast<double>(n)); }});
  if (!config_.metrics_listen.empty()) {
    auto exposer = MetricsExposer::Start(config_.metrics_listen, metrics_);
    if (!exposer.ok()) {
      Fatal(absl::StrCat("metrics: ", exposer.status().message()));
      return 1;
    }
    exposer_ = std::move(*exposer);
    std::printf("poseidon-agent metrics on %s\n", exposer_->address().c_str());
  }
  if (!config_.timeline.empty()) {
    std::string path = config_.timeline;
    if (auto at = path.find("{rank}"); at != std::string::npos) {
      path.replace(at, 6, std::to_string(config_.rank));
    }
    auto timeline = Timeline::Open(path, config_.rank);
    if (!timeline.ok()) {
      Fatal(std::string(timeline.status().message()));
      return 1;
    }
    timeline_ = std::move(*timeline);
  }
  // The SFB listener starts at once so that peers can connect while we wait for our framework.
  std::string listen =
      !config_.listen.empty()
          ? config_.listen
          : (config_.rank < config_.peers.size() ? config_.peers[config_.rank] : "");
  own_host_ = listen.empty() ? "" : HostOf(listen);
  if (!listen.empty()) {
    auto listener = transports_.Primary().Listen(listen);
    if (!listener.ok()) {
      Fatal(absl::StrCat("cannot listen for peers on ", listen, ": ", listener.status().message()));
      return 1;
    }
    // With a coordinator, port 0 takes any free port: the address registered is the bound one
    // (no window in which another process can take a port chosen in advance).
    if (!config_.coordinator.empty() && absl::EndsWith(listen, ":0")) {
      listen = (*listener)->Address();
    }
    auto secrets = std::make_shared<transport::SecretStore>();
    secrets->SetKeys(config_.job_id, creds_.peer_keys());
    sfb_server_ = std::make_shared<transport::FrameServer>(*listener, secrets, shared_from_this());
    sfb_server_->Start();
    // Serving both kinds (a coordinator, --transport=auto with a device): RDMA peers connect to
    // a listener of their own (an RDMA listener serves RDMA clients only), on any port.
    if (transports_.tcp && transports_.rdma) {
      auto rdma_listener = transports_.rdma->Listen(absl::StrCat(own_host_, ":0"));
      if (!rdma_listener.ok()) {
        Fatal(absl::StrCat("cannot listen for RDMA peers on ", own_host_, ": ",
                           rdma_listener.status().message()));
        sfb_server_->Stop();
        sfb_server_.reset();
        transports_.Close();
        return 1;
      }
      rdma_listen_ = (*rdma_listener)->Address();
      sfb_server_rdma_ =
          std::make_shared<transport::FrameServer>(*rdma_listener, secrets, shared_from_this());
      sfb_server_rdma_->Start();
    }
  }
  if (!config_.coordinator.empty()) {
    if (auto s = JoinCoordinator(listen); !s.ok()) {
      Fatal(absl::StrCat("joining the coordinator ", config_.coordinator, ": ", s.message()));
      if (sfb_server_) sfb_server_->Stop();
      if (sfb_server_rdma_) sfb_server_rdma_->Stop();
      sfb_server_.reset();
      sfb_server_rdma_.reset();
      transports_.Close();
      return 1;
    }
  }
  PSD_LOG_INFO(
      "agent rank {}/{} of job {}: segment {}, {} servers{}", config_.rank, config_.world_size,
      config_.job_id, config_.segment, config_.servers.size(),
      listen.empty()
          ? ""
          : absl::StrCat(", peers on ", listen,
                         rdma_listen_.empty() ? "" : absl::StrCat(" and rdma://", rdma_listen_)));
  std::printf("poseidon-agent ready on %s\n", config_.segment.c_str());
  std::fflush(stdout);

  scheduler_->Start();
  auto stop = [&](int code) {
    peer_gate_->Stop();
    for (auto& [kind, syncer] : syncers_) syncer->Stop();
    scheduler_->Stop();
    {
      std::lock_guard<std::mutex> lock(plan_mu_);
      watcher_stop_ = true;
    }
    if (telemetry_) telemetry_->Stop();
    if (heartbeats_) heartbeats_->Stop();
    // The KV servers first: they (and through them the other ranks) learn at once that this
    // rank is gone, not after the plan watcher's parked call returns (up to a second).
    env_.replication.stopping.store(true, std::memory_order_release);
    for (auto& s : env_.servers) s->Close();
    if (coord_) {
      (void)coord_->Deregister(code == 0 ? "training finished" : "agent exiting", code != 0);
    }
    if (watcher_.joinable()) watcher_.join();
    env_.joined.stuck.store(true, std::memory_order_release);  // nothing more is taken up
    env_.joined.Unpark();
    for (uint32_t j = 0; j < env_.joined.Count(); ++j) env_.joined.clients[j]->Close();
    if (sfb_server_) sfb_server_->Stop();
    if (sfb_server_rdma_) sfb_server_rdma_->Stop();
    transports_.Close();
    // Drains the device streams (their callbacks use the timeline) and unpins the segment.
    stager_.store(nullptr);
    stager_owner_.reset();
    timeline_.reset();  // closes the JSON
    exposer_.reset();
    // Break the ownership cycle agent -> frame server -> handler (this agent).
    sfb_server_.reset();
    sfb_server_rdma_.reset();
    env_.servers.clear();
    env_.peers.Clear();
    return code;
  };

  const absl::Time attach_deadline = absl::Now() + config_.attach_timeout;
  while (true) {
    if (stop_requested.load()) {
      PSD_LOG_INFO("stop requested; the agent of rank {} exits", config_.rank);
      shm_->SetState(PSD_AGENT_EXITED, "the agent was stopped");
      return stop(0);
    }
    shm_->Heartbeat();
    if (auto s = shm_->CheckFramework(); !s.ok()) {
      PSD_LOG_ERROR("{}; the agent of rank {} exits", s.message(), config_.rank);
      shm_->SetState(PSD_AGENT_EXITED, std::string(s.message()));
      return stop(3);
    }
    if (!shm_->attached() && !registered_.load() && absl::Now() > attach_deadline) {
      Fatal(absl::StrCat("no training process attached to ", config_.segment, " within ",
                         absl::FormatDuration(config_.attach_timeout)));
      return stop(1);
    }
    if (registered_.load()) {
      const absl::Time now = absl::Now();
      SendKeepalives(now);
      PassGonePeers();
      for (auto& [kind, syncer] : syncers_) syncer->CheckDeadlines(now);
      CheckStalls();
      ApplyPendingPlan();
      CheckLostMembers();
    }
    auto event = shm_->NextEvent(absl::Milliseconds(100));
    if (!event.ok()) {
      PSD_LOG_WARN("bad event from the training process: {}", event.status().message());
      CountError("bad_event");
      continue;
    }
    if (!event->has_value()) continue;
    const Event e = **event;
    switch (e.type) {
      case PSD_EVENT_REGISTER:
        if (registered_.load()) {
          PSD_LOG_WARN("a second registration was ignored");
          break;
        }
        if (auto s = Register(); !s.ok()) {
          const std::string why = absl::StrCat("registration failed: ", s.message());
          shm_->FailRegistration(why);
          Fatal(why);
          return stop(1);
        }
        registered_.store(true);
        {
          // The replacements alive when this rank registered are not news to its syncers
          // (PeerReturning): the last heartbeat answer's, or else the first one's after.
          std::lock_guard<std::mutex> lock(lost_mu_);
          heartbeat_seq_at_register_ = heartbeat_seq_;
          if (heartbeat_seq_ > 0) {
            for (const auto& [node, rank] : replaced_by_) returning_told_.insert(node);
            replaced_by_seen_ = replaced_by_version_;
            returning_baseline_ = true;
          }
        }
        if (coord_) watcher_ = std::thread([this] { WatchPlans(); });
        break;
      case PSD_EVENT_LAYER_READY:
        OnReady(e);
        break;
      case PSD_EVENT_CUDA_ATTACH:
        AttachCuda();
        break;
      case PSD_EVENT_DETACH:
        PSD_LOG_INFO("the training process detached; the agent of rank {} exits", config_.rank);
        MaybeCheckpoint(0, /*final=*/true);
        return stop(0);
      default:
        break;
    }
  }
}

absl::Status Agent::JoinCoordinator(const std::string& listen) {
  if (listen.empty() || absl::StartsWith(listen, "0.0.0.0:") || absl::StartsWith(listen, "[::]:")) {
    return absl::InvalidArgumentError(
        "--listen must name a host the peers can reach (host:port, or host:0 for any port)");
  }
  ASSIGN_OR_RETURN(
      coord_, coordinator::CoordinatorClient::Connect(config_.coordinator,
                                                      absl::StrCat(config_.job_id),
                                                      config_.coordinator_token,
                                                      config_.coordinator_tls));
  coordinator::AgentRegistration reg;
  char host[256] = {};
  reg.host = gethostname(host, sizeof(host) - 1) == 0 && host[0] ? host : "unknown-host";
  reg.gpu_index =
      config_.local_rank >= 0 ? static_cast<uint32_t>(config_.local_rank) : config_.rank;
  // Every kind this agent serves (an RDMA-only agent's one listener is its RDMA endpoint).
  if (transports_.tcp) {
    reg.endpoints.push_back(coordinator::MakeEndpoint(v1::TRANSPORT_KIND_TCP, listen));
  }
  if (transports_.rdma) {
    reg.endpoints.push_back(coordinator::MakeEndpoint(v1::TRANSPORT_KIND_RDMA,
                                                      transports_.tcp ? rdma_listen_ : listen));
  }
  reg.world_size = config_.world_size;
  reg.requested_rank = config_.rank;
  const absl::Time deadline = absl::Now() + config_.connect_timeout;
  absl::StatusOr<coordinator::World> joined =
      coord_->RegisterAgentAndRendezvous(reg, config_.connect_timeout);
  // A replacement on another host or GPU (--rejoin): the dead agent holds the rank until the
  // coordinator declares it dead (its lease), so the slot is asked for again until then.
  bool logged = false;
  while (config_.rejoin && joined.status().code() == absl::StatusCode::kAlreadyExists &&
         absl::Now() + absl::Milliseconds(500) < deadline) {
    if (!logged) {
      PSD_LOG_WARN("rank {} is still held by the agent this one replaces ({}); asking again until "
                   "the coordinator declares it dead", config_.rank, joined.status().message());
      logged = true;
    }
    absl::SleepFor(absl::Milliseconds(500));
    joined = coord_->RegisterAgentAndRendezvous(reg, deadline - absl::Now());
  }
  ASSIGN_OR_RETURN(coordinator::World world, std::move(joined));
  if (world.rank != config_.rank || world.world_size != config_.world_size) {
    return absl::InternalError(absl::StrCat("the coordinator gave rank ", world.rank, " of ",
                                            world.world_size, ", not ", config_.rank, " of ",
                                            config_.world_size));
  }
  membership_epoch_ = world.membership_epoch;
  config_.peers.clear();
  peer_rdma_.assign(config_.world_size, false);
  peer_tcp_fallback_.assign(config_.world_size, "");
  peer_unusable_.assign(config_.world_size, "");
  for (const auto& peer : world.peers) {
    const size_t p = config_.peers.size();
    auto chosen = coordinator::ChooseEndpoint(
        peer.endpoints(), Local(),
        absl::StrCat("peer agent of rank ", p, " (", peer.node_id(), ")"));
    if (!chosen.ok()) {
      // Only SFB needs the peers: ConnectPeers fails naming it if this job does.
      if (p < peer_unusable_.size()) peer_unusable_[p] = std::string(chosen.status().message());
      config_.peers.push_back("");
      continue;
    }
    if (p < peer_rdma_.size()) {
      peer_rdma_[p] = chosen->kind == v1::TRANSPORT_KIND_RDMA;
      peer_tcp_fallback_[p] = chosen->tcp_fallback;
    }
    config_.peers.push_back(chosen->address);
  }
  coordinator::CoordinatorClient::HeartbeatOptions hb;
  hb.iteration = [this] { return ReportedIteration(); };
  hb.plan_epoch = [this] { return RunningEpoch(); };
  // A rank that took up the running job says at which iteration (TakeUpRunningJob runs after
  // the heartbeats start): the others count it (psd_takeovers).
  hb.took_up_at = [this] { return took_up_at_.load(); };
  if (config_.min_workers > 0) {
    hb.world = [this] {
      return std::pair<uint32_t, uint64_t>{live_world_.load(), world_generation_.load()};
    };
    // The ranks whose connections to this agent all closed: a killed agent is then declared
    // dead once it misses its heartbeats, and removed (SFB layers wait for that word).
    hb.peers_gone = [this] {
      std::vector<uint32_t> gone;
      std::lock_guard<std::mutex> lock(peers_mu_);
      for (const auto& [rank, why] : gone_peers_) {
        if (rank < config_.world_size && rank != config_.rank) gone.push_back(rank);
      }
      return gone;
    };
  }
  // The world this rank joined is the one it runs: a restarted coordinator gets the same rank,
  // and the job's model, plan and joined servers from its agents (Registry::TakeUpRunningPlan).
  hb.register_again = true;
  hb.on_registered_again = [this] {
    std::optional<v1::Plan> plan;
    {
      std::lock_guard<std::mutex> lock(plan_mu_);
      plan = latest_plan_;
    }
    if (!plan) return;  // its model is not registered yet: registration does it
    std::vector<std::string> joined, lost;
    {
      std::lock_guard<std::mutex> lock(lost_mu_);
      for (const v1::PlanServer& server : joined_servers_) joined.push_back(server.node_id());
    }
    // The plan's servers this agent lost (their keys moved on), once its servers are connected.
    if (servers_connected_.load(std::memory_order_acquire)) {
      for (size_t s = 0; s < env_.servers.size() && s < static_cast<size_t>(plan->servers_size());
           ++s) {
        if (env_.servers[s]->Broken() || env_.replication.Epoch(static_cast<uint32_t>(s)) > 0) {
          lost.push_back(plan->servers(static_cast<int>(s)).node_id());
        }
      }
    }
    if (absl::Status s = coord_->RegisterModelAgain(*plan, joined, lost); s.ok()) {
      PSD_LOG_WARN("registered the model again with the coordinator, running plan epoch {}",
                   plan->plan_epoch());
    } else {
      PSD_LOG_WARN("registering the model again with the coordinator failed: {}", s.message());
    }
  };
  hb.on_result = [this](const absl::StatusOr<v1::HeartbeatResponse>& result) {
    if (!result.ok()) {
      PSD_LOG_WARN("heartbeat to the coordinator failed: {}", result.status().message());
      return;
    }
    if (result->shutdown()) {
      PSD_LOG_WARN("the coordinator asks this agent to shut down (declared dead or replaced)");
    }
    shm_->SetTakeovers(result->takeovers());
    std::lock_guard<std::mutex> lock(lost_mu_);
    replaced_ = std::set<uint32_t>(result->replaced().begin(), result->replaced().end());
    ++heartbeat_seq_;
    std::map<std::string, uint32_t> by;
    for (int i = 0; i < result->replaced_size() && i < result->replaced_by_size(); ++i) {
      by[result->replaced_by(i)] = result->replaced(i);
    }
    if (by != replaced_by_) {
      replaced_by_ = std::move(by);
      ++replaced_by_version_;
    }
    // The joined servers' order is their place in every chain: only a list that extends the
    // one taken so far is taken (a restarted coordinator forgets it, and may list others).
    const auto listed = static_cast<size_t>(result->joined_servers_size());
    bool agrees = true;
    for (size_t j = 0; agrees && j < std::min(listed, joined_servers_.size()); ++j) {
      agrees = result->joined_servers(static_cast<int>(j)).node_id() ==
               joined_servers_[j].node_id();
    }
    if (agrees && listed > joined_servers_.size()) {
      joined_servers_.assign(result->joined_servers().begin(), result->joined_servers().end());
      env_.joined.announced.store(static_cast<uint32_t>(listed), std::memory_order_release);
    } else if (!agrees || (listed > 0 && listed < joined_servers_.size())) {
      if (!joined_mismatch_logged_) {
        joined_mismatch_logged_ = true;
        PSD_LOG_WARN("the coordinator lists {} servers joined to the job, not the {} this agent "
                     "took up (a restarted coordinator?): only a list that extends this agent's "
                     "is taken up",
                     listed, joined_servers_.size());
      }
    }
    if (result->lost_size() == 0 && result->departed_size() == 0) return;
    // The coordinator lists every member lost so far: a later answer may add one.
    lost_.assign(result->lost().begin(), result->lost().end());
    departed_.assign(result->departed().begin(), result->departed().end());
  };
  heartbeats_ = coord_->StartHeartbeats(hb);
  if (config_.telemetry_interval > absl::ZeroDuration()) {
    std::vector<std::string> servers, peers;
    for (const auto& server : world.servers) servers.push_back(server.node_id());
    for (const auto& peer : world.peers) peers.push_back(peer.node_id());
    telemetry_ = std::make_unique<TelemetryReporter>(
        coord_.get(), config_.telemetry_interval, std::move(servers), std::move(peers),
        config_.rank, [this] { return ReportedIteration(); });
    telemetry_->Start();
  }
  PSD_LOG_INFO("rendezvous with {}: rank {} of {}, {} servers", config_.coordinator, world.rank,
               world.world_size, world.servers.size());
  if (config_.probe_bytes > 0) ProbeServers(world);
  return absl::OkStatus();
}

// The first plan from a measurement: each server link's capacity by a probe, reported before
// this rank registers its model (the coordinator plans once every rank has). A failed probe is
// only logged: the plan then assumes the configured bandwidth.
void Agent::ProbeServers(const coordinator::World& world) {
  // One rank after the other (the world formed for all of them at once): probes of several
  // ranks at the same server at the same time would share its link and each measure a part. A
  // slot is twice the probe's time at the configured bandwidth, the whole wait at most 5 s.
  const absl::Duration slot =
      absl::Seconds(2.0 * static_cast<double>(config_.probe_bytes) /
                    std::max(config_.bandwidth_bytes_per_second, 1e6)) +
      absl::Milliseconds(10);
  absl::SleepFor(std::min(slot * static_cast<double>(config_.rank), absl::Seconds(5)));
  std::vector<v1::LinkTelemetry> links;
  std::vector<std::string> addresses;
  std::vector<bool> rdma;
  for (const v1::ServerInfo& server : world.servers) {
    auto chosen = coordinator::ChooseEndpoint(server.endpoints(), Local(),
                                              absl::StrCat("server ", server.node_id()));
    if (!chosen.ok()) PSD_LOG_WARN("bandwidth probe: {}", chosen.status().message());
    addresses.push_back(chosen.ok() ? chosen->address : "");
    rdma.push_back(chosen.ok() && chosen->kind == v1::TRANSPORT_KIND_RDMA);
  }
  const std::vector<bool> measured = MeasuredServers(addresses, own_host_);
  for (size_t s = 0; s < world.servers.size(); ++s) {
    const v1::ServerInfo& server = world.servers[s];
    if (addresses[s].empty() || !measured[s]) continue;
    const std::string& address = addresses[s];
    absl::StatusOr<server::KvClient::Probe> bandwidth = absl::UnavailableError("not connected");
    auto client = server::KvClient::Connect(ContextFor(rdma[s]), address, config_.job_id,
                                            config_.rank, creds_.server_key(), absl::Seconds(10));
    if (client.ok()) {
      bandwidth = (*client)->MeasureBandwidth(config_.probe_bytes, 2, absl::Seconds(10));
      (*client)->Close();
    } else {
      bandwidth = client.status();
    }
    if (!bandwidth.ok()) {
      PSD_LOG_WARN("bandwidth probe of server {} ({}): {}", server.node_id(), address,
                   bandwidth.status().message());
      continue;
    }
    PSD_LOG_INFO("server {} ({}): {:.3g} Gbit/s measured by a {}-byte probe, round trip {}",
                 server.node_id(), address, bandwidth->bytes_per_second * 8 / 1e9,
                 config_.probe_bytes, absl::FormatDuration(bandwidth->round_trip));
    v1::LinkTelemetry link;
    link.set_peer_node_id(server.node_id());
    link.set_transport(LinkKind(rdma[s]));
    link.set_capacity_bytes_per_second(bandwidth->bytes_per_second);
    // The first plan's latency too (round trip / 2 for the coordinator), instead of its nominal.
    link.set_latency_ns(static_cast<uint64_t>(
        std::max<int64_t>(1, absl::ToInt64Nanoseconds(bandwidth->round_trip))));
    links.push_back(std::move(link));
  }
  if (links.empty()) return;
  if (absl::Status s = coord_->ReportTelemetry(links, 0); !s.ok()) {
    PSD_LOG_WARN("reporting the bandwidth probes: {}", s.message());
  }
}

absl::Status Agent::Register() {
  ASSIGN_OR_RETURN(std::vector<LayerDesc> descs, shm_->ReadLayers());
  ASSIGN_OR_RETURN(server_rule_, shm_->ReadServerRule());
  // A server-side rule keeps parameters on the servers: every layer goes by PS.
  if (server_rule_.rule != 0) config_.scheme = "ps";
  for (const LayerDesc& d : descs) {
    if (d.counters && server_rule_.rule == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", d.name, " is a layer of counters (PSD_LAYER_COUNTERS), which the KV servers "
          "hold under a server-side rule: set one first (psd_set_server_rule)"));
    }
  }
  if (config_.min_workers > config_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("--min_workers ", config_.min_workers,
                                                   " exceeds the world size ",
                                                   config_.world_size));
  }
  v1::ModelSpec model;
  model.set_name(absl::StrCat("job-", config_.job_id));
  for (const auto& d : descs) {
    auto* l = model.add_layers();
    l->set_name(d.name);
    // "ps" and "allreduce" keep every layer on one scheme: present FC layers as "other" to the
    // planner.
    l->set_kind(d.kind == PSD_KIND_FC && (config_.scheme == "ps" || config_.scheme == "allreduce")
                    ? v1::LAYER_KIND_OTHER
                    : static_cast<v1::LayerKind>(d.kind));
    for (uint64_t s : d.shape) l->add_shape(s);
    l->set_element_type(v1::ELEMENT_TYPE_F32);
    l->set_batch_per_worker(d.kind == PSD_KIND_FC ? d.batch_k : 1);
  }
  v1::Plan plan;
  if (coord_) {
    // Every rank registers its model; the coordinator answers with the job's plan once all of
    // them registered the same model (or names the first layer that differs).
    v1::UpdateRuleSpec rule;
    rule.set_rule(v1::UPDATE_RULE_SUM);
    // Where the ring can run, every rank connects it first and measures its step, which goes
    // with the model: the coordinator's first plan can then weigh the ring (--allreduce_by_cost),
    // and that plan decides the all-reduce buckets for the world (docs/planner.md).
    // A rank taking up the running job comes into the others' ring later (AllreduceSyncer::
    // ComeBack): they connect no ring of the world now.
    if (AllreducePossible() && !config_.rejoin) {
      // Keys of this world only (a later world of the job rendezvouses afresh).
      rendezvous_ = std::make_unique<CoordinatorStore>(
          coord_.get(), absl::StrCat("gloo/", membership_epoch_, "/"), config_.connect_timeout);
      ASSIGN_OR_RETURN(ring_, ConnectGlooRing(*rendezvous_, config_.rank, config_.world_size,
                                              own_host_, config_.sync_timeout));
    }
    ASSIGN_OR_RETURN(plan, coord_->RegisterModel(model, rule, {}, config_.attach_timeout,
                                                 AllreducePossible(),
                                                 config_.allreduce_bucket_bytes,
                                                 ring_ ? ring_->step : absl::ZeroDuration()));
    {
      std::lock_guard<std::mutex> lock(plan_mu_);
      latest_plan_ = plan;  // a restarted coordinator learns it from here (on_registered_again)
    }
    config_.servers.clear();
    server_rdma_.clear();
    server_tcp_fallback_.clear();
    for (const auto& server : plan.servers()) {
      if (server.endpoints_size() == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("the plan names server ", server.node_id(), " without an address"));
      }
      ASSIGN_OR_RETURN(coordinator::ChosenEndpoint chosen,
                       coordinator::ChooseEndpoint(server.endpoints(), Local(),
                                                   absl::StrCat("server ", server.node_id())));
      server_rdma_.push_back(chosen.kind == v1::TRANSPORT_KIND_RDMA);
      server_tcp_fallback_.push_back(chosen.tcp_fallback);
      config_.servers.push_back(chosen.address);
    }
    replication_servers_ = config_.servers;
    plan_servers_ = plan.servers();
    if (config_.replicas > 0 && plan.servers_size() > 1) {
      ASSIGN_OR_RETURN(replication_servers_, coordinator::ServerToServerAddresses(plan.servers()));
    }
  } else {
    planner::PlannerConfig pc;
    pc.workers = config_.world_size;
    pc.servers = std::max<uint32_t>(1, static_cast<uint32_t>(config_.servers.size()));
    pc.colocated = config_.colocated;
    pc.bandwidth_bytes_per_second = config_.bandwidth_bytes_per_second;
    pc.block_bytes = config_.block_bytes;
    pc.job_id = absl::StrCat(config_.job_id);
    pc.allreduce = false;  // its rendezvous needs the coordinator
    pc.lossy_wire = *planner::ParseWireType(config_.plan_lossy_wire);  // checked by OneOf
    ASSIGN_OR_RETURN(planner::PlanResult planned, planner::BuildPlan(model, pc));
    plan = std::move(planned.plan);
  }
  LayerTableOptions to;
  to.world_size = config_.world_size;
  to.force_sfb = config_.scheme == "sfb";
  to.sfb_possible = config_.scheme != "ps" && config_.scheme != "allreduce" &&
                    (config_.world_size == 1 || config_.peers.size() == config_.world_size);
  to.allreduce_possible = AllreducePossible();
  to.force_allreduce = config_.scheme == "allreduce";
  if (config_.scheme == "allreduce" && !to.allreduce_possible) {
    return absl::FailedPreconditionError(
        "--scheme=allreduce needs several ranks and a coordinator (Gloo's rendezvous store), "
        "no server-side update rule, and with --rejoin_timeout or --rejoin also --min_workers "
        "(a ring takes a restarted rank back only in a job that may shrink)");
  }
  to.fusion_from_plan = config_.fusion == "plan";
  if (config_.wire != "plan") to.force_wire = ParseWireName(config_.wire);
  to.lossy_possible = server_rule_.rule == 0;
  if (to.force_wire.has_value() && IsLossy(*to.force_wire) && !to.lossy_possible) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--wire=", config_.wire, " needs the sum rule, and the training process asked for a "
        "server-side update rule (its pulls return parameters, which must stay exact)"));
  }
  if (config_.lowrank_rank >= 0) to.force_lowrank = static_cast<uint32_t>(config_.lowrank_rank);
  if (config_.lowrank_rank > 0 && !to.lossy_possible) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--lowrank_rank=", config_.lowrank_rank, " needs the sum rule, and the training process "
        "asked for a server-side update rule (its pulls return parameters, which must stay "
        "exact)"));
  }
  to.bucket_bytes = config_.fusion == "bytes" ? config_.bucket_bytes : 0;
  to.allreduce_bucket_bytes = config_.allreduce_bucket_bytes;
  if (config_.scheme == "sfb" && !to.sfb_possible) {
    return absl::FailedPreconditionError(
        absl::StrCat("SFB layers need every agent's address (--peers: ", config_.world_size,
                     " entries, got ", config_.peers.size(), ")"));
  }
  // A rank taking up a running job whose plan runs layers by ring all-reduce (a job that may
  // shrink: its ranks left went on in a ring without this one) cannot join that ring.
  if (config_.rejoin && !to.allreduce_possible) {
    for (const v1::LayerPlan& lp : plan.layers()) {
      if (lp.scheme() != v1::SYNC_SCHEME_ALLREDUCE) continue;
      return absl::FailedPreconditionError(
          absl::StrCat("the job's plan runs layer ", lp.layer_name(),
                       " (and maybe others) by ring all-reduce, and a ring takes a rank back "
                       "only in a job that may shrink: this rank cannot take up the running job "
                       "(give every agent the same --min_workers, or run with --scheme ps, sfb "
                       "or auto without all-reduce)"));
    }
  }
  auto table = BuildLayerTable(descs, plan, to);
  if (!table.ok()) {
    // The plan chose SFB where this agent cannot run it (no peer addresses): say what to pass.
    if (!to.sfb_possible && absl::StrContains(table.status().message(), "SFB")) {
      return absl::FailedPreconditionError(
          absl::StrCat("SFB layers need every agent's address (--peers: ", config_.world_size,
                       " entries, got ", config_.peers.size(), ")"));
    }
    return table.status();
  }
  table_ = *std::move(table);
  bool any_ps = false;
  for (LayerSpec& st : table_.layers) {
    // Without servers an SFB layer's chunks are of no use: it stays on SFB.
    if (config_.servers.empty() && st.layout.scheme == PSD_SCHEME_SFB) st.chunks.clear();
    any_ps |= !st.chunks.empty();
  }
  if (any_ps && config_.servers.empty()) {
    return absl::FailedPreconditionError("PS layers need KV servers (--servers)");
  }
  schedules_ = std::make_unique<LayerSchedules>(table_.layers.size());
  progress_.resize(table_.layers.size());
  deferred_.resize(table_.layers.size());
  for (uint32_t i = 0; i < table_.layers.size(); ++i) {
    schedules_->Set(i, Schedule::Fixed(table_.layers[i].layout.scheme));
  }
  applied_epoch_.store(plan.plan_epoch());
  previous_epoch_.store(plan.plan_epoch());

  env_.config = &config_;
  env_.table = &table_;
  env_.shm = shm_.get();
  env_.scheduler = scheduler_.get();
  env_.timeline = timeline_.get();
  env_.telemetry = telemetry_.get();
  env_.stager = &stager_;
  env_.peer_gate = peer_gate_.get();
  env_.server_rule = server_rule_.rule;
  env_.wire_guard.check_every = config_.wire_check_every;
  env_.wire_guard.max_error = config_.wire_max_error;
  if (to.allreduce_possible) {
    // The job's keys; the syncer's of this world are under ring_world (a later world of the job
    // rendezvouses afresh), a returning rank's question outside it.
    ring_store_ = std::make_unique<CoordinatorStore>(coord_.get(), "gloo/",
                                                     config_.connect_timeout);
    env_.rendezvous = ring_store_.get();
    env_.ring_world = absl::StrCat(membership_epoch_);
    env_.ring = ring_ ? &*ring_ : nullptr;
  }
  env_.own_host = own_host_;
  env_.finished = [this](uint32_t layer, uint64_t iteration, int part, const absl::Status& s) {
    Finished(layer, iteration, part, s);
  };
  for (const SyncerRow& row : SyncerTable()) {
    std::unique_ptr<Syncer> syncer = row.make(env_);
    if (transport::FrameHandler* h = syncer->peer_handler()) peer_handler_.store(h);
    syncers_[row.kind] = std::move(syncer);
  }
  if (!table_.buckets.empty()) {
    size_t fused = 0;
    for (const BucketSpec& b : table_.buckets) fused += b.members.size();
    uint64_t largest = 0;
    for (const BucketSpec& b : table_.buckets) largest = std::max(largest, b.chunk.length);
    PSD_LOG_INFO("{} small layers fused into {} buckets (largest {} bytes; {})", fused,
                 table_.buckets.size(), largest,
                 config_.fusion == "plan"
                     ? absl::StrCat("the plan's, target ", plan.bucket_bytes(), " bytes")
                     : absl::StrCat("--bucket_bytes=", config_.bucket_bytes));
  }
  if (!table_.ring_groups.empty()) {
    size_t fused = 0;
    uint64_t largest = 0;
    for (const RingGroupSpec& g : table_.ring_groups) {
      fused += g.members.size();
      largest = std::max(largest, g.bytes);
    }
    PSD_LOG_INFO("{} all-reduce layers fused into {} all-reduce buckets (largest {} bytes; "
                 "--allreduce_bucket_bytes={})", fused, table_.ring_groups.size(), largest,
                 config_.allreduce_bucket_bytes);
  }
  // The coordinator's planner predicted the same buckets (LayerPlan.allreduce_bucket, from the
  // agents' rule); where this agent formed others (layers on the GPU are not fused, a forced
  // scheme), the plan's times for those layers are off: say so once.
  if (coord_ && to.allreduce_possible && !to.force_allreduce) {
    size_t differ = 0;
    for (int i = 0; i < plan.layers_size(); ++i) {
      const int group = table_.layers[static_cast<size_t>(i)].ring_group;
      const uint32_t planned = plan.layers(i).allreduce_bucket();
      differ += (group < 0 ? planned != 0 : planned != static_cast<uint32_t>(group) + 1);
    }
    if (differ > 0) {
      PSD_LOG_WARN("{} layers are in other all-reduce buckets than the plan predicted (this "
                   "agent fuses only host-memory layers): the plan's times for them are off",
                   differ);
    }
  }
  {
    std::map<std::string, size_t> lossy;  // by wire name
    size_t planned_lossy = 0;
    for (int i = 0; i < plan.layers_size(); ++i) {
      const LayerSpec& st = table_.layers[static_cast<size_t>(i)];
      if (st.chunks.empty()) continue;
      if (IsLossy(st.wire)) ++lossy[WireName(st.wire)];
      const v1::ElementType planned = plan.layers(i).wire_type();
      if (planner::IsLossyWire(planned)) ++planned_lossy;
    }
    std::vector<std::string> parts;
    for (const auto& [name, count] : lossy) parts.push_back(absl::StrCat(count, " ", name));
    if (!parts.empty()) {
      PSD_LOG_INFO("{} of {} layers' PS keys on a lossy wire ({}; error feedback)",
                   absl::StrJoin(parts, ", "), table_.layers.size(),
                   config_.wire == "plan" ? "the plan's" : absl::StrCat("--wire=", config_.wire));
    }
    if (config_.wire == "plan" && !to.lossy_possible && planned_lossy > 0) {
      PSD_LOG_WARN("the plan puts {} layers on a lossy wire; with a server-side update rule "
                   "(exact parameters) they stay float32", planned_lossy);
    }
  }
  if (any_ps) {
    if (config_.rejoin) AwaitHeartbeatAnswer();
    RETURN_IF_ERROR(ConnectServers());
  }
  if (config_.rejoin) {
    RETURN_IF_ERROR(TakeUpRunningJob());
    // The others may need to hand this rank their state (psd_takeovers): tell it at once.
    if (took_up_at_.load() > 1 && heartbeats_) heartbeats_->BeatNow();
  }
  // SFB frames carry the job's iteration (a rank taking up the job starts at its iteration T).
  env_.clock_base = std::max<uint64_t>(config_.resumed_iteration, 1) - 1;
  iteration_base_.store(env_.clock_base);
  if (!config_.joined_marker.empty()) {
    // A restart of this agent (its container) finds it and rejoins (--rejoin_if_restarted).
    std::ofstream marker(config_.joined_marker, std::ios::trunc);
    marker << "job " << config_.job_id << " rank " << config_.rank << "\n";
    if (!marker.flush()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--rejoin_if_restarted: cannot write ", config_.joined_marker));
    }
  }
  if (ExchangesFactors()) {
    // Every layer's syncer and inbox exist now: peers send factors as soon as they have our
    // PING below, so the inbound path must be open first (a frame refused here would cost that
    // peer's connection and leave this layer waiting forever).
    // A readmission connected them already (ReadmitToJob).
    if (env_.peers.size() == 0) RETURN_IF_ERROR(ConnectPeers());
    for (uint32_t p = 0; p < config_.world_size; ++p) {
      if (p == config_.rank) continue;
      FrameHeader ping;
      ping.type = FrameType::kPing;
      ping.job_id = config_.job_id;
      ping.sender_rank = config_.rank;
      // Taking up the running job: the iteration it takes up, which tells the others to send
      // this agent their frames on this connection from now on (Agent::OnFrame).
      ping.clock = config_.rejoin ? env_.clock_base + 1 : 0;
      env_.peers.Get(p)->Send(ping, {}, [](absl::Status) {});
    }
  }
  for (auto& [kind, syncer] : syncers_) RETURN_IF_ERROR(syncer->Ready());
  if (telemetry_) {
    std::vector<std::string> names;
    for (const auto& d : descs) names.push_back(d.name);
    telemetry_->SetLayers(std::move(names));
    // Latency of the links to the KV servers: a few pings per window from the reporter thread.
    if (!env_.servers.empty()) {
      telemetry_->SetServerPing([servers = env_.servers](size_t s, absl::Duration timeout) {
        return s < servers.size() ? servers[s]->MeasureRoundTrip(timeout)
                                  : absl::StatusOr<absl::Duration>(absl::NotFoundError("server"));
      });
    }
  }
  std::vector<LayerLayout> layout;
  for (const LayerSpec& st : table_.layers) layout.push_back(st.layout);
  // A rejoining rank's process takes up the job's iteration (a resumed job's learns its own
  // from $POSEIDON_RESUMED_ITERATION, as before).
  RETURN_IF_ERROR(shm_->PublishLayout(descs, layout, table_.data_bytes,
                                      config_.rejoin ? JobIteration(1) : 1));
  plan_epoch_->Set(static_cast<double>(plan.plan_epoch()));
  int sfb_layers = 0, allreduce_layers = 0;
  for (size_t i = 0; i < table_.layers.size(); ++i) {
    const MetricLabels labels = {{"layer", table_.layers[i].desc.name}};
    if (auto g = metrics_.GetGauge("poseidon_agent_layer_scheme",
                                   "Scheme of each layer: 1 parameter server, 2 SFB, 3 all-reduce", labels);
        g.ok()) {
      (*g)->Set(layout[i].scheme);
      progress_[i].scheme_gauge = *g;
    }
    if (auto h = metrics_.GetHistogram("poseidon_agent_layer_sync_seconds",
                                       "Time from a layer's ready to its done", labels,
                                       ExponentialBuckets(1e-4, 2, 18));
        h.ok()) {
      progress_[i].sync_seconds = *h;
    }
    sfb_layers += layout[i].scheme == PSD_SCHEME_SFB;
    allreduce_layers += layout[i].scheme == PSD_SCHEME_ALLREDUCE;
  }
  PSD_LOG_INFO("registered {} layers ({} on SFB, {} on all-reduce), {} bytes of buffers, plan "
               "epoch {}",
               descs.size(), sfb_layers, allreduce_layers, table_.data_bytes, plan.plan_epoch());
  return absl::OkStatus();
}

absl::Status Agent::ConnectServers() {
  // Each server gets the tables of the chunks it owns; every rank sends the same registration.
  std::vector<v1::RegisterTablesRequest> requests(config_.servers.size());
  // Replication: each key is also registered on the next `replicas` servers (its backups).
  const auto n = static_cast<uint32_t>(config_.servers.size());
  const uint32_t replicas = n > 1 ? std::min(config_.replicas, n - 1) : 0;
  for (uint32_t s = 0; s < n; ++s) {
    v1::RegisterTablesRequest& r = requests[s];
    r.set_num_workers(config_.world_size);
    r.set_average_gradients(server_rule_.rule != 0);
    r.set_rejoin_timeout_ms(
        static_cast<uint32_t>(absl::ToInt64Milliseconds(config_.rejoin_timeout)));
    r.set_min_workers(config_.min_workers);
    if (replicas > 0) {
      for (const auto& address : replication_servers_) r.add_servers(address);
      r.set_server_index(s);
      r.set_replicas(replicas);
    }
  }
  env_.replication.replicas = replicas;
  env_.replication.servers = n;
  env_.replication.epoch = std::make_unique<std::atomic<uint32_t>[]>(std::max<uint32_t>(n, 1));
  for (uint32_t s = 0; s < n; ++s) env_.replication.epoch[s].store(0);
  // A table per layer (its chunks: SFB layers' too, used when a plan change makes them PS), or
  // per bucket (one key).
  struct TableSource {
    std::string name;
    std::vector<PsChunk> chunks;
    WireType wire = WireType::kF32;
    std::vector<uint32_t> layers;  // the layer, or the bucket's members
    bool average = false;          // PSD_LAYER_AVERAGE (a bucket's members all alike)
    bool counters = false;         // PSD_LAYER_COUNTERS
  };
  std::vector<TableSource> sources;
  for (uint32_t i = 0; i < table_.layers.size(); ++i) {
    const LayerSpec& st = table_.layers[i];
    if (st.chunks.empty() || st.bucket >= 0) continue;
    sources.push_back({st.desc.name, st.chunks, st.wire, {i}, st.desc.average, st.desc.counters});
  }
  for (const BucketSpec& b : table_.buckets) {
    const LayerDesc& first = table_.layers[b.members.front()].desc;
    sources.push_back({b.name, {b.chunk}, b.wire, b.members, first.average, first.counters});
  }
  auto new_table = [&](uint32_t holder, bool standby, const std::string& name, uint32_t primary,
                       WireType wire, bool average, bool counters) {
    v1::KvTableSpec* t =
        standby ? requests[holder].add_standby_tables() : requests[holder].add_tables();
    t->set_name(name);
    t->set_average(average);
    if (replicas > 0) t->set_primary(primary);
    t->set_element_type(v1::ELEMENT_TYPE_F32);
    if (IsLossy(wire)) t->set_wire_type(WireToProto(wire));
    auto* u = t->mutable_update_rule();
    if (server_rule_.rule == 0) {
      u->set_rule(v1::UPDATE_RULE_SUM);
      return t;
    }
    t->set_initial_value(v1::INITIAL_VALUE_PUSHED_BY_RANK0);
    if (counters) {  // held - wanted, averaged, at learning rate 1: the servers hold `wanted`
      u->set_rule(v1::UPDATE_RULE_SGD);
      u->set_learning_rate(1.0f);
      return t;
    }
    u->set_rule(static_cast<v1::UpdateRule>(server_rule_.rule));
    u->set_learning_rate(server_rule_.lr);
    u->set_momentum(server_rule_.momentum);
    u->set_dampening(server_rule_.dampening);
    u->set_nesterov(server_rule_.nesterov);
    u->set_beta1(server_rule_.beta1);
    u->set_beta2(server_rule_.beta2);
    u->set_epsilon(server_rule_.eps);
    u->set_weight_decay(server_rule_.weight_decay);
    return t;
  };
  for (const TableSource& src : sources) {
    // One table per (source, primary) on each server of its chain: the primary and its backups
    // hold a copy, by copy; the other servers stand by to adopt one when a backup is given up.
    std::map<std::pair<uint32_t, uint32_t>, v1::KvTableSpec*> tables;
    for (const auto& c : src.chunks) {
      if (c.server >= requests.size()) return absl::InternalError("chunk on an unknown server");
      for (uint32_t copy = 0; copy < (replicas > 0 ? n : 1); ++copy) {
        const uint32_t holder = (c.server + copy) % n;
        auto*& t = tables[{c.server, copy}];
        if (t == nullptr) {
          t = new_table(holder, copy > replicas, src.name, c.server, src.wire, src.average,
                        src.counters);
        }
        auto* key = t->add_keys();
        key->set_key(c.key);
        key->set_elements(c.length / sizeof(float));
      }
      if (IsLossy(src.wire)) {
        auto wire = std::make_unique<LossyWire>(src.wire, c.length / sizeof(float), src.name);
        wire->layers = src.layers;
        env_.lossy[c.key] = std::move(wire);
      }
    }
  }
  const absl::Time deadline = absl::Now() + config_.connect_timeout;
  const std::vector<bool> measured = MeasuredServers(config_.servers, own_host_);
  std::map<uint64_t, uint32_t> restored_at;  // a restored key: the first server that said so
  std::map<uint64_t, StandbyCopies> standby_copies;
  std::map<uint32_t, absl::Status> unreachable;  // servers lost before we connected
  if (telemetry_) telemetry_->SetCapacityMinBytes(config_.capacity_min_bytes);
  for (const uint32_t s : config_.lost_servers) {
    if (s >= n || replicas == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--lost_servers names KV server ", s, ", but the job has ", n, " servers and ",
          replicas, " backups of each key: ",
          s >= n ? "there is no such server" : "a lost server's keys have no other copy"));
    }
  }
  // A rank taking up the running job does not wait for a server the coordinator declared dead:
  // the others went on without it, and its keys are further down their chains.
  std::map<uint32_t, std::string> declared_dead;
  if (config_.rejoin && replicas > 0) {
    std::lock_guard<std::mutex> lock(lost_mu_);
    for (const v1::LostMember& m : lost_) {
      for (int i = 0; m.role() == v1::NODE_ROLE_SERVER && i < plan_servers_.size(); ++i) {
        if (plan_servers_[i].node_id() == m.node_id()) {
          declared_dead[static_cast<uint32_t>(i)] = m.reason();
        }
      }
    }
  }
  // A server frozen at connect (HandshakeTimeout) is given up after one attempt: its keys start
  // at a backup then, as a lost one's, rather than after connect_timeout of attempts.
  const absl::Duration handshake = HandshakeTimeout();
  for (size_t s = 0; s < config_.servers.size(); ++s) {
    ConnectTarget target{server_rdma_[s], config_.servers[s], server_tcp_fallback_[s]};
    const std::string what = absl::StrCat("KV server ", config_.servers[s]);
    const auto dead = declared_dead.find(static_cast<uint32_t>(s));
    // A server lost before the checkpoint this job resumes from is not connected: its file is
    // older than the others', which hold its keys' copies.
    absl::StatusOr<std::shared_ptr<server::KvClient>> client =
        config_.lost_servers.contains(static_cast<uint32_t>(s))
            ? absl::UnavailableError(absl::StrCat(
                  "before the checkpoint of iteration ", config_.resumed_iteration,
                  " that the job resumes from (--lost_servers); the others' checkpoints hold "
                  "copies of its keys"))
        : dead != declared_dead.end()
            ? absl::UnavailableError(
                  absl::StrCat("declared dead by the coordinator: ", dead->second))
            : ConnectWithFallback<std::shared_ptr<server::KvClient>>(
                  what, target,
                  [&](bool rdma, const std::string& address) {
                    return server::KvClient::Connect(ContextFor(rdma), address, config_.job_id,
                                                     config_.rank, creds_.server_key(), handshake);
                  },
                  deadline, absl::Milliseconds(200), nullptr,
                  /*give_up_when_silent=*/GiveUpWhenSilent());
    if (!client.ok() && replicas > 0) {
      // Lost during start-up: its keys start at a backup (below); it stays unreachable.
      unreachable[static_cast<uint32_t>(s)] = Annotate(client.status(), what);
      client = server::KvClient::Unreachable(config_.servers[s], config_.job_id, config_.rank,
                                             unreachable[static_cast<uint32_t>(s)]);
    } else if (!client.ok()) {
      return Annotate(client.status(), what);
    }
    server_rdma_[s] = target.rdma;
    config_.servers[s] = target.address;
    if (telemetry_ && !unreachable.contains(static_cast<uint32_t>(s))) {
      telemetry_->SetServerTransport(s, LinkKind(target.rdma));
    }
    if (telemetry_ && measured[s]) {
      // The capacity estimate of this link: large pull responses, from header to last byte.
      (*client)->SetPullObserver(kCapacityTransferBytes,
                                 [telemetry = telemetry_.get(), s](uint64_t bytes,
                                                                   absl::Duration busy) {
                                   telemetry->AddServerTransfer(s, bytes, busy);
                                 });
    }
    if ((requests[s].tables_size() > 0 || requests[s].standby_tables_size() > 0) &&
        !unreachable.contains(static_cast<uint32_t>(s))) {
      std::vector<server::KeyProgress> progress;
      bool removed = false;
      const absl::Status registered = (*client)->RegisterTables(
          requests[s], kRegistrationTimeout, &progress, &removed, config_.peer_timeout);
      if (!registered.ok() && replicas > 0 && RegistrationLost(**client, registered)) {
        // Lost while it registered the job (its connection closed or broke, or it said nothing
        // for peer_timeout, or did not answer in kRegistrationTimeout): as one lost before we
        // connected, its keys start at a backup, and the
        // ranks it registered find it lost at their first request (failover, clock 0).
        unreachable[static_cast<uint32_t>(s)] =
            Annotate(registered, absl::StrCat(what, ", lost while it registered the job"));
        (*client)->Close();
        client = server::KvClient::Unreachable(config_.servers[s], config_.job_id, config_.rank,
                                               unreachable[static_cast<uint32_t>(s)]);
      } else {
        RETURN_IF_ERROR(registered);
        RETURN_IF_ERROR(
            NoteRestoredClocks(s, requests[s], progress, restored_at, &standby_copies));
        if (removed) removed_on_.insert(s);
      }
    }
    env_.servers.push_back(*client);
    CountLink(server_rdma_[s]);
    const MetricLabels labels = {{"server", std::to_string(s)}};
    env_.metrics.push_bytes.push_back(
        metrics_.GetCounter("poseidon_agent_push_bytes_total", "Gradient bytes pushed", labels)
            .value_or(nullptr));
    env_.metrics.pull_bytes.push_back(
        metrics_.GetCounter("poseidon_agent_pull_bytes_total", "Result bytes pulled", labels)
            .value_or(nullptr));
  }
  registrations_ = std::move(requests);
  // A rank taking up the running job takes the joined servers up before its keys start (the
  // others did as they joined): a key whose every plan server was lost lives on them only.
  if (config_.rejoin && replicas > 0) JoinNewServers(/*note_copies=*/true);
  RETURN_IF_ERROR(StartAtBackups(unreachable));
  TakeStandbyCopies(standby_copies);
  servers_connected_.store(true, std::memory_order_release);  // env_.servers is final
  return absl::OkStatus();
}

void Agent::AwaitHeartbeatAnswer() {
  if (!heartbeats_) return;
  uint64_t seen;
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    seen = heartbeat_seq_;
  }
  heartbeats_->BeatNow();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (absl::Now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(lost_mu_);
      if (heartbeat_seq_ > seen) return;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  PSD_LOG_WARN("no heartbeat answer from the coordinator in 5 s: rank {} takes up the job "
               "without its word on the job's servers (declared dead, joined)",
               config_.rank);
}

// The copies a joined server holds (its answer to JoinServer's standby registration: server 0's
// standby tables, then its tables, in that order; a key it holds a copy of has a completed
// clock) tell a rank taking up the running job where the keys only it holds are
// (TakeUpRunningJob).
void Agent::NoteJoinedCopies(const std::vector<server::KeyProgress>& progress) {
  size_t i = 0;
  auto note = [&](const v1::KvTableSpec& t) {
    for (const auto& k : t.keys()) {
      const server::KeyProgress p = i < progress.size() ? progress[i] : server::KeyProgress{};
      ++i;
      if (p.completed == 0 || env_.restored.contains(k.key())) continue;
      env_.restored[k.key()] = p;
      NoteFallback(k.key(), p);
    }
  };
  for (const v1::KvTableSpec& t : registrations_[0].standby_tables()) note(t);
  for (const v1::KvTableSpec& t : registrations_[0].tables()) note(t);
}

// The keys first held by a server that could not be reached at start go to the first server of
// their chain that could (its backup holds them from clock 0), as a failover at clock 0 would;
// none left is an error naming them all.
absl::Status Agent::StartAtBackups(const std::map<uint32_t, absl::Status>& unreachable) {
  const uint32_t n = static_cast<uint32_t>(env_.servers.size());
  // At start, only the backups hold copies; in a job resumed after losses (--lost_servers) a
  // server further down the chain may hold an adopted one, restored from its checkpoint (one
  // that holds none answers NotFound, and the requests walk on along the chain).
  // A rank taking up the running job may find a copy anywhere down the chain (adopted after
  // losses), and past the ring on the servers that joined the job (JoinNewServers).
  const uint32_t last =
      config_.lost_servers.empty() && !config_.rejoin ? env_.replication.replicas : n - 1;
  const uint32_t joined = config_.rejoin ? env_.joined.Count() : 0;
  for (const auto& [s, why] : unreachable) {
    uint32_t epoch = 1;
    while (epoch <= last && unreachable.contains((s + epoch) % n)) ++epoch;
    if (epoch > last && joined > 0) epoch = n;  // the first server that joined
    if (epoch > last && joined == 0) {
      std::vector<std::string> lost;
      for (uint32_t e = 0; e <= last; ++e) lost.push_back(config_.servers[(s + e) % n]);
      return absl::UnavailableError(absl::StrCat(
          "the keys first held by KV server ", s, " have no reachable copy: ",
          absl::StrJoin(lost, ", "), " cannot be reached (", why.message(), ")"));
    }
    env_.replication.epoch[s].store(epoch);
    const uint32_t at = env_.replication.ServerAt(s, epoch);
    PSD_LOG_WARN("KV server {} ({}) {} ({}): its keys start at server {} ({}), epoch {}", s,
                 config_.servers[s],
                 config_.lost_servers.contains(s) ? "was lost" : "cannot be reached at start",
                 why.message(), at, env_.ServerAddress(at), epoch);
  }
  return absl::OkStatus();
}

// A rank that died is restarted with --rejoin and takes up the running job: the other ranks
// wait for its pushes of the iteration in flight (the servers and their agents give it
// rejoin_timeout). The keys of the layers posted every iteration are at that iteration's clock
// or one before (a key's clock moves on once every rank pushed it), so the highest completed
// clock T is where this process's iteration 1 goes: every such layer pushes T first — a key
// that completed T already takes the push as a retransmission and answers T's sum; one at T - 1
// takes it as the dead rank's contribution. Either way the result is the fault-free run's (if
// the dead rank had pushed nothing of the iteration after T, that iteration comes next). A
// layer further behind (not posted lately) goes on from its own clock. Under a server-side
// rule the process's iteration 1 re-reads the parameters of clock T - 1, which every iteration-T
// gradient was computed from (a key that completed T answers them from its previous parameters,
// which a job with a rejoin timeout keeps), and its iteration 2 pushes clock T.
absl::Status Agent::TakeUpRunningJob() {
  if (config_.resumed_iteration != 0) {
    return absl::InvalidArgumentError("--rejoin and --resumed_iteration exclude each other");
  }
  // SFB layers take it back too: the others send this rank again their factors of the
  // iterations it takes up (their last two are kept, SfbSyncer) and take its factors of an
  // iteration they have as a retransmission (a server-side rule runs every layer on PS). Ring
  // layers (a job that may shrink): the live agents say where their all-reduces are, and this
  // rank comes into a new ring with them (AllreduceSyncer::ComeBack) — from the iteration after
  // those they started where it was removed, from the highest they completed where it rejoins
  // in its predecessor's place.
  uint64_t ring_from = 0;
  env_.removed_by_servers = !removed_on_.empty();
  if (auto ring = syncers_.find(SyncerKind::kAllreduce); ring != syncers_.end()) {
    const absl::Time deadline =
        absl::Now() + std::max(config_.connect_timeout, absl::Seconds(30));
    ASSIGN_OR_RETURN(ring_from, ring->second->ComeBack(deadline));
  }
  if (env_.restored.empty() && ring_from > 0) {
    // Ring layers only: the ring says where the job is.
    env_.rejoin_top = ring_from;
    config_.resumed_iteration = ring_from;
    took_up_at_.store(ring_from);
    RETURN_IF_ERROR(syncers_.at(SyncerKind::kAllreduce)->TakeUpAt(ring_from));
    PSD_LOG_WARN("rank {} takes up job {} at iteration {} in the others' ring", config_.rank,
                 config_.job_id, ring_from);
    return absl::OkStatus();
  }
  if (env_.restored.empty()) {
    return absl::FailedPreconditionError(
        "--rejoin: the job has no PS keys to take up from (the job's iteration is read from "
        "its KV servers; a job without them cannot take a restarted rank back)");
  }
  // The job's iteration is read from the layers that count it: a layer of its own iterations
  // (PSD_LAYER_OWN_CLOCK) may be ahead of them or behind.
  std::set<uint64_t> own_clock_keys;
  for (const LayerSpec& st : table_.layers) {
    if (!st.desc.own_clock) continue;
    for (const PsChunk& c : st.chunks) own_clock_keys.insert(c.key);
  }
  uint64_t lowest = std::numeric_limits<uint64_t>::max(), highest = 0;
  for (const auto& [key, progress] : env_.restored) {
    if (own_clock_keys.contains(key)) continue;
    lowest = std::min(lowest, progress.completed);
    highest = std::max(highest, progress.completed);
  }
  if (server_rule_.rule != 0 && highest < 2) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--rejoin: the job has completed ", highest, " updates of its server-side rule; a rank "
        "can take it up from the second on (restart the job instead)"));
  }
  if (!removed_on_.empty()) return ReadmitToJob(highest, ring_from);
  highest = std::max(highest, ring_from);
  env_.rejoin_top = highest;
  config_.resumed_iteration = std::max<uint64_t>(highest, 1);
  for (auto& [kind, syncer] : syncers_) {
    RETURN_IF_ERROR(syncer->TakeUpAt(config_.resumed_iteration));
  }
  took_up_at_.store(config_.resumed_iteration);
  PSD_LOG_WARN("rank {} rejoins job {} at iteration {} (its keys completed clocks {} to {})",
               config_.rank, config_.job_id, config_.resumed_iteration, lowest, highest);
  return absl::OkStatus();
}

// The world grows again: this rank came back after the job went on without it (its rejoin
// timeout ran out and the world shrank, --min_workers), so the others are not waiting for it.
// It asks every server to count it again from clock F = (the highest completed clock it heard
// of) + 2, or, with SFB layers, from where the other agents' SFB layers wait for it (ComeBack):
// each key leaves it out of the clocks before F that it had not counted and needs its
// push from F on, so the others stop at F - 1 at the latest. A key that had completed F already
// says so, and it asks again from a later clock (the keys that took the earlier one let it go).
// Once every key is at F - 1 its process starts with iteration F, as a rejoining rank's whose
// keys are all one clock behind (TakeUpRunningJob).
absl::Status Agent::ReadmitToJob(uint64_t highest, uint64_t ring_from) {
  const absl::Time deadline = absl::Now() + std::max(config_.connect_timeout, absl::Seconds(30));
  // The others' SFB layers left this rank out: they say where they are and wait for it from
  // there (SfbSyncer::ComeBack), which fixes the iteration it can take up. Their PS layers can
  // still complete the clock before it, so the servers take it from there. Their ring layers
  // likewise hold from `ring_from` (TakeUpRunningJob asked them).
  uint64_t sfb_from = ring_from;
  if (ExchangesFactors()) {
    RETURN_IF_ERROR(ConnectPeers());
    for (auto& [kind, syncer] : syncers_) {
      if (kind == SyncerKind::kAllreduce) continue;  // asked already
      ASSIGN_OR_RETURN(const uint64_t from, syncer->ComeBack(deadline));
      sfb_from = std::max(sfb_from, from);
    }
  }
  // Every server's registration, with readmit_from = `readmit` (0: only its keys' progress).
  // `lowest`: the lowest completed clock of a current key and where it is; `top`: the highest.
  struct Lowest {
    uint64_t clock = std::numeric_limits<uint64_t>::max();
    uint64_t key = 0;
    size_t server = 0;
  };
  auto ask = [&](uint64_t readmit, uint64_t from, Lowest& lowest, uint64_t& top) -> absl::Status {
    lowest = Lowest{};
    for (size_t s = 0; s < registrations_.size(); ++s) {
      if (registrations_[s].tables_size() == 0 || env_.servers[s]->Broken()) continue;
      v1::RegisterTablesRequest request = registrations_[s];
      request.set_readmit_from(readmit);
      std::vector<server::KeyProgress> progress;
      RETURN_IF_ERROR(
          Annotate(env_.servers[s]->RegisterTables(request, kRegistrationTimeout, &progress,
                                                   nullptr, config_.peer_timeout),
                   absl::StrCat("readmission on KV server ", config_.servers[s])));
      std::map<uint64_t, uint32_t> unused;
      RETURN_IF_ERROR(NoteRestoredClocks(s, request, progress, unused));
      size_t i = 0;
      for (const auto& t : request.tables()) {
        for (const auto& k : t.keys()) {
          const uint64_t completed = i < progress.size() ? progress[i].completed : 0;
          ++i;
          // A key more than 3 clocks behind (a layer not posted lately) takes this rank from
          // its own next clock, and its layer goes on from there (RestoredClock).
          if (completed + 3 >= from && completed < lowest.clock) lowest = {completed, k.key(), s};
          top = std::max(top, completed);
        }
      }
    }
    return absl::OkStatus();
  };
  uint64_t from = 0;
  Lowest lowest;
  for (int attempt = 1;; ++attempt) {
    // Where the SFB layers wait from: the keys cannot complete that clock without this rank's
    // push (the others' SFB layers hold the iteration before it). Past it (SFB layers idle for
    // a while, a plan's PS phase), the keys' next clocks.
    from = attempt == 1 && sfb_from > highest ? sfb_from : highest + 2;
    RETURN_IF_ERROR(ask(from, from, lowest, highest));
    if (highest < from) break;  // every key took it
    if (attempt == 10 || absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rank ", config_.rank, " could not be readmitted to job ", config_.job_id,
          ": its keys kept completing the clock it asked for before every server took it (",
          attempt, " tries, the last from clock ", from, ")"));
    }
  }
  // The others' ring layers hold until they know F (they run those below it in their ring).
  for (auto& [kind, syncer] : syncers_) RETURN_IF_ERROR(syncer->TakeUpAt(from));
  // Every key needs this rank's push of F: each stops at F - 1, which its process's first
  // push follows (a push of F to a key still at F - 2 would break BSP). Read back from every
  // server's plain registration answer until then.
  // (No key counts it, every one idle: all-reduce layers alone are posted.)
  while (lowest.clock != std::numeric_limits<uint64_t>::max() && lowest.clock + 1 < from) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rank ", config_.rank, " was readmitted to job ", config_.job_id, " from clock ",
          from, ", but key ", lowest.key, " on KV server ", config_.servers[lowest.server],
          " is still at clock ", lowest.clock, " after waiting until ",
          absl::FormatTime(deadline), " for the others to reach clock ", from - 1));
    }
    absl::SleepFor(absl::Milliseconds(10));
    uint64_t unused = 0;
    RETURN_IF_ERROR(ask(0, from, lowest, unused));
  }
  env_.rejoin_top = from;
  config_.resumed_iteration = from;
  // A local optimizer's state is the ranks': the others hand it over once they hear of this
  // takeover (the coordinator's count, psd_takeovers), as for a rejoin.
  took_up_at_.store(from);
  PSD_LOG_WARN("rank {} is readmitted to job {} from iteration {}: the job had gone on without "
               "it (removed on {} of its {} KV servers), and grows again",
               config_.rank, config_.job_id, from, removed_on_.size(), config_.servers.size());
  return absl::OkStatus();
}

// A resumed job's servers answer each key's restored clock (0 for a new job): the PS syncers go
// on from there, and a lossy key that had fallen back to float32 stays there. Every copy of a
// key must have been restored alike.
absl::Status Agent::NoteRestoredClocks(size_t server, const v1::RegisterTablesRequest& request,
                                       const std::vector<server::KeyProgress>& progress,
                                       std::map<uint64_t, uint32_t>& restored_at,
                                       std::map<uint64_t, StandbyCopies>* standby) {
  size_t i = 0;
  for (const auto& t : request.tables()) {
    for (const auto& k : t.keys()) {
      const server::KeyProgress p = i < progress.size() ? progress[i] : server::KeyProgress{};
      ++i;
      auto [it, fresh] = env_.restored.try_emplace(k.key(), p);
      if (!fresh && config_.rejoin) {
        // A running job: a backup may be a clock behind its primary (replication in flight);
        // the primary's is the key's (TakeUpRunningJob).
        if (p.completed > it->second.completed) it->second = p;
        continue;
      }
      if (!fresh && !(it->second == p)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "table ", t.name(), " key ", k.key(), " was restored at clock ", it->second.completed,
            " on KV server ", config_.servers[restored_at[k.key()]], " and at clock ", p.completed,
            " on ", config_.servers[server],
            ": the servers' checkpoints differ (resume from a consistent set)"));
      }
      if (!fresh) continue;
      restored_at[k.key()] = static_cast<uint32_t>(server);
      NoteFallback(k.key(), p);
    }
  }
  // The standby tables' keys follow: a copy this server holds of one (restored as adopted).
  for (const auto& t : request.standby_tables()) {
    for (const auto& k : t.keys()) {
      const server::KeyProgress p = i < progress.size() ? progress[i] : server::KeyProgress{};
      ++i;
      if (standby == nullptr || p.completed == 0) continue;
      StandbyCopies& copies = (*standby)[k.key()];
      copies.primary = t.primary();
      copies.table = t.name();
      copies.at[static_cast<uint32_t>(server)] = p;
    }
  }
  return absl::OkStatus();
}

// A key that fell back at a completed clock (before the checkpoint; its residual was not kept)
// is float32 from the start. One falling back at the clock in flight (exact_from = completed +
// 1: a rank of a new job pushed it before this one registered) still takes this rank's 16-bit
// push of that clock, and its float32 answer switches this rank too.
void Agent::NoteFallback(uint64_t key, const server::KeyProgress& p) {
  if (auto lossy = env_.lossy.find(key);
      p.exact_from != 0 && p.exact_from <= p.completed && lossy != env_.lossy.end()) {
    lossy->second->exact.store(true);
    lossy->second->residual_released = true;
    PSD_LOG_INFO("{} (key {}) fell back to float32 at clock {} before the checkpoint: it "
                 "stays float32", lossy->second->name, key, p.exact_from);
  }
}

// A resumed job whose checkpoint came after two servers of a chain were lost: no server that
// holds a key's table answered for it (every one is lost), but servers further down the chain
// restored the copies they had adopted. The key goes on from the copy of the first of them from
// its epoch on (StartAtBackups), the server its requests go to first.
void Agent::TakeStandbyCopies(const std::map<uint64_t, StandbyCopies>& standby) {
  const auto n = static_cast<uint32_t>(env_.servers.size());
  for (const auto& [key, copies] : standby) {
    if (env_.restored.contains(key)) continue;
    for (uint32_t e = env_.replication.Epoch(copies.primary); e < n; ++e) {
      const uint32_t s = (copies.primary + e) % n;
      const auto it = copies.at.find(s);
      if (it == copies.at.end()) continue;
      env_.restored[key] = it->second;
      NoteFallback(key, it->second);
      PSD_LOG_INFO("table {} key {} goes on from the copy KV server {} ({}) adopted, restored at "
                   "clock {}",
                   copies.table, key, s, config_.servers[s], it->second.completed);
      break;
    }
  }
}

// Rank 0, at the first event of `next_iteration` (final: the training process detached): if the
// iteration before it completed on every layer and is due, every KV server writes the job's
// completed state now, before any push of the next iteration (so no key can have moved on:
// BSP waits for this rank). The servers' answers come before this returns.
void Agent::MaybeCheckpoint(uint64_t next_iteration, bool final) {
  const uint64_t done = final ? last_iteration_seen_ : next_iteration - 1;
  if (!final) last_iteration_seen_ = next_iteration;
  const bool due = final ? config_.checkpoint_at_end
                         : config_.checkpoint_every != 0 &&
                               JobIteration(done) % config_.checkpoint_every == 0;
  if (config_.rank != 0 || !due || env_.servers.empty() || done < 2 || done <= last_checkpoint_) {
    return;  // iteration 1: a new job's initial broadcast, or a resumed one's re-read
  }
  const uint64_t label = JobIteration(done);
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    for (size_t i = 0; i < progress_.size(); ++i) {
      const LayerProgress& st = progress_[i];
      // A layer behind `done` did not run since (the initial broadcast): its keys are at
      // their last clock. One in flight or failed would make the state half an iteration.
      if (st.posted > done || st.in_progress != 0 || st.failed) {
        PSD_LOG_WARN("no checkpoint after iteration {}: layer {} is at iteration {}{}", label,
                     table_.layers[i].desc.name, st.posted,
                     st.in_progress != 0 ? " (in flight)" : st.failed ? " (failed)" : "");
        return;
      }
    }
  }
  // Keys whose every plan server was lost live on servers that joined the running job only,
  // which write no checkpoint: a checkpoint without them could not be resumed from.
  for (uint32_t p = 0; p < env_.replication.servers; ++p) {
    if (env_.replication.Epoch(p) < env_.replication.servers) continue;
    if (!checkpoint_refused_logged_) {
      checkpoint_refused_logged_ = true;
      PSD_LOG_WARN("no checkpoint after iteration {} (nor later): the keys first held by KV "
                   "server {} are only on servers that joined the running job, which write no "
                   "checkpoint; the job's last checkpoint stays the one before (iteration {})",
                   label, p, last_checkpoint_ == 0 ? 0 : JobIteration(last_checkpoint_));
    }
    return;
  }
  last_checkpoint_ = done;
  const absl::Time start = absl::Now();
  // A lost server (its connection broken, not connected: --lost_servers, or given up for its
  // keys, which went on at the next server of their chain) writes nothing: the others' files
  // hold its keys' copies, since every clock is on a key's backups before it is answered. Every
  // other server is asked even after one fails: a failure leaves that server's file behind the
  // others', which a resume refuses unless that server is lost.
  size_t written = 0, lost = 0;
  for (size_t s = 0; s < env_.servers.size(); ++s) {
    if (env_.servers[s]->Broken() || env_.replication.Epoch(static_cast<uint32_t>(s)) != 0) {
      ++lost;
      continue;
    }
    if (const absl::Status st = env_.servers[s]->Checkpoint(absl::Seconds(120), label); !st.ok()) {
      PSD_LOG_ERROR("checkpoint after iteration {} on KV server {} failed: {}", label,
                    config_.servers[s], st.message());
      CountError("checkpoint");
      continue;
    }
    ++written;
  }
  if (written + lost == env_.servers.size()) {
    PSD_LOG_INFO("checkpoint after iteration {} written by {} KV servers in {}{}", label, written,
                 absl::FormatDuration(absl::Now() - start),
                 lost == 0 ? ""
                           : absl::StrCat(" (", lost, " lost: the others' files hold copies of "
                                          "their keys)"));
  }
}

absl::Status Agent::ConnectPeers() {
  env_.peers.Reset(config_.world_size);
  const absl::Time deadline = absl::Now() + config_.connect_timeout;
  // A peer agent frozen at connect (HandshakeTimeout) fails the connect after one attempt, naming
  // it, rather than after connect_timeout of attempts: its listener is up, so it is there.
  const absl::Duration handshake = HandshakeTimeout();
  for (uint32_t p = 0; p < config_.world_size; ++p) {
    if (p == config_.rank) continue;
    if (!peer_unusable_[p].empty()) return absl::FailedPreconditionError(peer_unusable_[p]);
    ConnectTarget target{peer_rdma_[p], config_.peers[p], peer_tcp_fallback_[p]};
    const std::string what = absl::StrCat("peer agent of rank ", p, " at ", config_.peers[p]);
    absl::StatusOr<std::shared_ptr<transport::Connection>> conn =
        ConnectWithFallback<std::shared_ptr<transport::Connection>>(
            what, target,
            [&](bool rdma, const std::string& address) {
              return transport::ConnectAuthenticated(ContextFor(rdma), address, config_.job_id,
                                                     config_.rank, *creds_.PeerKey(p), handshake);
            },
            deadline, absl::Milliseconds(200), nullptr, GiveUpWhenSilent());
    if (!conn.ok()) return Annotate(conn.status(), what);
    peer_rdma_[p] = target.rdma;
    config_.peers[p] = target.address;
    env_.peers.Set(p, *conn);
    // The others answer a rank taking up the job on its own connections (their connections to
    // the agent it replaces are dead): read them as the listener's.
    if (config_.rejoin && sfb_server_) {
      sfb_server_->Serve(*conn, transport::PeerIdentity{config_.job_id, p});
    }
    if (telemetry_) telemetry_->SetPeerTransport(p, LinkKind(target.rdma));
    CountLink(peer_rdma_[p]);
  }
  peers_alive_->Set(static_cast<double>(config_.world_size - 1));
  return absl::OkStatus();
}

void Agent::OnReady(const Event& e) {
  const uint32_t layer = e.layer;
  const uint64_t iteration = e.iteration;
  const bool on_device = e.location == PSD_READY_DEVICE;
  if (!registered_.load() || layer >= table_.layers.size()) {
    PSD_LOG_WARN("ready event for unknown layer {} ignored", layer);
    return;
  }
  if (iteration > last_iteration_seen_) MaybeCheckpoint(iteration, /*final=*/false);
  const LayerSpec& spec = table_.layers[layer];
  const uint32_t scheme = schedules_->At(layer, iteration);
  Post post;
  post.layer = layer;
  post.iteration = iteration;
  post.on_device = on_device;
  Syncer* syncer = syncers_
                       .at(spec.bucket >= 0                   ? SyncerKind::kBucket
                           : scheme == PSD_SCHEME_SFB       ? SyncerKind::kSfb
                           : scheme == PSD_SCHEME_ALLREDUCE ? SyncerKind::kAllreduce
                                                            : SyncerKind::kPs)
                       .get();
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    LayerProgress& st = progress_[layer];
    auto refuse = [&](const std::string& why) {
      PSD_LOG_WARN("layer {} ({}): {}", layer, spec.desc.name, why);
      shm_->LayerFailed(layer, iteration, why);
    };
    if (iteration != st.posted + 1) {
      return refuse(absl::StrCat("iteration ", iteration, " posted after ", st.posted));
    }
    if (!lost_why_.empty()) {
      st.posted = iteration;
      return refuse(absl::StrCat("iteration ", iteration, ": ", lost_why_));
    }
    if (st.in_progress != 0) {
      return refuse(absl::StrCat("iteration ", iteration, " posted while ", st.in_progress,
                                 " is still being synchronised"));
    }
    if (e.scheme != 0 && e.scheme != scheme) {
      return refuse(absl::StrCat("iteration ", iteration, " posted as ", SchemeName(e.scheme),
                                 " input, but the plan runs the layer by ", SchemeName(scheme),
                                 " at that iteration"));
    }
    if (on_device && (spec.bucket >= 0 || spec.ring_group >= 0)) {
      // Fused layers are synchronised from host memory only (the device path for them has
      // never run on a GPU): a framework must not mark CUDA layers PSD_LAYER_FUSABLE.
      return refuse(absl::StrCat(
          "iteration ", iteration,
          " posted on the GPU, but the layer is fused with its neighbours (PSD_LAYER_FUSABLE); "
          "fused layers must be posted from host memory"));
    }
    if (on_device && stager_.load() == nullptr) {
      return refuse(absl::StrCat("iteration ", iteration,
                                 " posted on the GPU, but no CUDA arena is attached"));
    }
    st.on_device = on_device;
    st.posted = iteration;
    st.in_progress = iteration;
    st.failed = false;
    st.ready_at = absl::Now();
    st.stall_reported = false;
    st.syncer = syncer;
    st.remaining = syncer->Parts(layer);
    st.pending.assign(static_cast<size_t>(st.remaining), 1);
    post.ready_at = st.ready_at;
  }
  post.priority = config_.priority ? spec.layout.priority : 0;
  if (timeline_) timeline_->Instant("ready", layer, iteration, post.ready_at);
  if (telemetry_) telemetry_->LayerReady(layer, iteration, post.ready_at);
  syncer->Start(post);
  // A plan change deferred until this layer passed a pending switch.
  if (!deferred_[layer].empty()) {
    std::vector<DeferredChange> changes;
    changes.swap(deferred_[layer]);
    for (const DeferredChange& c : changes) ApplyChange(layer, c.scheme, c.switch_at, c.epoch);
  }
}

void Agent::Finished(uint32_t layer, uint64_t iteration, int part, const absl::Status& status) {
  bool done = false, report_failure = false;
  std::string why;
  absl::Time ready_at;
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    LayerProgress& st = progress_[layer];
    if (st.in_progress != iteration) return;  // failed (and counted) already
    if (part >= 0 && static_cast<size_t>(part) < st.pending.size()) {
      if (!st.pending[static_cast<size_t>(part)]) return;  // reported twice
      st.pending[static_cast<size_t>(part)] = 0;
    }
    ready_at = st.ready_at;
    if (!status.ok() && !st.failed) {
      st.failed = true;
      st.failure = absl::StrCat("clock ", iteration, ": ", status.message());
      report_failure = true;
      why = st.failure;
    }
    if (--st.remaining == 0) {
      done = !st.failed;
      // The framework's stream waits for this event: record it before saying done.
      if (done && st.on_device) {
        if (absl::Status s = stager_.load()->MarkDone(layer); !s.ok()) {
          done = false;
          st.failed = true;
          st.failure = absl::StrCat("clock ", iteration, ": ", s.message());
          report_failure = true;
          why = st.failure;
        }
      }
      st.in_progress = 0;
    }
  }
  const LayerSpec& spec = table_.layers[layer];
  if (report_failure) {
    PSD_LOG_ERROR("layer {} ({}) {}", layer, spec.desc.name, why);
    shm_->LayerFailed(layer, iteration, why);
    CountError("sync_failed");
  }
  if (!done) return;
  const absl::Time now = absl::Now();
  if (progress_[layer].sync_seconds) {
    progress_[layer].sync_seconds->Observe(absl::ToDoubleSeconds(now - ready_at));
  }
  if (telemetry_) telemetry_->LayerSynced(layer, iteration, now - ready_at);
  if (timeline_) timeline_->Span("sync", layer, spec.desc.name, iteration, ready_at, now);
  {
    std::lock_guard<std::mutex> lock(iteration_mu_);
    if (++layers_done_[iteration] == table_.layers.size()) {
      layers_done_.erase(iteration);
      if (last_iteration_end_ != absl::Time()) {
        iteration_seconds_->Observe(absl::ToDoubleSeconds(now - last_iteration_end_));
      }
      last_iteration_end_ = now;
    }
  }
  shm_->LayerDone(layer, iteration);
  uint64_t seen = last_iteration_.load();
  while (iteration > seen && !last_iteration_.compare_exchange_weak(seen, iteration)) {
  }
}

// The training process shared its CUDA arena and per-layer events: open them (or say why not).
void Agent::AttachCuda() {
  auto refuse = [&](const std::string& why) {
    PSD_LOG_WARN("CUDA attach refused: {}", why);
    shm_->FailCuda(why);
  };
  if (!registered_.load()) return refuse("register the layers before attaching CUDA");
  if (stager_owner_) return refuse("a CUDA arena is already attached");
  auto attach = shm_->ReadCudaAttach();
  if (!attach.ok()) return refuse(std::string(attach.status().message()));
  auto stager = OpenDeviceStager(*attach, shm_->data(), shm_->data_bytes());
  if (!stager.ok()) return refuse(std::string(stager.status().message()));
  for (auto& [kind, syncer] : syncers_) syncer->AttachDevice(**stager);
  if (timeline_) {
    (*stager)->SetObserver([self = shared_from_this()](const char* what, uint32_t layer,
                                                       absl::Time start, absl::Time end,
                                                       uint64_t) {
      uint64_t iteration;
      {
        std::lock_guard<std::mutex> lock(self->layers_mu_);
        iteration = self->progress_[layer].posted;
      }
      self->timeline_->Span(what, layer, self->table_.layers[layer].desc.name, iteration, start,
                            end);
    });
  }
  stager_owner_ = std::move(*stager);
  stager_.store(stager_owner_.get(), std::memory_order_release);
  shm_->AnswerCuda(stager_owner_->DoneEvents());
  PSD_LOG_INFO("CUDA arena of {} bytes on device {} attached", attach->arena_bytes,
               attach->device);
}

void Agent::SetUpMetrics() {
  auto gauge = [&](const char* name, const char* help) {
    return metrics_.GetGauge(name, help).value_or(nullptr);
  };
  auto counter = [&](const char* name, const char* help) {
    return metrics_.GetCounter(name, help).value_or(nullptr);
  };
  env_.metrics.sfb_sent_bytes =
      counter("poseidon_agent_sfb_sent_bytes_total", "SFB factor bytes sent");
  env_.metrics.sfb_received_bytes =
      counter("poseidon_agent_sfb_received_bytes_total", "SFB factor bytes received");
  env_.metrics.allreduce_bytes =
      counter("poseidon_agent_allreduce_bytes_total", "Gradient bytes all-reduced (ring)");
  queue_depth_ = gauge("poseidon_agent_queue_depth", "Synchronisation tasks waiting");
  credit_in_use_ = gauge("poseidon_agent_credit_in_use_bytes", "Bytes in flight (the credit)");
  plan_epoch_ = gauge("poseidon_agent_plan_epoch", "Epoch of the plan in use");
  peers_alive_ = gauge("poseidon_agent_peers_connected", "Other agents connected for SFB");
  for (const char* kind : {"tcp", "rdma"}) {
    prometheus::Gauge* g =
        metrics_
            .GetGauge(
                "poseidon_agent_links",
                "Data-plane connections this agent opened (to servers and peers), by transport",
                {{"transport", kind}})
            .value_or(nullptr);
    (kind[0] == 't' ? links_tcp_ : links_rdma_) = g;
  }
  iteration_seconds_ = metrics_
                           .GetHistogram("poseidon_agent_iteration_seconds",
                                         "Time between the completions of consecutive iterations",
                                         {}, ExponentialBuckets(1e-3, 2, 16))
                           .value_or(nullptr);
  for (const char* kind : {"sync_failed", "bad_event", "stall"}) {
    (void)metrics_.GetCounter("poseidon_agent_errors_total", "Errors by kind", {{"kind", kind}});
  }
}

void Agent::CountError(const std::string& kind) {
  if (auto c =
          metrics_.GetCounter("poseidon_agent_errors_total", "Errors by kind", {{"kind", kind}});
      c.ok()) {
    (*c)->Increment();
  }
}

// The stall detector: a layer in progress for longer than stall_timeout is reported once, with
// what it waits for (its syncer says: PS its pending chunks and their servers, SFB the missing
// ranks).
void Agent::CheckStalls() {
  struct Stalled {
    uint32_t layer;
    uint64_t iteration;
    absl::Duration age;
    Syncer* syncer;
    std::vector<uint8_t> pending;
  };
  std::vector<Stalled> stalled;
  const absl::Time now = absl::Now();
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    for (uint32_t l = 0; l < progress_.size(); ++l) {
      LayerProgress& st = progress_[l];
      if (st.in_progress == 0 || st.stall_reported || now - st.ready_at < config_.stall_timeout) {
        continue;
      }
      st.stall_reported = true;
      stalled.push_back({l, st.in_progress, now - st.ready_at, st.syncer, st.pending});
    }
  }
  for (auto& s : stalled) {
    const std::string waiting = s.syncer->Waiting(s.layer, s.iteration, s.pending);
    CountError("stall");  // first: whoever reads the line below finds it counted
    PSD_LOG_WARN("stall: layer {} ({}) iteration {} has waited {} for {}", s.layer,
                 table_.layers[s.layer].desc.name, s.iteration, absl::FormatDuration(s.age),
                 waiting);
  }
}

// ---- Plan changes ------------------------------------------------------------------------------

// The watcher thread: a parked GetPlan that the coordinator answers as soon as it installs a
// newer epoch (no polling per layer). Short waits, so that stopping never waits long.
void Agent::WatchPlans() {
  uint64_t seen = applied_epoch_.load();
  absl::Duration backoff = absl::Milliseconds(100);
  while (true) {
    {
      std::lock_guard<std::mutex> lock(plan_mu_);
      if (watcher_stop_) return;
    }
    JoinNewServers();
    absl::StatusOr<v1::Plan> plan = coord_->WaitForPlan(seen + 1, absl::Seconds(1));
    if (!plan.ok()) {
      PSD_LOG_DEBUG("waiting for a new plan: {}", plan.status().message());
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Seconds(2));
      continue;
    }
    backoff = absl::Milliseconds(100);
    if (plan->plan_epoch() <= seen) continue;
    seen = plan->plan_epoch();
    std::lock_guard<std::mutex> lock(plan_mu_);
    latest_plan_ = *plan;
    pending_plan_ = *std::move(plan);
  }
}

// A KV server that joined the running job (a replacement for a lost one) is connected,
// registered as standing by for every table (after the ring in every chain: kv.proto
// ring_servers), and then named to the job's other servers with the extended list, in that
// order: a primary short of backups copies its keys there from its next clock, which must find
// the job registered. Only then do this agent's requests walk on to it after a loss
// (Replication::ServerAt, JoinedServers::count). Every rank does the same; the servers take the
// identical registrations once.
void Agent::JoinNewServers(bool note_copies) {
  if (env_.replication.replicas == 0 || registrations_.empty() || joining_stuck_) return;
  std::vector<v1::PlanServer> joined;
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    joined = joined_servers_;
  }
  for (uint32_t slot = env_.joined.Count(); slot < joined.size(); ++slot) {
    std::vector<server::KeyProgress> progress;
    const absl::Status s = slot >= JoinedServers::kMax
                               ? absl::ResourceExhaustedError(absl::StrCat(
                                     "a job takes at most ", JoinedServers::kMax,
                                     " servers joining it while it runs"))
                               : JoinServer(slot, joined, note_copies ? &progress : nullptr);
    if (!s.ok()) {
      // The chains name the joined servers in join order: one left out blocks the later ones,
      // and a request waiting at its chain's end for it fails now.
      joining_stuck_ = true;
      env_.joined.stuck.store(true, std::memory_order_release);
      env_.joined.Unpark();
      PSD_LOG_WARN("KV server {} joined the running job, but this agent cannot use it ({}): its "
                   "keys keep the copies they have",
                   joined[slot].node_id(), s.message());
      return;
    }
    if (note_copies) NoteJoinedCopies(progress);
  }
}

absl::Status Agent::JoinServer(uint32_t slot, const std::vector<v1::PlanServer>& joined,
                               std::vector<server::KeyProgress>* progress) {
  const auto ring = static_cast<uint32_t>(env_.replication.servers);
  const uint32_t index = ring + slot;
  const std::string what = absl::StrCat("KV server ", index, " (", joined[slot].node_id(), ")");
  ASSIGN_OR_RETURN(coordinator::ChosenEndpoint chosen,
                   coordinator::ChooseEndpoint(joined[slot].endpoints(), Local(), what));
  // The servers' addresses for each other: the plan's, then the joined ones, on one transport.
  google::protobuf::RepeatedPtrField<v1::PlanServer> all = plan_servers_;
  for (uint32_t j = 0; j <= slot; ++j) *all.Add() = joined[j];
  ASSIGN_OR_RETURN(std::vector<std::string> addresses,
                   coordinator::ServerToServerAddresses(all));
  const bool rdma = chosen.kind == v1::TRANSPORT_KIND_RDMA;
  ASSIGN_OR_RETURN(std::shared_ptr<server::KvClient> client,
                   server::KvClient::Connect(ContextFor(rdma), chosen.address, config_.job_id,
                                             config_.rank, creds_.server_key(),
                                             absl::Seconds(10)));
  // Server s's registration with the extended list: a plan server's own; a joined one stands
  // by for every table (every plan server holds each, or stands by for it).
  auto registration = [&](uint32_t s) {
    v1::RegisterTablesRequest r = registrations_[s < ring ? s : 0];
    r.clear_servers();
    for (const std::string& a : addresses) r.add_servers(a);
    r.set_ring_servers(ring);
    if (s >= ring) {
      for (const v1::KvTableSpec& t : r.tables()) *r.add_standby_tables() = t;
      r.clear_tables();
      r.set_server_index(s);
    }
    return r;
  };
  if (absl::Status st = client->RegisterTables(registration(index), kRegistrationTimeout, progress,
                                               nullptr, config_.peer_timeout);
      !st.ok()) {
    client->Close();
    return Annotate(st, absl::StrCat("registering at ", what));
  }
  for (uint32_t s = 0; s < index; ++s) {
    server::KvClient& other = env_.Server(s);
    if (other.Broken()) continue;  // a lost server
    if (absl::Status st = other.RegisterTables(registration(s), kRegistrationTimeout, nullptr,
                                               nullptr, config_.peer_timeout);
        !st.ok() && !other.Broken()) {
      PSD_LOG_WARN("KV server {} ({}) was not told of {}: {}", s, env_.ServerAddress(s), what,
                   st.message());
    }
  }
  env_.joined.clients[slot] = std::move(client);
  env_.joined.addresses[slot] = chosen.address;
  env_.joined.count.store(slot + 1, std::memory_order_release);
  env_.joined.Unpark();  // the requests waiting at their chain's end go on to it
  CountLink(rdma);
  PSD_LOG_WARN("{} at {} joined the running job: the keys short of backups take copies there, "
               "and a loss walks on to it (server {} of every chain)",
               what, chosen.address, index);
  return absl::OkStatus();
}

// A KV server the coordinator declared dead (no heartbeat for its lease: dead, frozen, cut off)
// is lost to this agent too, whether or not one of its requests found that out yet: its client
// fails every waiting request and every later one, and each goes on at the next server of its
// key's chain (Replication), as when the agent finds the loss itself. So a frozen server costs
// the coordinator's lease where the agents' own --peer_timeout is longer or off. One the
// coordinator declared dead wrongly (cut off from it alone) is fenced by the backup that takes
// its keys over: it answers no clock after that.
void Agent::FailDeclaredDeadServer(const v1::LostMember& m) {
  const absl::Status why =
      absl::UnavailableError(absl::StrCat("declared dead by the coordinator: ", m.reason()));
  for (int i = 0; i < plan_servers_.size() && static_cast<size_t>(i) < env_.servers.size(); ++i) {
    if (plan_servers_[i].node_id() == m.node_id()) env_.servers[i]->Fail(why);
  }
  std::vector<std::string> joined;
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    for (const v1::PlanServer& server : joined_servers_) joined.push_back(server.node_id());
  }
  for (uint32_t j = 0; j < env_.joined.Count() && j < joined.size(); ++j) {
    if (joined[j] == m.node_id()) env_.joined.clients[j]->Fail(why);
  }
}

void Agent::CheckLostMembers() {
  if (!lost_why_.empty()) return;
  std::vector<v1::LostMember> lost, departed;
  std::vector<v1::LostMember> gone;  // left with an error, cannot be removed (ring layers)
  std::set<uint32_t> replaced;
  std::map<std::string, uint32_t> replaced_by;  // copied only when it changed (main loop)
  bool tell = false;
  {
    std::lock_guard<std::mutex> lock(lost_mu_);
    lost = lost_;
    departed = departed_;
    replaced = replaced_;
    if (!returning_baseline_ && heartbeat_seq_ > heartbeat_seq_at_register_) {
      // No answer had come before it registered: the first one after is what it found.
      for (const auto& [node, rank] : replaced_by_) returning_told_.insert(node);
      replaced_by_seen_ = replaced_by_version_;
      returning_baseline_ = true;
    } else if (returning_baseline_ && replaced_by_version_ != replaced_by_seen_) {
      replaced_by = replaced_by_;
      replaced_by_seen_ = replaced_by_version_;
      tell = true;
    }
  }
  // A replacement registered: a ring makes room for it (AllreduceSyncer::TakeBack). Those
  // listed when this agent registered were there before it.
  if (!syncers_.empty() && tell) {
    for (const auto& [node, rank] : replaced_by) {
      if (!returning_told_.insert(node).second || rank == config_.rank) continue;
      PSD_LOG_INFO("rank {} is held by a replacement now (agent {})", rank, node);
      for (auto& [kind, syncer] : syncers_) syncer->PeerReturning(rank);
    }
  }
  // A dead rank may be restarted and rejoin (--rejoin_timeout): waited for that long.
  if (config_.rejoin_timeout > absl::ZeroDuration()) {
    std::erase_if(lost, [this](const v1::LostMember& m) {
      if (m.role() != v1::NODE_ROLE_AGENT ||
          absl::Milliseconds(m.dead_for_ms()) >= config_.rejoin_timeout) {
        return false;
      }
      if (ranks_awaited_.insert(m.node_id()).second) {
        PSD_LOG_WARN("rank {} (host {}) declared dead by the coordinator ({}): waiting up to {} "
                     "for it to rejoin", m.rank(), m.host(), m.reason(),
                     absl::FormatDuration(config_.rejoin_timeout));
      }
      return true;
    });
  }
  // With replicas, a lost server's keys go on at its backups (Replication::Failover): only what
  // failover cannot survive ends the job.
  if (env_.replication.replicas > 0) {
    std::erase_if(lost, [this](const v1::LostMember& m) {
      if (m.role() != v1::NODE_ROLE_SERVER) return false;
      // Before its servers are connected, a starting agent leaves it to its registration.
      if (servers_connected_.load(std::memory_order_acquire) &&
          servers_reported_lost_.insert(m.node_id()).second) {
        PSD_LOG_WARN("server {} (host {}) declared dead by the coordinator ({}): its keys' "
                     "backups serve them",
                     m.node_id(), m.host(), m.reason());
        FailDeclaredDeadServer(m);
      }
      return true;
    });
  }
  // The world shrinks (--min_workers): a rank given up is removed while enough are left (the
  // KV servers complete its keys' clocks without it); this rank goes on.
  // A rank whose agent left with an error (its training process died) likewise, once the
  // rejoin timeout is over; while it cannot be removed the KV servers name it to the pulls.
  if (config_.min_workers > 0) {
    auto publish = [this] {  // this rank's index among the ranks left, their number
      uint32_t live_rank = 0;
      for (uint32_t r = 0; r < config_.rank; ++r) live_rank += ranks_removed_.contains(r) ? 0 : 1;
      const auto size = static_cast<uint32_t>(config_.world_size - ranks_removed_.size());
      live_world_.store(size);
      shm_->SetLiveWorld(live_rank, size, world_generation_.fetch_add(1) + 1);
    };
    // A removed rank whose replacement came (readmitted by the servers: the world grows).
    for (auto it = ranks_removed_.begin(); it != ranks_removed_.end();) {
      if (!replaced.contains(*it)) {
        ++it;
        continue;
      }
      const uint32_t back = *it;
      it = ranks_removed_.erase(it);
      PSD_LOG_WARN("rank {} is back (a replacement took it up): the job grows to {} of its {} "
                   "workers",
                   back, config_.world_size - ranks_removed_.size(), config_.world_size);
      publish();
    }
    auto remove = [&](const v1::LostMember& m, absl::string_view how) {
      if (m.role() != v1::NODE_ROLE_AGENT || m.rank() >= config_.world_size) return false;
      // Removed already (the coordinator's lists keep an agent that was replaced since).
      if (nodes_removed_.contains(m.node_id())) return true;
      if (ranks_removed_.contains(m.rank())) {
        // A later agent of the removed rank, dead too: a replacement that asked to come back
        // may have died before it took up the job (the SFB layers' wait for it ends).
        nodes_removed_.insert(m.node_id());
        for (auto& [kind, syncer] : syncers_) syncer->PeerRemoved(m.rank());
        return true;
      }
      // The rank was taken up again after this death (its replacement's PING, OnFrame; an
      // answer older than the replacement may arrive after it): the death it came back from,
      // whose removal its SFB layers made on its question and undid (SfbSyncer::ComeBack).
      {
        std::lock_guard<std::mutex> lock(peers_mu_);
        auto back = took_up_.find(m.rank());
        const absl::Time died = absl::Now() - absl::Milliseconds(m.dead_for_ms());
        if (back != took_up_.end() && died < back->second) {
          nodes_removed_.insert(m.node_id());
          return true;
        }
      }
      const auto left = static_cast<uint32_t>(config_.world_size - ranks_removed_.size() - 1);
      if (left < config_.min_workers) return false;
      ranks_removed_.insert(m.rank());
      nodes_removed_.insert(m.node_id());
      // SFB layers agree with the other agents on its last iteration that counts.
      for (auto& [kind, syncer] : syncers_) syncer->PeerRemoved(m.rank());
      PSD_LOG_WARN("rank {} (host {}) {} ({}){}: the job goes on with {} of its {} workers "
                   "(--min_workers {})",
                   m.rank(), m.host(), how, m.reason(),
                   config_.rejoin_timeout > absl::ZeroDuration()
                       ? absl::StrCat(" and did not rejoin within ",
                                      absl::FormatDuration(config_.rejoin_timeout))
                       : "",
                   left, config_.world_size, config_.min_workers);
      publish();
      return true;
    };
    std::erase_if(lost, [&](const v1::LostMember& m) {
      return remove(m, "declared dead by the coordinator");
    });
    // Ring all-reduce layers have no KV server to name a rank that left and cannot be removed:
    // their collectives would wait for a ring without it. It ends the job here, named.
    const bool ring = syncers_.contains(SyncerKind::kAllreduce) && AllreducePossible();
    for (const v1::LostMember& m : departed) {
      if (absl::Milliseconds(m.dead_for_ms()) >= config_.rejoin_timeout &&
          !remove(m, "left the job with an error") && ring && m.role() == v1::NODE_ROLE_AGENT) {
        gone.push_back(m);
      }
    }
  }
  if (lost.empty() && gone.empty()) return;
  std::vector<std::string> names;
  for (const v1::LostMember& m : lost) {
    // Who first: the framework's copy of a failure message is 128 bytes.
    names.push_back(m.role() == v1::NODE_ROLE_SERVER
                        ? absl::StrCat("server ", m.node_id(), " (host ", m.host(), ")")
                        : absl::StrCat("rank ", m.rank(), " (host ", m.host(), ")"));
  }
  if (lost.empty()) {
    const v1::LostMember& m = gone.front();
    lost_why_ = absl::StrCat("rank ", m.rank(), " (host ", m.host(), ") left the job with an "
                             "error (", m.reason(), "), and it cannot go on without it: ",
                             config_.world_size - ranks_removed_.size() - 1,
                             " ranks would be left, its min_workers is ", config_.min_workers);
  } else {
    lost_why_ = absl::StrCat(absl::StrJoin(names, ", "), " declared dead by the coordinator: ",
                             lost.front().reason(), " (", lost.front().node_id(), ")");
  }
  PSD_LOG_ERROR("{}: the iterations of this job cannot complete without it", lost_why_);
  CountError("sync_failed");
  std::vector<std::pair<uint32_t, uint64_t>> waiting;
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    for (uint32_t l = 0; l < progress_.size(); ++l) {
      LayerProgress& st = progress_[l];
      if (st.in_progress == 0) continue;
      waiting.emplace_back(l, st.in_progress);
      st.failed = true;
      st.failure = lost_why_;
      st.in_progress = 0;  // late completions of its transfers are ignored
    }
  }
  for (const auto& [layer, iteration] : waiting) shm_->LayerFailed(layer, iteration, lost_why_);
}

void Agent::ApplyPendingPlan() {
  std::optional<v1::Plan> plan;
  {
    std::lock_guard<std::mutex> lock(plan_mu_);
    plan.swap(pending_plan_);
  }
  if (!plan || plan->plan_epoch() <= applied_epoch_.load()) return;
  if (absl::Status s = ApplyPlan(*plan); !s.ok()) {
    // Keeping the old plan while the other ranks switch would mix schemes within an iteration:
    // stop with the reason instead.
    Fatal(absl::StrCat("plan epoch ", plan->plan_epoch(), " cannot be applied: ", s.message()));
    for (uint32_t l = 0; l < progress_.size(); ++l) {
      shm_->LayerFailed(l, progress_[l].posted + 1,
                        absl::StrCat("plan epoch ", plan->plan_epoch(), ": ", s.message()));
    }
  }
}

uint32_t Agent::PlannedScheme(const v1::LayerPlan& lp, const LayerSpec& spec) const {
  if (config_.scheme == "ps" || spec.desc.by_servers) return PSD_SCHEME_PS;
  if (config_.scheme == "allreduce") return PSD_SCHEME_ALLREDUCE;
  if (config_.scheme == "sfb" && spec.desc.kind == PSD_KIND_FC) return PSD_SCHEME_SFB;
  switch (lp.scheme()) {
    case v1::SYNC_SCHEME_SFB:
      return PSD_SCHEME_SFB;
    case v1::SYNC_SCHEME_ALLREDUCE:
      return PSD_SCHEME_ALLREDUCE;
    default:
      return PSD_SCHEME_PS;
  }
}

// A new epoch changes schemes (and priorities) only: the layers, the servers and every layer's
// chunks must be the ones this agent registered.
absl::Status Agent::ApplyPlan(const v1::Plan& plan) {
  if (plan.layers_size() != static_cast<int>(table_.layers.size())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "it covers ", plan.layers_size(), " layers, this agent has ", table_.layers.size()));
  }
  if (plan.servers_size() != static_cast<int>(config_.servers.size())) {
    return absl::FailedPreconditionError(absl::StrCat("it names ", plan.servers_size(),
                                                      " servers, this agent uses ",
                                                      config_.servers.size()));
  }
  for (int s = 0; s < plan.servers_size(); ++s) {
    const auto& server = plan.servers(s);
    const auto chosen = coordinator::ChooseEndpoint(server.endpoints(), Local(),
                                                    absl::StrCat("server ", server.node_id()));
    if (!chosen.ok() || chosen->address != config_.servers[static_cast<size_t>(s)]) {
      return absl::FailedPreconditionError(
          absl::StrCat("server ", s, " moved (", config_.servers[static_cast<size_t>(s)], ")"));
    }
  }
  // The job's iteration, as the coordinator counts (ReportedIteration), in this process's.
  const uint64_t at = plan.effective_iteration() > env_.clock_base
                          ? plan.effective_iteration() - env_.clock_base
                          : 1;
  for (uint32_t l = 0; l < table_.layers.size(); ++l) {
    const v1::LayerPlan& lp = plan.layers(static_cast<int>(l));
    const LayerSpec& spec = table_.layers[l];
    const uint32_t scheme = PlannedScheme(lp, spec);
    // Chunks must not move (a layer that switches to PS uses the keys registered for it).
    // (A layer without chunks here, an SFB layer of a job without servers, stays on SFB.)
    const bool compare = !spec.chunks.empty() && lp.chunks_size() > 0;
    bool same = !compare || spec.chunks.size() == static_cast<size_t>(lp.chunks_size());
    for (int c = 0; compare && same && c < lp.chunks_size(); ++c) {
      const PsChunk& mine = spec.chunks[static_cast<size_t>(c)];
      const v1::Chunk& theirs = lp.chunks(c);
      same = mine.key == theirs.key() && mine.offset == theirs.offset() &&
             mine.length == theirs.length() && mine.server == theirs.server_index();
    }
    if (!same) {
      return absl::FailedPreconditionError(
          absl::StrCat("the chunks of layer ", spec.desc.name, " changed"));
    }
    uint64_t next_post;
    {
      std::lock_guard<std::mutex> lock(layers_mu_);
      next_post = progress_[l].posted + 1;
    }
    const ScheduleChange change =
        ComposeSchedule(spec, schedules_->Get(l), scheme, std::max<uint64_t>(at, 1), next_post);
    if (change.outcome == ScheduleChange::kRefused && absl::StartsWith(change.why, "too late")) {
      return absl::FailedPreconditionError(absl::StrCat("layer ", spec.desc.name, ": ", change.why,
                                                        " (the coordinator's lead was too short)"));
    }
  }
  // Every layer can take it: write the schedules.
  for (uint32_t l = 0; l < table_.layers.size(); ++l) {
    ApplyChange(l, PlannedScheme(plan.layers(static_cast<int>(l)), table_.layers[l]),
                std::max<uint64_t>(at, 1), plan.plan_epoch());
  }
  previous_epoch_.store(RunningEpoch());
  applied_at_.store(at);
  applied_epoch_.store(plan.plan_epoch());
  plan_epoch_->Set(static_cast<double>(plan.plan_epoch()));
  int sfb = 0, allreduce = 0;
  for (uint32_t l = 0; l < table_.layers.size(); ++l) {
    const uint32_t scheme = PlannedScheme(plan.layers(static_cast<int>(l)), table_.layers[l]);
    sfb += scheme == PSD_SCHEME_SFB;
    allreduce += scheme == PSD_SCHEME_ALLREDUCE;
  }
  PSD_LOG_INFO("plan epoch {} from iteration {}: {} of {} layers on SFB, {} on all-reduce",
               plan.plan_epoch(), at, sfb, table_.layers.size(), allreduce);
  return absl::OkStatus();
}

void Agent::ApplyChange(uint32_t layer, uint32_t scheme, uint64_t switch_at, uint64_t epoch) {
  const LayerSpec& spec = table_.layers[layer];
  uint64_t next_post;
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    next_post = progress_[layer].posted + 1;
  }
  const ScheduleChange change =
      ComposeSchedule(spec, schedules_->Get(layer), scheme, switch_at, next_post);
  switch (change.outcome) {
    case ScheduleChange::kDefer:
      deferred_[layer].push_back({scheme, switch_at, epoch});
      return;
    case ScheduleChange::kRefused:
      // Every rank refuses alike (the same layer table): the layer keeps its scheme.
      PSD_LOG_WARN("plan epoch {}: layer {} ({}) stays on {}: {}", epoch, layer, spec.desc.name,
                   SchemeName(schedules_->At(layer, switch_at)), change.why);
      return;
    case ScheduleChange::kApply:
      if (!change.changed) return;
      schedules_->Set(layer, change.schedule);
      shm_->PublishSchedule(layer, change.schedule.Pack());
      if (progress_[layer].scheme_gauge) progress_[layer].scheme_gauge->Set(scheme);
      PSD_LOG_INFO("plan epoch {}: layer {} ({}) runs {} from iteration {}", epoch, layer,
                   spec.desc.name, SchemeName(scheme), switch_at);
      return;
  }
}

// The epoch whose schemes the iterations being run use: the applied one once its effective
// iteration is reached.
uint64_t Agent::RunningEpoch() const {
  return last_iteration_.load() + 1 >= applied_at_.load() ? applied_epoch_.load()
                                                          : previous_epoch_.load();
}

// ---- Frames from the other agents --------------------------------------------------------------

absl::StatusOr<transport::PayloadTarget> Agent::OnHeader(
    const std::shared_ptr<transport::PeerSession>& peer, const FrameHeader& h) {
  const uint32_t from = peer->identity().rank;
  if (from < config_.world_size) peer_last_ns_[from].store(SteadyNs(), std::memory_order_relaxed);
  if (!peer->has_handler_state()) {  // its first frame (one connection's frames are in order)
    peer->set_handler_state(std::make_shared<bool>(true));
    std::lock_guard<std::mutex> lock(peers_mu_);
    peer_address_[from] = peer->address();
    if (peer_connections_[from]++ == 0 && gone_peers_.erase(from) > 0) ++gone_version_;
  } else if (silent_any_.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> lock(peers_mu_);
    if (silent_peers_.erase(from) > 0) {
      gone_peers_.erase(from);
      ++gone_version_;
      silent_any_.store(!silent_peers_.empty(), std::memory_order_relaxed);
    }
  }
  // A PING says the peer registered; it may come before we did (the gate remembers it).
  if (h.type == FrameType::kPing && h.payload_length == 0) {
    return transport::PayloadTarget::Discard();
  }
  transport::FrameHandler* handler = peer_handler_.load();
  if (handler == nullptr) {
    return absl::FailedPreconditionError("this agent has not registered its model yet");
  }
  return handler->OnHeader(peer, h);
}

void Agent::OnClose(const std::shared_ptr<transport::PeerSession>& peer,
                    const absl::Status& reason) {
  if (!peer->has_handler_state()) return;  // never sent a frame: never counted
  const uint32_t rank = peer->identity().rank;
  std::lock_guard<std::mutex> lock(peers_mu_);
  if (--peer_connections_[rank] > 0) return;
  // A rank that finished has sent everything it owed before it closed (its frames arrive
  // before the close); one that died mid-iteration has not, and waiting layers fail now.
  gone_peers_[rank] = absl::StrCat("rank ", rank, " (", peer->address(),
                                   ") is gone: its connection to this agent closed (",
                                   reason.ok() ? "by the peer" : reason.message(), ")");
  ++gone_version_;
}

void Agent::PassGonePeers() {
  std::map<uint32_t, std::string> gone;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    if (config_.peer_timeout > absl::ZeroDuration()) {
      // A connected peer that sent frames before and nothing for peer_timeout: it pings every
      // third of it, so it is frozen or cut off.
      const int64_t now = SteadyNs();
      const int64_t limit = absl::ToInt64Nanoseconds(config_.peer_timeout);
      for (const auto& [rank, connections] : peer_connections_) {
        if (rank >= config_.world_size) continue;
        const int64_t last = peer_last_ns_[rank].load(std::memory_order_relaxed);
        if (connections == 0 || last == 0 || now - last < limit || silent_peers_.contains(rank)) {
          continue;
        }
        silent_peers_.insert(rank);
        silent_any_.store(true, std::memory_order_relaxed);
        gone_peers_[rank] = absl::StrCat(
            "rank ", rank, " (", peer_address_[rank], ") is silent: nothing from it for ",
            absl::FormatDuration(
                absl::Trunc(absl::Nanoseconds(now - last), absl::Milliseconds(100))),
            " (it pings every few seconds: frozen, or its network is cut)");
        ++gone_version_;
      }
    }
    if (gone_version_ == gone_passed_ && gone_since_.empty()) return;
    gone_passed_ = gone_version_;
    gone = gone_peers_;
  }
  // A rank that may be restarted (--rejoin_timeout) is waited for that long: what waits for its
  // frames fails only then (a restarted agent taking it up comes back on a new connection).
  if (config_.rejoin_timeout > absl::ZeroDuration()) {
    const absl::Time now = absl::Now();
    std::erase_if(gone_since_, [&](const auto& g) { return !gone.contains(g.first); });
    for (auto it = gone.begin(); it != gone.end();) {
      auto [since, fresh] = gone_since_.try_emplace(it->first, now);
      if (fresh) {
        PSD_LOG_WARN("{}: waiting up to {} for it to rejoin", it->second,
                     absl::FormatDuration(config_.rejoin_timeout));
      }
      if (now - since->second < config_.rejoin_timeout) {
        it = gone.erase(it);
        continue;
      }
      it->second = absl::StrCat(it->second, ", and it did not rejoin within ",
                                absl::FormatDuration(config_.rejoin_timeout));
      ++it;
    }
    if (gone == gone_told_) return;
    gone_told_ = gone;
  }
  // A job that may go on without a rank (--min_workers) waits for the coordinator's word: the
  // rank is removed (SFB layers then agree on its last iteration, PeerRemoved), or, where too
  // few would be left, declared dead, which fails what waits.
  if (config_.min_workers > 0) return;
  for (auto& [kind, syncer] : syncers_) syncer->PeersGone(gone);
}

// Every peer_timeout / 3 (main thread, after registration): an empty PING to each server (the
// PONG is dropped) and to each peer agent, so that both can tell silence from a slow iteration.
// A server that answered nothing for peer_timeout while requests wait is frozen or cut off: its
// requests fail now (and go to the next server of their chain when the keys are replicated).
void Agent::SendKeepalives(absl::Time now) {
  if (config_.peer_timeout <= absl::ZeroDuration()) return;
  const auto servers = static_cast<uint32_t>(env_.servers.size() + env_.joined.Count());
  for (uint32_t s = 0; s < servers; ++s) {
    server::KvClient& server = env_.Server(s);
    if (server.FailIfSilent(config_.peer_timeout)) {
      PSD_LOG_WARN("KV server {} is silent for {}: its requests fail", server.server(),
                   absl::FormatDuration(config_.peer_timeout));
    }
  }
  if (now < next_keepalive_) return;
  next_keepalive_ = now + config_.peer_timeout / 3;
  for (uint32_t s = 0; s < servers; ++s) {
    server::KvClient& server = env_.Server(s);
    server.OnDone(server.Ping(), [](absl::Status) {});
  }
  for (uint32_t p = 0; p < env_.peers.size(); ++p) {
    if (p == config_.rank) continue;
    std::shared_ptr<transport::Connection> link = env_.peers.Get(p);
    if (link == nullptr) continue;
    FrameHeader ping;
    ping.type = FrameType::kPing;
    ping.job_id = config_.job_id;
    ping.sender_rank = config_.rank;
    link->Send(ping, {}, [](absl::Status) {});
  }
}

void Agent::OnFrame(const std::shared_ptr<transport::PeerSession>& peer, const FrameHeader& h,
                    transport::MutableBuffer payload) {
  if (h.type == FrameType::kPing) {
    const uint32_t rank = peer->identity().rank;
    // A restarted agent took up this rank at the job's iteration h.clock (--rejoin): what this
    // agent sends it goes on its connection from now on (ours led to the agent it replaces),
    // starting with a PING of ours (its gate) and what it needs again of that iteration on.
    if (h.clock > 0 && config_.rejoin_timeout > absl::ZeroDuration() && registered_.load() &&
        rank < config_.world_size && rank != config_.rank) {
      if (std::shared_ptr<transport::Connection> old =
              env_.peers.Set(rank, peer->shared_connection());
          old != nullptr && old != peer->shared_connection()) {
        old->Close();
      }
      PSD_LOG_WARN("rank {} ({}) took up the job at iteration {}: this agent's frames to it go "
                   "on its connection",
                   rank, peer->address(), h.clock);
      {
        std::lock_guard<std::mutex> lock(peers_mu_);
        took_up_[rank] = absl::Now();
      }
      FrameHeader ping;
      ping.type = FrameType::kPing;
      ping.job_id = config_.job_id;
      ping.sender_rank = config_.rank;
      peer->connection().Send(ping, {}, [](absl::Status) {});
      for (auto& [kind, syncer] : syncers_) syncer->PeerBack(rank, h.clock);
    }
    peer_gate_->MarkReady(rank);
    return;
  }
  if (transport::FrameHandler* handler = peer_handler_.load()) handler->OnFrame(peer, h, payload);
}

}  // namespace

void RequestAgentStop() {
  stop_requested.store(true);
}

int RunAgent(const AgentConfig& config) {
  auto agent = std::make_shared<Agent>(config);
  return agent->Run();
}

}  // namespace poseidon::agent
