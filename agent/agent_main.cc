// poseidon-agent: the per-GPU sidecar daemon. Configuration from flags > POSEIDON_* environment
// > config file. Until the coordinator service hands out ranks and addresses, the cluster is
// given explicitly (rank, world size, servers, peers); every agent computes the same plan.
#include <signal.h>

#include <filesystem>
#include <set>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agent/agent.h"
#include "agent/syncer.h"
#include "common/fd_limit.h"
#include "common/config.h"
#include "common/log.h"
#include "transport/tcp/tls_config.h"

namespace {

// A comma-separated list's items (empty ones skipped).
std::vector<std::string> List(const std::string& s) {
  return absl::StrSplit(s, ',', absl::SkipWhitespace());
}

// Above any plan's server count (the coordinator's and the planner's limits are far lower).
constexpr uint32_t kMaxServerIndex = 1u << 16;

// --lost_servers: server indices in the plan's order, comma-separated.
absl::StatusOr<std::set<uint32_t>> ParseServerIndices(const std::string& text) {
  std::set<uint32_t> indices;
  for (const std::string& item : List(text)) {
    const absl::StatusOr<uint64_t> index = poseidon::ParseUint64(item);
    if (!index.ok() || *index >= kMaxServerIndex) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", item, "' is not a server index (0 to ", kMaxServerIndex - 1, ")"));
    }
    indices.insert(static_cast<uint32_t>(*index));
  }
  return indices;
}

struct Flags {
  std::string segment;
  uint64_t job_id = 1;
  std::string secret;
  std::string keyring;
  int64_t rank = 0;
  int64_t local_rank = -1;
  int64_t world_size = 1;
  std::string servers;
  std::string peers;
  std::string listen;
  std::string scheme = "auto";
  std::string transport = "auto";
  std::string wire = "plan";
  std::string plan_lossy_wire = "none";
  int64_t wire_check_every = 100;
  double wire_max_error = 0.05;
  int64_t lowrank_rank = -1;
  int64_t lowrank_warmup = 10;
  double lowrank_max_held = 8.0;
  int64_t replicas = 1;
  int64_t checkpoint_every = 0;
  bool checkpoint_at_end = false;
  int64_t resumed_iteration = 0;
  std::string lost_servers;
  absl::Duration rejoin_timeout = absl::ZeroDuration();
  bool rejoin = false;
  std::string rejoin_if_restarted;
  int64_t min_workers = 0;
  double bandwidth = 1.25e9;
  bool colocated = true;
  bool allreduce = true;
  uint64_t block_bytes = 4u << 20;
  uint64_t credit_bytes = 64u << 20;
  std::string fusion = "plan";
  uint64_t bucket_bytes = 512u << 10;
  uint64_t allreduce_bucket_bytes = uint64_t{25} << 20;
  uint64_t probe_bytes = 4u << 20;
  uint64_t capacity_min_bytes = 1u << 20;
  int64_t sync_threads = 8;
  int64_t blas_threads = 1;
  bool priority = true;
  absl::Duration sync_timeout = absl::Seconds(60);
  absl::Duration attach_timeout = absl::Seconds(120);
  absl::Duration connect_timeout = absl::Seconds(60);
  std::string log_level = "info";
  std::string coordinator;
  std::string coordinator_token;
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
  std::string metrics_listen;
  std::string timeline;
  absl::Duration stall_timeout = absl::Seconds(10);
  absl::Duration telemetry_interval = absl::Seconds(5);
  absl::Duration peer_timeout = absl::Seconds(15);
};

