// CoordinatorClient: how agents, servers and tools call poseidon-coordinator, every call with a
// deadline, answers as absl::StatusOr; HeartbeatLoop keeps a node alive from its own thread.
// Thread-safety: CoordinatorClient is safe from any thread; stop a HeartbeatLoop before its client.

// Every call carries the job id, the token and, once registered, the node id; errors keep the
// coordinator's code and message.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "coordinator/store_limits.h"
#include "coordinator/tls.h"
#include "poseidon/v1/coordinator.grpc.pb.h"

namespace poseidon::coordinator {

struct CoordinatorClientOptions {
  std::string address;  // "host:port" of the coordinator
  std::string job_id;   // empty only for cluster-wide servers and tools (with the cluster token)
  std::string token;
  ClientTlsOptions tls;
  // The deadline of calls that do not wait (everything but Rendezvous, RegisterModel and
  // WaitForPlan, which take their own timeout).
  absl::Duration call_timeout = absl::Seconds(10);
};

// What an agent tells the coordinator about itself.
struct AgentRegistration {
  std::string host;
  uint32_t gpu_index = 0;
  // The agent's data-plane listeners (at least one), e.g. {TRANSPORT_KIND_TCP, "10.0.0.5:7200"}.
  std::vector<poseidon::v1::Endpoint> endpoints;
  uint32_t world_size = 0;
  std::optional<uint32_t> requested_rank;  // from a launcher; absent: the coordinator chooses
};

// What a server tells the coordinator about itself.
struct ServerRegistration {
  std::string host;
  std::vector<poseidon::v1::Endpoint> endpoints;
  poseidon::v1::ServerCapacity capacity;
  std::string previous_node_id;  // to re-join as the same server after a restart
  std::vector<std::string> jobs;  // a cluster-wide server's jobs (empty: every job)
};

// A job's membership, as Rendezvous returns it.
struct World {
  uint32_t rank = 0;
  uint32_t world_size = 0;
  std::vector<poseidon::v1::PeerInfo> peers;      // every agent of the job, by rank (incl. self)
  std::vector<poseidon::v1::ServerInfo> servers;  // the job's servers (Plan.servers' order)
  uint64_t membership_epoch = 0;
};

// An endpoint from its parts.
poseidon::v1::Endpoint MakeEndpoint(poseidon::v1::TransportKind transport,
                                    absl::string_view address);

class HeartbeatLoop;

class CoordinatorClient {
 public:
  // Creates the channel (no call is made: an unreachable coordinator shows on the first call).
  // Errors: an empty address, unreadable TLS files.
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Connect(
      CoordinatorClientOptions options);
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Connect(
      absl::string_view address, absl::string_view job_id, absl::string_view token,
      const ClientTlsOptions& tls = {});

  CoordinatorClient(const CoordinatorClient&) = delete;
  CoordinatorClient& operator=(const CoordinatorClient&) = delete;

  // Registration; on success node_id() is set and sent with every later call. A retry with the
  // same client returns the same registration.
  absl::StatusOr<poseidon::v1::RegisterAgentResponse> RegisterAgent(const AgentRegistration& agent);
  absl::StatusOr<poseidon::v1::RegisterServerResponse> RegisterServer(
      const ServerRegistration& server);
  // Sends this client's last successful registration again, a server's under its node id (for
  // a coordinator that restarted and knows nobody). FAILED_PRECONDITION before any registration.
  absl::Status RegisterAgain();

  // Waits (at most `timeout`) until the job's world is complete; the rank, the peers and the
  // servers. DEADLINE_EXCEEDED names the ranks that are missing.
  absl::StatusOr<World> Rendezvous(absl::Duration timeout);
  // RegisterAgent, then Rendezvous within `timeout` in all.
  absl::StatusOr<World> RegisterAgentAndRendezvous(const AgentRegistration& agent,
                                                   absl::Duration timeout);

  // Registers this rank's model and waits (at most `timeout`) until every rank registered the
  // same model; returns the job's plan. FAILED_PRECONDITION names the first differing layer.
  // `allreduce`: whether this rank can run ring all-reduce (the plans use it only if so);
  // `allreduce_bucket_bytes`: its --allreduce_bucket_bytes (unset: the planner's default);
  // `allreduce_step`: the ring step it measured (zero: none).
  absl::StatusOr<poseidon::v1::Plan> RegisterModel(
      const poseidon::v1::ModelSpec& model, const poseidon::v1::UpdateRuleSpec& update_rule = {},
      const poseidon::v1::ConsistencySpec& consistency = {},
      absl::Duration timeout = absl::Minutes(5), bool allreduce = true,
      std::optional<uint64_t> allreduce_bucket_bytes = std::nullopt,
      absl::Duration allreduce_step = absl::ZeroDuration());

