// poseidon-server: the long-running KV shard daemon (DESIGN.md "Processes"). Configuration from
// flags > POSEIDON_* environment > config file; logs to stderr; Prometheus metrics over HTTP;
// SIGTERM/SIGINT finish the clock in flight, write checkpoints if configured, and exit 0.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/config.h"
#include "common/fd_limit.h"
#include "common/log.h"
#include "common/metrics.h"
#include "coordinator/client.h"
#include "server/checkpoint.h"
#include "server/kv_engine.h"
#include "server/kv_service.h"
#include "server/replicator.h"
#include "server/server_telemetry.h"
#include "transport/frame_server.h"
#include "transport/handshake.h"
#include "transport/rdma/rdma_context.h"
#include "transport/tcp/tcp_context.h"
#include "transport/tcp/tls_config.h"

namespace poseidon::server {
namespace {

struct ServerConfig {
  std::string listen = "0.0.0.0:7100";
  std::string transport = "auto";
  std::string rdma_listen;
  std::string metrics_listen;
  std::string secrets_file;
  uint64_t job_id = 0;
  std::string job_secret;
  int64_t workers = 2;
  int64_t io_threads = 1;
  uint64_t max_payload = 256u << 20;
  uint64_t max_memory = uint64_t{16} << 30;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  bool checkpoint_on_exit = true;
  absl::Duration shutdown_timeout = absl::Seconds(30);
  absl::Duration handshake_timeout = absl::Seconds(10);
  absl::Duration peer_timeout = absl::Seconds(15);
  std::string log_level = "info";
  std::string coordinator;
  std::string coordinator_token;
  std::string advertise;
  absl::Duration telemetry_interval = absl::Seconds(5);
  bool coordinator_tls = false;
  std::string coordinator_tls_ca;
  std::string coordinator_tls_cert;
  std::string coordinator_tls_key;
  std::string coordinator_tls_server_name;
  bool data_tls = false;
  std::string data_tls_cert;
  std::string data_tls_key;
  std::string data_tls_ca;
  std::string data_tls_server_name;
  bool data_tls_verify_clients = false;
};

ConfigSchema<ServerConfig> Schema() {
  ConfigSchema<ServerConfig> s("poseidon-server");
  s.Field("listen", &ServerConfig::listen, "data-plane address to listen on (host:port)",
          NonEmpty())
      .Field("transport", &ServerConfig::transport,
             "data plane: auto (RDMA and TCP where an RDMA device is usable, else TCP; TCP "
             "without a coordinator), tcp, or rdma (only, on listen; refused without a device)",
             OneOf({"auto", "tcp", "rdma"}))
      .Field("rdma_listen", &ServerConfig::rdma_listen,
             "serving both transports: the RDMA listener's address (default: listen's host, "
             "any port; advertised to the coordinator)")
      .Field("metrics_listen", &ServerConfig::metrics_listen,
             "Prometheus /metrics address (host:port); empty: off")
      .Field("secrets_file", &ServerConfig::secrets_file,
             "file of '<job id> <secret>' lines: the jobs this server serves")
      .Field("job_id", &ServerConfig::job_id, "a single job to serve (with job_secret)")
      .SecretField("job_secret", &ServerConfig::job_secret, "the secret of job_id")
      .Field("workers", &ServerConfig::workers, "engine threads (keys are spread over them)",
             InRange<int64_t>(1, 256))
      .Field("io_threads", &ServerConfig::io_threads, "network I/O threads",
             InRange<int64_t>(1, 64))
      .ByteSizeField("max_payload", &ServerConfig::max_payload, "largest frame payload accepted",
                     InRange<uint64_t>(4096, uint64_t{1} << 34))
      .ByteSizeField("max_memory", &ServerConfig::max_memory,
                     "memory all jobs' tables may take; a registration beyond it is refused",
                     AtLeast<uint64_t>(1 << 20))
      .Field("checkpoint_dir", &ServerConfig::checkpoint_dir,
             "directory for checkpoints; restored from at start")
      .Field("checkpoint_every", &ServerConfig::checkpoint_every,
             "checkpoint every N clocks (0: only on request and at shutdown)", AtLeast<int64_t>(0))
      .Field("checkpoint_on_exit", &ServerConfig::checkpoint_on_exit,
             "on SIGTERM, checkpoint each job at its clock boundary (false: keep the last one "
             "written, e.g. the ones rank 0's agent asks for between iterations)")
      .Field("shutdown_timeout", &ServerConfig::shutdown_timeout,
             "on SIGTERM, wait at most this long for the clock in flight")
      .Field("handshake_timeout", &ServerConfig::handshake_timeout,
             "a new connection must authenticate within this time")
      .Field("peer_timeout", &ServerConfig::peer_timeout,
             "an agent silent this long (they ping every 5s) is declared lost: pulls waiting for "
             "its push fail naming it (0: never); a backup silent this long (or that does not "
             "finish a handshake in it, at most 10s) is given up",
             poseidon::InRange(absl::ZeroDuration(), absl::Hours(1)))
      .Field("coordinator", &ServerConfig::coordinator,
             "poseidon-coordinator to register with (host:port); empty: none")
      .SecretField("coordinator_token", &ServerConfig::coordinator_token,
                   "the job's coordinator token (with coordinator); with secrets_file, the "
                   "coordinator's cluster token (the server registers for those jobs)")
      .Field("advertise", &ServerConfig::advertise,
             "the address peers reach this server at (default: the bound listen address)")
      .Field(
          "telemetry_interval", &ServerConfig::telemetry_interval,
          "with a coordinator: report the bytes moved with each agent this often; 0: off",
          [](const absl::Duration& d) {
            if (d == absl::ZeroDuration() || (d >= absl::Milliseconds(10) && d <= absl::Hours(1))) {
              return absl::OkStatus();
            }
            return absl::InvalidArgumentError("must be 0 (off) or in [10ms, 1h]");
          })
      .Field("log_level", &ServerConfig::log_level, "trace, debug, info, warn, error",
             OneOf({"trace", "debug", "info", "warn", "error"}));
  coordinator::AddCoordinatorTlsFields(s);
  transport::AddDataTlsFields(s);
  return s;
}

// Fills `store` and returns the ids of the jobs served.
absl::StatusOr<std::vector<uint64_t>> LoadSecrets(const ServerConfig& config,
                                                  transport::SecretStore& store) {
  std::vector<uint64_t> jobs;
  if (!config.job_secret.empty()) {
    store.Set(config.job_id, config.job_secret);
    jobs.push_back(config.job_id);
  }
  if (!config.secrets_file.empty()) {
    std::ifstream in(config.secrets_file);
    if (!in)
      return absl::NotFoundError(absl::StrCat("cannot read secrets_file ", config.secrets_file));
    std::string line;
    int n = 0;
    while (std::getline(in, line)) {
      ++n;
      absl::string_view l = absl::StripAsciiWhitespace(line);
      if (l.empty() || l[0] == '#') continue;
      std::vector<absl::string_view> parts =
          absl::StrSplit(l, absl::ByAnyChar(" \t"), absl::SkipEmpty());
      uint64_t id = 0;
      if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &id)) {
        return absl::InvalidArgumentError(
            absl::StrCat(config.secrets_file, ":", n, ": expected '<job id> <secret>'"));
      }
      store.Set(id, std::string(parts[1]));
      jobs.push_back(id);
    }
  }
  if (jobs.empty()) {
    return absl::InvalidArgumentError(
        "no job to serve: set job_id and job_secret, or secrets_file");
  }
  return jobs;
}

