// The coordinator's state machine: registered nodes, each job's world, model, plans and
// re-planning from telemetry, and liveness; time is passed in, so tests can drive it.
// Thread-safety: not thread-safe. CoordinatorService calls it under its one mutex.

// It answers requests whose callers the service already authenticated and validated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "coordinator/planner/planner.h"
#include "coordinator/store_limits.h"
#include "coordinator/telemetry.h"
#include "poseidon/v1/coordinator.pb.h"

namespace poseidon::coordinator {

// The caller of a request, as authentication established it.
struct Caller {
  // The job whose token the caller presented; empty for the cluster token (cluster scope:
  // servers that serve every job, status of every job).
  std::string job_id;
};

// How the registry plans and judges liveness. docs/operations.md ("Coordinator") explains each.
struct RegistryOptions {
  // A node silent for longer than this is declared dead.
  absl::Duration lease = absl::Seconds(15);
  // How often nodes are asked to heartbeat; zero: lease / 5.
  absl::Duration heartbeat_interval = absl::ZeroDuration();
  // A job's world forms only when at least this many servers are available to it.
  uint32_t min_servers = 1;
  // The network the planner assumes until telemetry measures it.
  double nominal_bandwidth_bytes_per_second = 10e9 / 8;
  double nominal_latency_seconds = 50e-6;
  bool colocated = false;
  uint64_t block_bytes = planner::kDefaultBlockBytes;
  // K for every layer; 0 takes each layer's batch_per_worker from the registered model.
  uint32_t batch_per_worker = 0;
  planner::SchemeRule scheme_rule = planner::SchemeRule::kTime;
  planner::FusionRule fusion = planner::FusionRule::kCost;
  // The lossy wire a PS or all-reduce layer may use where it pays (PlannerConfig::lossy_wire;
  // F32: none).
  poseidon::v1::ElementType lossy_wire = poseidon::v1::ELEMENT_TYPE_F32;
  // The low rank an all-reduce layer may be sent at where it pays (PlannerConfig::lowrank_rank;
  // 0: none).
  uint32_t lowrank_rank = 0;
  // Per-layer ranks forced instead of the rule's (PlannerConfig::lowrank_overrides): r > 0 that
  // layer by all-reduce at rank r, 0 never low rank. A name the job's model lacks fails its plan.
  std::map<std::string, uint32_t, std::less<>> lowrank_overrides;
  // The time rule may choose ring all-reduce (from the agents' measured step); off, only
  // --scheme=allreduce and operator overrides put layers on it.
  bool allreduce_by_cost = false;
  // Re-plan only when the measured bandwidth differs from the current plan's by more than this
  // fraction (and the new plan's schemes differ).
  double replan_threshold = 0.2;
  // At least this long between a plan's installation and the next re-plan from telemetry: a
  // change measured sooner is re-evaluated once the interval has passed (ReplanDue), not lost.
  absl::Duration replan_min_interval = absl::Seconds(10);
  // A re-plan takes effect at
  //   ceil(last + rate * (now - last_at) + rate * plan_lead_time) + plan_lead_iterations
  // where last is the highest iteration any agent of the job reported (heartbeat or telemetry),
  // last_at when it was first reported, and rate the job's iterations per second over
  // iteration_rate_window (0 until the samples span at least a second): the estimate of where
  // the job is now, plus the time the agents need to learn the plan, plus a margin. It is always
  // above the current plan's effective iteration.
  uint64_t plan_lead_iterations = 10;
  absl::Duration plan_lead_time = absl::Seconds(2);
  // Instead of plan_lead_iterations while the job trains but its rate is not known yet (its
  // samples span less than a second): an agent that learns a plan after its effective iteration
  // cannot switch exactly and stops, so without a rate the margin is wide.
  uint64_t plan_unknown_rate_lead_iterations = 200;
  absl::Duration iteration_rate_window = absl::Seconds(30);
  // Link samples and agents' reports older than this are ignored.
  absl::Duration telemetry_max_age = absl::Seconds(60);
  // An achieved-throughput sample counts for the planner only if its window moved at least this
  // many bytes in its busier direction, and then only as a lower bound of the link's bandwidth
  // (docs/planner.md, "Measured bandwidth").
  uint64_t telemetry_min_bytes = uint64_t{16} << 20;
  // Dead and departed nodes stay visible in status this long (unless a job still refers to them).
  absl::Duration retention = absl::Minutes(10);
  // At most this many nodes (alive or remembered); registration beyond: RESOURCE_EXHAUSTED.
  size_t max_nodes = 100000;
};

class Registry {
 public:
  // `incarnation` distinguishes this coordinator's node ids from another run's.
  Registry(RegistryOptions options, std::string incarnation);