  // After RegisterAgain (a restarted coordinator): the last model registration again, with the
  // plan this agent runs and the servers that joined its job (RegisterModelRequest.running_plan),
  // answered at once. FAILED_PRECONDITION when no model was registered yet.
  absl::Status RegisterModelAgain(const poseidon::v1::Plan& running,
                                  const std::vector<std::string>& joined_servers,
                                  const std::vector<std::string>& lost_servers = {});

  // The job's newest plan (FAILED_PRECONDITION when it has none yet).
  absl::StatusOr<poseidon::v1::Plan> GetPlan();
  // Waits (at most `timeout`) for a plan of epoch >= min_plan_epoch. When none arrives in time
  // the current plan is returned (compare its epoch); without any plan, DEADLINE_EXCEEDED.
  absl::StatusOr<poseidon::v1::Plan> WaitForPlan(uint64_t min_plan_epoch, absl::Duration timeout);

  // Measured links to peers, and the iteration this node completed (agents; 0 for servers).
  absl::Status ReportTelemetry(const std::vector<poseidon::v1::LinkTelemetry>& links,
                               uint64_t iteration);
  // A whole report (the header is filled in), with its own deadline.
  absl::Status ReportTelemetry(poseidon::v1::ReportTelemetryRequest request,
                               absl::Duration timeout);
  // What one heartbeat reports (HeartbeatRequest's fields).
  struct HeartbeatReport {
    uint64_t iteration = 0;
    uint64_t plan_epoch = 0;
    std::pair<uint32_t, uint64_t> world{0, 0};  // live_world, world_generation (0, 0: none)
    uint64_t took_up_at = 0;
    std::vector<uint32_t> peers_gone;                      // agents
    std::map<uint64_t, std::vector<uint32_t>> ranks_gone;  // KV servers, by job id
  };
  // One heartbeat. A response with shutdown = true means this node id was declared dead or
  // replaced: stop, or register anew.
  absl::StatusOr<poseidon::v1::HeartbeatResponse> Heartbeat(const HeartbeatReport& report);
  // failed: leaving because of an error (HeartbeatResponse.departed tells the job's agents).
  absl::Status Deregister(absl::string_view reason, bool failed = false);
  absl::StatusOr<poseidon::v1::GetClusterStatusResponse> GetClusterStatus();
  // Operator override (SetLayerSchemes): forces the schemes of the named layers of this client's
  // job (SYNC_SCHEME_UNSPECIFIED: back to the cost model's choice) and returns the job's plan
  // afterwards: a new epoch when a scheme changed, else the current one. A client with the
  // cluster token (empty job id) names the job in `job_id`. INVALID_ARGUMENT names an unknown
  // layer or a non-FC layer asked to use SFB.
  absl::StatusOr<poseidon::v1::Plan> SetLayerSchemes(
      const std::map<std::string, poseidon::v1::SyncScheme>& schemes);
  absl::StatusOr<poseidon::v1::SetLayerSchemesResponse> SetLayerSchemes(
      const std::map<std::string, poseidon::v1::SyncScheme>& schemes, absl::string_view job_id,
      absl::string_view reason);

  // The job's rendezvous store (Gloo's): sets `key` to `value` for this client's job (a key set
  // twice takes the later value). INVALID_ARGUMENT for an empty key, a key over kMaxStoreKeyBytes
  // or a value over kMaxStoreValueBytes; RESOURCE_EXHAUSTED when the job holds kMaxStoreKeys.
  absl::Status StoreSet(absl::string_view key, absl::string_view value);
  // The values of `keys`, in order, once every one of them is set, waiting at most `timeout`;
  // DEADLINE_EXCEEDED names the keys still missing (the first few).
  absl::StatusOr<std::vector<std::string>> StoreGet(const std::vector<std::string>& keys,
                                                    absl::Duration timeout);

