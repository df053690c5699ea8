#include "agent/agent.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <queue>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agent/device_stager.h"
#include "agent/shm_endpoint.h"
#include "agent/telemetry_reporter.h"
#include "agent/timeline.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/periodic.h"
#include "common/status.h"
#include "coordinator/client.h"
#include "coordinator/planner/planner.h"
#include "server/kv_client.h"
#include "transport/frame_server.h"
#include "transport/handshake.h"
#include "transport/tcp/tcp_context.h"

namespace poseidon::agent {
namespace {

// Set from a signal handler (the one process-wide flag: a signal cannot reach a context object).
std::atomic<bool> stop_requested{false};

using transport::FrameHeader;
using transport::FrameType;

constexpr uint64_t kAlign = 64;
constexpr uint64_t kMaxDataBytes = uint64_t{1} << 40;  // shared buffers of one worker
uint64_t AlignUp(uint64_t x) {
  return (x + kAlign - 1) / kAlign * kAlign;
}

struct PsChunk {
  uint64_t key = 0;
  uint64_t offset = 0;  // bytes
  uint64_t length = 0;  // bytes
  uint32_t server = 0;
};

struct LayerState {
  LayerDesc desc;
  LayerLayout layout;
  std::vector<PsChunk> chunks;   // PS
  uint64_t m = 0, n = 0, k = 0;  // SFB: U is k x m, V is k x n
  // Progress (guarded by Agent::layers_mu_).
  uint64_t posted = 0;       // last iteration posted ready
  uint64_t in_progress = 0;  // iteration being synchronised (0: none)
  int remaining = 0;         // tasks left of in_progress
  bool failed = false;
  std::string failure;
  absl::Time ready_at;                 // when in_progress was posted
  std::vector<uint8_t> chunk_pending;  // PS: chunks of in_progress not yet complete
  bool stall_reported = false;
  bool on_device = false;  // in_progress was posted on the GPU (its buffers are in the arena)
  int bucket = -1;         // PS: the bucket this layer is fused into (its chunks are unused)
  prometheus::Histogram* sync_seconds = nullptr;
};

// Factors received from the other agents for one SFB layer, in two slots (iteration parity): a
// peer can be at most one iteration ahead of us on a layer.
struct SfbInbox {
  uint64_t floats = 0;           // k * (m + n)
  std::vector<float> data[2];    // world_size * floats each
  std::vector<uint64_t> tag[2];  // per peer: the iteration held, 0 if none
  // Progress of the current iteration (guarded by Agent::inbox_mu_).
  uint64_t sent = 0;      // iteration whose factors we have started sending
  int sends_pending = 0;  // our sends of `sent` not yet handed to the network
  absl::Status send_error;
  uint64_t rebuild_queued = 0;  // iteration whose rebuild is queued
  uint64_t finished = 0;        // iteration completed or failed
  absl::Time started;           // when `sent` began (the watchdog's clock)
};

// Consecutive small PS layers fused into one key (DDP's bucketing): their gradients are adjacent
// in the data segment, so the bucket's key covers [first layer's gradient, last one's end),
// alignment padding included (zeros, which sum to zeros). Synchronised once every member of
// the iteration is ready; each member completes with it.
struct Bucket {
  std::vector<uint32_t> members;  // layer indices, consecutive
  PsChunk chunk;                  // offset relative to the first member's gradient
  // Progress (guarded by Agent::layers_mu_).
  uint64_t iteration = 0;  // the iteration being gathered
  size_t waiting = 0;      // members of `iteration` not yet ready
};

struct Task {
  uint32_t priority = 0;
  uint64_t seq = 0;
  uint32_t layer = 0;
  uint64_t iteration = 0;
  int chunk = -1;  // PS chunk index; -1 for an SFB layer, -2 for a member of a finished bucket
  uint64_t bytes = 0;
  bool rebuild = false;                  // SFB: false sends our factors, true rebuilds the sum
  int bucket = -1;                       // a bucket's synchronisation (layer: its first member)
  absl::Time queued_at;                  // when it entered the queue (the timeline's "queue")
  bool operator<(const Task& o) const {  // for std::priority_queue (max-heap): invert
    return priority != o.priority ? priority > o.priority : seq > o.seq;
  }
};

// What completes one member of a bucket with the bucket's task.
Task MemberTask(const Task& bucket_task, uint32_t layer) {
  Task t = bucket_task;
  t.layer = layer;
  t.chunk = -2;
  t.bucket = -1;
  return t;
}

class Agent : public transport::FrameHandler, public std::enable_shared_from_this<Agent> {
 public:
  explicit Agent(AgentConfig config) : config_(std::move(config)) {}

  int Run();

  // SFB inbound factors (transport I/O threads).
  absl::StatusOr<transport::PayloadTarget> OnHeader(
      const std::shared_ptr<transport::PeerSession>& peer, const FrameHeader& header) override;
  void OnFrame(const std::shared_ptr<transport::PeerSession>& peer, const FrameHeader& header,
               transport::MutableBuffer payload) override;

 private:
  absl::Status Register();
  absl::Status ConnectServers();
  absl::Status ConnectPeers();
  void OnReady(uint32_t layer, uint64_t iteration, bool on_device);
  void FormBuckets();
  void AttachCuda();
  void Worker();
  // Runs a task the scheduler started; false when its credit is returned later (asynchronously,
  // by ReleaseCredit), true when the caller returns it now.
  bool RunTask(const Task& task);
  bool SyncChunk(const Task& task);
  void ReleaseCredit(uint64_t bytes);
  void SendFactors(const Task& task);
  void RebuildSfb(const Task& task);
  // With inbox_mu_ held: the rebuild task once our sends are out and every peer's factors are
  // in (at most once per iteration); StartRebuild runs it, after inbox_mu_ is released.
  std::optional<Task> MaybeRebuildLocked(uint32_t layer, uint64_t iteration);
  void StartRebuild(const Task& task);
  void CheckSfbDeadlines();
  void Enqueue(Task task);
  void TaskFinished(const Task& task, const absl::Status& status);
  void Fatal(const std::string& why);

  absl::Status JoinCoordinator(const std::string& listen);
  void SetUpMetrics();
  void CheckStalls();
  void CountError(const std::string& kind);

  AgentConfig config_;
  std::unique_ptr<coordinator::CoordinatorClient> coord_;
  std::unique_ptr<coordinator::HeartbeatLoop> heartbeats_;
  // With a coordinator: per-link bytes and per-layer sync times, reported periodically. Set in
  // JoinCoordinator, before any data-path thread can use it.
  std::unique_ptr<TelemetryReporter> telemetry_;
  std::atomic<uint64_t> last_iteration_{0};
  std::unique_ptr<ShmEndpoint> shm_;
  // The GPU path, once the training process has attached its CUDA arena (null otherwise).
  std::unique_ptr<DeviceStager> stager_;
  // Observability: metrics (always collected; served when metrics_listen is set), timeline.
  MetricsRegistry metrics_;
  std::unique_ptr<MetricsExposer> exposer_;
  std::unique_ptr<Timeline> timeline_;
  std::vector<prometheus::Counter*> push_bytes_, pull_bytes_;  // by server index
  prometheus::Counter* sfb_sent_bytes_ = nullptr;
  prometheus::Counter* sfb_received_bytes_ = nullptr;
  prometheus::Histogram* iteration_seconds_ = nullptr;
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* credit_in_use_ = nullptr;
  prometheus::Gauge* plan_epoch_ = nullptr;
  prometheus::Gauge* peers_alive_ = nullptr;
  std::mutex iteration_mu_;
  std::map<uint64_t, size_t> layers_done_;  // iteration -> layers completed
  absl::Time last_iteration_end_;
  std::shared_ptr<transport::Context> ctx_;
  std::shared_ptr<transport::FrameServer> sfb_server_;
  std::vector<std::shared_ptr<server::KvClient>> servers_;
  std::vector<std::shared_ptr<transport::Connection>> peers_;  // [rank], null for ourselves