  const RegistryOptions& options() const { return options_; }
  absl::Duration heartbeat_interval() const;
  uint64_t membership_epoch() const { return membership_epoch_; }
  // Increases on every change a waiting call may be waiting for.
  uint64_t version() const { return version_; }

  // The response header for a caller of `job_id`.
  void FillHeader(absl::string_view job_id, poseidon::v1::ResponseHeader* header) const;

  absl::Status RegisterServer(const Caller& caller,
                              const poseidon::v1::RegisterServerRequest& request, absl::Time now,
                              poseidon::v1::RegisterServerResponse* response);
  absl::Status RegisterAgent(const Caller& caller,
                             const poseidon::v1::RegisterAgentRequest& request, absl::Time now,
                             poseidon::v1::RegisterAgentResponse* response);

  // Calls that may wait: Try* returns true with the answer filled when the call can complete,
  // false while it has to wait, or an error when it cannot succeed by waiting.

  // Complete when every rank of the node's job is held by a live agent and the job's servers are
  // known (a formed world).
  absl::StatusOr<bool> TryRendezvous(const Caller& caller, absl::string_view node_id,
                                     absl::Time now, poseidon::v1::RendezvousResponse* response);
  // One line naming what a job's world lacks: missing ranks (never registered, dead, departed)
  // and servers.
  std::string DescribeIncompleteWorld(absl::string_view job_id, absl::Time now) const;

  // Stores the job's model (the first registration) or checks a rank's against it.
  absl::Status RegisterModel(const Caller& caller,
                             const poseidon::v1::RegisterModelRequest& request, absl::Time now);
  // Complete when the world is formed, every rank registered the same model, and the plan exists.
  absl::StatusOr<bool> TryModelPlan(const Caller& caller, absl::string_view node_id, absl::Time now,
                                    poseidon::v1::Plan* plan);
  // One line naming why a job has no plan (world, ranks without the model, refusals).
  std::string DescribeMissingPlan(absl::string_view job_id, absl::Time now) const;

  // Complete when the job has a plan (of at least `min_epoch`, when given). Without min_epoch and
  // without a plan: FAILED_PRECONDITION saying why.
  absl::StatusOr<bool> TryGetPlan(const Caller& caller, absl::string_view node_id,
                                  std::optional<uint64_t> min_epoch, absl::Time now,
                                  poseidon::v1::Plan* plan);
  // The job's newest plan, or null.
  const poseidon::v1::Plan* CurrentPlan(absl::string_view job_id) const;

  absl::Status ReportTelemetry(const Caller& caller,
                               const poseidon::v1::ReportTelemetryRequest& request, absl::Time now);
  absl::Status Heartbeat(const Caller& caller, const poseidon::v1::HeartbeatRequest& request,
                         absl::Time now, poseidon::v1::HeartbeatResponse* response);
  absl::Status Deregister(const Caller& caller, const poseidon::v1::DeregisterRequest& request,
                          absl::Time now);
  absl::Status ClusterStatus(const Caller& caller, absl::Time now,
                             poseidon::v1::GetClusterStatusResponse* response) const;

  // The operator's override of layer schemes (SetLayerSchemes): checks every named layer
  // (unknown: INVALID_ARGUMENT naming it; SFB for a non-FC layer: INVALID_ARGUMENT naming it),
  // merges the overrides into the job's (SYNC_SCHEME_UNSPECIFIED removes one) and, when the
  // schemes change, installs a new epoch (same chunks, effective iteration as for any re-plan).
  // The overrides stay in force for every later plan of the job until its world or model changes.
  absl::Status SetLayerSchemes(const Caller& caller,
                               const poseidon::v1::SetLayerSchemesRequest& request, absl::Time now,
                               poseidon::v1::SetLayerSchemesResponse* response);

