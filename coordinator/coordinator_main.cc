// poseidon-coordinator: the control-plane daemon (DESIGN.md "Processes"; docs/operations.md,
// "Coordinator"). Configuration from flags > POSEIDON_* environment > config file; logs to stderr;
// Prometheus metrics over HTTP; SIGTERM/SIGINT answer waiting calls, stop serving and exit 0. A bad
// configuration is refused with one line on stderr and exit code 2.
#include <grpc/support/log.h>
#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/fd_limit.h"
#include "common/config.h"
#include "common/log.h"
#include "common/metrics.h"
#include "coordinator/auth.h"
#include "coordinator/server.h"

namespace poseidon::coordinator {
namespace {

struct CoordinatorConfig {
  std::string listen = "127.0.0.1:7070";
  std::string tokens_file;
  std::string job_id;
  std::string job_token;
  std::string cluster_token;
  absl::Duration liveness_timeout = absl::Seconds(15);
  absl::Duration heartbeat_interval = absl::ZeroDuration();
  absl::Duration rendezvous_timeout = absl::Minutes(5);
  absl::Duration handshake_timeout = absl::Seconds(10);
  absl::Duration max_connection_idle = absl::Minutes(5);
  uint64_t max_message_bytes = uint64_t{16} << 20;
  absl::Duration plan_wait_timeout = absl::Seconds(60);
  int64_t min_servers = 1;
  double bandwidth = 10e9 / 8;
  absl::Duration latency = absl::Microseconds(50);
  bool colocated = false;
  uint64_t block_size = uint64_t{4} << 20;
  int64_t batch_per_worker = 0;
  std::string scheme_rule = "time";
  std::string fusion = "cost";
  std::string lossy_wire = "none";
  int64_t lowrank_rank = 0;
  std::string lowrank_layers;  // "fc6.weight=4,conv1.weight=0"
  bool allreduce_by_cost = false;
  double replan_threshold = 0.2;
  absl::Duration replan_min_interval = absl::Seconds(10);
  int64_t plan_lead = 10;
  absl::Duration plan_lead_time = absl::Seconds(2);
  absl::Duration telemetry_max_age = absl::Seconds(60);
  uint64_t telemetry_min_bytes = uint64_t{16} << 20;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  std::string metrics_listen;
  absl::Duration shutdown_timeout = absl::Seconds(1);
  std::string log_level = "info";
};

ConfigSchema<CoordinatorConfig> Schema() {
  using C = CoordinatorConfig;
  ConfigSchema<C> s("poseidon-coordinator");
  s.Field("listen", &C::listen, "gRPC address to listen on (host:port; port 0 picks one)",
          NonEmpty())
      .Field("tokens_file", &C::tokens_file,
             "file of '<job id> <token>' lines: the jobs this coordinator serves")
      .Field("job_id", &C::job_id, "a single job to serve (with job_token)")
      .SecretField("job_token", &C::job_token, "the token of job_id")
      .SecretField("cluster_token", &C::cluster_token,
                   "token of cluster-wide callers (servers for every job, status of all jobs); "
                   "empty: none")
      .Field("liveness_timeout", &C::liveness_timeout,
             "a node silent for longer than this is declared dead",
             InRange(absl::Milliseconds(10), absl::Hours(24)))
      .Field("heartbeat_interval", &C::heartbeat_interval,
             "how often nodes heartbeat (0: liveness_timeout / 5)",
             InRange(absl::ZeroDuration(), absl::Hours(1)))
      .Field("rendezvous_timeout", &C::rendezvous_timeout,
             "Rendezvous and RegisterModel wait at most this long for the whole job",
             InRange(absl::Milliseconds(1), absl::Hours(24)))
      .Field("plan_wait_timeout", &C::plan_wait_timeout,
             "GetPlan with min_plan_epoch waits at most this long",
             InRange(absl::Milliseconds(1), absl::Hours(1)))
      .Field("handshake_timeout", &C::handshake_timeout,
             "a connection that has not completed its TLS / HTTP/2 handshake by then is closed",
             InRange(absl::Milliseconds(100), absl::Minutes(10)))
      .Field("max_connection_idle", &C::max_connection_idle,
             "a connection without a call for this long is closed",
             InRange(absl::Seconds(1), absl::Hours(24)))
      .ByteSizeField("max_message_bytes", &C::max_message_bytes,
                     "the largest request accepted (a model spec of ~100,000 layers fits 16MiB)",
                     InRange<uint64_t>(uint64_t{64} << 10, uint64_t{1} << 30))
      .Field("min_servers", &C::min_servers, "a job's world forms once this many servers joined",
             InRange<int64_t>(1, 65536))
      .BandwidthField("bandwidth", &C::bandwidth,
                      "nominal per-machine bandwidth until telemetry measures it (10Gbit)",
                      [](const double& v) -> absl::Status {
                        if (v > 0) return absl::OkStatus();
                        return absl::InvalidArgumentError("must be more than 0");
                      })
      .Field("latency", &C::latency, "nominal per-message latency until telemetry measures it",
             InRange(absl::ZeroDuration(), absl::Seconds(10)))
      .Field("colocated", &C::colocated, "every worker machine also runs a server")
      .ByteSizeField("block_size", &C::block_size, "largest chunk of a PS layer",
                     InRange<uint64_t>(4, uint64_t{1} << 32))
      .Field("batch_per_worker", &C::batch_per_worker,
             "K for every layer (0: each layer's batch_per_worker from the model)",
             InRange<int64_t>(0, int64_t{1} << 20))
      .Field("scheme_rule", &C::scheme_rule,
             "time: SFB when predicted faster (re-plans on telemetry); bytes: Poseidon's rule",
             OneOf({"time", "bytes"}))
      .Field("plan_fusion", &C::fusion,
             "cost: the plan fuses small PS layers into buckets where the cost model says it "
             "pays (docs/planner.md, Fusion); off: none (agents with --fusion=bytes still fuse)",
             OneOf({"cost", "off"}))
      .Field("plan_lossy_wire", &C::lossy_wire,
             "none: every layer exact; bf16 or fp16: the job allows that lossy 16-bit wire, and "
             "the plan puts a PS or all-reduce layer on it where the cost model says it pays "
             "(docs/planner.md, Wire precision)",
             OneOf({"none", "bf16", "fp16"}))
      .Field("plan_lowrank_rank", &C::lowrank_rank,
             "0: no low rank; r: the job allows PowerSGD at rank r, and the plan sends an "
             "all-reduce layer's 2-D gradient as rank-r factors where the cost model says it "
             "pays (lossy, error feedback; docs/planner.md, Low rank)",
             InRange<int64_t>(0, 1024))
      .Field("plan_lowrank_layers", &C::lowrank_layers,
             "per-layer low-rank overrides, 'fc6.weight=4,conv1.weight=0': r sends that layer by "
             "all-reduce at rank r whatever the cost (a 2-D tensor r shrinks; lossy), 0 keeps it "
             "off low rank whatever --plan_lowrank_rank allows (docs/planner.md, Low rank)")
      .Field("allreduce_by_cost", &C::allreduce_by_cost,
             "let the time rule put layers on ring all-reduce from the agents' measured ring "
             "step (off: only --scheme=allreduce and overrides use it; docs/planner.md)")
      .Field("replan_threshold", &C::replan_threshold,
             "re-plan only when the measured bandwidth moved by more than this fraction",
             InRange(0.0, 100.0))
      .Field("replan_min_interval", &C::replan_min_interval,
             "at least this long between a plan and the next re-plan from telemetry (a change "
             "measured sooner is judged when it has passed)",
             InRange(absl::ZeroDuration(), absl::Hours(24)))
      .Field("plan_lead", &C::plan_lead,
             "a re-plan takes effect this many iterations after the job's estimated iteration "
             "(see plan_lead_time)",
             InRange<int64_t>(1, int64_t{1} << 32))
      .Field("plan_lead_time", &C::plan_lead_time,
             "a re-plan takes effect after the iterations the job is estimated to run in this "
             "long (the time agents need to learn it), plus plan_lead",
             InRange(absl::ZeroDuration(), absl::Hours(1)))
      .Field("telemetry_max_age", &C::telemetry_max_age, "link samples older than this are ignored",
             InRange(absl::Milliseconds(1), absl::Hours(24)))
      .ByteSizeField("telemetry_min_bytes", &C::telemetry_min_bytes,
                     "achieved throughput counts for the planner (as a lower bound) only from "
                     "windows that moved this much")
      .Field("tls_cert", &C::tls_cert, "PEM certificate chain: serve TLS (empty: insecure)")
      .Field("tls_key", &C::tls_key, "PEM private key of tls_cert")
      .Field("tls_client_ca", &C::tls_client_ca,
             "PEM CA: require client certificates signed by it (mutual TLS)")
      .Field("metrics_listen", &C::metrics_listen,
             "Prometheus /metrics address (host:port); empty: off")
      .Field("shutdown_timeout", &C::shutdown_timeout,
             "on SIGTERM, calls in flight get at most this long to finish (idle client "
             "connections are closed after it)",
             InRange(absl::ZeroDuration(), absl::Minutes(10)))
      .Field("log_level", &C::log_level, "trace, debug, info, warn, error",
             OneOf({"trace", "debug", "info", "warn", "error"}));
  return s;
}

absl::Status LoadTokens(const CoordinatorConfig& config, TokenStore& tokens) {
  if (config.job_id.empty() != config.job_token.empty()) {
    return absl::InvalidArgumentError(config.job_id.empty() ? "job_token is set but job_id is not"
                                                            : "job_id is set but job_token is not");
  }
  if (!config.job_id.empty()) {
    if (absl::Status s = tokens.AddJob(config.job_id, config.job_token); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("job_id/job_token: ", s.message()));
    }
  }
  if (!config.tokens_file.empty()) {
    if (absl::Status s = tokens.LoadFile(config.tokens_file); !s.ok()) return s;
  }
  if (tokens.job_count() == 0) {
    return absl::InvalidArgumentError("no job to serve: set job_id and job_token, or tokens_file");
  }
  if (absl::Status s = tokens.SetClusterToken(config.cluster_token); !s.ok()) return s;
  return absl::OkStatus();
}

bool IsLoopback(const std::string& listen) {
  return absl::StartsWith(listen, "127.") || absl::StartsWith(listen, "localhost:") ||
         absl::StartsWith(listen, "[::1]:");
}

// gRPC's own log lines go through the process logger.
void LogFromGrpc(gpr_log_func_args* args) {
  if (args->severity == GPR_LOG_SEVERITY_ERROR) {
    PSD_LOG_WARN("grpc: {}", args->message);
  } else {
    PSD_LOG_DEBUG("grpc: {}", args->message);
  }
}

int Refuse(absl::string_view reason) {
  std::fprintf(stderr, "poseidon-coordinator: refusing to start: %s\n",
               std::string(reason).c_str());
  return 2;
}

int Main(int argc, char** argv) {
  const CoordinatorConfig config = LoadOrExit(Schema(), argc, argv);
  InitLogging("poseidon-coordinator", *ParseLogLevel(config.log_level));
  gpr_set_log_function(LogFromGrpc);

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

  TokenStore tokens;
  if (absl::Status s = LoadTokens(config, tokens); !s.ok()) return Refuse(s.message());
  const size_t jobs = tokens.job_count();

  MetricsRegistry metrics;
  std::unique_ptr<MetricsExposer> exposer;
  if (!config.metrics_listen.empty()) {
    auto started = MetricsExposer::Start(config.metrics_listen, metrics);
    if (!started.ok()) return Refuse(started.status().message());
    exposer = std::move(*started);
  }

  CoordinatorServerOptions options;
  options.listen = config.listen;
  options.tls = ServerTlsFiles{config.tls_cert, config.tls_key, config.tls_client_ca};
  options.handshake_timeout = config.handshake_timeout;
  options.max_connection_idle = config.max_connection_idle;
  options.max_message_bytes = static_cast<int>(config.max_message_bytes);
  options.service.rendezvous_timeout = config.rendezvous_timeout;
  options.service.plan_wait_timeout = config.plan_wait_timeout;
  options.service.metrics = &metrics;
  RegistryOptions& registry = options.service.registry;
  registry.lease = config.liveness_timeout;
  registry.heartbeat_interval = config.heartbeat_interval;
  registry.min_servers = static_cast<uint32_t>(config.min_servers);
  registry.nominal_bandwidth_bytes_per_second = config.bandwidth;
  registry.nominal_latency_seconds = absl::ToDoubleSeconds(config.latency);
  registry.colocated = config.colocated;
  registry.block_bytes = config.block_size;
  registry.batch_per_worker = static_cast<uint32_t>(config.batch_per_worker);
  registry.scheme_rule =
      config.scheme_rule == "bytes" ? planner::SchemeRule::kBytes : planner::SchemeRule::kTime;
  registry.fusion = config.fusion == "off" ? planner::FusionRule::kOff : planner::FusionRule::kCost;
  registry.lossy_wire = *planner::ParseWireType(config.lossy_wire);  // checked by OneOf
  registry.lowrank_rank = static_cast<uint32_t>(config.lowrank_rank);
  absl::StatusOr<std::map<std::string, uint32_t, std::less<>>> lowrank_layers =
      planner::ParseLowRankOverrides(config.lowrank_layers);
  if (!lowrank_layers.ok()) {
    return Refuse(absl::StrCat("--plan_lowrank_layers: ", lowrank_layers.status().message()));
  }
  registry.lowrank_overrides = *std::move(lowrank_layers);
  registry.allreduce_by_cost = config.allreduce_by_cost;
  registry.replan_threshold = config.replan_threshold;
  registry.plan_lead_iterations = static_cast<uint64_t>(config.plan_lead);
  registry.plan_lead_time = config.plan_lead_time;
  registry.replan_min_interval = config.replan_min_interval;
  registry.telemetry_max_age = config.telemetry_max_age;
  registry.telemetry_min_bytes = config.telemetry_min_bytes;

  absl::StatusOr<std::unique_ptr<CoordinatorServer>> server =
      CoordinatorServer::Start(std::move(tokens), std::move(options));
  if (!server.ok()) return Refuse(server.status().message());

  if (!(*server)->tls() && !IsLoopback(config.listen)) {
    PSD_LOG_WARN(
        "serving without TLS on {}: tokens cross the network in clear text; set tls_cert "
        "and tls_key",
        config.listen);
  }
  PSD_LOG_INFO(
      "serving {} job{} on {} ({}{})", jobs, jobs == 1 ? "" : "s", (*server)->address(),
      (*server)->tls() ? (config.tls_client_ca.empty() ? "TLS" : "mutual TLS") : "insecure",
      exposer ? absl::StrCat(", metrics on ", exposer->address()) : "");
  // Tests and launchers read these lines to learn the bound ports.
  std::printf("poseidon-coordinator listening on %s\n", (*server)->address().c_str());
  if (exposer) std::printf("poseidon-coordinator metrics on %s\n", exposer->address().c_str());
  std::fflush(stdout);

  int sig = 0;
  sigwait(&signals, &sig);
  PSD_LOG_INFO("signal {}: answering waiting calls and stopping", sig);
  (*server)->Shutdown(config.shutdown_timeout);
  server->reset();
  exposer.reset();
  PSD_LOG_INFO("stopped");
  return 0;
}

}  // namespace
}  // namespace poseidon::coordinator

int main(int argc, char** argv) {
  return poseidon::coordinator::Main(argc, argv);
}