  std::mutex layers_mu_;
  std::vector<LayerState> layers_;
  std::vector<Bucket> buckets_;  // fixed at registration
  bool registered_ = false;
  std::atomic<uint64_t> layers_count_{0};  // layers_.size() once registered (I/O threads read)
  ShmEndpoint::ServerRule server_rule_;    // rule 0: sum (the framework's optimizer steps)

  std::mutex inbox_mu_;
  std::condition_variable inbox_cv_;
  std::map<uint32_t, SfbInbox> inbox_;  // by layer; created at registration, then fixed
  // A peer announces (PING) that it has registered and can take our factors.
  std::vector<bool> peer_ready_;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::priority_queue<Task> queue_;
  uint64_t in_flight_bytes_ = 0;
  uint64_t next_seq_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

void Agent::Fatal(const std::string& why) {
  PSD_LOG_ERROR("{}", why);
  if (shm_) shm_->SetState(PSD_AGENT_FAILED, why);
}

int Agent::Run() {
  if (config_.segment.empty()) {
    config_.segment = absl::StrCat("/poseidon-", config_.job_id, "-", config_.rank);
  }
  auto shm = ShmEndpoint::Create(config_.segment, config_.rank, config_.world_size, config_.job_id);
  if (!shm.ok()) {
    PSD_LOG_ERROR("cannot create the shared-memory segment: {}", shm.status().message());
    return 1;
  }
  shm_ = std::move(*shm);
  // The heartbeat says "this agent process is alive" on its own thread: the main loop can be
  // busy for seconds (connecting to servers and peers during registration on a loaded machine),
  // and a training process must not take that for a dead agent.
  PeriodicThread heartbeat;
  heartbeat.Start(absl::Milliseconds(100), [shm = shm_.get()] { shm->Heartbeat(); },
                  /*run_now=*/true);
  peer_ready_.assign(config_.world_size, false);
  SetUpMetrics();
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
  transport::TcpOptions tcp;
  tcp.io_threads = 2;
  auto ctx = transport::CreateTcpContext(tcp);
  if (!ctx.ok()) {
    Fatal(std::string(ctx.status().message()));
    return 1;
  }
  ctx_ = *ctx;
  // The SFB listener starts at once so that peers can connect while we wait for our framework.
  std::string listen =
      !config_.listen.empty()
          ? config_.listen
          : (config_.rank < config_.peers.size() ? config_.peers[config_.rank] : "");
  if (!listen.empty()) {
    auto listener = ctx_->Listen(listen);
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
    secrets->Set(config_.job_id, config_.secret);
    sfb_server_ = std::make_shared<transport::FrameServer>(*listener, secrets, shared_from_this());
    sfb_server_->Start();
  }
  if (!config_.coordinator.empty()) {
    if (auto s = JoinCoordinator(listen); !s.ok()) {
      Fatal(absl::StrCat("joining the coordinator ", config_.coordinator, ": ", s.message()));
      if (sfb_server_) sfb_server_->Stop();
      sfb_server_.reset();
      ctx_->Close();
      return 1;
    }
  }
  PSD_LOG_INFO("agent rank {}/{} of job {}: segment {}, {} servers{}", config_.rank,
               config_.world_size, config_.job_id, config_.segment, config_.servers.size(),
               listen.empty() ? "" : absl::StrCat(", peers on ", listen));
  std::printf("poseidon-agent ready on %s\n", config_.segment.c_str());
  std::fflush(stdout);

  for (int i = 0; i < config_.sync_threads; ++i) workers_.emplace_back([this] { Worker(); });
  auto stop = [&](int code) {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    inbox_cv_.notify_all();
    for (auto& w : workers_) w.join();
    if (telemetry_) telemetry_->Stop();
    if (heartbeats_) heartbeats_->Stop();
    if (coord_) (void)coord_->Deregister(code == 0 ? "training finished" : "agent exiting");
    if (sfb_server_) sfb_server_->Stop();
    for (auto& s : servers_) s->Close();
    ctx_->Close();
    // Drains the device streams (their callbacks use the timeline) and unpins the segment.
    stager_.reset();
    timeline_.reset();  // closes the JSON
    exposer_.reset();
    // Break the ownership cycle agent -> frame server -> handler (this agent).
    sfb_server_.reset();
    servers_.clear();
    peers_.clear();
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
    if (!shm_->attached() && !registered_ && absl::Now() > attach_deadline) {
      Fatal(absl::StrCat("no training process attached to ", config_.segment, " within ",
                         absl::FormatDuration(config_.attach_timeout)));
      return stop(1);
    }
    if (registered_) {
      CheckSfbDeadlines();
      CheckStalls();
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
        if (registered_) {
          PSD_LOG_WARN("a second registration was ignored");
          break;
        }
        if (auto s = Register(); !s.ok()) {
          const std::string why = absl::StrCat("registration failed: ", s.message());
          shm_->FailRegistration(why);
          Fatal(why);
          return stop(1);
        }
        registered_ = true;
        break;
      case PSD_EVENT_LAYER_READY:
        OnReady(e.layer, e.iteration, e.aux == PSD_READY_DEVICE);
        break;
      case PSD_EVENT_CUDA_ATTACH:
        AttachCuda();
        break;
      case PSD_EVENT_DETACH:
        PSD_LOG_INFO("the training process detached; the agent of rank {} exits", config_.rank);
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
  reg.gpu_index = config_.rank;
  reg.endpoints.push_back(coordinator::MakeEndpoint(v1::TRANSPORT_KIND_TCP, listen));
  reg.world_size = config_.world_size;
  reg.requested_rank = config_.rank;
  ASSIGN_OR_RETURN(coordinator::World world,
                   coord_->RegisterAgentAndRendezvous(reg, config_.connect_timeout));
  if (world.rank != config_.rank || world.world_size != config_.world_size) {
    return absl::InternalError(absl::StrCat("the coordinator gave rank ", world.rank, " of ",
                                            world.world_size, ", not ", config_.rank, " of ",
                                            config_.world_size));
  }
  config_.peers.clear();
  for (const auto& peer : world.peers) {
    config_.peers.push_back(peer.endpoints_size() > 0 ? peer.endpoints(0).address() : "");
  }
  coordinator::CoordinatorClient::HeartbeatOptions hb;
  hb.iteration = [this] { return last_iteration_.load(); };
  heartbeats_ = coord_->StartHeartbeats(hb);
  if (config_.telemetry_interval > absl::ZeroDuration()) {
    std::vector<std::string> servers, peers;
    for (const auto& server : world.servers) servers.push_back(server.node_id());
    for (const auto& peer : world.peers) peers.push_back(peer.node_id());
    telemetry_ = std::make_unique<TelemetryReporter>(
        coord_.get(), config_.telemetry_interval, std::move(servers), std::move(peers),
        config_.rank, [this] { return last_iteration_.load(); });
    telemetry_->Start();
  }
  PSD_LOG_INFO("rendezvous with {}: rank {} of {}, {} servers", config_.coordinator, world.rank,
               world.world_size, world.servers.size());
  return absl::OkStatus();
}

absl::Status Agent::Register() {
  ASSIGN_OR_RETURN(std::vector<LayerDesc> descs, shm_->ReadLayers());
  ASSIGN_OR_RETURN(server_rule_, shm_->ReadServerRule());
  // A server-side rule keeps parameters on the servers: every layer goes by PS.
  if (server_rule_.rule != 0) config_.scheme = "ps";
  v1::ModelSpec model;
  model.set_name(absl::StrCat("job-", config_.job_id));
  for (const auto& d : descs) {
    auto* l = model.add_layers();
    l->set_name(d.name);
    // "ps" keeps every layer on PS: present FC layers as "other" to the planner.
    l->set_kind(d.kind == PSD_KIND_FC && config_.scheme == "ps"
                    ? v1::LAYER_KIND_OTHER
                    : static_cast<v1::LayerKind>(d.kind));
    for (uint64_t s : d.shape) l->add_shape(s);
    l->set_element_type(v1::ELEMENT_TYPE_F32);
    l->set_batch_per_worker(d.kind == PSD_KIND_FC ? d.batch_k : 1);
  }
  planner::PlannerConfig pc;
  pc.workers = config_.world_size;
  pc.servers = std::max<uint32_t>(1, static_cast<uint32_t>(config_.servers.size()));
  pc.colocated = config_.colocated;
  pc.bandwidth_bytes_per_second = config_.bandwidth_bytes_per_second;
  pc.block_bytes = config_.block_bytes;
  pc.job_id = absl::StrCat(config_.job_id);
  v1::Plan plan;
  if (coord_) {
    // Every rank registers its model; the coordinator answers with the job's plan once all of
    // them registered the same model (or names the first layer that differs).
    v1::UpdateRuleSpec rule;
    rule.set_rule(v1::UPDATE_RULE_SUM);
    ASSIGN_OR_RETURN(plan, coord_->RegisterModel(model, rule, {}, config_.attach_timeout));
    config_.servers.clear();
    for (const auto& server : plan.servers()) {
      if (server.endpoints_size() == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("the plan names server ", server.node_id(), " without an address"));
      }
      config_.servers.push_back(server.endpoints(0).address());
    }
  } else {
    ASSIGN_OR_RETURN(planner::PlanResult planned, planner::BuildPlan(model, pc));
    plan = std::move(planned.plan);
  }
  if (plan.layers_size() != static_cast<int>(descs.size())) {
    return absl::InternalError("the plan does not cover every layer");
  }
  std::vector<LayerLayout> layout(descs.size());
  uint64_t offset = 0;
  layers_.resize(descs.size());
  bool any_sfb = false, any_ps = false;
  for (size_t i = 0; i < descs.size(); ++i) {
    const v1::LayerPlan& lp = plan.layers(static_cast<int>(i));
    LayerState& st = layers_[i];
    st.desc = descs[i];
    bool sfb = lp.scheme() == v1::SYNC_SCHEME_SFB;
    if (config_.scheme == "sfb" && descs[i].kind == PSD_KIND_FC) sfb = true;
    LayerLayout& lay = layout[i];
    lay.scheme = sfb ? PSD_SCHEME_SFB : PSD_SCHEME_PS;
    lay.priority = lp.priority();
    lay.grad_offset = offset;
    offset = AlignUp(offset + descs[i].elements * sizeof(float));
    if (sfb) {
      any_sfb = true;
      st.m = descs[i].shape[0];
      st.n = descs[i].shape[1];
      st.k = descs[i].batch_k;
      lay.u_offset = offset;
      offset = AlignUp(offset + st.k * st.m * sizeof(float));
      lay.v_offset = offset;
      offset = AlignUp(offset + st.k * st.n * sizeof(float));
      std::lock_guard<std::mutex> lock(inbox_mu_);  // peers' frames may already arrive
      SfbInbox& box = inbox_[static_cast<uint32_t>(i)];
      box.floats = st.k * (st.m + st.n);
      for (int s = 0; s < 2; ++s) {
        box.data[s].assign(box.floats * config_.world_size, 0.0f);
        box.tag[s].assign(config_.world_size, 0);
      }
    } else {
      any_ps = true;
      if (lp.chunks_size() == 0) {
        return absl::InternalError(absl::StrCat("layer ", descs[i].name, " has no PS chunks"));
      }
      for (const auto& c : lp.chunks()) {
        if (c.length() % sizeof(float) != 0 || c.offset() + c.length() > descs[i].elements * 4) {
          return absl::InternalError(absl::StrCat("bad chunk of layer ", descs[i].name));
        }
        st.chunks.push_back({c.key(), c.offset(), c.length(), c.server_index()});
      }
    }
    st.layout = lay;
    // Sizes come from the training process: refuse a layout that cannot be mapped rather than
    // let offsets wrap around (a layer adds at most ~2^55 bytes: this check cannot overflow).
    if (offset > kMaxDataBytes) {
      return absl::ResourceExhaustedError(absl::StrCat("the layers' buffers need more than ",
                                                       kMaxDataBytes, " bytes (at layer ", i, ", ",
                                                       descs[i].name, ")"));
    }
  }
  if (any_ps && config_.servers.empty()) {
    return absl::FailedPreconditionError("PS layers need KV servers (--servers)");
  }
  if (any_sfb && config_.world_size > 1 && config_.peers.size() != config_.world_size) {
    return absl::FailedPreconditionError(
        absl::StrCat("SFB layers need every agent's address (--peers: ", config_.world_size,
                     " entries, got ", config_.peers.size(), ")"));
  }
  FormBuckets();
  if (any_ps) RETURN_IF_ERROR(ConnectServers());
  // Every layer's state and inbox exists now. Peers send factors as soon as they have our PING
  // below, so the inbound path (OnHeader checks layer ids against this) must be open first: a
  // frame refused here would cost that peer's connection and leave this layer waiting forever.
  layers_count_.store(layers_.size());
  if (any_sfb) {
    RETURN_IF_ERROR(ConnectPeers());
    // Our inbox exists now: tell every peer it may send us factors.
    for (uint32_t p = 0; p < config_.world_size; ++p) {
      if (p == config_.rank) continue;
      FrameHeader ping;
      ping.type = FrameType::kPing;
      ping.job_id = config_.job_id;
      ping.sender_rank = config_.rank;
      peers_[p]->Send(ping, {}, [](absl::Status) {});
    }
  }
  if (telemetry_) {
    std::vector<std::string> names;
    for (const auto& d : descs) names.push_back(d.name);
    telemetry_->SetLayers(std::move(names));
    // Latency of the links to the KV servers: a few pings per window from the reporter thread.
    if (!servers_.empty()) {
      telemetry_->SetServerPing([servers = servers_](size_t s, absl::Duration timeout) {
        return s < servers.size() ? servers[s]->MeasureRoundTrip(timeout)
                                  : absl::StatusOr<absl::Duration>(absl::NotFoundError("server"));
      });
    }
  }
  RETURN_IF_ERROR(shm_->PublishLayout(descs, layout, std::max<uint64_t>(offset, kAlign)));
  plan_epoch_->Set(static_cast<double>(plan.plan_epoch()));
  for (size_t i = 0; i < layers_.size(); ++i) {
    const MetricLabels labels = {{"layer", layers_[i].desc.name}};
    if (auto g = metrics_.GetGauge("poseidon_agent_layer_scheme",
                                   "Scheme of each layer: 1 parameter server, 2 SFB", labels);
        g.ok()) {
      (*g)->Set(layout[i].scheme);
    }
    if (auto h = metrics_.GetHistogram("poseidon_agent_layer_sync_seconds",
                                       "Time from a layer's ready to its done", labels,
                                       ExponentialBuckets(1e-4, 2, 18));
        h.ok()) {
      layers_[i].sync_seconds = *h;
    }
  }
  int sfb_layers = 0;
  for (const auto& l : layout) sfb_layers += l.scheme == PSD_SCHEME_SFB;
  PSD_LOG_INFO("registered {} layers ({} on SFB), {} bytes of buffers", descs.size(), sfb_layers,
               offset);
  return absl::OkStatus();
}

void Agent::FormBuckets() {
  buckets_.clear();
  if (config_.bucket_bytes == 0) return;
  std::vector<uint32_t> run;
  uint64_t run_start = 0, run_end = 0;
  auto close = [&] {
    if (run.size() >= 2) {
      Bucket b;
      b.members = run;
      b.chunk.key = (uint64_t{1} << 63) | (uint64_t{run.front()} << 32) | run.size();
      b.chunk.offset = 0;
      b.chunk.length = run_end - run_start;
      b.chunk.server = layers_[run.front()].chunks[0].server;
      for (uint32_t l : run) layers_[l].bucket = static_cast<int>(buckets_.size());
      buckets_.push_back(std::move(b));
    }
    run.clear();
  };
  for (uint32_t i = 0; i < layers_.size(); ++i) {
    const LayerState& st = layers_[i];
    const uint64_t bytes = st.desc.elements * sizeof(float);
    if (!st.desc.fusable || st.layout.scheme != PSD_SCHEME_PS || st.chunks.size() != 1 ||
        bytes >= config_.bucket_bytes) {
      close();
      continue;
    }
    const uint64_t start = st.layout.grad_offset;
    // Members must be adjacent in the data segment (nothing but alignment between them).
    if (!run.empty() && (start != AlignUp(run_end) || start + bytes - run_start > config_.bucket_bytes)) {
      close();
    }
    if (run.empty()) run_start = start;
    run.push_back(i);
    run_end = start + bytes;
  }
  close();
  size_t fused = 0;
  for (const Bucket& b : buckets_) fused += b.members.size();
  if (!buckets_.empty()) {
    PSD_LOG_INFO("{} small layers fused into {} buckets of at most {} bytes", fused,
                 buckets_.size(), config_.bucket_bytes);
  }
}

absl::Status Agent::ConnectServers() {
  // Each server gets the tables of the chunks it owns; every rank sends the same registration.
  std::vector<v1::RegisterTablesRequest> requests(config_.servers.size());
  for (auto& r : requests) {
    r.set_num_workers(config_.world_size);
    r.set_average_gradients(server_rule_.rule != 0);
  }
  // A table per layer (its chunks), or per bucket (one key).
  struct TableSource {
    std::string name;
    std::vector<PsChunk> chunks;
  };
  std::vector<TableSource> sources;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerState& st = layers_[i];
    if (st.layout.scheme != PSD_SCHEME_PS || st.bucket >= 0) continue;
    sources.push_back({st.desc.name, st.chunks});
  }
  for (const Bucket& b : buckets_) {
    sources.push_back({absl::StrCat("bucket ", layers_[b.members.front()].desc.name, " .. ",
                                    layers_[b.members.back()].desc.name),
                       {b.chunk}});
  }
  for (const TableSource& src : sources) {
    std::map<uint32_t, v1::KvTableSpec*> tables;
    for (const auto& c : src.chunks) {
      if (c.server >= requests.size()) return absl::InternalError("chunk on an unknown server");
      auto*& t = tables[c.server];
      if (t == nullptr) {
        t = requests[c.server].add_tables();
        t->set_name(src.name);
        t->set_element_type(v1::ELEMENT_TYPE_F32);
        auto* u = t->mutable_update_rule();
        if (server_rule_.rule == 0) {
          u->set_rule(v1::UPDATE_RULE_SUM);
        } else {
          u->set_rule(static_cast<v1::UpdateRule>(server_rule_.rule));
          u->set_learning_rate(server_rule_.lr);
          u->set_momentum(server_rule_.momentum);
          u->set_dampening(server_rule_.dampening);
          u->set_nesterov(server_rule_.nesterov);
          u->set_beta1(server_rule_.beta1);
          u->set_beta2(server_rule_.beta2);
          u->set_epsilon(server_rule_.eps);
          u->set_weight_decay(server_rule_.weight_decay);
          t->set_initial_value(v1::INITIAL_VALUE_PUSHED_BY_RANK0);
        }
      }
      auto* key = t->add_keys();
      key->set_key(c.key);
      key->set_elements(c.length / sizeof(float));
    }
  }
  const absl::Time deadline = absl::Now() + config_.connect_timeout;
  for (size_t s = 0; s < config_.servers.size(); ++s) {
    absl::StatusOr<std::shared_ptr<server::KvClient>> client;
    while (true) {
      client = server::KvClient::Connect(*ctx_, config_.servers[s], config_.job_id, config_.rank,
                                         config_.secret, absl::Seconds(10));
      if (client.ok() || absl::Now() > deadline) break;
      absl::SleepFor(absl::Milliseconds(200));
    }
    if (!client.ok()) {
      return Annotate(client.status(), absl::StrCat("KV server ", config_.servers[s]));
    }
    if (requests[s].tables_size() > 0) {
      RETURN_IF_ERROR((*client)->RegisterTables(requests[s], absl::Seconds(30)));
    }
    servers_.push_back(*client);
    const MetricLabels labels = {{"server", std::to_string(s)}};
    push_bytes_.push_back(
        metrics_.GetCounter("poseidon_agent_push_bytes_total", "Gradient bytes pushed", labels)
            .value_or(nullptr));
    pull_bytes_.push_back(
        metrics_.GetCounter("poseidon_agent_pull_bytes_total", "Result bytes pulled", labels)
            .value_or(nullptr));
  }
  return absl::OkStatus();
}

absl::Status Agent::ConnectPeers() {
  peers_.assign(config_.world_size, nullptr);
  const absl::Time deadline = absl::Now() + config_.connect_timeout;
  for (uint32_t p = 0; p < config_.world_size; ++p) {
    if (p == config_.rank) continue;
    absl::StatusOr<std::shared_ptr<transport::Connection>> conn;
    while (true) {
      conn = transport::ConnectAuthenticated(*ctx_, config_.peers[p], config_.job_id, config_.rank,
                                             config_.secret, absl::Seconds(10));
      if (conn.ok() || absl::Now() > deadline) break;
      absl::SleepFor(absl::Milliseconds(200));
    }
    if (!conn.ok()) {
      return Annotate(conn.status(),
                      absl::StrCat("peer agent of rank ", p, " at ", config_.peers[p]));
    }
    peers_[p] = *conn;
  }
  peers_alive_->Set(static_cast<double>(config_.world_size - 1));
  return absl::OkStatus();
}

void Agent::OnReady(uint32_t layer, uint64_t iteration, bool on_device) {
  std::vector<Task> tasks;
  std::vector<DeviceRange> ranges;  // on the device: what to copy to the host first
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    if (!registered_ || layer >= layers_.size()) {
      PSD_LOG_WARN("ready event for unknown layer {} ignored", layer);
      return;
    }
    LayerState& st = layers_[layer];
    if (iteration != st.posted + 1) {
      const std::string why = absl::StrCat("iteration ", iteration, " posted after ", st.posted);
      PSD_LOG_WARN("layer {} ({}): {}", layer, st.desc.name, why);
      shm_->LayerFailed(layer, iteration, why);
      return;
    }
    if (st.in_progress != 0) {
      const std::string why = absl::StrCat("iteration ", iteration, " posted while ",
                                           st.in_progress, " is still being synchronised");
      shm_->LayerFailed(layer, iteration, why);
      return;
    }
    if (on_device && st.bucket >= 0) {
      // Fused layers are synchronised from host memory only (the device path for them has
      // never run on a GPU): a framework must not mark CUDA layers PSD_LAYER_FUSABLE.
      const std::string why = absl::StrCat(
          "iteration ", iteration,
          " posted on the GPU, but the layer is fused with its neighbours (PSD_LAYER_FUSABLE); "
          "fused layers must be posted from host memory");
      PSD_LOG_WARN("layer {} ({}): {}", layer, st.desc.name, why);
      shm_->LayerFailed(layer, iteration, why);
      return;
    }
    if (on_device && !stager_) {
      const std::string why = absl::StrCat(
          "iteration ", iteration, " posted on the GPU, but no CUDA arena is attached");
      PSD_LOG_WARN("layer {} ({}): {}", layer, st.desc.name, why);
      shm_->LayerFailed(layer, iteration, why);
      return;
    }
    st.on_device = on_device;
    st.posted = iteration;
    st.in_progress = iteration;
    st.failed = false;
    st.ready_at = absl::Now();
    st.stall_reported = false;
    st.chunk_pending.assign(st.chunks.size(), 1);
    if (timeline_) timeline_->Instant("ready", layer, iteration, st.ready_at);
    if (telemetry_) telemetry_->LayerReady(layer, iteration, st.ready_at);
    const uint32_t priority = config_.priority ? st.layout.priority : 0;
    if (st.bucket >= 0) {
      // A bucket member (host memory only): the bucket goes when its last member is ready.
      Bucket& b = buckets_[static_cast<size_t>(st.bucket)];
      st.remaining = 1;
      if (b.iteration != iteration) {
        b.iteration = iteration;
        b.waiting = b.members.size();
      }
      const uint32_t first = b.members.front();
      Task bucket_task{config_.priority ? layers_[first].layout.priority : 0,
                       0,
                       first,
                       iteration,
                       0,
                       b.chunk.length,
                       false,
                       st.bucket,
                       absl::Time()};
      if (--b.waiting == 0) tasks.push_back(bucket_task);
    } else if (st.layout.scheme == PSD_SCHEME_SFB) {
      st.remaining = 1;
      tasks.push_back({priority, 0, layer, iteration, -1, st.k * (st.m + st.n) * 4, false, -1,
                       absl::Time()});
      ranges.push_back({st.layout.u_offset, st.k * st.m * 4});
      ranges.push_back({st.layout.v_offset, st.k * st.n * 4});
    } else {
      st.remaining = static_cast<int>(st.chunks.size());
      for (size_t c = 0; c < st.chunks.size(); ++c) {
        tasks.push_back({priority, 0, layer, iteration, static_cast<int>(c), st.chunks[c].length,
                         false, -1, absl::Time()});
        ranges.push_back({st.layout.grad_offset + st.chunks[c].offset, st.chunks[c].length});
      }
    }
  }
  if (on_device) {
    // Each PS chunk goes to the network as soon as its copy is on the host, while the next
    // chunk is being copied; an SFB layer once both factors are.
    const bool sfb = tasks.size() == 1 && tasks[0].chunk < 0;
    auto staged = std::make_shared<std::vector<Task>>(tasks);
    const absl::Status s = stager_->StageOut(
        layer, ranges, [self = shared_from_this(), staged, sfb](size_t i) {
          if (!sfb) {
            self->Enqueue((*staged)[i]);
          } else if (i == 1) {
            self->Enqueue((*staged)[0]);
          }
        });
    if (!s.ok()) {
      for (const Task& t : tasks) TaskFinished(t, s);
    }
    return;
  }
  const absl::Time queued_at = absl::Now();
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    for (auto& t : tasks) {
      t.seq = next_seq_++;
      t.queued_at = queued_at;
      queue_.push(t);
    }
  }
  if (tasks.size() == 1) {
    queue_cv_.notify_one();
  } else if (!tasks.empty()) {
    queue_cv_.notify_all();
  }
}

// Wake-ups: one sync thread per task that can start (notify_one), never all of them: with eight
// threads per agent and several agents on a machine, waking every thread for every layer costs
// more CPU than the layer's synchronisation. A thread that takes a task wakes the next one when
// another task can start too; returned credit wakes one.
void Agent::Worker() {
  auto fits = [&] {  // with queue_mu_ held
    // Credit: a task goes when it fits, or when nothing else is in flight.
    return !queue_.empty() && (in_flight_bytes_ == 0 ||
                               in_flight_bytes_ + queue_.top().bytes <= config_.credit_bytes);
  };
  while (true) {
    Task task;
    bool more = false;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return stopping_ || fits(); });
      if (stopping_) return;
      task = queue_.top();
      queue_.pop();
      in_flight_bytes_ += task.bytes;
      queue_depth_->Set(static_cast<double>(queue_.size()));
      credit_in_use_->Set(static_cast<double>(in_flight_bytes_));
      more = fits();
    }
    if (more) queue_cv_.notify_one();
    if (RunTask(task)) ReleaseCredit(task.bytes);
  }
}

