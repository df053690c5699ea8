// A deterministic discrete-event simulation of BSP data-parallel training under Poseidon: N
// workers' per-layer forward and backward compute, wait-free backpropagation, each agent's
// scheduler (priority, credit), the plan's scheme per layer from the planner (PS with P2 servers,
// colocated or not; SFB all-to-all; ring all-reduce), and a network of full-duplex host links
// into one output-queued switch. It answers "what iteration time on N machines" where the
// planner's closed form (time_model.h) does not see overlap, priority, incast, per-message cost
// or jitter. Thread-safety: Simulate is a pure function of its arguments, safe from any thread.
#pragma once

// The model (docs/simulator.md has it with its limits):
//   - Hosts. Colocated: host i runs worker i and server i. Otherwise workers on hosts 0..P1−1 and
//     servers on hosts P1..P1+P2−1. Every host has an uplink (to the switch) and a downlink (the
//     switch's output port to the host), each of `bandwidth` bytes/s, FIFO. Every message first
//     costs its sender alpha (the per-message overhead: agent or server CPU, syscalls, framing),
//     one message after another on that host, pipelined with the link; then S/B on the sender's
//     uplink; it reaches the switch `latency` after its first byte left, queues at the
//     destination's port (FIFO in order of arrival: incast shows as queueing there) and is
//     delivered when its last byte has crossed the port: at max(port start + S/B, uplink end +
//     latency) (cut-through). A message's CPU work is alpha plus cpu_seconds_per_byte per byte
//     at its sender and cpu_seconds_per_byte per byte at its receiver (after the link, one
//     message after another per host); with shared_cpus = k the work of all hosts shares k CPUs
//     (an emulated cluster on one machine: each piece takes the earliest free stretch of one of
//     them, sim/shared_cpus.h), otherwise each host has its own. With link_burst_bytes every
//     link is a token bucket instead (the emulated cluster's tc tbf): what its bucket holds
//     crosses at once. Traffic between a worker and the server on its own host costs alpha and
//     no link.
//   - Compute. Per layer, forward and backward seconds from the planner (the spec's measured times,
//     or FLOPs × K / GPU rate: time_model.h LayerComputeSeconds), each multiplied by the jitter
//     (one factor per worker and iteration, one per layer pass) plus a fixed overhead per pass.
//     Forward of layer l in iteration t+1 waits for layer l's synchronisation of iteration t.
//     With WFBP each layer is posted when its backward ends; without, all after the backward.
//   - Agent. Per worker one scheduler (agent/scheduler.h): tasks in priority order (layer index;
//     FIFO among equals), started when their bytes fit in the credit or everything in flight is
//     parked. PS: one task per chunk of the planner's partition (partition.h): push to the
//     chunk's server, credit parked when the push is acknowledged, returned when the pull answer
//     arrives. Consecutive small PS layers of one chunk are fused into buckets as the agent does
//     (agent/layer_table.cc FormBuckets). SFB: one task sends the layer's factors to every peer,
//     parks when sent, returns when all peers' factors arrived; the rebuild (2·K·M·N·P1 FLOPs) runs
//     at the GPU rate. Ring all-reduce: when every worker posted the layer, one collective at a
//     time of time_model.h AllreduceSeconds with steps of max(latency, alpha); it does not share
//     the links with PS and SFB traffic. The agents' all-reduce buckets (the plan report's,
//     PlannerConfig::allreduce_bucket_bytes) are one collective each, of the members' bytes and
//     one set of steps, once every worker posted the first (lowest-index) member.
//   - Servers. BSP: a key's pull answers for clock t leave (one message per worker, in the order
//     the pushes arrived) once all P1 pushes of t are in; with replicas = k, once the key's
//     bytes went to each of the next k servers (its backups) and their acknowledgements (one
//     latency, no bytes) are back.
//   - Measures, as bench/synth reports them: per worker (backward end of the last iteration plus
//     its final waits − backward end of the first) / (iterations − 1), the slowest worker's.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/planner/planner.h"
#include "poseidon/v1/model.pb.h"