// HeartbeatResponse.lost_servers: each backup the coordinator declared dead is given up by the
// replica sender (its waiting and later replicas fail at once), logged the first time.
void GiveUpDeclaredDead(const v1::HeartbeatResponse& response, KvReplicaSender& replicas) {
  for (const v1::LostServer& lost : response.lost_servers()) {
    uint64_t job = 0;
    if (!absl::SimpleAtoi(lost.job_id(), &job)) continue;  // not a job this server can serve
    std::vector<std::string> addresses;
    for (const v1::Endpoint& e : lost.server().endpoints()) addresses.push_back(e.address());
    const std::string what =
        absl::StrCat("KV server ", lost.server_index(), " (", lost.server().node_id(), " at ",
                     absl::StrJoin(addresses, ", "), ")");
    const absl::Status why = absl::UnavailableError(
        absl::StrCat(what, " declared dead by the coordinator ",
                     absl::FormatDuration(absl::Milliseconds(lost.dead_for_ms())), " ago (",
                     lost.reason(), ")"));
    if (replicas.DeclaredDead(job, lost.server_index(), addresses, why)) {
      PSD_LOG_WARN("job {}: {}: no replica goes to it from here on", job, why.message());
    }
  }
}

int Main(int argc, char** argv) {
  const ServerConfig config = LoadOrExit(Schema(), argc, argv);
  InitLogging("poseidon-server", *ParseLogLevel(config.log_level));

  // Signals are taken synchronously by the main thread; block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // Connections count against the open-file limit: take what the operator allows.
  if (const poseidon::FileLimit files = poseidon::RaiseOpenFileLimit(); files.now > files.before) {
    PSD_LOG_DEBUG("open-file limit raised from {} to {}", files.before, files.now);
  }

  auto secrets = std::make_shared<transport::SecretStore>();
  const absl::StatusOr<std::vector<uint64_t>> jobs = LoadSecrets(config, *secrets);
  if (!jobs.ok()) {
    PSD_LOG_ERROR("refusing to start: {}", jobs.status().message());
    return 2;
  }
  if (!config.checkpoint_dir.empty()) {
    ::mkdir(config.checkpoint_dir.c_str(), 0700);
    struct stat st {};
    if (::stat(config.checkpoint_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      PSD_LOG_ERROR("refusing to start: checkpoint_dir {} is not a directory",
                    config.checkpoint_dir);
      return 2;
    }
  }

  // Checkpoints are written by one thread, in order. `written`: each job's progress
  // (KvEngine::Progress) in its last checkpoint, so that shutdown does not write it again.
  std::mutex ckpt_mu;
  std::map<uint64_t, uint64_t> written;
  auto write_checkpoint = [&](const JobSnapshot& snap) {
    std::lock_guard<std::mutex> lock(ckpt_mu);
    const absl::Status s = WriteCheckpoint(config.checkpoint_dir, snap);
    if (s.ok()) {
      written[snap.job_id] = SnapshotProgress(snap);
      PSD_LOG_INFO("checkpoint of job {} at clock {} written", snap.job_id, snap.clock);
    } else {
      PSD_LOG_ERROR("checkpoint of job {} at clock {} failed: {}", snap.job_id, snap.clock,
                    s.message());
    }
    return s;
  };

  transport::TcpOptions tcp;
  tcp.io_threads = static_cast<int>(config.io_threads);
  tcp.limits.max_payload_bytes = config.max_payload;
  tcp.tls = transport::DataTls(config);
  transport::RdmaOptions rdma;
  rdma.limits.max_payload_bytes = config.max_payload;
  // Without a coordinator agents reach this server by their --servers list: TCP unless
  // --transport=rdma.
  const bool lists_only = config.coordinator.empty() && config.transport == "auto";
  auto transport_set =
      transport::MakeTransportSet(lists_only ? "tcp" : config.transport, tcp, rdma);
  if (!transport_set.ok()) {
    PSD_LOG_ERROR("refusing to start: {}", transport_set.status().message());
    return 2;
  }
  const transport::TransportSet transports = *std::move(transport_set);
  PSD_LOG_INFO("transport: {}{}",
               lists_only ? std::string("tcp (--transport=auto without a coordinator: agents "
                                        "use --servers)")
                          : transports.choice,
               tcp.tls.enabled && transports.tcp ? "; TCP with TLS (data_tls)" : "");
  // Replicas of the keys this server is the primary of go to their backups from here: over TCP
  // when this server has it (agents send the backups' TCP addresses then), else RDMA
  // (coordinator::ServerToServerAddresses).
  // A backup that does not finish the handshake within peer_timeout (a live server answers it at
  // once) is frozen, as one silent that long once connected (at most 10 s either way).
  const absl::Duration replica_connect =
      transport::HandshakeTimeoutFor(config.peer_timeout, KvReplicaSender::kConnectTimeout);
  auto replicas =
      std::make_shared<KvReplicaSender>(transports.tcp ? transports.tcp : transports.rdma, secrets,
                                        config.peer_timeout, replica_connect);

  EngineOptions engine_options;
  engine_options.replica_sender = replicas;
  engine_options.workers = static_cast<int>(config.workers);
  engine_options.max_key_bytes = config.max_payload;  // a larger key could never be pushed
  engine_options.max_memory_bytes = config.max_memory;
  if (!config.checkpoint_dir.empty() && config.checkpoint_every > 0) {
    engine_options.snapshot_every = static_cast<uint64_t>(config.checkpoint_every);
    engine_options.on_periodic_snapshot = [&](JobSnapshot snap) {
      std::thread([&write_checkpoint, snap = std::move(snap)] {
        (void)write_checkpoint(snap);
      }).detach();
    };
  }
  auto engine = std::make_shared<KvEngine>(engine_options);

  if (!config.checkpoint_dir.empty()) {
    auto restored = LoadCheckpoints(config.checkpoint_dir);
    if (!restored.ok()) {
      PSD_LOG_ERROR("refusing to start: {}", restored.status().message());
      return 2;
    }
    for (const auto& snap : *restored) {
      if (auto s = engine->Restore(snap); !s.ok()) {
        PSD_LOG_ERROR("refusing to start: restoring job {}: {}", snap.job_id, s.message());
        return 2;
      }
      // On stdout like the listening line: `poseidon run --resume` checks that every server
      // restored the job at the same clock.
      std::printf("poseidon-server restored job %llu at clock %llu (%zu keys)\n",
                  static_cast<unsigned long long>(snap.job_id),
                  static_cast<unsigned long long>(snap.clock), snap.keys.size());
      std::fflush(stdout);
    }
  }

  std::function<absl::Status(uint64_t, uint64_t)> checkpoint_now;
  if (!config.checkpoint_dir.empty()) {
    checkpoint_now = [&, engine](uint64_t job, uint64_t iteration) -> absl::Status {
      auto snap = iteration != 0 ? engine->SnapshotCompleted(job, iteration)
                                 : engine->Snapshot(job, absl::Seconds(60));
      if (!snap.ok()) return snap.status();
      return write_checkpoint(*snap);
    };
  }

  auto listener = transports.Primary().Listen(config.listen);
  if (!listener.ok()) {
    PSD_LOG_ERROR("refusing to start: {}", listener.status().message());
    return 2;
  }
  // Serving both kinds: RDMA clients connect to a listener of their own (an RDMA listener
  // serves RDMA clients only).
  std::shared_ptr<transport::Listener> rdma_listener;
  if (transports.tcp && transports.rdma) {
    std::string rdma_listen = config.rdma_listen;
    if (rdma_listen.empty()) {
      rdma_listen = absl::StrCat(config.listen.substr(0, config.listen.rfind(':')), ":0");
    }
    auto l = transports.rdma->Listen(rdma_listen);
    if (!l.ok()) {
      PSD_LOG_ERROR("refusing to start: RDMA listener on {}: {}", rdma_listen,
                    l.status().message());
      return 2;
    }
    rdma_listener = *l;
  }
  auto pool = BufferPool::Create(size_t{1} << 30);
  KvServiceOptions service_options;
  service_options.peer_timeout = config.peer_timeout;
  auto service = std::make_shared<KvService>(engine, pool, service_options, checkpoint_now);
  transport::FrameServerOptions fs_options;
  fs_options.handshake_timeout = config.handshake_timeout;
  auto server = std::make_shared<transport::FrameServer>(*listener, secrets, service, fs_options);
  server->Start();
  std::shared_ptr<transport::FrameServer> rdma_server;
  if (rdma_listener) {
    rdma_server =
        std::make_shared<transport::FrameServer>(rdma_listener, secrets, service, fs_options);
    rdma_server->Start();
  }

  MetricsRegistry registry;
  std::unique_ptr<MetricsExposer> exposer;
  if (!config.metrics_listen.empty()) {
    auto e = MetricsExposer::Start(config.metrics_listen, registry);
    if (!e.ok()) {
      PSD_LOG_ERROR("refusing to start: {}", e.status().message());
      return 2;
    }
    exposer = std::move(*e);
  }
  std::atomic<bool> stop_metrics{false};
  std::thread metrics_thread([&] {
    struct Exported {
      const std::atomic<uint64_t>* source;
      prometheus::Counter* counter;
      uint64_t last = 0;
    };
    const EngineStats& st = engine->stats();
    std::vector<Exported> exported;
    auto add = [&](const char* name, const char* help, const std::atomic<uint64_t>& source) {
      if (auto c = registry.GetCounter(name, help); c.ok()) exported.push_back({&source, *c});
    };
    add("poseidon_server_pushes_total", "Pushes aggregated", st.pushes);
    add("poseidon_server_push_bytes_total", "Bytes of pushes aggregated", st.push_bytes);
    add("poseidon_server_duplicate_pushes_total", "Duplicate pushes acknowledged and dropped",
        st.duplicate_pushes);
    add("poseidon_server_pulls_total", "Pulls answered", st.pulls);
    add("poseidon_server_pull_bytes_total", "Bytes of pull responses", st.pull_bytes);
    add("poseidon_server_clocks_completed_total", "Key clocks completed", st.clocks_completed);
    add("poseidon_server_request_errors_total", "Requests answered with an error",
        st.request_errors);
    add("poseidon_server_pull_timeouts_total", "Pulls that timed out", st.pull_timeouts);
    add("poseidon_server_replicated_total", "Key clocks acknowledged by a backup", st.replicated);
    add("poseidon_server_replicas_applied_total", "Replicas applied as a backup",
        st.replicas_applied);
    add("poseidon_server_promotions_total", "Keys this server took over as their new primary",
        st.promotions);
    add("poseidon_server_fenced_total", "Keys a later primary took from this server", st.fenced);
    add("poseidon_server_backups_lost_total", "Key backups given up (unreachable or silent)",
        st.backups_lost);
    add("poseidon_server_keys_adopted_total",
        "Keys this server took a copy of as a new backup (another was given up)", st.adopted);
    auto* active =
        registry.GetGauge("poseidon_server_connections", "Open peer connections").value();
    auto by_transport = [&](const char* kind) {
      return registry
          .GetGauge("poseidon_server_transport_connections",
                    "Open peer connections by transport (the listener they came in by)",
                    {{"transport", kind}})
          .value();
    };
    prometheus::Gauge* by_tcp = by_transport("tcp");
    prometheus::Gauge* by_rdma = by_transport("rdma");
    auto* table_bytes = registry
                            .GetGauge("poseidon_server_table_bytes",
                                      "Memory the tables this server holds take (the keys it "
                                      "adopted included); --max_memory bounds it")
                            .value();
    registry.GetGauge("poseidon_server_max_memory_bytes", "--max_memory")
        .value()
        ->Set(static_cast<double>(engine->max_memory()));
    while (!stop_metrics.load()) {
      table_bytes->Set(static_cast<double>(engine->memory_used()));
      for (auto& e : exported) {
        const uint64_t now = e.source->load(std::memory_order_relaxed);
        e.counter->Increment(static_cast<double>(now - e.last));
        e.last = now;
      }
      const uint64_t primary = server->Stats().active;
      const uint64_t over_rdma = rdma_server ? rdma_server->Stats().active : 0;
      active->Set(static_cast<double>(primary + over_rdma));
      by_tcp->Set(static_cast<double>(transports.tcp ? primary : 0));
      by_rdma->Set(static_cast<double>(transports.tcp ? over_rdma : primary));
      service->CheckSilence();  // this thread's other duty: frozen agents, every 500 ms
      absl::SleepFor(absl::Milliseconds(500));
    }
  });
  // Every exit path from here on (a failed registration too) stops and joins the metrics thread:
  // a joinable std::thread destroyed on return would abort the process (exit 134).
  struct StopOnExit {
    std::atomic<bool>& stop;
    std::thread& thread;
    std::shared_ptr<transport::FrameServer>& server;
    std::shared_ptr<transport::FrameServer>& rdma_server;
    ~StopOnExit() {
      stop = true;
      if (thread.joinable()) thread.join();
      server->Stop();
      if (rdma_server) rdma_server->Stop();
    }
  } stop_on_exit{stop_metrics, metrics_thread, server, rdma_server};

  // Join the coordinator's registry so agents learn this server from their plan.
  std::unique_ptr<coordinator::CoordinatorClient> coord;
  std::unique_ptr<coordinator::HeartbeatLoop> heartbeats;
  std::unique_ptr<ServerTelemetry> telemetry;
  if (!config.coordinator.empty()) {
    // One job (job_id and job_secret): a server of that job, with its coordinator token. Jobs
    // from a secrets_file: a cluster-wide server (an empty job id, coordinator_token is the
    // cluster token) that the coordinator gives to those jobs only.
    const bool one_job = config.secrets_file.empty();
    auto client = coordinator::CoordinatorClient::Connect(
        config.coordinator, one_job ? absl::StrCat(config.job_id) : std::string(),
        config.coordinator_token, coordinator::CoordinatorTls(config));
    if (!client.ok()) {
      PSD_LOG_ERROR("refusing to start: coordinator: {}", client.status().message());
      return 2;
    }
    coordinator::ServerRegistration reg;
    char host[256] = {};
    reg.host = gethostname(host, sizeof(host) - 1) == 0 && host[0] ? host : "unknown-host";
    const std::string advertise = config.advertise.empty() ? server->Address() : config.advertise;
    // Every kind this server serves (an RDMA-only server's one listener is its RDMA endpoint);
    // the RDMA listener is advertised at the advertised host.
    if (transports.tcp) {
      reg.endpoints.push_back(coordinator::MakeEndpoint(v1::TRANSPORT_KIND_TCP, advertise));
    }
    if (transports.rdma) {
      std::string rdma_advertise = advertise;
      if (rdma_server) {
        const std::string bound = rdma_server->Address();
        rdma_advertise = config.advertise.empty()
                             ? bound
                             : absl::StrCat(advertise.substr(0, advertise.rfind(':')),
                                            bound.substr(bound.rfind(':')));
      }
      reg.endpoints.push_back(coordinator::MakeEndpoint(v1::TRANSPORT_KIND_RDMA, rdma_advertise));
    }
    if (!one_job) {
      for (uint64_t job : *jobs) reg.jobs.push_back(absl::StrCat(job));
    }
    if (auto r = (*client)->RegisterServer(reg); !r.ok()) {
      PSD_LOG_ERROR("refusing to start: registering with the coordinator {}: {}",
                    config.coordinator, r.status().message());
      return 2;
    }
    coord = std::move(*client);
    // A restarted coordinator registers this server again under the same node id.
    coordinator::CoordinatorClient::HeartbeatOptions hb;
    hb.register_again = true;
    // The ranks whose connections closed or went silent lately: the coordinator declares their
    // agents dead once they also miss their heartbeats, instead of at the end of their lease.
    hb.ranks_gone = [service] { return service->RanksGone(absl::Minutes(1)); };
    // A backup the coordinator declared dead is given up at once, not at peer_timeout.
    hb.on_result = [client = coord.get(),
                    replicas](const absl::StatusOr<v1::HeartbeatResponse>& result) {
      coordinator::LogHeartbeatResult(client->node_id(), result);
      if (result.ok()) GiveUpDeclaredDead(*result, *replicas);
    };
    heartbeats = coord->StartHeartbeats(std::move(hb));
    if (config.telemetry_interval > absl::ZeroDuration()) {
      telemetry = std::make_unique<ServerTelemetry>(
          [service] { return service->TakeTraffic(); }, config.telemetry_interval,
          [client = coord.get()](const v1::ReportTelemetryRequest& request,
                                 absl::Duration timeout) {
            return client->ReportTelemetry(request, timeout);
          },
          // Serving both kinds, a peer's kind is the listener its connections came in by.
          [rdma_server, rdma_only = transports.tcp == nullptr](uint64_t job, uint32_t rank) {
            return rdma_only || (rdma_server && rdma_server->HasPeer(job, rank))
                       ? v1::TRANSPORT_KIND_RDMA
                       : v1::TRANSPORT_KIND_TCP;
          },
          // Each report waits at most a second for the engine's workers (a busy one is left
          // out of that report).
          [engine] { return engine->ReplicationStatus(absl::Seconds(1)); });
      telemetry->Start();
    }
  }

  PSD_LOG_INFO("serving on {}{} ({} engine threads{}{})", server->Address(),
               rdma_server ? absl::StrCat(" and rdma://", rdma_server->Address()) : "",
               config.workers, exposer ? absl::StrCat(", metrics on ", exposer->address()) : "",
               config.checkpoint_dir.empty()
                   ? ""
                   : absl::StrCat(", checkpoints in ", config.checkpoint_dir));
  // Tests and launchers read this line to learn the bound port.
  std::printf("poseidon-server listening on %s\n", server->Address().c_str());
  std::fflush(stdout);

  int sig = 0;
  sigwait(&signals, &sig);
  PSD_LOG_INFO("signal {}: finishing the clock in flight", sig);
  if (!engine->WaitForQuiescence(config.shutdown_timeout)) {
    PSD_LOG_WARN("a clock was still incomplete after {}; stopping anyway",
                 absl::FormatDuration(config.shutdown_timeout));
  }
  int rc = 0;
  if (!config.checkpoint_dir.empty() && config.checkpoint_on_exit) {
    for (uint64_t job : engine->Jobs()) {
      {
        std::lock_guard<std::mutex> lock(ckpt_mu);
        if (auto it = written.find(job); it != written.end() && it->second == engine->Progress(job)) {
          PSD_LOG_INFO("job {} has not changed since its last checkpoint", job);
          continue;
        }
      }
      auto snap = engine->Snapshot(job, absl::Seconds(1));
      if (!snap.ok() || !write_checkpoint(*snap).ok()) {
        PSD_LOG_ERROR("final checkpoint of job {} failed", job);
        rc = 1;
      }
    }
  }
  if (telemetry) telemetry->Stop();
  if (heartbeats) heartbeats->Stop();
  if (coord) (void)coord->Deregister("shutting down");
  server->Stop();
  if (rdma_server) rdma_server->Stop();
  replicas->Stop();
  transports.Close();
  PSD_LOG_INFO("stopped");  // stop_on_exit joins the metrics thread
  return rc;
}

}  // namespace
}  // namespace poseidon::server

int main(int argc, char** argv) {
  return poseidon::server::Main(argc, argv);
}