void Agent::ReleaseCredit(uint64_t bytes) {
  bool waiting;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    in_flight_bytes_ -= bytes;
    credit_in_use_->Set(static_cast<double>(in_flight_bytes_));
    waiting = !queue_.empty();
  }
  if (waiting) queue_cv_.notify_one();
}

bool Agent::RunTask(const Task& task) {
  if (task.chunk >= 0) return SyncChunk(task);
  if (!task.rebuild) {
    SendFactors(task);
  } else {
    RebuildSfb(task);
  }
  return true;
}

void Agent::Enqueue(Task task) {
  task.queued_at = absl::Now();
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    task.seq = next_seq_++;
    queue_.push(task);
  }
  queue_cv_.notify_one();
}

void Agent::TaskFinished(const Task& task, const absl::Status& task_status) {
  if (task.bucket >= 0) {
    // Every member completes (or fails) with its bucket.
    for (uint32_t m : buckets_[static_cast<size_t>(task.bucket)].members) {
      TaskFinished(MemberTask(task, m), task_status);
    }
    return;
  }
  bool done = false, report_failure = false, on_device = false;
  std::string why;
  absl::Time ready_at;
  absl::Status status = task_status;
  const LayerState& lst = layers_[task.layer];
  if (status.ok() && task.chunk >= 0 && lst.on_device) {
    // This chunk's result goes back to the GPU now (before the count below, so that the done
    // event is recorded after every chunk's copy).
    const PsChunk& c = lst.chunks[static_cast<size_t>(task.chunk)];
    status = stager_->StageIn(task.layer, {lst.layout.grad_offset + c.offset, c.length});
  }
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    LayerState& st = layers_[task.layer];
    if (task.chunk >= 0 && static_cast<size_t>(task.chunk) < st.chunk_pending.size()) {
      st.chunk_pending[static_cast<size_t>(task.chunk)] = 0;
    }
    ready_at = st.ready_at;
    if (!status.ok() && !st.failed) {
      st.failed = true;
      st.failure = absl::StrCat("clock ", task.iteration, ": ", status.message());
      report_failure = true;
      why = st.failure;
    }
    on_device = st.on_device;
    if (--st.remaining == 0) {
      done = !st.failed;
      // The framework's stream waits for this event: record it before saying done.
      if (done && on_device) {
        if (absl::Status s = stager_->MarkDone(task.layer); !s.ok()) {
          done = false;
          st.failed = true;
          st.failure = absl::StrCat("clock ", task.iteration, ": ", s.message());
          report_failure = true;
          why = st.failure;
        }
      }
      st.in_progress = 0;
    }
  }
  if (report_failure) {
    PSD_LOG_ERROR("layer {} ({}) {}", task.layer, layers_[task.layer].desc.name, why);
    shm_->LayerFailed(task.layer, task.iteration, why);
    CountError("sync_failed");
  }
  if (done) {
    const absl::Time now = absl::Now();
    const LayerState& st = layers_[task.layer];
    if (st.sync_seconds) st.sync_seconds->Observe(absl::ToDoubleSeconds(now - ready_at));
    if (telemetry_) telemetry_->LayerSynced(task.layer, task.iteration, now - ready_at);
    if (timeline_) timeline_->Span("sync", task.layer, st.desc.name, task.iteration, ready_at, now);
    std::lock_guard<std::mutex> lock(iteration_mu_);
    if (++layers_done_[task.iteration] == layers_.size()) {
      layers_done_.erase(task.iteration);
      if (last_iteration_end_ != absl::Time()) {
        iteration_seconds_->Observe(absl::ToDoubleSeconds(now - last_iteration_end_));
      }
      last_iteration_end_ = now;
    }
  }
  if (done) {
    shm_->LayerDone(task.layer, task.iteration);
    uint64_t seen = last_iteration_.load();
    while (task.iteration > seen && !last_iteration_.compare_exchange_weak(seen, task.iteration)) {
    }
  }
}