  // The job's rendezvous store (Gloo's). The caller is a live agent or server of its job
  // (header.node_id) with the job's token. StoreSet: a key set again takes the later value;
  // RESOURCE_EXHAUSTED when a new key would exceed kMaxStoreKeys or the keys and values
  // kMaxStoreBytes. The store is dropped with the rest of the job's state when the job starts
  // afresh (no live agent left and a new one registers).
  absl::Status StoreSet(const Caller& caller, const poseidon::v1::StoreSetRequest& request,
                        absl::Time now);
  // Complete when every key of the request is set: the values, in the keys' order.
  absl::StatusOr<bool> TryStoreGet(const Caller& caller,
                                   const poseidon::v1::StoreGetRequest& request, absl::Time now,
                                   poseidon::v1::StoreGetResponse* response);
  // One line naming the first few of `keys` the job's store lacks (escaped, each cut at 64 bytes).
  std::string DescribeMissingKeys(
      absl::string_view job_id, const google::protobuf::RepeatedPtrField<std::string>& keys) const;
  // The keys a job's store holds (0 for an unknown job). For tests and status.
  size_t StoreKeys(absl::string_view job_id) const;

  // Re-evaluates the re-plans that replan_min_interval deferred and whose time has come. The
  // housekeeping thread calls it.
  void ReplanDue(absl::Time now);

  // The iteration a plan installed at `now` would take effect at (RegistryOptions,
  // plan_lead_iterations); 0 for an unknown job. For tests and status.
  uint64_t NextEffectiveIteration(absl::string_view job_id, absl::Time now) const;
  // The job's measured iterations per second (0 without enough samples).
  double IterationRate(absl::string_view job_id, absl::Time now) const;

  // A node with a parked call (Rendezvous, RegisterModel, GetPlan) counts as alive while it
  // waits: the open call is proof of life. Unknown ids are ignored.
  void BeginWait(absl::string_view node_id, absl::Time now);
  void EndWait(absl::string_view node_id, absl::Time now);

  // Declares nodes silent for longer than the lease dead, and forgets dead or departed nodes
  // after the retention time. Returns true if a node was declared dead.
  bool Expire(absl::Time now);

  // For metrics: nodes by role and state (SUSPECT: alive but silent for two heartbeat intervals).
  struct NodeCount {
    poseidon::v1::NodeRole role = poseidon::v1::NODE_ROLE_UNSPECIFIED;
    poseidon::v1::NodeState state = poseidon::v1::NODE_STATE_UNSPECIFIED;
    size_t count = 0;
  };
  std::vector<NodeCount> CountNodes(absl::Time now) const;
  // (job id, plan epoch) for every job that has a plan.
  std::vector<std::pair<std::string, uint64_t>> PlanEpochs() const;
  // Plans installed so far (first plans and re-plans).
  uint64_t plans_installed() const { return plans_installed_; }