namespace poseidon::sim {

enum class JitterKind { kNone, kNormal, kLognormal };

// The agents' --scheme: the plan's schemes (auto), PS for every layer (FC layers get no factor
// buffers, which changes the buckets), or the ring for every layer.
enum class AgentScheme { kAuto, kPs, kAllreduce };

// Multiplicative compute noise with mean 1: normal max(0, 1 + σZ) or lognormal exp(σZ − σ²/2).
struct JitterModel {
  JitterKind kind = JitterKind::kNone;
  double iteration_sigma = 0;  // one factor per worker and iteration (shared by its layers)
  double layer_sigma = 0;      // one factor per layer pass
};

inline constexpr uint32_t kMaxSharedCpus = 4096;
// Framing: IPv4 and TCP (with timestamps) headers per segment; the smallest and largest MTU.
inline constexpr uint32_t kTcpIpHeaderBytes = 52;
inline constexpr uint32_t kMinMtu = 576;
inline constexpr uint32_t kMaxMtu = 65535;

struct SimOptions {
  uint32_t iterations = 20;  // >= 2; the first is warm-up
  AgentScheme scheme = AgentScheme::kAuto;
  bool wfbp = true;
  bool priority = true;  // false: tasks in the order they are posted (agent --priority=false)
  uint64_t credit_bytes = uint64_t{64} << 20;  // agent --credit_bytes
  // agent --fusion: the plan's buckets (LayerPlan.bucket, within Plan.max_chunk_bytes), or when
  // false runs of at most bucket_bytes (--fusion=bytes; 0: no fusion, --fusion=off).
  bool fusion_from_plan = true;
  uint64_t bucket_bytes = uint64_t{512} << 10;  // agent --bucket_bytes
  double alpha_seconds = 0;                     // per message, at its sender
  // The cost of one ring all-reduce step, as the agents measure it (Gloo's per-message work and
  // the threads': a 1-element all-reduce / 2 (P1 - 1)); each step of a collective costs at least
  // this, the latency and alpha.
  double allreduce_step_seconds = 0;
  // With shared_cpus: the CPU work of one ring step at each rank (Gloo's threads, the
  // syscalls), which every rank's steps put on the shared CPUs; a collective ends no earlier than
  // its ranks' work there. 0: none (a real cluster's step holds it: allreduce_step_seconds).
  double allreduce_cpu_seconds_per_step = 0;
  // CPU per byte of a message at each end, the sender's beside alpha before its link, the
  // receiver's (one message after another per host) before it counts as delivered: copies,
  // checksums, the TCP stack, a server's summation.
  double cpu_seconds_per_byte = 0;
  // 0: every host has CPUs of its own (a real cluster). k > 0: that CPU work of every host
  // (alpha and per byte, sending and receiving) runs on k CPUs they share, first come first
  // served: an emulated cluster whose hosts are processes on one k-CPU machine.
  uint32_t shared_cpus = 0;  // at most kMaxSharedCpus
  // With shared_cpus: the CPU each host spends whatever the job does (an emulated host's
  // timers, heartbeats, polls), as a fraction of one CPU. The hosts' load takes that share of
  // every shared CPU: a piece of work of w seconds holds one for w / (1 − hosts · load / k).
  // hosts · load must stay below k.
  double host_cpu_load = 0;
  // Every link's token bucket (tc tbf, as bench/cluster shapes its links): after idling, a link
  // sends up to this many bytes at once, then at its rate. 0: a plain rate (a switch port).
  uint64_t link_burst_bytes = 0;
  // Framing: a message of S bytes crosses a link as TCP segments of at most mtu − 52 bytes
  // (IPv4, TCP with timestamps), each with 52 + frame_overhead_bytes more on the link (Ethernet
  // on the wire: 38 — header, FCS, preamble, gap; bench/cluster's tc tbf counts the 14 of the
  // header). The ring's bytes pay the same share. mtu 0: the link rate is the payload rate.
  uint32_t mtu = 0;
  uint32_t frame_overhead_bytes = 0;
  double compute_overhead_seconds = 0;          // added to every layer's forward and backward
  // CPU work of each layer pass (forward and backward) at its worker's host, after the pass's
  // compute: in an emulated cluster the worker's wake-up and gradient write and the agent's
  // handling of its event, which with shared_cpus take their turn on the shared CPUs (a pass
  // ends when its work is done). 0: none (a real cluster's GPU compute holds it).
  double pass_cpu_seconds = 0;
  bool sfb_rebuild = true;                      // count the SFB rebuild at the GPU rate
  // Backups per PS key (agent --replicas; capped at servers - 1): a completed clock goes to each
  // backup, and its answers leave once every backup acknowledged it (docs/server.md).
  uint32_t replicas = 0;
  JitterModel jitter;
  uint64_t seed = 1;
};

// Where one iteration of a worker goes: compute + exposed + waiting = the iteration (period).
struct Breakdown {
  double compute_seconds = 0;
  // Forward stalls on a layer whose synchronisation was under way with every worker's part
  // posted: the communication the overlap did not hide.
  double exposed_seconds = 0;
  // Forward stalls while some worker had not yet posted the layer (BSP: waiting for a straggler).
  double waiting_seconds = 0;
};

struct SimResult {
  uint32_t workers = 0;
  uint32_t servers = 0;
  // bench/synth's figure (final waits included), the slowest worker's.
  double iteration_seconds = 0;
  // Steady period between backward ends, the slowest worker's (no final wait).
  double period_seconds = 0;
  Breakdown breakdown;  // the slowest worker's, per iteration, over iterations 2..T
  uint32_t sfb_layers = 0;
  uint32_t allreduce_layers = 0;
  uint32_t tasks_per_iteration = 0;  // one worker's scheduler tasks (chunks, buckets, SFB layers)
  uint64_t messages = 0;
  // The CPU work of messages (alpha and per byte, both ends), summed over every host, per
  // iteration.
  double cpu_seconds_per_iteration = 0;
  uint64_t events = 0;
  // The longest FIFO seen at a switch output port (messages waiting or crossing) and its host.
  uint32_t max_port_queue = 0;
  uint32_t max_port_queue_host = 0;
  double link_busy_fraction = 0;  // the busiest link's busy time / simulated time
};

// Simulates `options.iterations` iterations of `model` on the cluster of `config` (the plan is
// BuildPlan(model, config); every layer's compute time must be known: measured times in the spec
// or FLOPs and config.gpu). Scheme overrides in config force schemes as `poseidon plan --set`.
absl::StatusOr<SimResult> Simulate(const poseidon::v1::ModelSpec& model,
                                   const planner::PlannerConfig& config,
                                   const SimOptions& options);

}  // namespace poseidon::sim