// A PS chunk: push our gradient and pull the clock's sum into the same buffer. Both complete
// asynchronously on the transport's threads: the credit (bytes in flight) is returned when the
// server has taken our push, the layer completes with the pull, which needs every other rank's
// push too. No sync thread waits on the network (a thread held on a pull could deadlock two
// agents whose threads all wait on each other's next pushes; one held on the push acknowledgement
// costs a thread wake-up per chunk on the critical path of a small layer).
bool Agent::SyncChunk(const Task& task) {
  const LayerState& st = layers_[task.layer];
  // A bucket's chunk is relative to its first member's gradient, which task.layer is.
  const PsChunk& c = task.bucket >= 0 ? buckets_[static_cast<size_t>(task.bucket)].chunk
                                      : st.chunks[static_cast<size_t>(task.chunk)];
  server::KvClient& kv = *servers_[c.server];
  std::span<float> values(shm_->Grad(task.layer) + c.offset / sizeof(float),
                          c.length / sizeof(float));
  // The pull's answer overwrites the gradient in place: the server answers only once every
  // rank's push of this clock, ours included, has been received.
  const absl::Time start = absl::Now();
  if (timeline_) {
    timeline_->Span("queue", task.layer, st.desc.name, task.iteration, task.queued_at, start);
  }
  // With a server-side rule, iteration 1 carries rank 0's initial parameters (clock 0) and
  // iteration t the gradient of clock t - 1; the answer is the updated parameters.
  const bool server_rule = server_rule_.rule != 0;
  const uint64_t clock = server_rule ? task.iteration - 1 : task.iteration;
  const bool init = server_rule && clock == 0;
  std::optional<server::Ticket> push;
  if (!init || config_.rank == 0) push = kv.Push(c.key, clock, values, init);
  const server::Ticket pull = kv.Pull(c.key, clock, values, config_.sync_timeout);
  kv.OnDone(pull, [self = shared_from_this(), task, start, server = c.server,
                   bytes = c.length](absl::Status s) {
    if (s.ok() && self->pull_bytes_[server]) self->pull_bytes_[server]->Increment(bytes);
    if (s.ok() && self->telemetry_) self->telemetry_->AddServerBytes(server, 0, bytes);
    if (self->timeline_) {
      self->timeline_->Span("push+pull", task.layer, self->layers_[task.layer].desc.name,
                            task.iteration, start, absl::Now());
    }
    self->TaskFinished(task, s);
  });
  if (!push) return true;  // nothing in flight: the caller returns the credit
  kv.OnDone(*push, [self = shared_from_this(), task, server = c.server,
                    bytes = c.length](absl::Status pushed) {
    if (pushed.ok() && self->push_bytes_[server]) self->push_bytes_[server]->Increment(bytes);
    if (pushed.ok() && self->telemetry_) self->telemetry_->AddServerBytes(server, bytes, 0);
    if (!pushed.ok()) {
      // The pull fails too (the server never gets our push); say why now.
      PSD_LOG_ERROR("layer {} ({}) clock {}: {}", task.layer, self->layers_[task.layer].desc.name,
                    task.iteration, pushed.message());
    }
    self->ReleaseCredit(task.bytes);
  });
  return false;
}

