// HybComm's cost model (DESIGN.md, "HybComm: the cost model"): how many bytes one layer moves per
// iteration under parameter-server (PS) and sufficient-factor broadcasting (SFB), and the rule that
// picks between them. Thread-safety: pure functions of their arguments, safe from any thread.
#pragma once

// The table, for P1 workers, P2 servers, per-worker batch K and a layer of S parameters (an FC
// layer has S = M·N), in elements per iteration (bytes = elements × element size):
//
//   scheme | per server   | per worker        | per machine, servers colocated with workers
//   PS     | 2·P1·S/P2    | 2·S               | 2·S·(P1+P2−2)/P2
//   SFB    | 0            | 2·K·(P1−1)·(M+N)  | 2·K·(P1−1)·(M+N)
//   AR     | 0            | 4·S·(P1−1)/P1     | 4·S·(P1−1)/P1
//   PS-16  | PS's, in 2-byte elements: bfloat16 or fp16 on the wire (lossy, error feedback)
//   AR-16  | AR's, in 2-byte elements (each rank sums its shard in float32: no rounding on a hop)
//   AR-LR  | AR's of (M'+N')·r elements, in two all-reduces (PowerSGD's P and Q; M'×N' the
//          | tensor as a matrix: its first dimension by the rest)
//
// PS: each worker pushes its S-element gradient and pulls S elements back (2·S); the servers share
// the layer evenly, so each receives S/P2 from every worker and sends S/P2 back to each
// (2·P1·S/P2). On a machine that hosts one worker and one server, the worker's 1/P2 share to its
// own server and that server's traffic with its own worker stay local: 2·S·(P2−1)/P2 +
// 2·S·(P1−1)/P2. SFB: each worker sends its K pairs of factors (u ∈ R^M, v ∈ R^N) to each of the
// P1−1 other workers and receives theirs; no server is involved, so a machine moves what its worker
// moves. AR (ring all-reduce, P1 > 1): reduce-scatter then all-gather, each worker sends and
// receives S/P1 elements in each of 2·(P1−1) steps: the bytes of colocated PS with P2 = P1, without
// the servers (and their incast), at the price of 2·(P1−1) message latencies instead of two. AR
// is not part of the bytes rule below (the paper's); the time rule (planner.h) weighs it.
// PS-16 (issue 15, "Wire precision"): PS with every push and pull in a 16-bit type, half the
// bytes of float32 (of any element size: the agents' buffers and the exact wire are float32),
// at the price of the casts (WireCastSecondsPerElement) and of being lossy: a column only when
// the job allows it (PlannerConfig::lossy_wire, wire_overrides). AR-16 is all-reduce's
// counterpart (agent/allreduce_syncer.cc: 16-bit shards to their owners, float32 sums, 16-bit
// sums back), at the same casts; SFB layers stay float32. AR-LR (issue 15, "Low rank";
// agent/lowrank.h): an all-reduce layer's gradient as rank-r factors, two all-reduces (twice the
// ring's steps) of (M'+N')·r elements instead of one of M'·N', at the price of the agent's
// arithmetic (LowRankSecondsPerElement) and of being lossy: a column only when the job allows a
// rank (PlannerConfig::lowrank_rank) and the rank shrinks the tensor (common/lowrank_shape.h).
//
// The selection rule (Poseidon's, between PS and SFB): an FC layer uses SFB when its SFB cost is at most its PS cost,
// where the two numbers compared are those of the busiest link that differs between the schemes,
// the network interface of one worker machine:
//   - colocated:     SFB per worker  2·K·(P1−1)·(M+N)  <=  PS per machine  2·M·N·(P1+P2−2)/P2
//   - not colocated: SFB per worker  2·K·(P1−1)·(M+N)  <=  PS per worker   2·M·N
// (not colocated, the servers' interfaces carry PS traffic too, but SFB never touches them, so a
// worker's own interface is the only place where the two schemes compete). The comparison is made
// exactly in integers, colocated multiplied through by P2, so boundary cases (equality) are
// decided exactly. With P1 = P2 = P colocated it is K·(P−1)·(M+N) <= M·N·2·(P−1)/P, i.e. (for
// P > 1) P <= 2·M·N / (K·(M+N)); for fc7 of VGG (4096×4096) at K = 32 that is P <= 128. With a
// single worker SFB moves nothing and is chosen. Every other kind (conv, bias, other) uses PS.

#include <cstdint>
#include <optional>
#include <string_view>

#include "poseidon/v1/model.pb.h"
#include "poseidon/v1/plan.pb.h"

