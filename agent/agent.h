// poseidon-agent: the per-GPU sidecar (DESIGN.md, "Processes"). It owns the shared-memory
// channel to one training process, plans the model's layers (HybComm), and synchronises each
// layer as soon as the framework posts it ready (wait-free backpropagation), by the syncer its
// schedule names for that iteration (agent/syncer.h: PS chunk by chunk against the KV servers,
// SFB by broadcasting the sufficient factors and rebuilding the sum with a GEMM, fused buckets);
// the scheduler (agent/scheduler.h) decides what goes next by priority and credit. With a
// coordinator, new plan epochs switch layers between schemes at their effective iteration.
// Thread model: Run() is the main thread (events, liveness, plan changes); the scheduler's
// sync_threads workers run the tasks; a watcher thread waits for plan epochs, the heartbeat and
// telemetry threads report; transport I/O threads complete transfers. See docs/thread_model.md.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/tls.h"
#include "transport/tcp/tcp_context.h"

namespace poseidon::agent {

struct AgentConfig {
  std::string segment;  // "/poseidon-<job>-<rank>" when empty
  uint64_t job_id = 1;
  // The data plane's keys (transport/credentials.h): the job's secret, from which the agent
  // derives its own, or its keyring (what poseidon run hands it; then it never sees the secret).
  // Exactly one is set.
  std::string secret;
  std::string keyring;
  uint32_t rank = 0;
  // This worker's index on its host (its GPU): with the host name, the agent's identity at the
  // coordinator (a rank asked for again from another host or GPU is refused, not taken as a
  // restart). Negative: the rank.
  int64_t local_rank = -1;
  uint32_t world_size = 1;
  std::vector<std::string> servers;  // KV servers, in plan order
  std::vector<std::string> peers;    // every agent's SFB address, rank order (may be empty: no SFB)
  std::string listen;                // our SFB address (peers[rank] when empty)
  std::string scheme = "auto";       // auto (HybComm), ps, sfb, allreduce
  // The data plane (docs/operations.md "Transport"): "auto" (RDMA and TCP where an RDMA device
  // is usable, else TCP; without a coordinator TCP), "tcp", or "rdma" (only; refused, exit 2,
  // without a usable device). With both, each server and peer is reached by RDMA when it
  // advertises an RDMA endpoint, else by TCP.
  std::string transport = "auto";
  // What PS pushes and pulls carry: "plan" (each layer's LayerPlan.wire_type: float32 unless
  // the job allows a lossy wire and the cost model chose it), or for every layer "fp32" (exact),
  // "bf16" or "fp16" (half the bytes, lossy, with error feedback on both ends; the sum rule
  // only). A job setting: every rank must give the same (the servers refuse a registration that
  // differs).
  std::string wire = "plan";
  // Without a coordinator, the job setting its local plan gets (the coordinator's
  // --plan_lossy_wire otherwise): "none" (exact), "bf16" or "fp16" (allowed where it pays).
  std::string plan_lossy_wire = "none";
  // The divergence guard of a lossy wire (agent/wire_guard.h): on clock 1 and every
  // wire_check_every-th clock (0: off), a key whose 16-bit encoding is further than
  // wire_max_error (relative L2) from its gradient falls back to float32 for the rest of the job.
  uint32_t wire_check_every = 100;
  double wire_max_error = 0.05;
  // Low rank (PowerSGD, agent/lowrank.h) of the first plan's all-reduce layers whose 2-D view it
  // shrinks: -1 the plan's (LayerPlan.lowrank_rank: 0 unless the job allows it), 0 off, r > 0
  // rank r for every such layer (lossy, error feedback; the sum rule only). The first
  // lowrank_warmup all-reduces of each are exact. Its divergence guard, on the guard's clocks
  // (wire_check_every), sums the ranks' residuals and gradients: past lowrank_max_held times the
  // gradient's norm held back, the layer falls back to the exact all-reduce. Every rank the same.
  int32_t lowrank_rank = -1;
  uint32_t lowrank_warmup = 10;
  double lowrank_max_held = 8.0;
  // Replication (DESIGN.md "Faults"): every PS key is also held by the next `replicas` servers
  // (capped at servers - 1), which its primary keeps up to date each clock before answering it;
  // when a server is lost, its keys go on at the next one, which holds every answered clock. A
  // job setting: every rank the same.
  uint32_t replicas = 1;
  // Checkpoints (rank 0's agent asks every KV server, docs/server.md "Checkpoints"): after
  // every checkpoint_every-th iteration (0: none), between that iteration and the next, and with
  // checkpoint_at_end when the training process detaches cleanly, each server writes every
  // key's completed state, labelled with the job's iteration. resumed_iteration: the label the
  // job resumed from (0: a new job); the training process's iteration 1 then re-reads it, so
  // its iteration i is the job's i + resumed_iteration - 1.
  uint64_t checkpoint_every = 0;
  bool checkpoint_at_end = false;
  uint64_t resumed_iteration = 0;
  // The KV servers (indices in the plan's order) lost before the checkpoint the job resumes
  // from: their files are older than the others', whose files hold copies of their keys (a
  // checkpoint after a loss is written by the servers left). They are not connected; their keys
  // start at the next server of their chains, as for a server lost at start. Needs replicas.
  std::set<uint32_t> lost_servers;
  // Elastic workers (docs/operations.md "A rank rejoins"): a rank that dies is waited for this
  // long — by the KV servers (a job setting, sent with the tables: every rank the same) and by
  // this agent when the coordinator declares it dead — so that it can be restarted and rejoin
  // without anyone rolling back; zero: the iterations that need it fail at once. rejoin: this
  // agent replaces a dead rank of the running job: its layers' clocks start at the servers'
  // (the lowest key's) and the training process is told which iteration it takes up
  // (psd_start_iteration). Every layer must go by PS under the sum rule.
  absl::Duration rejoin_timeout = absl::ZeroDuration();
  bool rejoin = false;
  // --rejoin_if_restarted: the file this agent creates once its rank is in the job (its tables
  // registered on the KV servers); an agent started while it exists rejoins. Empty: none.
  std::string joined_marker;
  // The world shrinking: a dead rank given up (once rejoin_timeout is over) is removed while at
  // least this many ranks are left — by the KV servers (a job setting sent with the tables) and
  // by this agent, which then goes on instead of failing (its SFB layers agree with the other
  // agents on the last iteration that counts it); 0: never. PS or SFB layers, no all-reduce.
  uint32_t min_workers = 0;
  double bandwidth_bytes_per_second = 1.25e9;
  bool colocated = true;
  bool allreduce = true;  // ring all-reduce may be planned (needs a coordinator and 2+ ranks)
  uint64_t block_bytes = uint64_t{4} << 20;
  uint64_t credit_bytes = uint64_t{64} << 20;
  // Fusion of consecutive small PS layers (each a single chunk) into one key, synchronised once
  // all of them are ready: "plan" (the plan's buckets: the planner decides from the per-key
  // cost and the overlap lost, docs/planner.md "Fusion"), "bytes" (runs of at most bucket_bytes)
  // or "off".
  std::string fusion = "plan";
  uint64_t bucket_bytes = uint64_t{512} << 10;
  // Fusion of consecutive all-reduce layers (host memory, adjacent in the data segment) into one
  // collective of at most this many bytes, once all of them are ready: DDP's bucket_cap_mb (25
  // MiB). 0: one collective per layer. Every rank the same.
  uint64_t allreduce_bucket_bytes = uint64_t{25} << 20;
  // With a coordinator: each KV server link is measured with a probe of this many bytes (a PING
  // payload the server drops) after the rendezvous and reported as a capacity sample, so that
  // the first plan uses the measured bandwidth (0: off; --bandwidth is then the assumption).
  uint64_t probe_bytes = uint64_t{4} << 20;
  // A telemetry window reports a link capacity only after this many bytes of large pull
  // responses (fewer say little about the rate).
  uint64_t capacity_min_bytes = uint64_t{1} << 20;
  int sync_threads = 8;
  // false: tasks run in the order layers become ready (no priority), for comparisons.
  bool priority = true;
  absl::Duration sync_timeout = absl::Seconds(60);
  absl::Duration attach_timeout = absl::Seconds(120);
  absl::Duration connect_timeout = absl::Seconds(60);
  // With a coordinator, rank, peers, servers and the plan come from it (rendezvous and model
  // registration); `listen` must then be a concrete address the peers can reach.
  std::string coordinator;
  std::string coordinator_token;
  coordinator::ClientTlsOptions coordinator_tls;  // the coordinator_tls* settings
  transport::TlsOptions data_tls;                 // the data_tls* settings (TCP data plane)
  // Observability: Prometheus /metrics address (empty: not served), Chrome-trace timeline file
  // (empty: off), and how long a layer may take before the stall detector reports what it waits
  // for.
  std::string metrics_listen;
  std::string timeline;
  absl::Duration stall_timeout = absl::Seconds(10);
  // With a coordinator: how often to report per-link bytes and per-layer sync times to it
  // (ReportTelemetry; `poseidon status` shows them). Zero: never.
  absl::Duration telemetry_interval = absl::Seconds(5);
  // Liveness on the data plane: the agent pings each server and peer every peer_timeout / 3,
  // and a peer agent that sent nothing for peer_timeout (frozen, or cut off) is declared gone:
  // the layers waiting for its factors fail naming it (servers do the same for pushes, with
  // their own --peer_timeout). Zero: neither.
  absl::Duration peer_timeout = absl::Seconds(15);
};

// Runs until the framework detaches (0), dies (3), a stop is requested (0), or a fatal error
// (1). Never throws.
int RunAgent(const AgentConfig& config);

// Asks a running agent to stop cleanly (the framework's waits then report the agent lost).
// Async-signal-safe: meant for a SIGTERM/SIGINT handler.
void RequestAgentStop();

}  // namespace poseidon::agent