// SFB, first half: broadcast our factors (straight from shared memory) to every other agent.
// The rebuild is queued once our sends are out and every peer's factors are in.
void Agent::SendFactors(const Task& task) {
  const LayerState& st = layers_[task.layer];
  const uint32_t me = config_.rank;
  const uint32_t world = config_.world_size;
  SfbInbox& box = inbox_.at(task.layer);
  if (timeline_) {
    timeline_->Span("queue", task.layer, st.desc.name, task.iteration, task.queued_at,
                    absl::Now());
  }
  std::optional<Task> rebuild;
  {
    // Every peer must have registered (its PING) before it can take our factors.
    std::unique_lock<std::mutex> lock(inbox_mu_);
    const bool ready =
        inbox_cv_.wait_for(lock, absl::ToChronoNanoseconds(config_.sync_timeout), [&] {
          if (stopping_) return true;
          for (uint32_t p = 0; p < world; ++p) {
            if (p != me && !peer_ready_[p]) return false;
          }
          return true;
        });
    if (!ready || stopping_) {
      std::vector<uint32_t> missing;
      for (uint32_t p = 0; p < world; ++p) {
        if (p != me && !peer_ready_[p]) missing.push_back(p);
      }
      box.finished = task.iteration;
      lock.unlock();
      TaskFinished(task, absl::DeadlineExceededError(
                             absl::StrCat("peer agents of ranks [", absl::StrJoin(missing, ", "),
                                          "] never registered their model")));
      return;
    }
    box.sent = task.iteration;
    box.sends_pending = static_cast<int>(world) - 1;
    box.send_error = absl::OkStatus();
    box.started = absl::Now();
    rebuild = MaybeRebuildLocked(task.layer, task.iteration);  // world == 1: nothing to wait for
  }
  const float* u = shm_->FactorU(task.layer);
  const float* v = shm_->FactorV(task.layer);
  const uint64_t ku = st.k * st.m, kv = st.k * st.n;
  sfb_sent_bytes_->Increment(static_cast<double>((ku + kv) * sizeof(float) * (world - 1)));
  if (timeline_) timeline_->Instant("send factors", task.layer, task.iteration, absl::Now());
  for (uint32_t p = 0; p < world; ++p) {
    if (p == me) continue;
    FrameHeader h;
    h.type = FrameType::kFactors;
    h.job_id = config_.job_id;
    h.sender_rank = me;
    h.key = task.layer;
    h.clock = task.iteration;
    h.payload_length = (ku + kv) * sizeof(float);
    if (telemetry_) telemetry_->AddPeerBytes(p, h.payload_length, 0);
    peers_[p]->Send(
        h, {std::as_bytes(std::span(u, ku)), std::as_bytes(std::span(v, kv))},
        [self = shared_from_this(), layer = task.layer, it = task.iteration, p](absl::Status s) {
          std::optional<Task> ready;
          {
            std::lock_guard<std::mutex> lock(self->inbox_mu_);
            SfbInbox& b = self->inbox_.at(layer);
            if (b.sent != it) return;
            --b.sends_pending;
            if (!s.ok() && b.send_error.ok()) {
              b.send_error = Annotate(s, absl::StrCat("sending SFB factors to rank ", p));
            }
            ready = self->MaybeRebuildLocked(layer, it);
          }
          if (ready) self->StartRebuild(*ready);
        });
  }
  if (rebuild) StartRebuild(*rebuild);
}