namespace poseidon::planner {

// The cluster as the cost model sees it.
struct ClusterShape {
  uint32_t workers = 1;           // P1
  uint32_t servers = 1;           // P2
  uint32_t batch_per_worker = 1;  // K
  bool colocated = false;         // every worker machine also runs a server
};

// Numbers moved per iteration by one scheme for one layer (elements or bytes, as stated).
struct SchemeVolume {
  double per_worker = 0;
  double per_server = 0;
  // Through the interface of one machine hosting a worker and a server (colocated clusters).
  double per_machine = 0;
};

// PS volume of a layer with `parameters` elements, in elements.
SchemeVolume PsElements(uint64_t parameters, const ClusterShape& cluster);

// SFB volume of an M×N FC layer, in elements.
SchemeVolume SfbElements(uint64_t m, uint64_t n, const ClusterShape& cluster);
// Ring all-reduce volume of a layer with `parameters` elements, in elements (P1 > 1).
SchemeVolume AllreduceElements(uint64_t parameters, const ClusterShape& cluster);

// The rule above for an M×N FC layer: true when SFB costs at most as much as PS.
bool SfbNoCostlierThanPs(uint64_t m, uint64_t n, const ClusterShape& cluster);

// The volume the selection rule compares: per machine when colocated, per worker otherwise.
double ComparedVolume(const SchemeVolume& volume, bool colocated);

// What one element costs in casts on a lossy wire, summed over its trips: the agent's encode with
// error feedback, the server's decode into the float32 sum, the server's encode of the result
// with feedback and the agent's decode (common/wire_codec.h). Measured on this project's 2-vCPU
// build host with `build/release/bench/poseidon-bench-wire-codec` (docs/benchmarks.md, "Wire
// precision"): 1.8-2.0 ns for bfloat16 (shifts), 6.6-7.3 ns for fp16 (re-biasing, subnormals).
inline constexpr double kBf16CastSecondsPerElement = 2e-9;
inline constexpr double kF16CastSecondsPerElement = 7e-9;
// What one gradient element costs in low rank's arithmetic on the agent's CPU (the three
// products, Gram-Schmidt and the error feedback of one step; memory-bound, so nearly the same
// for ranks 1 to 8). Measured on this project's 2-vCPU build host with
// `build/release/bench/poseidon-bench-lowrank` (docs/benchmarks.md, "Low rank"): 3.4-5.1 ns.
inline constexpr double kLowRankSecondsPerElement = 5e-9;
// 0 for F32 (and anything not lossy).
double WireCastSecondsPerElement(poseidon::v1::ElementType wire);
// BF16 or F16 (proto/wire_type.h's mapping).
bool IsLossyWire(poseidon::v1::ElementType wire);
// A volume in elements as bytes of `element_bytes` each.
SchemeVolume ScaleVolume(SchemeVolume volume, uint64_t element_bytes);
// "fp32" (F32 or UNSPECIFIED), "bf16", "fp16" (common/wire_codec.h's names), "?" otherwise.
const char* WireTypeName(poseidon::v1::ElementType wire);
// The inverse, for flags: "fp32" (or "none") -> F32, "bf16" -> BF16, "fp16" -> F16; nullopt
// otherwise.
std::optional<poseidon::v1::ElementType> ParseWireType(std::string_view name);

// One layer's costs under both schemes, in bytes, and the scheme the rule picks.
struct LayerCost {
  uint64_t parameters = 0;
  uint64_t element_bytes = 0;
  SchemeVolume ps_bytes;
  // PS with a 16-bit wire (set by the planner when the job allows a lossy wire for the layer).
  std::optional<SchemeVolume> ps_lossy_bytes;
  // What the layer's PS pushes and pulls or all-reduce carry: F32 (exact), or BF16 / F16 when
  // the planner chose the PS-16 or AR-16 column (the layer's scheme is then PS or all-reduce).
  poseidon::v1::ElementType wire = poseidon::v1::ELEMENT_TYPE_F32;
  std::optional<SchemeVolume> sfb_bytes;  // FC layers only
  std::optional<SchemeVolume> allreduce_bytes;  // P1 > 1 only
  // All-reduce with a 16-bit wire (set by the planner when the job allows a lossy wire for the
  // layer and all-reduce is possible).
  std::optional<SchemeVolume> allreduce_lossy_bytes;
  // All-reduce at low rank: both factors' all-reduces (set by the planner when the job allows a
  // rank that shrinks the layer and all-reduce is possible), and the rank the layer goes at when
  // it runs all-reduce (0: none; LayerPlan.lowrank_rank: where AR-LR beats the other all-reduce
  // columns, whatever scheme the plan chose, so that an agent forcing all-reduce follows it; on
  // all-reduce the layer's wire is then float32).
  std::optional<SchemeVolume> allreduce_lowrank_bytes;
  uint32_t lowrank = 0;
  poseidon::v1::SyncScheme scheme = poseidon::v1::SYNC_SCHEME_PS;
};

// The cost of a layer that ValidateModelSpec accepted (shape non-empty, FC exactly [M, N]) with a
// known element size.
LayerCost CostOfLayer(const poseidon::v1::LayerSpec& layer, uint64_t element_bytes,
                      const ClusterShape& cluster);

}  // namespace poseidon::planner