 private:
  struct Node {
    std::string id;
    poseidon::v1::NodeRole role = poseidon::v1::NODE_ROLE_UNSPECIFIED;
    std::string job_id;  // agents: their job; servers: the job they serve, "" for every job
    std::set<std::string, std::less<>> jobs;  // servers of "": the only jobs served (empty: all)
    std::string host;
    uint32_t gpu_index = 0;
    std::vector<poseidon::v1::Endpoint> endpoints;
    poseidon::v1::ServerCapacity capacity;
    uint32_t rank = 0;
    uint32_t rank_restarts = 0;  // agents: the rank's holders before this one (RankSlot::agents)
    bool took_up = false;        // agents: reported a running job taken up (Job::takeovers)
    poseidon::v1::NodeState state = poseidon::v1::NODE_STATE_ALIVE;  // ALIVE, DEAD or LEFT
    std::string state_reason;                                        // why dead or left
    bool left_failed = false;  // LEFT with an error (DeregisterRequest.failed)
    absl::Time last_seen;
    absl::Time state_since;
    uint64_t iteration = 0;
    uint64_t plan_epoch = 0;
    uint32_t live_world = 0;  // agents: HeartbeatRequest.live_world and world_generation
    uint64_t world_generation = 0;
    // Agents: when a peer of its job or a KV server of it last reported every connection to it
    // closed (HeartbeatRequest.peers_gone, ranks_gone), and who did ("rank 0's agent").
    absl::Time gone_reported;
    std::string gone_reported_by;
    int waits = 0;
    uint64_t seq = 0;
    // The latest ReportTelemetry: its links to known nodes, its layers (agents), and when.
    std::vector<poseidon::v1::LinkTelemetry> telemetry_links;
    std::vector<poseidon::v1::LayerTelemetry> telemetry_layers;
    std::vector<poseidon::v1::ReplicationTelemetry> telemetry_replication;  // servers
    std::optional<absl::Time> telemetry_at;
  };
  struct RankSlot {
    std::string node_id;  // the latest agent registered for the rank; "" before the first
    bool model_ok = false;
    std::string model_refusal;  // why this rank's model was refused
    uint32_t agents = 0;        // how many agents have held the rank in this world
  };
  using SchemeOverrides = std::map<std::string, poseidon::v1::SyncScheme, std::less<>>;
  struct JobModel {
    poseidon::v1::ModelSpec spec;
    poseidon::v1::UpdateRuleSpec update_rule;
    poseidon::v1::ConsistencySpec consistency;
    uint32_t registered_by_rank = 0;
    bool allreduce = true;  // the agents can run ring all-reduce
    // The agents' --allreduce_bucket_bytes (RegisterModelRequest.allreduce_bucket_bytes).
    uint64_t allreduce_bucket_bytes = planner::kDefaultAllreduceBucketBytes;
  };
  struct Job {
    std::string id;
    uint32_t world_size = 0;  // 0 until the first agent registers
    uint64_t takeovers = 0;   // agents that took up the running job (HeartbeatRequest.took_up_at)
    std::string world_size_origin;
    std::vector<RankSlot> ranks;
    // The last world that formed: agents by rank, and the job's servers (fixed when the first
    // world formed).
    std::vector<std::string> world_agents;
    std::vector<std::string> world_servers;
    // The servers that registered for the job once its first plan was out (replacements for
    // lost ones), in that order, never removed (HeartbeatResponse.joined_servers); members of
    // the job like world_servers (kept while the job is, their reports of lost ranks taken).
    std::vector<std::string> joined_servers;
    std::optional<JobModel> model;
    std::optional<poseidon::v1::Plan> plan;
    double plan_bandwidth = 0;
    double plan_latency = 0;
    std::string plan_error;
    uint64_t last_plan_epoch = 0;
    uint64_t max_iteration = 0;
    // (when first reported, iteration) each time max_iteration rose, over the rate window; at
    // most one entry per 100 ms.
    std::deque<std::pair<absl::Time, uint64_t>> progress;
    std::optional<double> last_evaluated_bandwidth;
    // The ring all-reduce step each rank measured (ReportTelemetryRequest.allreduce_step_ns).
    std::map<uint32_t, uint64_t> allreduce_step_ns;
    std::optional<absl::Time> plan_installed_at;
    // A re-plan from telemetry that replan_min_interval held back, due at replan_due.
    bool replan_deferred = false;
    absl::Time replan_due;
    // The operator's overrides (layer name -> scheme), applied to every plan of the job.
    SchemeOverrides scheme_overrides;
    // The rendezvous store (StoreSet, StoreGet): key -> value, and the bytes of its keys and
    // values together.
    std::map<std::string, std::string, std::less<>> store;
    size_t store_bytes = 0;
  };