  // Heartbeats every heartbeat_interval() on a thread of its own until stopped.
  struct HeartbeatOptions {
    absl::Duration interval = absl::ZeroDuration();  // zero: what registration returned
    std::function<uint64_t()> iteration;             // null: 0
    std::function<uint64_t()> plan_epoch;            // null: the last plan epoch seen
    // Agents of a job that may shrink: (ranks trained with now, generation); null: not sent.
    std::function<std::pair<uint32_t, uint64_t>()> world;
    // Agents that took up a running job: its iteration (HeartbeatRequest.took_up_at); null: 0.
    std::function<uint64_t()> took_up_at;
    // Agents of a job that may shrink: the ranks whose connections to it all closed
    // (HeartbeatRequest.peers_gone); null: none sent.
    std::function<std::vector<uint32_t>()> peers_gone;
    // KV servers: per job, the ranks whose connections to it all closed or went silent
    // (HeartbeatRequest.ranks_gone); null: none sent.
    std::function<std::map<uint64_t, std::vector<uint32_t>>()> ranks_gone;
    // Every result, on the loop's thread (keep it short). Null: failures are logged.
    std::function<void(const absl::StatusOr<poseidon::v1::HeartbeatResponse>&)> on_result;
    // When a heartbeat is answered NOT_FOUND (a restarted coordinator starts empty), the loop
    // calls RegisterAgain() (the data plane never stopped), so that the coordinator lists this
    // node again and watches its liveness; it logs the outcome and goes on beating either way.
    bool register_again = false;
    // After a successful RegisterAgain, on the loop's thread (an agent registers its model and
    // running plan again: RegisterModelAgain).
    std::function<void()> on_registered_again;
  };
  std::unique_ptr<HeartbeatLoop> StartHeartbeats(HeartbeatOptions options);

  // Registration state and the newest epochs seen in any response.
  std::string node_id() const;
  poseidon::v1::NodeRole role() const;
  absl::Duration heartbeat_interval() const;
  uint64_t membership_epoch() const;
  uint64_t plan_epoch() const;
  const CoordinatorClientOptions& options() const { return options_; }

 private:
  CoordinatorClient(CoordinatorClientOptions options,
                    std::unique_ptr<poseidon::v1::Coordinator::Stub> stub);
  // Sends a registration (its header filled here) and keeps it for RegisterAgain.
  absl::StatusOr<poseidon::v1::RegisterAgentResponse> SendRegistration(
      poseidon::v1::RegisterAgentRequest request);
  absl::StatusOr<poseidon::v1::RegisterServerResponse> SendRegistration(
      poseidon::v1::RegisterServerRequest request);
  void FillHeader(poseidon::v1::RequestHeader* header) const;
  void Observe(const poseidon::v1::ResponseHeader& header);
  // Every call: its deadline, and its job and token as metadata (auth.h) besides the header.
  void Prepare(grpc::ClientContext* context, absl::Duration timeout) const;

  const CoordinatorClientOptions options_;
  const std::unique_ptr<poseidon::v1::Coordinator::Stub> stub_;
  mutable std::mutex mu_;
  std::string node_id_;                                                // guarded by mu_
  poseidon::v1::NodeRole role_ = poseidon::v1::NODE_ROLE_UNSPECIFIED;  // guarded by mu_
  absl::Duration heartbeat_interval_ = absl::Seconds(3);               // guarded by mu_
  uint64_t membership_epoch_ = 0;                                      // guarded by mu_
  uint64_t plan_epoch_ = 0;                                            // guarded by mu_
  // The last successful registration (its header is filled anew when it is sent again).
  std::optional<poseidon::v1::RegisterAgentRequest> agent_registration_;    // guarded by mu_
  std::optional<poseidon::v1::RegisterServerRequest> server_registration_;  // guarded by mu_
  std::optional<poseidon::v1::RegisterModelRequest> model_registration_;    // guarded by mu_
};

// What a heartbeat loop without its own on_result logs: a failure, or the coordinator's request
// to shut down.
void LogHeartbeatResult(const std::string& node_id,
                        const absl::StatusOr<poseidon::v1::HeartbeatResponse>& result);

// A running heartbeat thread (CoordinatorClient::StartHeartbeats). Stops when destroyed.
class HeartbeatLoop {
 public:
  HeartbeatLoop(CoordinatorClient* client, CoordinatorClient::HeartbeatOptions options);
  ~HeartbeatLoop();
  HeartbeatLoop(const HeartbeatLoop&) = delete;
  HeartbeatLoop& operator=(const HeartbeatLoop&) = delete;

  // Stops and joins the thread (a heartbeat in flight finishes first, within the call timeout).
  void Stop();
  // The next heartbeat goes now rather than at the end of the interval (news the coordinator
  // should have at once). Any thread.
  void BeatNow();

 private:
  void Run();

  CoordinatorClient* const client_;
  const CoordinatorClient::HeartbeatOptions options_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mu_
  bool now_ = false;   // guarded by mu_: BeatNow
  std::thread thread_;
};

}  // namespace poseidon::coordinator