std::optional<Task> Agent::MaybeRebuildLocked(uint32_t layer, uint64_t iteration) {
  SfbInbox& box = inbox_.at(layer);
  if (box.sent != iteration || box.sends_pending > 0 || box.rebuild_queued == iteration ||
      box.finished == iteration) {
    return std::nullopt;
  }
  const int slot = static_cast<int>(iteration % 2);
  for (uint32_t p = 0; p < config_.world_size; ++p) {
    if (p != config_.rank && box.tag[slot][p] != iteration) return std::nullopt;
  }
  box.rebuild_queued = iteration;
  Task t;
  t.priority = config_.priority ? layers_[layer].layout.priority : 0;
  t.layer = layer;
  t.iteration = iteration;
  t.rebuild = true;
  t.bytes = 0;  // computation, not network: never held back by the credit
  t.queued_at = absl::Now();
  return t;
}

// A small host rebuild (at most kInlineRebuildMacs multiply-adds: ~1 ms on one core) runs at
// once on the thread that completed its inputs (the last factors' receive or our last send):
// handing it to a sync thread costs a wake-up, which on a loaded machine is longer than the GEMMs.
// Larger ones, and the GPU's, go through the queue in priority order.
void Agent::StartRebuild(const Task& task) {
  constexpr uint64_t kInlineRebuildMacs = uint64_t{1} << 22;
  const LayerState& st = layers_[task.layer];
  if (!st.on_device && st.k * st.m * st.n * config_.world_size <= kInlineRebuildMacs) {
    RebuildSfb(task);
  } else {
    Enqueue(task);
  }
}