poseidon::ConfigSchema<Flags> Schema() {
  using poseidon::AtLeast;
  using poseidon::InRange;
  poseidon::ConfigSchema<Flags> s("poseidon-agent");
  s.Field("segment", &Flags::segment, "shared-memory segment (default /poseidon-<job>-<rank>)")
      .Field("job_id", &Flags::job_id, "job id")
      .SecretField("secret", &Flags::secret, "the job's secret (or keyring)")
      .SecretField("keyring", &Flags::keyring,
                   "this rank's keys, as poseidon run writes them (instead of the secret)")
      .Field("rank", &Flags::rank, "this worker's rank", InRange<int64_t>(0, 65535))
      .Field("local_rank", &Flags::local_rank,
             "this worker's index on its host (its GPU): with the host name, the agent's "
             "identity at the coordinator; -1: the rank",
             InRange<int64_t>(-1, 65535))
      .Field("world_size", &Flags::world_size, "number of workers (P1)", InRange<int64_t>(1, 65536))
      .Field("servers", &Flags::servers, "KV servers, comma-separated host:port")
      .Field("peers", &Flags::peers, "every agent's SFB address, comma-separated, in rank order")
      .Field("listen", &Flags::listen, "our SFB address (default: peers[rank])")
      .Field("scheme", &Flags::scheme,
             "auto (HybComm plan), ps, sfb (FC layers; the rest PS), allreduce (every layer; "
             "needs a coordinator)",
             poseidon::OneOf({"auto", "ps", "sfb", "allreduce"}))
      .Field("transport", &Flags::transport,
             "data plane: auto (RDMA and TCP where an RDMA device is usable, else TCP; TCP "
             "without a coordinator), tcp, or rdma (only; refused without a device)",
             poseidon::OneOf({"auto", "tcp", "rdma"}))
      .Field("wire", &Flags::wire,
             "what PS pushes and pulls and all-reduces carry: plan (each layer's wire from the "
             "plan: exact unless the job allows a lossy wire), or for every layer fp32 (exact), "
             "bf16 or fp16 (half the bytes, lossy, with error feedback and float32 sums; not with "
             "a server-side update rule); every rank the same",
             poseidon::OneOf({"plan", "fp32", "bf16", "fp16"}))
      .Field("plan_lossy_wire", &Flags::plan_lossy_wire,
             "without a coordinator: the lossy wire the agent's own plan may choose where it "
             "pays (none: exact; with a coordinator, its --plan_lossy_wire decides)",
             poseidon::OneOf({"none", "bf16", "fp16"}))
      .Field("wire_check_every", &Flags::wire_check_every,
             "lossy wire's divergence guard: compare what a key sends with its exact gradient on "
             "clock 1 and every this many clocks (0: off)",
             InRange<int64_t>(0, int64_t{1} << 30))
      .Field("wire_max_error", &Flags::wire_max_error,
             "the guard's limit: a key whose 16-bit encoding is further than this (relative L2 "
             "error) from its gradient falls back to float32 for the rest of the job",
             InRange<double>(1e-6, 10.0))
      .Field("lowrank_rank", &Flags::lowrank_rank,
             "low rank (PowerSGD) of all-reduce layers with a 2-D gradient it shrinks: -1 the "
             "plan's (exact unless the job allows it), 0 off, r sends every such layer as rank-r "
             "factors (lossy, error feedback; not with a server-side update rule); every rank "
             "the same",
             InRange<int64_t>(-1, 1024))
      .Field("lowrank_warmup", &Flags::lowrank_warmup,
             "the first this many all-reduces of a low-rank layer are exact",
             InRange<int64_t>(0, int64_t{1} << 30))
      .Field("lowrank_max_held", &Flags::lowrank_max_held,
             "low rank's divergence guard (on --wire_check_every's clocks): a layer whose ranks "
             "hold back more than this many times their summed gradient's norm falls back to "
             "the exact all-reduce for the rest of the job",
             InRange<double>(0.01, 1e6))
      .Field("replicas", &Flags::replicas,
             "backups of every PS key on the next servers (0: none; at most servers - 1): a "
             "killed server's keys are served on by its backup; every rank the same",
             InRange<int64_t>(0, 8))
      .Field("checkpoint_every", &Flags::checkpoint_every,
             "rank 0: ask every KV server for a checkpoint after every N-th iteration (0: "
             "never; the servers need a checkpoint_dir)",
             AtLeast<int64_t>(0))
      .Field("checkpoint_at_end", &Flags::checkpoint_at_end,
             "rank 0: ask every KV server for a checkpoint when training ends cleanly")
      .Field("resumed_iteration", &Flags::resumed_iteration,
             "the iteration the job's checkpoint was taken at, when it resumes from one (0: a "
             "new job); checkpoints go on counting from it",
             AtLeast<int64_t>(0))
      .Field("lost_servers", &Flags::lost_servers,
             "with --resumed_iteration: the KV servers (indices in the plan's order, "
             "comma-separated) lost before that checkpoint; their keys start at their backups' "
             "copies, which the others' checkpoints hold (needs --replicas)",
             [](const std::string& v) { return ParseServerIndices(v).status(); })
      .Field("rejoin_timeout", &Flags::rejoin_timeout,
             "a rank that dies is waited for this long (by the KV servers and the other agents) "
             "so that, restarted with --rejoin, it takes up the running job where it stopped; "
             "0: the iterations that need it fail at once. Every rank the same; PS and SFB layers "
             "(no ring all-reduce is connected)",
             poseidon::InRange(absl::ZeroDuration(), absl::Hours(1)))
      .Field("min_workers", &Flags::min_workers,
             "a dead rank given up (at once, or after --rejoin_timeout) is removed and the job "
             "goes on with the ranks left while at least this many are; 0: the job fails naming "
             "it. Every rank the same; all-reduce layers go on in a ring of the ranks left",
             InRange<int64_t>(0, 65536))
      .Field("rejoin", &Flags::rejoin,
             "this agent replaces a dead rank of the running job: its layers start at the KV "
             "servers' clocks, and the training process learns the iteration it takes up "
             "(psd_start_iteration)")
      .Field("rejoin_if_restarted", &Flags::rejoin_if_restarted,
             "a directory that outlives this agent's process but not its slot (a Kubernetes "
             "pod's emptyDir): the agent leaves poseidon-<job>-<rank>.joined there once its "
             "rank is in the job, and an agent that finds it there is a restart and takes up "
             "the running job as --rejoin does (empty: off)")
      .BandwidthField("bandwidth", &Flags::bandwidth, "link bandwidth the planner assumes")
      .Field("colocated", &Flags::colocated, "servers share machines with workers")
      .Field("allreduce", &Flags::allreduce,
             "ring all-reduce (Gloo) may be planned for this job (false: Gloo's ports stay closed)")
      .ByteSizeField("block_bytes", &Flags::block_bytes, "largest PS chunk",
                     InRange<uint64_t>(4096, uint64_t{1} << 30))
      .ByteSizeField("credit_bytes", &Flags::credit_bytes, "bytes in flight before queueing",
                     AtLeast<uint64_t>(4096))
      .Field("fusion", &Flags::fusion,
             "fuse consecutive small PS layers into one key: plan (the buckets the planner "
             "chose from the per-key cost and the overlap lost), bytes (runs of at most "
             "--bucket_bytes) or off; every rank the same",
             poseidon::OneOf({"plan", "bytes", "off"}))
      .ByteSizeField("bucket_bytes", &Flags::bucket_bytes,
                     "with --fusion=bytes: the largest bucket (0: no fusion)",
                     InRange<uint64_t>(0, uint64_t{1} << 30))
      .ByteSizeField("allreduce_bucket_bytes", &Flags::allreduce_bucket_bytes,
                     "consecutive all-reduce layers fused into one collective of at most this "
                     "many bytes, run once all of them are ready (DDP's bucket_cap_mb; 0: one "
                     "collective per layer); every rank the same",
                     InRange<uint64_t>(0, uint64_t{1} << 30))
      .ByteSizeField("probe_bytes", &Flags::probe_bytes,
                     "with a coordinator: measure each server link with a probe this large at "
                     "start-up, for the first plan (0: off, the plan assumes --bandwidth)",
                     InRange<uint64_t>(0, uint64_t{16} << 20))
      .ByteSizeField("capacity_min_bytes", &Flags::capacity_min_bytes,
                     "a telemetry window reports a link capacity after this many bytes of large "
                     "pull responses",
                     InRange<uint64_t>(1, uint64_t{1} << 40))
      .Field("sync_threads", &Flags::sync_threads, "synchronisation threads",
             InRange<int64_t>(1, 256))
      .Field("blas_threads", &Flags::blas_threads,
             "threads of one host-side SFB rebuild (OpenBLAS): 1, as the sync threads already "
             "rebuild layers side by side and OpenBLAS's own threads spin between calls "
             "(sched_yield), taking the cores of the training process and the other agents",
             InRange<int64_t>(1, 256))
      .Field("priority", &Flags::priority,
             "synchronise the layer the next forward needs first (false: in ready order)")
      .Field("sync_timeout", &Flags::sync_timeout, "a layer's synchronisation must finish within")
      .Field("attach_timeout", &Flags::attach_timeout, "wait this long for the training process")
      .Field("connect_timeout", &Flags::connect_timeout, "wait this long for servers and peers")
      .Field("coordinator", &Flags::coordinator,
             "poseidon-coordinator (host:port): rank, peers, servers and plan come from it")
      .SecretField("coordinator_token", &Flags::coordinator_token, "the job's coordinator token")
      .Field("metrics_listen", &Flags::metrics_listen, "Prometheus /metrics address; empty: off")
      .Field("timeline", &Flags::timeline,
             "write a Chrome-trace timeline here ({rank} is replaced); empty: off")
      .Field("stall_timeout", &Flags::stall_timeout,
             "report a layer not done within this time, with what it waits for")
      .Field("peer_timeout", &Flags::peer_timeout,
             "ping servers and peers every third of this; a peer silent this long is gone: the "
             "layers waiting for it fail naming it; a KV server silent this long while it "
             "registers the job, or that takes the connection but answers no handshake at start, "
             "is lost; a peer agent that answers no handshake fails the connect (0: off)",
             poseidon::InRange(absl::ZeroDuration(), absl::Hours(1)))
      .Field(
          "telemetry_interval", &Flags::telemetry_interval,
          "with a coordinator: report link bytes and layer sync times this often; 0: off",
          [](const absl::Duration& d) {
            if (d == absl::ZeroDuration() || (d >= absl::Milliseconds(10) && d <= absl::Hours(1))) {
              return absl::OkStatus();
            }
            return absl::InvalidArgumentError("must be 0 (off) or in [10ms, 1h]");
          })
      .Field("log_level", &Flags::log_level, "trace, debug, info, warn, error",
             poseidon::OneOf({"trace", "debug", "info", "warn", "error"}));
  poseidon::coordinator::AddCoordinatorTlsFields(s);
  poseidon::transport::AddDataTlsFields(s);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = poseidon::LoadOrExit(Schema(), argc, argv);
  poseidon::InitLogging("poseidon-agent", *poseidon::ParseLogLevel(f.log_level));
  signal(SIGPIPE, SIG_IGN);
  // Connections count against the open-file limit: take what the operator allows.
  if (const poseidon::FileLimit files = poseidon::RaiseOpenFileLimit(); files.now > files.before) {
    PSD_LOG_DEBUG("open-file limit raised from {} to {}", files.before, files.now);
  }
  struct sigaction stop {};
  stop.sa_handler = [](int) { poseidon::agent::RequestAgentStop(); };
  sigaction(SIGTERM, &stop, nullptr);
  sigaction(SIGINT, &stop, nullptr);
  poseidon::agent::SetHostBlasThreads(static_cast<int>(f.blas_threads));
  poseidon::agent::AgentConfig c;
  c.segment = f.segment;
  c.job_id = f.job_id;
  c.secret = f.secret;
  c.keyring = f.keyring;
  if (c.secret.empty() == c.keyring.empty()) {
    std::fprintf(stderr, "poseidon-agent: set exactly one of secret and keyring (%s)\n",
                 c.secret.empty() ? "neither is set" : "both are set");
    return 2;
  }
  c.rank = static_cast<uint32_t>(f.rank);
  c.local_rank = f.local_rank;
  c.world_size = static_cast<uint32_t>(f.world_size);
  c.servers = List(f.servers);
  c.peers = List(f.peers);
  c.listen = f.listen;
  c.scheme = f.scheme;
  c.transport = f.transport;
  c.wire = f.wire;
  c.plan_lossy_wire = f.plan_lossy_wire;
  c.wire_check_every = static_cast<uint32_t>(f.wire_check_every);
  c.wire_max_error = f.wire_max_error;
  c.lowrank_rank = static_cast<int32_t>(f.lowrank_rank);
  c.lowrank_warmup = static_cast<uint32_t>(f.lowrank_warmup);
  c.lowrank_max_held = f.lowrank_max_held;
  c.replicas = static_cast<uint32_t>(f.replicas);
  c.checkpoint_every = static_cast<uint64_t>(f.checkpoint_every);
  c.checkpoint_at_end = f.checkpoint_at_end;
  c.resumed_iteration = static_cast<uint64_t>(f.resumed_iteration);
  c.lost_servers = *ParseServerIndices(f.lost_servers);  // validated by the schema
  c.rejoin_timeout = f.rejoin_timeout;
  c.rejoin = f.rejoin;
  if (!f.rejoin_if_restarted.empty()) {
    c.joined_marker = absl::StrCat(f.rejoin_if_restarted, "/poseidon-", c.job_id, "-", c.rank,
                                   ".joined");
    std::error_code error;
    if (std::filesystem::exists(c.joined_marker, error)) {
      PSD_LOG_WARN("{} exists: this agent restarts rank {} of job {} and takes up the running "
                   "job (--rejoin)",
                   c.joined_marker, c.rank, c.job_id);
      c.rejoin = true;
    }
  }
  c.min_workers = static_cast<uint32_t>(f.min_workers);
  c.bandwidth_bytes_per_second = f.bandwidth;
  c.colocated = f.colocated;
  c.allreduce = f.allreduce;
  c.block_bytes = f.block_bytes;
  c.credit_bytes = f.credit_bytes;
  c.fusion = f.fusion;
  c.bucket_bytes = f.bucket_bytes;
  c.allreduce_bucket_bytes = f.allreduce_bucket_bytes;
  c.probe_bytes = f.probe_bytes;
  c.capacity_min_bytes = f.capacity_min_bytes;
  c.sync_threads = static_cast<int>(f.sync_threads);
  c.priority = f.priority;
  c.sync_timeout = f.sync_timeout;
  c.attach_timeout = f.attach_timeout;
  c.connect_timeout = f.connect_timeout;
  c.coordinator = f.coordinator;
  c.coordinator_token = f.coordinator_token;
  c.coordinator_tls = poseidon::coordinator::CoordinatorTls(f);
  c.data_tls = poseidon::transport::DataTls(f);
  c.metrics_listen = f.metrics_listen;
  c.timeline = f.timeline;
  c.stall_timeout = f.stall_timeout;
  c.telemetry_interval = f.telemetry_interval;
  c.peer_timeout = f.peer_timeout;
  if (c.rank >= c.world_size) {
    std::fprintf(stderr, "poseidon-agent: rank %u must be below world_size %u\n", c.rank,
                 c.world_size);
    return 2;
  }
  if (c.data_tls.enabled && c.scheme == "allreduce") {
    std::fprintf(stderr,
                 "poseidon-agent: --scheme=allreduce cannot run with data_tls: ring all-reduce "
                 "goes through Gloo, whose transport (Debian's libgloo) has no TLS\n");
    return 2;
  }
  if (!c.peers.empty() && c.peers.size() != c.world_size) {
    std::fprintf(stderr, "poseidon-agent: --peers has %zu entries for world_size %u\n",
                 c.peers.size(), c.world_size);
    return 2;
  }
  return poseidon::agent::RunAgent(c);
}