  // A running job's plan and joined servers, from an agent after this coordinator restarted.
  void TakeUpRunningPlan(Job& job, uint32_t rank,
                         const poseidon::v1::RegisterModelRequest& request, absl::Time now);
  // Servers registered for the job since its first plan went out join it
  // (Job::joined_servers).
  void JoinServers(Job& job);
  std::string NewId(absl::string_view prefix);
  Node* FindNode(absl::string_view id);
  const Node* FindNode(absl::string_view id) const;
  Job& JobFor(absl::string_view job_id);
  const Job* FindJob(absl::string_view job_id) const;
  static bool Live(const Node* node);
  bool HolderLive(const Job& job, uint32_t rank) const;
  bool WorldComplete(const Job& job) const;
  bool WorldFormed(const Job& job) const;
  // A KV server's heartbeat answer: the dead servers of the jobs it is a server of
  // (HeartbeatResponse.lost_servers).
  void ListLostServers(const Caller& caller, const Node& server, absl::Time now,
                       poseidon::v1::HeartbeatResponse* response) const;
  bool AllModelsAgree(const Job& job) const;
  std::vector<std::string> CurrentHolders(const Job& job) const;
  std::vector<const Node*> EligibleServers(absl::string_view job_id) const;
  absl::Status CheckScope(const Caller& caller, const Node& node) const;
  // The live node `node_id` of the caller's job (or scope) with `role` (UNSPECIFIED: any).
  absl::StatusOr<Node*> Member(const Caller& caller, absl::string_view node_id,
                               poseidon::v1::NodeRole role, absl::Time now);
  // The agent's job, checking the agent still holds its rank.
  absl::StatusOr<Job*> AgentJob(const Node& agent);
  void MarkLeft(Node& node, absl::Time now, absl::string_view reason);
  void ResetJob(Job& job);
  std::string DescribeNode(const Node& node, absl::Time now) const;
  std::string DescribeRank(const Job& job, uint32_t rank, absl::Time now) const;

  // Forms the world when it is complete, then plans when everything a plan needs is there.
  void Refresh(Job& job, absl::Time now);
  void MaybePlan(Job& job, absl::Time now);
  // Re-plans when telemetry moved the bandwidth beyond the threshold and the schemes change.
  void EvaluateReplan(Job& job, absl::Time now);
  std::vector<poseidon::v1::PlanServer> PlanServers(const Job& job) const;
  // A plan of the job's world with `overrides`; a re-plan of the same world (same servers)
  // carries the current plan's chunks over unchanged.
  // The slowest rank's measured ring step, once every rank of the world measured one.
  static std::optional<double> AllreduceStep(const Job& job);
  // A re-plan once the ring's step is known (the first plans could not weigh the ring).
  void ReplanForMeasuredRing(Job& job, absl::Time now);
  // Plans the job's next epoch on `bandwidth` and `latency` and installs it (for `why`) when it
  // moves a scheme; whether it did. Errors: the planner's.
  absl::StatusOr<bool> ReplanIfSchemesChange(Job& job, double bandwidth, double latency,
                                             const std::string& why, absl::Time now);
  absl::StatusOr<poseidon::v1::Plan> Build(const Job& job, double bandwidth, double latency,
                                           uint64_t epoch, uint64_t effective_iteration,
                                           const SchemeOverrides& overrides) const;
  void Install(Job& job, poseidon::v1::Plan plan, double bandwidth, double latency,
               absl::string_view why, absl::Time now);
  // An agent's (heartbeat or telemetry) iteration, for max_iteration and the rate estimate.
  void ObserveIteration(Job& job, uint64_t iteration, absl::Time now);
  double Rate(const Job& job, absl::Time now) const;
  uint64_t EffectiveIteration(const Job& job, absl::Time now) const;
  bool RateUnknown(const Job& job, absl::Time now) const;
  std::optional<std::pair<size_t, double>> RateWindow(const Job& job, absl::Time now) const;
  std::pair<double, double> Network(const Job& job, absl::Time now) const;
  // The node's latest telemetry if it is at most telemetry_max_age old.
  bool FreshTelemetry(const Node& node, absl::Time now) const;
  // The status of a job's synchronisation from its agents' recent telemetry.
  void FillSyncStatus(const Job& job, absl::Time now, poseidon::v1::JobStatus* out) const;
  absl::flat_hash_set<std::string> Members(const Job& job) const;

  RegistryOptions options_;
  std::string incarnation_;
  uint64_t next_seq_ = 0;
  uint64_t membership_epoch_ = 0;
  uint64_t version_ = 0;
  uint64_t plans_installed_ = 0;
  std::map<std::string, Node, std::less<>> nodes_;
  std::map<std::string, Job, std::less<>> jobs_;
  LinkTable links_;
};

}  // namespace poseidon::coordinator