// SFB, second half: sum_p U_p^T V_p (M x N, row-major) into the gradient buffer, ranks in order.
void Agent::RebuildSfb(const Task& task) {
  const LayerState& st = layers_[task.layer];
  SfbInbox& box = inbox_.at(task.layer);
  absl::Status status;
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    if (box.finished == task.iteration) return;  // the watchdog failed it already
    status = box.send_error;
  }
  const uint32_t me = config_.rank;
  const int slot = static_cast<int>(task.iteration % 2);
  const float* u = shm_->FactorU(task.layer);
  const float* v = shm_->FactorV(task.layer);
  float* grad = shm_->Grad(task.layer);
  const int m = static_cast<int>(st.m), n = static_cast<int>(st.n), k = static_cast<int>(st.k);
  const uint64_t ku = st.k * st.m;
  const absl::Time rebuild_start = absl::Now();
  if (timeline_) {
    timeline_->Span("rebuild queue", task.layer, st.desc.name, task.iteration, task.queued_at,
                    rebuild_start);
  }
  if (st.on_device) {
    // On the GPU: one cuBLAS GEMM over every rank's factors, straight into the arena.
    DeviceStager::SfbShape shape;
    shape.m = st.m;
    shape.n = st.n;
    shape.k = st.k;
    shape.world = config_.world_size;
    shape.me = me;
    shape.grad_offset = st.layout.grad_offset;
    shape.u_offset = st.layout.u_offset;
    shape.v_offset = st.layout.v_offset;
    if (absl::Status s = stager_->Rebuild(task.layer, shape, task.iteration, box.data[slot].data());
        !s.ok() && status.ok()) {
      status = s;
    }
  } else {
    for (uint32_t p = 0; p < config_.world_size; ++p) {
      const float* up = p == me ? u : box.data[slot].data() + p * box.floats;
      const float* vp = p == me ? v : up + ku;
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, n, k, 1.0f, up, m, vp, n,
                  p == 0 ? 0.0f : 1.0f, grad, n);
    }
  }
  if (timeline_) {
    timeline_->Span("rebuild", task.layer, st.desc.name, task.iteration, rebuild_start,
                    absl::Now());
  }
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    if (box.finished == task.iteration) return;
    box.finished = task.iteration;
  }
  TaskFinished(task, status);
}

// The training process shared its CUDA arena and per-layer events: open them (or say why not).
void Agent::AttachCuda() {
  auto refuse = [&](const std::string& why) {
    PSD_LOG_WARN("CUDA attach refused: {}", why);
    shm_->FailCuda(why);
  };
  if (!registered_) return refuse("register the layers before attaching CUDA");
  if (stager_) return refuse("a CUDA arena is already attached");
  auto attach = shm_->ReadCudaAttach();
  if (!attach.ok()) return refuse(std::string(attach.status().message()));
  auto stager = OpenDeviceStager(*attach, shm_->data(), shm_->data_bytes());
  if (!stager.ok()) return refuse(std::string(stager.status().message()));
  {
    // Peers' factors are copied to the GPU from the inboxes: pin them too (fixed since
    // registration). Pageable memory still works, only slower: a failure is not fatal.
    std::lock_guard<std::mutex> lock(inbox_mu_);
    for (auto& [layer, box] : inbox_) {
      for (auto& d : box.data) {
        if (absl::Status s = (*stager)->PinHost(d.data(), d.size() * sizeof(float)); !s.ok()) {
          PSD_LOG_WARN("layer {}: SFB inbox stays pageable: {}", layer, s.message());
        }
      }
    }
  }
  if (timeline_) {
    (*stager)->SetObserver([self = shared_from_this()](const char* what, uint32_t layer,
                                                       absl::Time start, absl::Time end,
                                                       uint64_t) {
      uint64_t iteration;
      {
        std::lock_guard<std::mutex> lock(self->layers_mu_);
        iteration = self->layers_[layer].posted;
      }
      self->timeline_->Span(what, layer, self->layers_[layer].desc.name, iteration, start, end);
    });
  }
  stager_ = std::move(*stager);
  shm_->AnswerCuda(stager_->DoneEvents());
  PSD_LOG_INFO("CUDA arena of {} bytes on device {} attached", attach->arena_bytes,
               attach->device);
}

// The main thread's watchdog: SFB layers whose peers' factors did not all arrive in time fail,
// naming the ranks that are missing.
void Agent::CheckSfbDeadlines() {
  std::vector<std::pair<Task, absl::Status>> expired;
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    const absl::Time now = absl::Now();
    for (auto& [layer, box] : inbox_) {
      if (box.sent == 0 || box.finished == box.sent || box.rebuild_queued == box.sent) continue;
      if (now - box.started < config_.sync_timeout) continue;
      const int slot = static_cast<int>(box.sent % 2);
      std::vector<uint32_t> missing;
      for (uint32_t p = 0; p < config_.world_size; ++p) {
        if (p != config_.rank && box.tag[slot][p] != box.sent) missing.push_back(p);
      }
      box.finished = box.sent;
      Task t;
      t.layer = layer;
      t.iteration = box.sent;
      expired.emplace_back(t, absl::DeadlineExceededError(absl::StrCat(
                                  "SFB factors of clock ", box.sent, " not received from ranks [",
                                  absl::StrJoin(missing, ", "), "] within ",
                                  absl::FormatDuration(config_.sync_timeout))));
    }
  }
  for (auto& [task, status] : expired) TaskFinished(task, status);
}

void Agent::SetUpMetrics() {
  auto gauge = [&](const char* name, const char* help) {
    return metrics_.GetGauge(name, help).value_or(nullptr);
  };
  auto counter = [&](const char* name, const char* help) {
    return metrics_.GetCounter(name, help).value_or(nullptr);
  };
  sfb_sent_bytes_ = counter("poseidon_agent_sfb_sent_bytes_total", "SFB factor bytes sent");
  sfb_received_bytes_ =
      counter("poseidon_agent_sfb_received_bytes_total", "SFB factor bytes received");
  queue_depth_ = gauge("poseidon_agent_queue_depth", "Synchronisation tasks waiting");
  credit_in_use_ = gauge("poseidon_agent_credit_in_use_bytes", "Bytes in flight (the credit)");
  plan_epoch_ = gauge("poseidon_agent_plan_epoch", "Epoch of the plan in use");
  peers_alive_ = gauge("poseidon_agent_peers_connected", "Other agents connected for SFB");
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
// what it waits for (PS: its pending chunks and their servers; SFB: the missing ranks).
void Agent::CheckStalls() {
  struct Stalled {
    uint32_t layer;
    uint64_t iteration;
    absl::Duration age;
    std::string waiting;
  };
  std::vector<Stalled> stalled;
  const absl::Time now = absl::Now();
  {
    std::lock_guard<std::mutex> lock(layers_mu_);
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      LayerState& st = layers_[l];
      if (st.in_progress == 0 || st.stall_reported || now - st.ready_at < config_.stall_timeout) {
        continue;
      }
      st.stall_reported = true;
      if (st.bucket >= 0) {
        const Bucket& b = buckets_[static_cast<size_t>(st.bucket)];
        std::vector<std::string> not_ready;
        for (uint32_t m : b.members) {
          if (layers_[m].posted < st.in_progress) not_ready.push_back(layers_[m].desc.name);
        }
        stalled.push_back(
            {l, st.in_progress, now - st.ready_at,
             absl::StrCat("chunks [key ", b.chunk.key, " on ", config_.servers[b.chunk.server],
                          "] (bucket of layers ", b.members.front(), "..", b.members.back(),
                          not_ready.empty()
                              ? ""
                              : absl::StrCat("; not yet ready: ", absl::StrJoin(not_ready, ", ")),
                          ")")});
        continue;
      }
      std::vector<std::string> pending;
      for (size_t c = 0; c < st.chunk_pending.size() && pending.size() < 8; ++c) {
        if (st.chunk_pending[c]) {
          pending.push_back(
              absl::StrCat("key ", st.chunks[c].key, " on ", config_.servers[st.chunks[c].server]));
        }
      }
      stalled.push_back(
          {l, st.in_progress, now - st.ready_at,
           pending.empty() ? "" : absl::StrCat("chunks [", absl::StrJoin(pending, ", "), "]")});
    }
  }
  for (auto& s : stalled) {
    if (s.waiting.empty()) {  // SFB: which ranks' factors are missing
      std::lock_guard<std::mutex> lock(inbox_mu_);
      auto it = inbox_.find(s.layer);
      if (it != inbox_.end()) {
        const int slot = static_cast<int>(s.iteration % 2);
        std::vector<uint32_t> missing;
        for (uint32_t p = 0; p < config_.world_size; ++p) {
          if (p != config_.rank && it->second.tag[slot][p] != s.iteration) missing.push_back(p);
        }
        s.waiting = absl::StrCat("SFB factors from ranks [", absl::StrJoin(missing, ", "), "]");
      }
    }
    CountError("stall");  // first: whoever reads the line below finds it counted
    PSD_LOG_WARN("stall: layer {} ({}) iteration {} has waited {} for {}", s.layer,
                 layers_[s.layer].desc.name, s.iteration, absl::FormatDuration(s.age), s.waiting);
  }
}

absl::StatusOr<transport::PayloadTarget> Agent::OnHeader(
    const std::shared_ptr<transport::PeerSession>& peer, const FrameHeader& h) {
  if (h.type == FrameType::kPing && h.payload_length == 0)
    return transport::PayloadTarget::Discard();
  if (h.type != FrameType::kFactors) {
    return absl::InvalidArgumentError("agents only exchange SFB factors");
  }
  const uint32_t from = peer->identity().rank;
  if (from >= config_.world_size || from == config_.rank || h.sender_rank != from) {
    return absl::PermissionDeniedError(
        absl::StrCat("factors from rank ", h.sender_rank, " on a connection of rank ", from));
  }
  if (h.key >= layers_count_.load()) {
    return absl::InvalidArgumentError(
        absl::StrCat("factors for layer ", h.key, " of ", layers_count_.load()));
  }
  std::lock_guard<std::mutex> lock(inbox_mu_);
  auto it = inbox_.find(static_cast<uint32_t>(h.key));
  if (it == inbox_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", h.key, " is not an SFB layer here"));
  }
  SfbInbox& box = it->second;
  if (h.payload_length != box.floats * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("factors of layer ", h.key, " carry ",
                                                   h.payload_length, " bytes, expected ",
                                                   box.floats * sizeof(float)));
  }
  if (h.clock == 0) return absl::InvalidArgumentError("iterations start at 1");
  const int slot = static_cast<int>(h.clock % 2);
  const uint64_t held = box.tag[slot][from];
  if (held != 0 && held + 2 != h.clock) {
    return absl::FailedPreconditionError(absl::StrCat("factors of layer ", h.key, " clock ",
                                                      h.clock, " from rank ", from,
                                                      " arrive while the slot holds clock ", held));
  }
  box.tag[slot][from] = 0;  // being overwritten
  return transport::PayloadTarget::Into(
      std::as_writable_bytes(std::span(box.data[slot].data() + from * box.floats, box.floats)));
}

void Agent::OnFrame(const std::shared_ptr<transport::PeerSession>& peer, const FrameHeader& h,
                    transport::MutableBuffer) {
  if (h.type == FrameType::kPing) {
    const uint32_t from = peer->identity().rank;
    {
      std::lock_guard<std::mutex> lock(inbox_mu_);
      if (from < peer_ready_.size()) peer_ready_[from] = true;
    }
    inbox_cv_.notify_all();
    return;
  }
  const uint32_t from = peer->identity().rank;
  const auto layer = static_cast<uint32_t>(h.key);
  if (stager_ && layers_[layer].on_device) {
    // The GPU rebuild needs every rank's factors on the device: copy these now, while the
    // other ranks' are still on the network (pinned inbox, asynchronous).
    const LayerState& st = layers_[layer];
    DeviceStager::SfbShape shape;
    shape.m = st.m;
    shape.n = st.n;
    shape.k = st.k;
    shape.world = config_.world_size;
    shape.me = config_.rank;
    shape.grad_offset = st.layout.grad_offset;
    shape.u_offset = st.layout.u_offset;
    shape.v_offset = st.layout.v_offset;
    const SfbInbox& box = inbox_.at(layer);
    if (absl::Status s = stager_->StagePeerFactors(
            layer, shape, h.clock, from, box.data[h.clock % 2].data() + from * box.floats);
        !s.ok()) {
      PSD_LOG_WARN("layer {}: staging rank {}'s factors: {} (the rebuild copies them)", layer,
                   from, s.message());
    }
  }
  std::optional<Task> rebuild;
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    inbox_.at(layer).tag[h.clock % 2][from] = h.clock;
    sfb_received_bytes_->Increment(static_cast<double>(h.payload_length));
    if (telemetry_) telemetry_->AddPeerBytes(peer->identity().rank, 0, h.payload_length);
    rebuild = MaybeRebuildLocked(static_cast<uint32_t>(h.key), h.clock);
  }
  inbox_cv_.notify_all();
  if (rebuild) StartRebuild(*rebuild);
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
