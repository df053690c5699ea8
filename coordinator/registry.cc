#include "coordinator/registry.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/model_diff.h"
#include "google/protobuf/util/message_differencer.h"

namespace poseidon::coordinator {
namespace {

namespace v1 = ::poseidon::v1;

// Lists name at most this many ranks; the rest are counted.
constexpr size_t kMaxListed = 16;

std::string Ago(absl::Duration d) {
  const absl::Duration rounded =
      absl::Trunc(std::max(d, absl::ZeroDuration()), absl::Milliseconds(1));
  return rounded == absl::ZeroDuration() ? "0s" : absl::FormatDuration(rounded);
}

uint64_t Millis(absl::Duration d) {
  return static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Milliseconds(d)));
}

std::string Bandwidth(double bytes_per_second) {
  return absl::StrCat(absl::SixDigits(bytes_per_second * 8 / 1e9), " Gbit/s");
}

const char* RoleName(v1::NodeRole role) {
  return role == v1::NODE_ROLE_SERVER ? "server" : role == v1::NODE_ROLE_AGENT ? "agent" : "node";
}

std::vector<v1::SyncScheme> Schemes(const v1::Plan& plan) {
  std::vector<v1::SyncScheme> schemes;
  schemes.reserve(static_cast<size_t>(plan.layers_size()));
  for (const v1::LayerPlan& layer : plan.layers()) schemes.push_back(layer.scheme());
  return schemes;
}

// "2, 3, 5 and 7 more" style list of the first kMaxListed entries.
std::string Listed(const std::vector<std::string>& items) {
  std::vector<std::string> shown(
      items.begin(),
      items.begin() + static_cast<std::ptrdiff_t>(std::min(items.size(), kMaxListed)));
  std::string text = absl::StrJoin(shown, "; ");
  if (items.size() > kMaxListed)
    absl::StrAppend(&text, "; and ", items.size() - kMaxListed, " more");
  return text;
}

// An agent's synchronisation in its telemetry window: the sum of the layers' mean sync times
// (one iteration's synchronisation) and the layer with the longest mean (-1: none).
struct SyncSummary {
  double total_seconds = 0;
  int64_t slowest_index = -1;
  std::string slowest_name;
  double slowest_seconds = 0;
};

SyncSummary Summarize(const std::vector<v1::LayerTelemetry>& layers) {
  SyncSummary summary;
  for (const v1::LayerTelemetry& layer : layers) {
    if (layer.syncs() == 0) continue;
    summary.total_seconds += layer.mean_sync_seconds();
    if (summary.slowest_index < 0 || layer.mean_sync_seconds() > summary.slowest_seconds) {
      summary.slowest_index = layer.index();
      summary.slowest_name = layer.name();
      summary.slowest_seconds = layer.mean_sync_seconds();
    }
  }
  return summary;
}

// A layer's name from the plan, else from the report, else its index.
std::string LayerName(const std::optional<v1::Plan>& plan, uint32_t index,
                      const std::string& reported) {
  if (plan.has_value() && index < static_cast<uint32_t>(plan->layers_size())) {
    return plan->layers(static_cast<int>(index)).layer_name();
  }
  return reported.empty() ? absl::StrCat("layer ", index) : reported;
}

}  // namespace

Registry::Registry(RegistryOptions options, std::string incarnation)
    : options_(std::move(options)), incarnation_(std::move(incarnation)) {}

absl::Duration Registry::heartbeat_interval() const {
  return options_.heartbeat_interval > absl::ZeroDuration() ? options_.heartbeat_interval
                                                            : options_.lease / 5;
}

void Registry::FillHeader(absl::string_view job_id, v1::ResponseHeader* header) const {
  header->set_epoch(membership_epoch_);
  const Job* job = job_id.empty() ? nullptr : FindJob(job_id);
  header->set_plan_epoch(job != nullptr && job->plan.has_value() ? job->plan->plan_epoch() : 0);
}

// ---- Lookups
// -------------------------------------------------------------------------------------

std::string Registry::NewId(absl::string_view prefix) {
  // A server may keep an id of its choosing (previous_node_id), so make sure ours is free.
  std::string id;
  do {
    id = absl::StrCat(prefix, "-", incarnation_, "-", ++next_seq_);
  } while (nodes_.contains(id));
  return id;
}

Registry::Node* Registry::FindNode(absl::string_view id) {
  const auto it = nodes_.find(id);
  return it == nodes_.end() ? nullptr : &it->second;
}

const Registry::Node* Registry::FindNode(absl::string_view id) const {
  const auto it = nodes_.find(id);
  return it == nodes_.end() ? nullptr : &it->second;
}

Registry::Job& Registry::JobFor(absl::string_view job_id) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    it = jobs_.emplace(std::string(job_id), Job{}).first;
    it->second.id = std::string(job_id);
  }
  return it->second;
}

const Registry::Job* Registry::FindJob(absl::string_view job_id) const {
  const auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

bool Registry::Live(const Node* node) {
  return node != nullptr && node->state == v1::NODE_STATE_ALIVE;
}

bool Registry::HolderLive(const Job& job, uint32_t rank) const {
  return rank < job.ranks.size() && Live(FindNode(job.ranks[rank].node_id));
}

bool Registry::WorldComplete(const Job& job) const {
  if (job.world_size == 0) return false;
  for (uint32_t r = 0; r < job.world_size; ++r) {
    if (!HolderLive(job, r)) return false;
  }
  return true;
}

bool Registry::WorldFormed(const Job& job) const {
  return !job.world_agents.empty() && WorldComplete(job) && job.world_agents == CurrentHolders(job);
}

bool Registry::AllModelsAgree(const Job& job) const {
  if (!job.model.has_value() || job.ranks.empty()) return false;
  return std::all_of(job.ranks.begin(), job.ranks.end(),
                     [](const RankSlot& slot) { return slot.model_ok; });
}

std::vector<std::string> Registry::CurrentHolders(const Job& job) const {
  std::vector<std::string> holders;
  holders.reserve(job.ranks.size());
  for (const RankSlot& slot : job.ranks) holders.push_back(slot.node_id);
  return holders;
}

std::vector<const Registry::Node*> Registry::EligibleServers(absl::string_view job_id) const {
  std::vector<const Node*> servers;
  for (const auto& [id, node] : nodes_) {
    if (node.role == v1::NODE_ROLE_SERVER && Live(&node) &&
        (node.job_id.empty() ? node.jobs.empty() || node.jobs.contains(job_id)
                             : node.job_id == job_id)) {
      servers.push_back(&node);
    }
  }
  std::sort(servers.begin(), servers.end(),
            [](const Node* a, const Node* b) { return a->seq < b->seq; });
  return servers;
}

absl::Status Registry::CheckScope(const Caller& caller, const Node& node) const {
  if (node.job_id == caller.job_id) return absl::OkStatus();
  if (caller.job_id.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat("node '", node.id, "' belongs to job '", node.job_id,
                     "': send that job's id and token, not the cluster token"));
  }
  if (node.job_id.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat("node '", node.id,
                     "' is a cluster-wide server: send an empty header.job_id and the "
                     "cluster token, not job '",
                     caller.job_id, "'"));
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "node '", node.id, "' belongs to job '", node.job_id, "', not to job '", caller.job_id, "'"));
}

absl::StatusOr<Registry::Node*> Registry::Member(const Caller& caller, absl::string_view node_id,
                                                 v1::NodeRole role, absl::Time now) {
  Node* node = FindNode(node_id);
  if (node == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "node '", node_id,
        "' is not registered with this coordinator (it may have restarted): register again"));
  }
  RETURN_IF_ERROR(CheckScope(caller, *node));
  if (role != v1::NODE_ROLE_UNSPECIFIED && node->role != role) {
    return absl::FailedPreconditionError(
        absl::StrCat("node '", node_id, "' is registered as ", v1::NodeRole_Name(node->role),
                     ", this call is for ", v1::NodeRole_Name(role)));
  }
  if (node->state == v1::NODE_STATE_DEAD) {
    return absl::FailedPreconditionError(absl::StrCat("node '", node_id, "' was declared dead ",
                                                      Ago(now - node->state_since), " ago (",
                                                      node->state_reason, "): register again"));
  }
  if (node->state == v1::NODE_STATE_LEFT) {
    return absl::FailedPreconditionError(
        absl::StrCat("node '", node_id, "' has left (", node->state_reason, "): register again"));
  }
  node->last_seen = std::max(node->last_seen, now);
  return node;
}

absl::StatusOr<Registry::Job*> Registry::AgentJob(const Node& agent) {
  const auto it = jobs_.find(agent.job_id);
  if (it == jobs_.end() || agent.rank >= it->second.ranks.size() ||
      it->second.ranks[agent.rank].node_id != agent.id) {
    return absl::FailedPreconditionError(
        absl::StrCat("agent '", agent.id, "' no longer holds rank ", agent.rank, " of job '",
                     agent.job_id, "': register again"));
  }
  return &it->second;
}

void Registry::MarkLeft(Node& node, absl::Time now, absl::string_view reason) {
  node.state = v1::NODE_STATE_LEFT;
  node.state_since = now;
  node.state_reason = std::string(reason);
  ++membership_epoch_;
  ++version_;
  PSD_LOG_INFO("{} {} left: {}", RoleName(node.role), node.id, reason);
}

void Registry::ResetJob(Job& job) {
  PSD_LOG_INFO("job {}: no live agent is left; the next registration starts a new world", job.id);
  const uint64_t last_epoch = job.last_plan_epoch;
  const std::string id = job.id;
  job = Job{};
  job.id = id;
  job.last_plan_epoch = last_epoch;  // plan epochs never repeat
  ++version_;
}

std::string Registry::DescribeNode(const Node& node, absl::Time now) const {
  std::string text = absl::StrCat(node.id, " on host ", node.host);
  if (node.role == v1::NODE_ROLE_AGENT) absl::StrAppend(&text, " gpu ", node.gpu_index);
  switch (node.state) {
    case v1::NODE_STATE_DEAD:
      absl::StrAppend(&text, ", declared dead ", Ago(now - node.state_since), " ago (",
                      node.state_reason, ")");
      break;
    case v1::NODE_STATE_LEFT:
      absl::StrAppend(&text, ", left (", node.state_reason, ")");
      break;
    default:
      absl::StrAppend(&text, ", alive, last heard ", Ago(now - node.last_seen), " ago");
  }
  return text;
}

std::string Registry::DescribeRank(const Job& job, uint32_t rank, absl::Time now) const {
  const Node* holder = rank < job.ranks.size() ? FindNode(job.ranks[rank].node_id) : nullptr;
  if (holder == nullptr) return absl::StrCat("rank ", rank, " (no agent has registered)");
  return absl::StrCat("rank ", rank, " (", DescribeNode(*holder, now), ")");
}

// ---- Registration ----------------------------------------------------------------------------

absl::Status Registry::RegisterServer(const Caller& caller,
                                      const v1::RegisterServerRequest& request, absl::Time now,
                                      v1::RegisterServerResponse* response) {
  const std::string& previous = request.previous_node_id();
  Node* node = previous.empty() ? nullptr : FindNode(previous);
  if (node != nullptr) {
    // A server re-joining after a restart keeps its id (and the tables assigned to it).
    if (node->role != v1::NODE_ROLE_SERVER) {
      return absl::FailedPreconditionError(
          absl::StrCat("previous_node_id '", previous, "' is an agent, not a server"));
    }
    RETURN_IF_ERROR(CheckScope(caller, *node));
    if (Live(node) && node->host != request.host()) {
      return absl::AlreadyExistsError(
          absl::StrCat("server '", previous, "' is registered and alive on host ", node->host,
                       "; another host can take its id only after it is declared dead (",
                       Ago(options_.lease), " of silence) or deregisters"));
    }
    node->host = request.host();
    node->endpoints.assign(request.endpoints().begin(), request.endpoints().end());
    if (caller.job_id.empty()) node->jobs = {request.jobs().begin(), request.jobs().end()};
    node->capacity = request.capacity();
    node->state = v1::NODE_STATE_ALIVE;
    node->state_reason.clear();
    node->last_seen = now;
    PSD_LOG_INFO("server {} re-joined from host {}", node->id, node->host);
  } else {
    if (nodes_.size() >= options_.max_nodes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the coordinator already tracks ", nodes_.size(), " nodes (max_nodes)"));
    }
    Node fresh;
    // An id from a previous coordinator run is kept, so the server stays the same server.
    fresh.id = previous.empty() ? NewId("server") : previous;
    fresh.role = v1::NODE_ROLE_SERVER;
    fresh.job_id = caller.job_id;
    if (caller.job_id.empty()) fresh.jobs.insert(request.jobs().begin(), request.jobs().end());
    fresh.host = request.host();
    fresh.endpoints.assign(request.endpoints().begin(), request.endpoints().end());
    fresh.capacity = request.capacity();
    fresh.last_seen = now;
    fresh.seq = ++next_seq_;
    node = &nodes_.emplace(fresh.id, std::move(fresh)).first->second;
    PSD_LOG_INFO(
        "server {} registered from host {} for {}", node->id, node->host,
        caller.job_id.empty() ? std::string("every job") : absl::StrCat("job ", caller.job_id));
  }
  ++membership_epoch_;
  ++version_;
  // A new server may complete a world that waits for servers; a re-joined one changes endpoints.
  for (auto& [id, job] : jobs_) Refresh(job, now);
  response->set_node_id(node->id);
  response->set_heartbeat_interval_ms(Millis(heartbeat_interval()));
  response->set_lease_ms(Millis(options_.lease));
  FillHeader(caller.job_id, response->mutable_header());
  return absl::OkStatus();
}

absl::Status Registry::RegisterAgent(const Caller& caller, const v1::RegisterAgentRequest& request,
                                     absl::Time now, v1::RegisterAgentResponse* response) {
  if (caller.job_id.empty()) {
    return absl::PermissionDeniedError(
        "an agent belongs to a job: send header.job_id and the job's token, not the cluster "
        "token");
  }
  Job& job = JobFor(caller.job_id);
  auto answer = [&](const Node& node) {
    response->set_node_id(node.id);
    response->set_rank(node.rank);
    response->set_world_size(job.world_size);
    response->set_heartbeat_interval_ms(Millis(heartbeat_interval()));
    response->set_lease_ms(Millis(options_.lease));
    FillHeader(job.id, response->mutable_header());
  };

  // A retry of a registration that went through (the response was lost) gets the same answer.
  if (Node* known = FindNode(request.header().node_id());
      known != nullptr && known->role == v1::NODE_ROLE_AGENT && known->job_id == job.id &&
      known->state != v1::NODE_STATE_LEFT && known->rank < job.ranks.size() &&
      job.ranks[known->rank].node_id == known->id && job.world_size == request.world_size() &&
      (!request.has_requested_rank() || request.requested_rank() == known->rank)) {
    if (known->state == v1::NODE_STATE_DEAD) {
      known->state = v1::NODE_STATE_ALIVE;
      known->state_reason.clear();
      ++membership_epoch_;
      ++version_;
      PSD_LOG_INFO("job {}: agent {} (rank {}) is back", job.id, known->id, known->rank);
    }
    known->last_seen = now;
    Refresh(job, now);
    answer(*known);
    return absl::OkStatus();
  }

  if (job.world_size != 0) {
    bool any_live = false;
    for (uint32_t r = 0; r < job.world_size; ++r) any_live = any_live || HolderLive(job, r);
    if (!any_live) ResetJob(job);
  }
  if (job.world_size == 0) {
    job.world_size = request.world_size();
    job.ranks.assign(job.world_size, RankSlot{});
    job.world_size_origin = absl::StrCat("host ", request.host(), " gpu ", request.gpu_index());
  } else if (request.world_size() != job.world_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "world_size mismatch: this agent says ", request.world_size(), ", job '", job.id,
        "' has world_size ", job.world_size, " (set by the first agent, ", job.world_size_origin,
        "); every agent of a job must send the same world_size"));
  }
  if (nodes_.size() >= options_.max_nodes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the coordinator already tracks ", nodes_.size(), " nodes (max_nodes)"));
  }

  uint32_t rank = 0;
  Node* restarted = nullptr;
  if (request.has_requested_rank()) {
    rank = request.requested_rank();
    Node* holder = FindNode(job.ranks[rank].node_id);
    if (Live(holder)) {
      if (holder->host != request.host() || holder->gpu_index != request.gpu_index()) {
        return absl::AlreadyExistsError(
            absl::StrCat("duplicate rank: rank ", rank, " of job '", job.id, "' is held by ",
                         DescribeNode(*holder, now), "; asked for by host ", request.host(),
                         " gpu ", request.gpu_index(),
                         "; a replacement can take the rank once that agent "
                         "deregisters or is declared dead after ",
                         Ago(options_.lease), " of silence"));
      }
      // The same host and GPU asking for its own rank again: the agent restarted.
      restarted = holder;
    }
  } else {
    bool found = false;
    for (uint32_t r = 0; r < job.world_size && !found; ++r) {
      if (!HolderLive(job, r)) {
        rank = r;
        found = true;
      }
    }
    if (!found) {
      return absl::AlreadyExistsError(
          absl::StrCat("job '", job.id, "' already has ", job.world_size,
                       " live agents (world_size ", job.world_size,
                       "); a replacement can register once one of them deregisters or is "
                       "declared dead"));
    }
  }
  if (restarted != nullptr) MarkLeft(*restarted, now, "replaced by a restart on the same GPU");

  Node node;
  node.id = NewId("agent");
  node.role = v1::NODE_ROLE_AGENT;
  node.job_id = job.id;
  node.host = request.host();
  node.gpu_index = request.gpu_index();
  node.endpoints.assign(request.endpoints().begin(), request.endpoints().end());
  node.rank = rank;
  node.rank_restarts = job.ranks[rank].agents;
  node.last_seen = now;
  node.seq = ++next_seq_;
  const Node& added = nodes_.emplace(node.id, std::move(node)).first->second;
  const std::string previous = job.ranks[rank].node_id;
  job.ranks[rank] = RankSlot{added.id, false, "", added.rank_restarts + 1};
  ++membership_epoch_;
  ++version_;
  PSD_LOG_INFO("job {}: agent {} (host {} gpu {}) registered as rank {} of {}{}", job.id, added.id,
               added.host, added.gpu_index, rank, job.world_size,
               previous.empty() ? ""
                                : absl::StrCat(" in place of agent ", previous, " (restart ",
                                               added.rank_restarts, " of the rank)"));
  Refresh(job, now);
  answer(added);
  return absl::OkStatus();
}

// ---- Rendezvous --------------------------------------------------------------------------------

absl::StatusOr<bool> Registry::TryRendezvous(const Caller& caller, absl::string_view node_id,
                                             absl::Time now, v1::RendezvousResponse* response) {
  ASSIGN_OR_RETURN(Node * node, Member(caller, node_id, v1::NODE_ROLE_AGENT, now));
  ASSIGN_OR_RETURN(Job * job, AgentJob(*node));
  if (!WorldFormed(*job)) return false;
  response->Clear();
  response->set_rank(node->rank);
  response->set_world_size(job->world_size);
  for (uint32_t r = 0; r < job->world_size; ++r) {
    const Node& peer = *FindNode(job->world_agents[r]);
    v1::PeerInfo* info = response->add_peers();
    info->set_node_id(peer.id);
    info->set_rank(r);
    info->set_host(peer.host);
    info->set_gpu_index(peer.gpu_index);
    for (const v1::Endpoint& endpoint : peer.endpoints) *info->add_endpoints() = endpoint;
  }
  for (const std::string& id : job->world_servers) {
    const Node* server = FindNode(id);
    if (server == nullptr) continue;  // never: world servers are not forgotten
    v1::ServerInfo* info = response->add_servers();
    info->set_node_id(server->id);
    info->set_host(server->host);
    for (const v1::Endpoint& endpoint : server->endpoints) *info->add_endpoints() = endpoint;
    *info->mutable_capacity() = server->capacity;
  }
  FillHeader(job->id, response->mutable_header());
  return true;
}

std::string Registry::DescribeIncompleteWorld(absl::string_view job_id, absl::Time now) const {
  const Job* job = FindJob(job_id);
  if (job == nullptr || job->world_size == 0) {
    return absl::StrCat("no agent of job '", job_id, "' has registered");
  }
  std::vector<std::string> missing;
  uint32_t live = 0;
  for (uint32_t r = 0; r < job->world_size; ++r) {
    if (HolderLive(*job, r)) {
      ++live;
    } else {
      missing.push_back(DescribeRank(*job, r, now));
    }
  }
  std::vector<std::string> parts;
  if (!missing.empty()) {
    parts.push_back(absl::StrCat(live, " of ", job->world_size,
                                 " ranks have a live agent; missing: ", Listed(missing)));
  }
  if (job->world_servers.empty()) {
    const size_t servers = EligibleServers(job_id).size();
    if (servers < options_.min_servers) {
      parts.push_back(absl::StrCat("servers: ", servers, " of the ", options_.min_servers,
                                   " required have registered"));
    }
  }
  if (parts.empty()) return "the world is complete";
  return absl::StrJoin(parts, "; ");
}

// ---- Model and plan ----------------------------------------------------------------------------

namespace {

// The agents' all-reduce bucket size a registration gives (unset: their default).
uint64_t BucketBytesOf(const v1::RegisterModelRequest& request) {
  return request.has_allreduce_bucket_bytes() ? request.allreduce_bucket_bytes()
                                              : planner::kDefaultAllreduceBucketBytes;
}

}  // namespace

absl::Status Registry::RegisterModel(const Caller& caller, const v1::RegisterModelRequest& request,
                                     absl::Time now) {
  ASSIGN_OR_RETURN(Node * node,
                   Member(caller, request.header().node_id(), v1::NODE_ROLE_AGENT, now));
  ASSIGN_OR_RETURN(Job * job, AgentJob(*node));
  RankSlot& slot = job->ranks[node->rank];

  std::optional<std::string> difference;
  if (job->model.has_value()) {
    difference = FirstModelDifference(job->model->spec, request.model());
    if (!difference) {
      difference = FirstUpdateRuleDifference(job->model->update_rule, request.update_rule());
    }
    if (!difference) {
      difference = FirstConsistencyDifference(job->model->consistency, request.consistency());
    }
    if (!difference && job->model->allreduce == request.allreduce_unavailable()) {
      difference = absl::StrCat("this rank ", request.allreduce_unavailable() ? "cannot" : "can",
                                " run ring all-reduce, the model's first rank ",
                                job->model->allreduce ? "can" : "cannot");
    }
    if (!difference && job->model->allreduce_bucket_bytes != BucketBytesOf(request)) {
      difference = absl::StrCat("this rank fuses all-reduce layers into buckets of ",
                                BucketBytesOf(request), " bytes, the model's first rank into ",
                                job->model->allreduce_bucket_bytes,
                                " (--allreduce_bucket_bytes must be the same on every rank)");
    }
  }
  bool others_agree = false;
  for (uint32_t r = 0; r < job->ranks.size(); ++r) {
    others_agree = others_agree || (r != node->rank && job->ranks[r].model_ok);
  }
  if (difference && others_agree) {
    slot.model_ok = false;
    slot.model_refusal = absl::StrCat("the model of rank ", node->rank, " differs from job '",
                                      job->id, "''s model (first registered by rank ",
                                      job->model->registered_by_rank, "): ", *difference);
    ++version_;
    return absl::FailedPreconditionError(slot.model_refusal);
  }
  if (!job->model.has_value() || difference) {
    // The job's first model, or a new one no other rank has agreed to yet. A dry run on the
    // job's shape refuses a model the planner cannot plan now, to its sender.
    planner::PlannerConfig trial;
    trial.workers = job->world_size;
    trial.servers = static_cast<uint32_t>(std::max<size_t>(1, job->world_servers.empty()
                                                                  ? EligibleServers(job->id).size()
                                                                  : job->world_servers.size()));
    trial.batch_per_worker = options_.batch_per_worker;
    trial.colocated = options_.colocated;
    trial.bandwidth_bytes_per_second = options_.nominal_bandwidth_bytes_per_second;
    trial.latency_seconds = options_.nominal_latency_seconds;
    trial.block_bytes = options_.block_bytes;
    trial.scheme_rule = options_.scheme_rule;
    trial.allreduce = !request.allreduce_unavailable();
    trial.allreduce_bucket_bytes = BucketBytesOf(request);
    if (absl::StatusOr<planner::PlanResult> dry = planner::BuildPlan(request.model(), trial);
        !dry.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("model: ", dry.status().message()));
    }
    job->model = JobModel{request.model(), request.update_rule(), request.consistency(),
                          node->rank, !request.allreduce_unavailable(), BucketBytesOf(request)};
    job->scheme_overrides.clear();  // they named the old model's layers
    job->plan.reset();
    job->allreduce_step_ns.clear();  // measured by the ranks of this model's world
    job->plan_error.clear();
    PSD_LOG_INFO("job {}: model '{}' ({} layers) registered by rank {}", job->id,
                 request.model().name(), request.model().layers_size(), node->rank);
  }
  slot.model_ok = true;
  slot.model_refusal.clear();
  // The ring step the rank measured before registering: the first plan weighs the ring with it.
  if (request.allreduce_step_ns() > 0 && node->rank < job->world_size) {
    job->allreduce_step_ns[node->rank] = request.allreduce_step_ns();
  }
  if (request.has_running_plan()) TakeUpRunningPlan(*job, node->rank, request, now);
  ++version_;
  Refresh(*job, now);
  return absl::OkStatus();
}

// A restarted coordinator learns a running job's plan from its agents (RegisterModelRequest.
// running_plan): the newest epoch any rank received is the job's, its servers in their order are
// the world's, and the servers that joined are taken in the agents' order; later epochs go on
// from it. A plan that does not fit its model is refused before (ValidateRequest).
void Registry::TakeUpRunningPlan(Job& job, uint32_t rank, const v1::RegisterModelRequest& request,
                                 absl::Time now) {
  // Validated (ValidateRequest): it fits its model, its chunks its servers.
  const v1::Plan& running = request.running_plan();
  if (job.plan.has_value() && job.plan->plan_epoch() >= running.plan_epoch()) {
    job.last_plan_epoch = std::max(job.last_plan_epoch, running.plan_epoch());
  } else {
    job.plan = running;
    job.scheme_overrides = SchemeOverrides(running.scheme_overrides().begin(),
                                           running.scheme_overrides().end());
    job.plan_error.clear();
    job.last_plan_epoch = std::max(job.last_plan_epoch, running.plan_epoch());
    job.plan_installed_at = now;
    job.last_evaluated_bandwidth.reset();
    std::tie(job.plan_bandwidth, job.plan_latency) = Network(job, now);
    job.world_servers.clear();
    for (const v1::PlanServer& server : running.servers()) {
      job.world_servers.push_back(server.node_id());
    }
    ++plans_installed_;
    PSD_LOG_WARN("job {}: taken up from rank {} after a restart: plan epoch {} ({} layers, {} "
                 "servers) goes on",
                 job.id, rank, running.plan_epoch(), running.layers_size(),
                 running.servers_size());
  }
  // A plan server the agent lost before the restart, which did not register again: listed dead
  // to the job's agents (a rank taking the job up connects no such server), until it registers.
  for (const std::string& id : request.lost_servers()) {
    if (FindNode(id) != nullptr || !absl::c_linear_search(job.world_servers, id) ||
        nodes_.size() >= options_.max_nodes) {
      continue;
    }
    Node lost;
    lost.id = id;
    lost.role = v1::NODE_ROLE_SERVER;
    lost.job_id = job.id;
    lost.state = v1::NODE_STATE_DEAD;
    lost.state_reason = absl::StrCat("lost before this coordinator started (rank ", rank,
                                     " moved its keys on)");
    lost.last_seen = now;
    lost.state_since = now;
    nodes_.emplace(id, std::move(lost));  // no endpoints: PlanServers keeps the plan's
    PSD_LOG_WARN("job {}: server {} was lost before this coordinator started (rank {})", job.id,
                 id, rank);
  }
  // The joined servers' order is their place in every key's chain: a list that extends the
  // job's is taken.
  const auto& joined = request.joined_servers();
  if (static_cast<size_t>(joined.size()) > job.joined_servers.size() &&
      std::equal(job.joined_servers.begin(), job.joined_servers.end(), joined.begin())) {
    job.joined_servers.assign(joined.begin(), joined.end());
    PSD_LOG_WARN("job {}: {} servers had joined the running job (rank {})", job.id,
                 job.joined_servers.size(), rank);
  }
}

absl::StatusOr<bool> Registry::TryModelPlan(const Caller& caller, absl::string_view node_id,
                                            absl::Time now, v1::Plan* plan) {
  ASSIGN_OR_RETURN(Node * node, Member(caller, node_id, v1::NODE_ROLE_AGENT, now));
  ASSIGN_OR_RETURN(Job * job, AgentJob(*node));
  const RankSlot& slot = job->ranks[node->rank];
  if (!slot.model_ok) {
    return absl::FailedPreconditionError(
        slot.model_refusal.empty()
            ? absl::StrCat("rank ", node->rank, " has no registered model: register it again")
            : slot.model_refusal);
  }
  if (!job->plan_error.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job->id, "' cannot be planned: ", job->plan_error));
  }
  if (!job->plan.has_value() || !WorldFormed(*job) || !AllModelsAgree(*job)) return false;
  *plan = *job->plan;
  return true;
}

std::string Registry::DescribeMissingPlan(absl::string_view job_id, absl::Time now) const {
  const Job* job = FindJob(job_id);
  if (job == nullptr || job->world_size == 0) {
    return absl::StrCat("no agent of job '", job_id, "' has registered");
  }
  if (!WorldFormed(*job)) {
    return absl::StrCat("the world is incomplete: ", DescribeIncompleteWorld(job_id, now));
  }
  if (!job->model.has_value()) return "no rank has registered the model";
  std::vector<std::string> waiting;
  std::vector<std::string> refused;
  for (uint32_t r = 0; r < job->world_size; ++r) {
    const RankSlot& slot = job->ranks[r];
    if (slot.model_ok) continue;
    if (!slot.model_refusal.empty()) {
      refused.push_back(slot.model_refusal);
    } else {
      waiting.push_back(DescribeRank(*job, r, now));
    }
  }
  std::vector<std::string> parts;
  if (!waiting.empty()) {
    parts.push_back(absl::StrCat(waiting.size(), " of ", job->world_size,
                                 " ranks have not registered the model: ", Listed(waiting)));
  }
  if (!refused.empty()) parts.push_back(Listed(refused));
  if (!job->plan_error.empty()) parts.push_back(absl::StrCat("planning failed: ", job->plan_error));
  if (parts.empty()) return "the plan is ready";
  return absl::StrJoin(parts, "; ");
}

absl::StatusOr<bool> Registry::TryGetPlan(const Caller& caller, absl::string_view node_id,
                                          std::optional<uint64_t> min_epoch, absl::Time now,
                                          v1::Plan* plan) {
  if (caller.job_id.empty()) {
    return absl::InvalidArgumentError("header.job_id: GetPlan needs the job whose plan to return");
  }
  if (!node_id.empty()) {
    RETURN_IF_ERROR(Member(caller, node_id, v1::NODE_ROLE_UNSPECIFIED, now).status());
  }
  const Job* job = FindJob(caller.job_id);
  if (job == nullptr || !job->plan.has_value()) {
    if (!min_epoch.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", caller.job_id, "' has no plan yet: ", DescribeMissingPlan(caller.job_id, now)));
    }
    return false;
  }
  if (min_epoch.has_value() && job->plan->plan_epoch() < *min_epoch) return false;
  *plan = *job->plan;
  return true;
}

const v1::Plan* Registry::CurrentPlan(absl::string_view job_id) const {
  const Job* job = FindJob(job_id);
  return job != nullptr && job->plan.has_value() ? &*job->plan : nullptr;
}

void Registry::Refresh(Job& job, absl::Time now) {
  if (WorldComplete(job)) {
    std::vector<std::string> holders = CurrentHolders(job);
    if (holders != job.world_agents) {
      bool formed = true;
      if (job.world_servers.empty()) {
        const std::vector<const Node*> servers = EligibleServers(job.id);
        if (servers.size() < options_.min_servers) {
          formed = false;
        } else {
          for (const Node* server : servers) job.world_servers.push_back(server->id);
        }
      }
      if (formed) {
        job.world_agents = std::move(holders);
        ++version_;
        PSD_LOG_INFO("job {}: world formed: {} agents, {} servers (membership epoch {})", job.id,
                     job.world_size, job.world_servers.size(), membership_epoch_);
      }
    }
  }
  MaybePlan(job, now);
  // A server registered since the first plan went out joins the running job (Refresh runs
  // on every registration).
  JoinServers(job);
}

void Registry::JoinServers(Job& job) {
  if (!job.plan.has_value() || job.world_servers.empty()) return;
  for (const Node* server : EligibleServers(job.id)) {
    if (absl::c_linear_search(job.world_servers, server->id) ||
        absl::c_linear_search(job.joined_servers, server->id)) {
      continue;
    }
    job.joined_servers.push_back(server->id);
    PSD_LOG_WARN("job {}: KV server {} ({}) joined the running job (its server {}): a replicated "
                 "job's keys short of backups take copies there",
                 job.id, server->id, server->host,
                 job.world_servers.size() + job.joined_servers.size() - 1);
  }
}

std::vector<v1::PlanServer> Registry::PlanServers(const Job& job) const {
  std::vector<v1::PlanServer> servers;
  for (const std::string& id : job.world_servers) {
    v1::PlanServer server;
    server.set_node_id(id);
    const Node* node = FindNode(id);
    if (node != nullptr && !node->endpoints.empty()) {
      for (const v1::Endpoint& endpoint : node->endpoints) *server.add_endpoints() = endpoint;
    } else if (job.plan.has_value()) {
      // Endpoints unknown here: a server lost before this coordinator restarted, or not
      // registered again yet (TakeUpRunningPlan). The plan keeps the endpoints it had, so that
      // its death alone never makes a new plan.
      for (const v1::PlanServer& planned : job.plan->servers()) {
        if (planned.node_id() == id) server = planned;
      }
    }
    servers.push_back(std::move(server));
  }
  return servers;
}

absl::flat_hash_set<std::string> Registry::Members(const Job& job) const {
  absl::flat_hash_set<std::string> members(job.world_agents.begin(), job.world_agents.end());
  members.insert(job.world_servers.begin(), job.world_servers.end());
  members.insert(job.joined_servers.begin(), job.joined_servers.end());
  return members;
}

std::pair<double, double> Registry::Network(const Job& job, absl::Time now) const {
  const NetworkEstimate estimate =
      links_.Estimate(Members(job), now, options_.telemetry_max_age,
                      {options_.telemetry_min_bytes, options_.nominal_bandwidth_bytes_per_second});
  return {estimate.bandwidth_bytes_per_second.value_or(options_.nominal_bandwidth_bytes_per_second),
          estimate.latency_seconds.value_or(options_.nominal_latency_seconds)};
}

absl::StatusOr<v1::Plan> Registry::Build(const Job& job, double bandwidth, double latency,
                                         uint64_t epoch, uint64_t effective_iteration,
                                         const SchemeOverrides& overrides) const {
  planner::PlannerConfig config;
  config.workers = job.world_size;
  config.servers = static_cast<uint32_t>(job.world_servers.size());
  config.batch_per_worker = options_.batch_per_worker;
  config.colocated = options_.colocated;
  config.bandwidth_bytes_per_second = bandwidth;
  config.latency_seconds = latency;
  config.block_bytes = options_.block_bytes;
  config.scheme_rule = options_.scheme_rule;
  config.fusion = options_.fusion;
  config.lossy_wire = options_.lossy_wire;
  config.lowrank_rank = options_.lowrank_rank;
  config.lowrank_overrides = options_.lowrank_overrides;
  config.allreduce = job.model->allreduce;
  config.allreduce_bucket_bytes = job.model->allreduce_bucket_bytes;
  if (options_.allreduce_by_cost) config.allreduce_step_seconds = AllreduceStep(job);
  config.job_id = job.id;
  config.plan_epoch = epoch;
  config.effective_iteration = effective_iteration;
  config.membership_epoch = membership_epoch_;
  config.server_node_ids = job.world_servers;
  config.scheme_overrides = overrides;
  // A re-plan of the same world (the model's layers, the servers in their order): the agents
  // formed their all-reduce buckets from its first plan (they form them only then), so the
  // planner plans with those (plan.proto, allreduce_bucket).
  bool same_world = job.plan.has_value() &&
                    job.plan->layers_size() == job.model->spec.layers_size() &&
                    job.plan->servers_size() == static_cast<int>(job.world_servers.size());
  for (int i = 0; same_world && i < job.plan->servers_size(); ++i) {
    same_world = job.plan->servers(i).node_id() == job.world_servers[static_cast<size_t>(i)];
  }
  if (same_world) {
    // All zeros too: then every layer the ring takes runs its own collective.
    for (const v1::LayerPlan& layer : job.plan->layers()) {
      config.fixed_allreduce_buckets.push_back(layer.allreduce_bucket());
    }
  }
  ASSIGN_OR_RETURN(planner::PlanResult result, planner::BuildPlan(job.model->spec, config));
  for (const auto& [name, scheme] : overrides) {
    (*result.plan.mutable_scheme_overrides())[name] = scheme;
  }
  const std::vector<v1::PlanServer> servers = PlanServers(job);
  for (size_t i = 0; i < servers.size(); ++i) {
    *result.plan.mutable_servers(static_cast<int>(i)) = servers[i];
  }
  // A re-plan of the same world keeps every layer's chunks and buckets exactly (plan.proto,
  // LayerPlan.chunks and .bucket):
  // the planner's partition does not depend on schemes, and carrying the current chunks over
  // makes that a guarantee rather than a property of the planner.
  if (same_world) {
    bool moved = false;
    for (int i = 0; i < result.plan.layers_size(); ++i) {
      v1::LayerPlan* layer = result.plan.mutable_layers(i);
      const v1::LayerPlan& previous = job.plan->layers(i);
      if (!moved) {
        moved = layer->chunks_size() != previous.chunks_size();
        for (int c = 0; !moved && c < layer->chunks_size(); ++c) {
          moved = !google::protobuf::util::MessageDifferencer::Equals(layer->chunks(c),
                                                                      previous.chunks(c));
        }
      }
      *layer->mutable_chunks() = previous.chunks();
      // The buckets too: the agents formed them from the world's first plan (plan.proto).
      layer->set_bucket(previous.bucket());
      // And the wire (the servers' tables were registered with it).
      layer->set_wire_type(previous.wire_type());
      // And the low rank (the agents' compressors were set up from the first plan).
      layer->set_lowrank_rank(previous.lowrank_rank());
      // And the all-reduce buckets (the planner kept them: fixed_allreduce_buckets).
      layer->set_allreduce_bucket(previous.allreduce_bucket());
    }
    result.plan.set_bucket_bytes(job.plan->bucket_bytes());
    if (moved) {
      PSD_LOG_WARN("job {}: the planner moved chunks within one world; epoch {} keeps epoch {}'s",
                   job.id, epoch, job.plan->plan_epoch());
    }
  }
  return std::move(result.plan);
}

void Registry::Install(Job& job, v1::Plan plan, double bandwidth, double latency,
                       absl::string_view why, absl::Time now) {
  job.last_plan_epoch = plan.plan_epoch();
  job.plan_bandwidth = bandwidth;
  job.plan_latency = latency;
  job.plan_error.clear();
  job.last_evaluated_bandwidth.reset();
  job.plan_installed_at = now;
  int sfb = 0, ring = 0;
  uint32_t ring_buckets = 0;
  for (const v1::LayerPlan& layer : plan.layers()) {
    if (layer.scheme() == v1::SYNC_SCHEME_SFB) ++sfb;
    if (layer.scheme() == v1::SYNC_SCHEME_ALLREDUCE) ++ring;
    ring_buckets = std::max(ring_buckets, layer.allreduce_bucket());
  }
  PSD_LOG_INFO(
      "job {}: plan epoch {} from iteration {} ({}): {} layers, {} on SFB, {} on ring all-reduce "
      "({} all-reduce buckets), bandwidth {}, latency {:.6g}us",
      job.id, plan.plan_epoch(), plan.effective_iteration(), why, plan.layers_size(), sfb, ring,
      ring_buckets, Bandwidth(bandwidth), latency * 1e6);
  job.plan = std::move(plan);
  ++plans_installed_;
  ++version_;
}

void Registry::MaybePlan(Job& job, absl::Time now) {
  if (!WorldFormed(job) || !AllModelsAgree(job)) return;
  double bandwidth = job.plan_bandwidth;
  double latency = job.plan_latency;
  std::string why;
  if (!job.plan.has_value()) {
    std::tie(bandwidth, latency) = Network(job, now);
    why = "first plan of the world";
  } else {
    const std::vector<v1::PlanServer> servers = PlanServers(job);
    bool same = static_cast<int>(servers.size()) == job.plan->servers_size();
    for (size_t i = 0; same && i < servers.size(); ++i) {
      same = google::protobuf::util::MessageDifferencer::Equals(
          servers[i], job.plan->servers(static_cast<int>(i)));
    }
    if (same) return;
    why = "a server's endpoints changed";
  }
  if (!job.plan_error.empty()) return;  // cleared by the next model registration
  const uint64_t effective = job.plan.has_value() ? EffectiveIteration(job, now) : 0;
  absl::StatusOr<v1::Plan> plan =
      Build(job, bandwidth, latency, job.last_plan_epoch + 1, effective, job.scheme_overrides);
  if (!plan.ok()) {
    job.plan_error = std::string(plan.status().message());
    ++version_;
    PSD_LOG_ERROR("job {}: cannot plan: {}", job.id, job.plan_error);
    return;
  }
  Install(job, *std::move(plan), bandwidth, latency, why, now);
}

void Registry::EvaluateReplan(Job& job, absl::Time now) {
  if (!job.plan.has_value() || !job.model.has_value() || !WorldFormed(job) ||
      !AllModelsAgree(job)) {
    return;
  }
  // Achieved throughput is a lower bound of the capacity: it may raise the estimate above the
  // plan's bandwidth, but an idle or compute-bound link never drags it down.
  const NetworkEstimate estimate =
      links_.Estimate(Members(job), now, options_.telemetry_max_age,
                      {options_.telemetry_min_bytes, job.plan_bandwidth});
  if (!estimate.bandwidth_bytes_per_second.has_value()) {
    job.replan_deferred = false;
    return;
  }
  const double measured = *estimate.bandwidth_bytes_per_second;
  // Hysteresis: small moves never re-plan, so noise cannot make plans flap.
  if (!MovedBeyond(job.plan_bandwidth, measured, options_.replan_threshold)) {
    job.replan_deferred = false;
    return;
  }
  // A move already judged (no change of scheme) is not re-judged until it moves on.
  if (job.last_evaluated_bandwidth.has_value() &&
      !MovedBeyond(*job.last_evaluated_bandwidth, measured, options_.replan_threshold / 4)) {
    return;
  }
  // At most one re-plan per replan_min_interval: a move measured sooner is judged when the
  // interval has passed (ReplanDue), on the estimate of that moment.
  if (job.plan_installed_at.has_value() &&
      now - *job.plan_installed_at < options_.replan_min_interval) {
    if (!job.replan_deferred) {
      PSD_LOG_DEBUG("job {}: bandwidth {} (plan: {}); re-planning deferred by {}", job.id,
                    Bandwidth(measured), Bandwidth(job.plan_bandwidth),
                    Ago(*job.plan_installed_at + options_.replan_min_interval - now));
    }
    job.replan_deferred = true;
    job.replan_due = *job.plan_installed_at + options_.replan_min_interval;
    return;
  }
  job.replan_deferred = false;
  job.last_evaluated_bandwidth = measured;
  const double latency = estimate.latency_seconds.value_or(options_.nominal_latency_seconds);
  const absl::StatusOr<bool> installed = ReplanIfSchemesChange(
      job, measured, latency,
      absl::StrCat("measured bandwidth moved from ", Bandwidth(job.plan_bandwidth), " to ",
                   Bandwidth(measured)),
      now);
  if (!installed.ok()) {
    PSD_LOG_WARN("job {}: re-planning for {} failed: {}", job.id, Bandwidth(measured),
                 installed.status().message());
  } else if (!*installed) {
    PSD_LOG_DEBUG("job {}: bandwidth {} (plan: {}) changes no scheme; plan kept", job.id,
                  Bandwidth(measured), Bandwidth(job.plan_bandwidth));
  }
}

absl::StatusOr<bool> Registry::ReplanIfSchemesChange(Job& job, double bandwidth, double latency,
                                                     const std::string& why, absl::Time now) {
  ASSIGN_OR_RETURN(v1::Plan candidate, Build(job, bandwidth, latency, job.last_plan_epoch + 1,
                                             EffectiveIteration(job, now), job.scheme_overrides));
  if (Schemes(candidate) == Schemes(*job.plan)) return false;
  Install(job, std::move(candidate), bandwidth, latency, why, now);
  return true;
}

std::optional<double> Registry::AllreduceStep(const Job& job) {
  if (job.world_size < 2 || job.allreduce_step_ns.size() < job.world_size) return std::nullopt;
  uint64_t slowest = 0;
  for (const auto& [rank, ns] : job.allreduce_step_ns) slowest = std::max(slowest, ns);
  return static_cast<double>(slowest) * 1e-9;
}

void Registry::ReplanForMeasuredRing(Job& job, absl::Time now) {
  if (!options_.allreduce_by_cost || !job.plan.has_value() || !job.model.has_value() ||
      !job.model->allreduce || !WorldFormed(job) || !AllModelsAgree(job)) {
    return;  // the first plan (MaybePlan) will weigh the ring
  }
  const double step = *AllreduceStep(job);
  const absl::StatusOr<bool> installed = ReplanIfSchemesChange(
      job, job.plan_bandwidth, job.plan_latency,
      absl::StrCat("ring all-reduce measured at ", absl::FormatDuration(absl::Seconds(step)),
                   " per step"),
      now);
  if (!installed.ok()) {
    PSD_LOG_WARN("job {}: re-planning with the measured ring failed: {}", job.id,
                 installed.status().message());
  } else if (!*installed) {
    PSD_LOG_INFO("job {}: ring all-reduce measured at {:.3g}us per step: no layer is faster by it",
                 job.id, step * 1e6);
  }
}

void Registry::ReplanDue(absl::Time now) {
  for (auto& [id, job] : jobs_) {
    if (job.replan_deferred && now >= job.replan_due) EvaluateReplan(job, now);
  }
}

// ---- Progress and the effective iteration
// --------------------------------------------------------

void Registry::ObserveIteration(Job& job, uint64_t iteration, absl::Time now) {
  if (!job.progress.empty() && iteration <= job.max_iteration) return;
  job.max_iteration = std::max(job.max_iteration, iteration);
  // At most one sample per 100 ms: the newest replaces a sample taken less than that after the
  // one before it, which bounds the samples to the window / 100 ms.
  if (job.progress.size() >= 2 &&
      now - job.progress[job.progress.size() - 2].first < absl::Milliseconds(100)) {
    job.progress.back() = {now, job.max_iteration};
  } else {
    job.progress.emplace_back(now, job.max_iteration);
  }
  while (job.progress.size() > 1 &&
         job.progress.front().first < now - options_.iteration_rate_window) {
    job.progress.pop_front();
  }
}

// The job's progress samples inside the rate window: the oldest's index, and the seconds from it
// to the newest (nullopt when no sample is inside: a stalled job).
std::optional<std::pair<size_t, double>> Registry::RateWindow(const Job& job,
                                                              absl::Time now) const {
  const absl::Time start = now - options_.iteration_rate_window;
  const auto first = std::find_if(job.progress.begin(), job.progress.end(),
                                  [&](const auto& sample) { return sample.first >= start; });
  if (first == job.progress.end()) return std::nullopt;
  return std::make_pair(static_cast<size_t>(first - job.progress.begin()),
                        absl::ToDoubleSeconds(job.progress.back().first - first->first));
}

double Registry::Rate(const Job& job, absl::Time now) const {
  // From the oldest and the newest samples inside the window; a stalled job (no new iteration
  // within the window) or samples spanning less than a second give 0.
  const auto window = RateWindow(job, now);
  if (!window || window->second < 1.0) return 0;
  return static_cast<double>(job.progress.back().second - job.progress[window->first].second) /
         window->second;
}

// Whether the job is training but its rate is not known yet (samples of the window span less
// than a second, or nothing reported yet: reports lag behind the training).
bool Registry::RateUnknown(const Job& job, absl::Time now) const {
  if (job.max_iteration == 0) return job.plan.has_value();
  const auto window = RateWindow(job, now);
  return window && window->second < 1.0;
}

uint64_t Registry::EffectiveIteration(const Job& job, absl::Time now) const {
  const double rate = Rate(job, now);
  const absl::Time last_at = job.progress.empty() ? now : job.progress.back().first;
  const double ahead =
      rate * (absl::ToDoubleSeconds(std::max(now - last_at, absl::ZeroDuration())) +
              absl::ToDoubleSeconds(options_.plan_lead_time));
  // Saturating: a plan 2^62 iterations ahead is as good as never, and never wraps around.
  constexpr double kMax = 4611686018427387904.0;  // 2^62
  const double estimate = std::min(std::ceil(static_cast<double>(job.max_iteration) + ahead), kMax);
  uint64_t effective = static_cast<uint64_t>(estimate);
  // A job that started less than a second ago may run fast: without a rate, a wide margin.
  const uint64_t lead = RateUnknown(job, now) ? std::max(options_.plan_lead_iterations,
                                                         options_.plan_unknown_rate_lead_iterations)
                                              : options_.plan_lead_iterations;
  effective += std::min<uint64_t>(lead, std::numeric_limits<uint64_t>::max() - effective);
  // Epochs take effect in order: after the current plan's iteration.
  if (job.plan.has_value() && effective <= job.plan->effective_iteration()) {
    effective = job.plan->effective_iteration() + 1;
  }
  return effective;
}

uint64_t Registry::NextEffectiveIteration(absl::string_view job_id, absl::Time now) const {
  const Job* job = FindJob(job_id);
  return job == nullptr ? 0 : EffectiveIteration(*job, now);
}

double Registry::IterationRate(absl::string_view job_id, absl::Time now) const {
  const Job* job = FindJob(job_id);
  return job == nullptr ? 0 : Rate(*job, now);
}

// ---- Operator overrides
// --------------------------------------------------------------------------

absl::Status Registry::SetLayerSchemes(const Caller& caller,
                                       const v1::SetLayerSchemesRequest& request, absl::Time now,
                                       v1::SetLayerSchemesResponse* response) {
  if (!caller.job_id.empty() && !request.job_id().empty() && request.job_id() != caller.job_id) {
    return absl::PermissionDeniedError(absl::StrCat(
        "job_id: the token of job '", caller.job_id, "' may only change that job's plan, not job '",
        request.job_id(), "'s (use that job's token or the cluster token)"));
  }
  const std::string job_id = caller.job_id.empty() ? request.job_id() : caller.job_id;
  const auto found = jobs_.find(job_id);
  if (found == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "job '", job_id, "' is unknown to this coordinator (no agent has registered)"));
  }
  Job& job = found->second;
  if (!job.plan.has_value() || !job.model.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job_id, "' has no plan yet: ", DescribeMissingPlan(job_id, now)));
  }
  // Checked in name order, all before anything changes.
  const std::map<std::string, v1::SyncScheme> requested(request.schemes().begin(),
                                                        request.schemes().end());
  SchemeOverrides overrides = job.scheme_overrides;
  for (const auto& [name, scheme] : requested) {
    const auto layer =
        std::find_if(job.model->spec.layers().begin(), job.model->spec.layers().end(),
                     [&name = name](const v1::LayerSpec& spec) { return spec.name() == name; });
    if (layer == job.model->spec.layers().end()) {
      return absl::InvalidArgumentError(absl::StrCat("schemes['", name, "']: job '", job_id,
                                                     "''s model '", job.model->spec.name(),
                                                     "' has no layer '", name, "'"));
    }
    if (scheme == v1::SYNC_SCHEME_SFB && layer->kind() != v1::LAYER_KIND_FC) {
      return absl::InvalidArgumentError(absl::StrCat("schemes['", name, "']: layer '", name,
                                                     "' is ", v1::LayerKind_Name(layer->kind()),
                                                     ": only FC layers can use SFB"));
    }
    if (scheme == v1::SYNC_SCHEME_UNSPECIFIED) {
      overrides.erase(name);
    } else {
      overrides[name] = scheme;
    }
  }
  absl::StatusOr<v1::Plan> candidate =
      Build(job, job.plan_bandwidth, job.plan_latency, job.last_plan_epoch + 1,
            EffectiveIteration(job, now), overrides);
  if (!candidate.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("schemes: the job cannot be planned so: ", candidate.status().message()));
  }
  // The overrides live in the plan's epochs (Plan.scheme_overrides), which every agent holds: a
  // restarted coordinator takes them up from there (TakeUpRunningPlan). So a change of them is
  // a new epoch even where no scheme changes (a layer pinned to the scheme it has), or it would
  // be lost with the coordinator; the same overrides again are nothing new.
  const bool overrides_changed = overrides != job.scheme_overrides;
  job.scheme_overrides = std::move(overrides);
  std::vector<std::string> listed;
  for (const auto& [name, scheme] : job.scheme_overrides) {
    listed.push_back(absl::StrCat(name, "=", v1::SyncScheme_Name(scheme)));
    (*response->mutable_overrides())[name] = scheme;
  }
  const bool schemes_changed = Schemes(*candidate) != Schemes(*job.plan);
  const bool changed = schemes_changed || overrides_changed;
  if (changed) {
    std::string why = "operator override";
    if (!request.reason().empty()) absl::StrAppend(&why, " (", request.reason(), ")");
    absl::StrAppend(&why, ": ", listed.empty() ? "none, back to the cost model" : Listed(listed));
    if (!schemes_changed) absl::StrAppend(&why, " (no scheme changes)");
    Install(job, *std::move(candidate), job.plan_bandwidth, job.plan_latency, why, now);
  } else {
    ++version_;
    PSD_LOG_INFO("job {}: operator override ({}) changes nothing; plan epoch {} kept", job.id,
                 listed.empty() ? "none" : Listed(listed), job.plan->plan_epoch());
  }
  response->set_installed(changed);
  *response->mutable_plan() = *job.plan;
  FillHeader(job.id, response->mutable_header());
  return absl::OkStatus();
}

// ---- The job's rendezvous store -----------------------------------------------------------------

namespace {

// A store key for a message: C-escaped (keys are bytes), cut at 64 bytes, quoted.
std::string QuotedKey(absl::string_view key) {
  constexpr size_t kShown = 64;
  std::string text = absl::StrCat("'", absl::CHexEscape(key.substr(0, kShown)), "'");
  if (key.size() > kShown) absl::StrAppend(&text, "... (", key.size(), " bytes)");
  return text;
}

}  // namespace

absl::Status Registry::StoreSet(const Caller& caller, const v1::StoreSetRequest& request,
                                absl::Time now) {
  if (caller.job_id.empty()) {
    return absl::InvalidArgumentError("header.job_id: the store is a job's; name the job");
  }
  RETURN_IF_ERROR(
      Member(caller, request.header().node_id(), v1::NODE_ROLE_UNSPECIFIED, now).status());
  Job& job = JobFor(caller.job_id);
  const auto found = job.store.find(request.key());
  const size_t old_bytes =
      found == job.store.end() ? 0 : found->first.size() + found->second.size();
  const size_t new_bytes = request.key().size() + request.value().size();
  if (found == job.store.end() && job.store.size() >= kMaxStoreKeys) {
    return absl::ResourceExhaustedError(
        absl::StrCat("job '", job.id, "''s store already holds ", job.store.size(),
                     " keys (the most a job may hold); cannot add ", QuotedKey(request.key())));
  }
  if (job.store_bytes - old_bytes + new_bytes > kMaxStoreBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("job '", job.id, "''s store would hold ",
                     job.store_bytes - old_bytes + new_bytes, " bytes of keys and values with ",
                     QuotedKey(request.key()), "; at most ", kMaxStoreBytes, " allowed"));
  }
  if (found == job.store.end()) {
    job.store.emplace(request.key(), request.value());
  } else {
    found->second = request.value();
  }
  job.store_bytes = job.store_bytes - old_bytes + new_bytes;
  ++version_;  // wakes the StoreGet calls waiting for it
  return absl::OkStatus();
}

absl::StatusOr<bool> Registry::TryStoreGet(const Caller& caller, const v1::StoreGetRequest& request,
                                           absl::Time now, v1::StoreGetResponse* response) {
  if (caller.job_id.empty()) {
    return absl::InvalidArgumentError("header.job_id: the store is a job's; name the job");
  }
  RETURN_IF_ERROR(
      Member(caller, request.header().node_id(), v1::NODE_ROLE_UNSPECIFIED, now).status());
  const Job* job = FindJob(caller.job_id);
  if (job == nullptr) return false;
  std::vector<const std::string*> values;
  values.reserve(static_cast<size_t>(request.keys_size()));
  for (const std::string& key : request.keys()) {
    const auto found = job->store.find(key);
    if (found == job->store.end()) return false;
    values.push_back(&found->second);
  }
  response->clear_values();
  for (const std::string* value : values) response->add_values(*value);
  FillHeader(caller.job_id, response->mutable_header());
  return true;
}

std::string Registry::DescribeMissingKeys(
    absl::string_view job_id, const google::protobuf::RepeatedPtrField<std::string>& keys) const {
  constexpr size_t kNamed = 8;
  const Job* job = FindJob(job_id);
  absl::flat_hash_set<absl::string_view> seen;
  std::vector<std::string> missing;
  size_t unique = 0;
  size_t not_set = 0;
  for (const std::string& key : keys) {
    if (!seen.insert(key).second) continue;
    ++unique;
    if (job != nullptr && job->store.contains(key)) continue;
    if (++not_set <= kNamed) missing.push_back(QuotedKey(key));
  }
  std::string text =
      absl::StrCat(not_set, " of ", unique, " keys not set: ", absl::StrJoin(missing, ", "));
  if (not_set > kNamed) absl::StrAppend(&text, " and ", not_set - kNamed, " more");
  return text;
}

size_t Registry::StoreKeys(absl::string_view job_id) const {
  const Job* job = FindJob(job_id);
  return job == nullptr ? 0 : job->store.size();
}

// ---- Telemetry, liveness, status ---------------------------------------------------------------

absl::Status Registry::ReportTelemetry(const Caller& caller,
                                       const v1::ReportTelemetryRequest& request, absl::Time now) {
  ASSIGN_OR_RETURN(Node * node,
                   Member(caller, request.header().node_id(), v1::NODE_ROLE_UNSPECIFIED, now));
  node->telemetry_links.clear();
  for (v1::LinkTelemetry link : request.links()) {
    if (link.peer_node_id().empty()) {
      // A peer named by job and rank (servers know agents from the data-plane handshake only):
      // the node holding that rank now, if the reporter's scope covers the job.
      if (!caller.job_id.empty() && link.peer_job_id() != caller.job_id) continue;
      const Job* job = FindJob(link.peer_job_id());
      if (job == nullptr || link.peer_rank() >= job->ranks.size()) continue;
      link.set_peer_node_id(job->ranks[link.peer_rank()].node_id);
      link.clear_peer_job_id();
      link.clear_peer_rank();
    }
    // Links to unknown nodes are dropped: the table only grows with real pairs of nodes.
    if (link.peer_node_id().empty() || link.peer_node_id() == node->id ||
        FindNode(link.peer_node_id()) == nullptr) {
      continue;
    }
    LinkSample sample{link.bytes_per_second(), link.latency_ns(), now, link.window_ns(),
                      std::max(link.bytes(), link.received_bytes())};
    sample.capacity_bytes_per_second = link.capacity_bytes_per_second();
    links_.Record(node->id, link.peer_node_id(), sample);
    node->telemetry_links.push_back(link);
  }
  node->telemetry_layers.assign(request.layers().begin(), request.layers().end());
  node->telemetry_replication.clear();
  if (node->role == v1::NODE_ROLE_SERVER) {
    for (const v1::ReplicationTelemetry& r : request.replication()) {
      // Within the reporter's scope (a job's server reports that job only).
      if (caller.job_id.empty() || r.job_id() == caller.job_id) {
        node->telemetry_replication.push_back(r);
      }
    }
  }
  node->telemetry_at = now;
  if (node->role == v1::NODE_ROLE_AGENT) {
    node->iteration = std::max(node->iteration, request.iteration());
    ASSIGN_OR_RETURN(Job * job, AgentJob(*node));
    ObserveIteration(*job, request.iteration(), now);
    if (request.allreduce_step_ns() > 0 && node->rank < job->world_size) {
      const bool known = AllreduceStep(*job).has_value();
      job->allreduce_step_ns[node->rank] = request.allreduce_step_ns();
      if (!known && AllreduceStep(*job).has_value()) ReplanForMeasuredRing(*job, now);
    }
    EvaluateReplan(*job, now);
  } else {
    for (auto& [id, job] : jobs_) {
      if (std::find(job.world_servers.begin(), job.world_servers.end(), node->id) !=
          job.world_servers.end()) {
        EvaluateReplan(job, now);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Registry::Heartbeat(const Caller& caller, const v1::HeartbeatRequest& request,
                                 absl::Time now, v1::HeartbeatResponse* response) {
  const std::string& node_id = request.header().node_id();
  Node* node = FindNode(node_id);
  if (node == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "node '", node_id,
        "' is not registered with this coordinator (it may have restarted): register again"));
  }
  RETURN_IF_ERROR(CheckScope(caller, *node));
  if (request.role() != node->role) {
    return absl::InvalidArgumentError(absl::StrCat("role: ", v1::NodeRole_Name(request.role()),
                                                   ", but node '", node_id, "' registered as ",
                                                   v1::NodeRole_Name(node->role)));
  }
  FillHeader(caller.job_id, response->mutable_header());
  if (!Live(node)) {
    // Dead or departed is final for this id: the node is told to stop (and may register anew).
    response->set_shutdown(true);
    response->set_lease_ms(0);
    return absl::OkStatus();
  }
  if (request.world_generation() > 0) {
    const Job* of = FindJob(node->job_id);
    const uint32_t world = of != nullptr ? of->world_size : 0;
    if (node->role != v1::NODE_ROLE_AGENT || request.live_world() == 0 ||
        request.live_world() > world) {
      return absl::InvalidArgumentError(absl::StrCat(
          "live_world ", request.live_world(), " (generation ", request.world_generation(),
          "): an agent reports between 1 and its job's world size (", world, ") ranks"));
    }
    if (request.world_generation() >= node->world_generation) {
      node->live_world = request.live_world();
      node->world_generation = request.world_generation();
    }
  }
  // Checked whole before any of it is taken.
  const Job* of = request.peers_gone_size() > 0 ? FindJob(node->job_id) : nullptr;
  for (const uint32_t gone : request.peers_gone()) {
    if (node->role != v1::NODE_ROLE_AGENT || of == nullptr || gone >= of->world_size ||
        gone == node->rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "peers_gone names rank ", gone, ": an agent reports other ranks of its job's world (",
          of != nullptr ? of->world_size : 0, " ranks)"));
    }
  }
  // A KV server's: ranks of the jobs it may serve (its caller's scope), within their worlds. A
  // job this coordinator has no world of with this server in it (a restarted coordinator, a job
  // formed without it) is left out, not refused: refusing would fail the server's heartbeat.
  auto reported = [&](const v1::RanksGone& gone) -> const Job* {
    const Job* job = FindJob(gone.job_id());
    if (job == nullptr || (!absl::c_linear_search(job->world_servers, node->id) &&
                           !absl::c_linear_search(job->joined_servers, node->id))) {
      return nullptr;
    }
    return job;
  };
  for (const v1::RanksGone& gone : request.ranks_gone()) {
    if (node->role != v1::NODE_ROLE_SERVER ||
        (!caller.job_id.empty() && caller.job_id != gone.job_id())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ranks_gone names job '", gone.job_id(),
          "': a KV server reports the ranks of the jobs it serves"));
    }
    const Job* job = reported(gone);
    if (job == nullptr) continue;
    for (const uint32_t rank : gone.ranks()) {
      if (rank >= job->world_size) {
        return absl::InvalidArgumentError(absl::StrCat("ranks_gone names rank ", rank, " of job '",
                                                       gone.job_id(), "' (", job->world_size,
                                                       " ranks)"));
      }
    }
  }
  // Takes a report that `rank` of `job` lost every connection to `by`.
  auto report = [&](const Job& job, uint32_t rank, const std::string& by) {
    if (rank >= job.world_agents.size()) return;  // no world yet
    if (Node* peer = FindNode(job.world_agents[rank]); peer != nullptr && Live(peer)) {
      peer->gone_reported = now;
      peer->gone_reported_by = by;
    }
  };
  if (of != nullptr) {
    for (const uint32_t gone : request.peers_gone()) {
      report(*of, gone, absl::StrCat("rank ", node->rank, "'s agent"));
    }
  }
  for (const v1::RanksGone& gone : request.ranks_gone()) {
    const Job* job = reported(gone);
    if (job == nullptr) continue;
    for (const uint32_t rank : gone.ranks()) report(*job, rank, absl::StrCat("KV server ", node->id));
  }
  node->last_seen = now;
  node->iteration = std::max(node->iteration, request.iteration());
  node->plan_epoch = request.plan_epoch();
  if (node->role == v1::NODE_ROLE_AGENT) {
    if (auto job = jobs_.find(node->job_id); job != jobs_.end()) {
      ObserveIteration(job->second, request.iteration(), now);
      if (request.took_up_at() > 1 && !node->took_up) {
        node->took_up = true;
        ++job->second.takeovers;
      }
      // The world's members declared dead (the agent fails what waits for them now), and its
      // agents that left with an error (a job that may shrink goes on without them).
      auto list = [&](google::protobuf::RepeatedPtrField<v1::LostMember>* into,
                      const Node& member, uint32_t rank) {
        v1::LostMember* out = into->Add();
        out->set_role(member.role);
        out->set_rank(rank);
        out->set_node_id(member.id);
        out->set_host(member.host);
        out->set_reason(member.state_reason);
        out->set_dead_for_ms(Millis(now - member.state_since));
      };
      auto lost = [&](const std::string& id, uint32_t rank) {
        const Node* member = FindNode(id);
        if (member == nullptr || member->id == node->id) return;
        if (member->state == v1::NODE_STATE_DEAD) {
          list(response->mutable_lost(), *member, rank);
        } else if (member->state == v1::NODE_STATE_LEFT && member->left_failed) {
          list(response->mutable_departed(), *member, rank);
        }
      };
      const Job& j = job->second;
      for (size_t r = 0; r < j.world_agents.size(); ++r) {
        lost(j.world_agents[r], static_cast<uint32_t>(r));
      }
      for (uint32_t r = 0; r < j.ranks.size(); ++r) {
        const Node* holder = FindNode(j.ranks[r].node_id);
        if (Live(holder) && holder->rank_restarts > 0) {
          response->add_replaced(r);
          response->add_replaced_by(holder->id);
        }
      }
      response->set_takeovers(j.takeovers);
      for (const std::string& server : j.world_servers) lost(server, 0);
      // Not listed as lost when they die: a job that does not replicate never used them, and
      // one that does walks past them as past any lost server.
      for (const std::string& server : j.joined_servers) {
        v1::PlanServer* joined = response->add_joined_servers();
        joined->set_node_id(server);
        if (const Node* n = FindNode(server)) {
          for (const v1::Endpoint& endpoint : n->endpoints) *joined->add_endpoints() = endpoint;
        }
      }
    }
  } else if (node->role == v1::NODE_ROLE_SERVER) {
    ListLostServers(caller, *node, now, response);
  }
  response->set_lease_ms(Millis(options_.lease));
  return absl::OkStatus();
}

void Registry::ListLostServers(const Caller& caller, const Node& server, absl::Time now,
                               v1::HeartbeatResponse* response) const {
  for (const auto& [id, job] : jobs_) {
    if (!caller.job_id.empty() && caller.job_id != id) continue;
    // The job's servers as its agents register them: the plan's, then the joined ones.
    std::vector<const std::string*> members;
    for (const std::string& s : job.world_servers) members.push_back(&s);
    for (const std::string& s : job.joined_servers) members.push_back(&s);
    if (std::none_of(members.begin(), members.end(),
                     [&](const std::string* s) { return *s == server.id; })) {
      continue;
    }
    for (size_t index = 0; index < members.size(); ++index) {
      const Node* member = FindNode(*members[index]);
      if (member == nullptr || member->id == server.id || member->state != v1::NODE_STATE_DEAD) {
        continue;
      }
      v1::LostServer* out = response->add_lost_servers();
      out->set_job_id(id);
      out->set_server_index(static_cast<uint32_t>(index));
      out->mutable_server()->set_node_id(member->id);
      for (const v1::Endpoint& e : member->endpoints) *out->mutable_server()->add_endpoints() = e;
      out->set_reason(member->state_reason);
      out->set_dead_for_ms(Millis(now - member->state_since));
    }
  }
}

absl::Status Registry::Deregister(const Caller& caller, const v1::DeregisterRequest& request,
                                  absl::Time now) {
  const std::string& node_id = request.header().node_id();
  Node* node = FindNode(node_id);
  if (node == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("node '", node_id, "' is not registered with this coordinator"));
  }
  RETURN_IF_ERROR(CheckScope(caller, *node));
  if (node->state == v1::NODE_STATE_LEFT) return absl::OkStatus();
  MarkLeft(*node, now, request.reason().empty() ? "deregistered" : request.reason());
  node->left_failed = request.failed();
  return absl::OkStatus();
}

absl::Status Registry::ClusterStatus(const Caller& caller, absl::Time now,
                                     v1::GetClusterStatusResponse* response) const {
  response->set_membership_epoch(membership_epoch_);
  FillHeader(caller.job_id, response->mutable_header());
  std::vector<const Node*> shown;
  for (const auto& [id, node] : nodes_) {
    const bool visible = caller.job_id.empty() || node.job_id == caller.job_id ||
                         (node.role == v1::NODE_ROLE_SERVER && node.job_id.empty());
    if (visible) shown.push_back(&node);
  }
  std::sort(shown.begin(), shown.end(), [](const Node* a, const Node* b) {
    return std::tie(a->role, a->job_id, a->rank, a->seq) <
           std::tie(b->role, b->job_id, b->rank, b->seq);
  });
  const absl::Duration suspect_after = 2 * heartbeat_interval();
  for (const Node* node : shown) {
    v1::NodeStatus* out = response->add_nodes();
    out->set_node_id(node->id);
    out->set_role(node->role);
    v1::NodeState state = node->state;
    if (state == v1::NODE_STATE_ALIVE && node->waits == 0 &&
        now - node->last_seen > suspect_after) {
      state = v1::NODE_STATE_SUSPECT;
    }
    out->set_state(state);
    out->set_host(node->host);
    for (const v1::Endpoint& endpoint : node->endpoints) *out->add_endpoints() = endpoint;
    if (node->role == v1::NODE_ROLE_AGENT) {
      out->set_job_id(node->job_id);
      out->set_rank(node->rank);
      out->set_gpu_index(node->gpu_index);
      out->set_plan_epoch(node->plan_epoch);
      out->set_rank_restarts(node->rank_restarts);
    }
    out->set_iteration(node->iteration);
    out->set_bytes_per_second(links_.MeanOutgoing(node->id, now, options_.telemetry_max_age));
    out->set_last_heartbeat_age_ms(Millis(now - node->last_seen));
    if (node->telemetry_at.has_value()) {
      out->set_telemetry_age_ms(Millis(now - *node->telemetry_at));
    }
    if (!FreshTelemetry(*node, now)) continue;
    for (const v1::ReplicationTelemetry& r : node->telemetry_replication) {
      if (caller.job_id.empty() || r.job_id() == caller.job_id) *out->add_replication() = r;
    }
    for (const v1::LinkTelemetry& link : node->telemetry_links) {
      const Node* peer = FindNode(link.peer_node_id());
      const LinkSample* sample = links_.Find(node->id, link.peer_node_id());
      if (peer == nullptr || sample == nullptr) continue;  // forgotten since
      v1::LinkStatus* status = out->add_links();
      status->set_peer_node_id(peer->id);
      status->set_peer_role(peer->role);
      status->set_peer_host(peer->host);
      if (peer->role == v1::NODE_ROLE_AGENT) {
        status->set_peer_rank(peer->rank);
        status->set_peer_job_id(peer->job_id);
      }
      status->set_transport(link.transport());
      status->set_sent_bytes(link.bytes());
      status->set_received_bytes(link.received_bytes());
      status->set_window_ns(link.window_ns());
      status->set_bytes_per_second(link.bytes_per_second());
      status->set_bandwidth_bytes_per_second(
          SampleBandwidth(*sample, options_.telemetry_min_bytes).value_or(0));
      status->set_lower_bound(IsLowerBound(*sample));
      status->set_capacity_bytes_per_second(link.capacity_bytes_per_second());
      status->set_latency_ns(link.latency_ns());
    }
    if (node->role == v1::NODE_ROLE_AGENT) {
      const SyncSummary summary = Summarize(node->telemetry_layers);
      out->set_sync_seconds(summary.total_seconds);
      if (summary.slowest_index >= 0) {
        static const std::optional<v1::Plan> kNoPlan;
        const Job* job = FindJob(node->job_id);
        out->set_slowest_layer(LayerName(job != nullptr ? job->plan : kNoPlan,
                                         static_cast<uint32_t>(summary.slowest_index),
                                         summary.slowest_name));
        out->set_slowest_layer_sync_seconds(summary.slowest_seconds);
      }
    }
  }
  for (const auto& [id, job] : jobs_) {
    if (!caller.job_id.empty() && id != caller.job_id) continue;
    v1::JobStatus* out = response->add_jobs();
    out->set_job_id(id);
    if (job.model.has_value()) out->set_model_name(job.model->spec.name());
    out->set_world_size(job.world_size);
    // The world it trains with now (a job that shrank or grew): the newest generation any of its
    // live agents reports.
    for (const RankSlot& slot : job.ranks) {
      const Node* agent = FindNode(slot.node_id);
      if (!Live(agent) || agent->world_generation == 0 ||
          agent->world_generation < out->world_generation()) {
        continue;
      }
      out->set_live_world(agent->live_world);
      out->set_world_generation(agent->world_generation);
    }
    if (job.plan.has_value()) {
      out->set_plan_epoch(job.plan->plan_epoch());
      out->set_effective_iteration(job.plan->effective_iteration());
      for (const v1::LayerPlan& layer : job.plan->layers()) {
        v1::LayerStatus* status = out->add_layers();
        status->set_name(layer.layer_name());
        status->set_scheme(layer.scheme());
        status->set_bytes(layer.predicted_bytes_per_worker());
        status->set_wire_type(layer.wire_type());
        if (layer.scheme() == v1::SYNC_SCHEME_ALLREDUCE) {
          status->set_lowrank_rank(layer.lowrank_rank());
        }
      }
    }
    FillSyncStatus(job, now, out);
  }
  return absl::OkStatus();
}

bool Registry::FreshTelemetry(const Node& node, absl::Time now) const {
  return node.telemetry_at.has_value() && now - *node.telemetry_at <= options_.telemetry_max_age;
}

void Registry::FillSyncStatus(const Job& job, absl::Time now, v1::JobStatus* out) const {
  // Per layer index: the sum and count of the ranks' mean sync times, and a reported name.
  std::map<uint32_t, std::tuple<double, int, std::string>> layers;
  std::map<uint32_t, uint32_t> fell_back;  // per layer index: ranks whose keys left the lossy wire
  double slowest_rank_seconds = 0;
  double waiting_seconds = 0;
  for (const RankSlot& slot : job.ranks) {
    const Node* agent = FindNode(slot.node_id);
    if (agent == nullptr || !Live(agent) || !FreshTelemetry(*agent, now)) continue;
    const SyncSummary summary = Summarize(agent->telemetry_layers);
    if (summary.slowest_index >= 0 &&
        (!out->has_slowest_rank() || summary.total_seconds > slowest_rank_seconds)) {
      out->set_slowest_rank(agent->rank);
      slowest_rank_seconds = summary.total_seconds;
    }
    for (const v1::LayerTelemetry& layer : agent->telemetry_layers) {
      if (layer.wire_fell_back()) ++fell_back[layer.index()];
      if (layer.syncs() > 0) {
        auto& [sum, count, name] = layers[layer.index()];
        sum += layer.mean_sync_seconds();
        ++count;
        if (name.empty()) name = layer.name();
      }
      if (layer.waiting_seconds() > waiting_seconds) {
        waiting_seconds = layer.waiting_seconds();
        out->set_waiting_rank(agent->rank);
        out->set_waiting_layer(LayerName(job.plan, layer.index(), layer.name()));
        out->set_waiting_iteration(layer.waiting_iteration());
        out->set_waiting_seconds(layer.waiting_seconds());
      }
    }
  }
  if (out->has_slowest_rank()) out->set_slowest_rank_sync_seconds(slowest_rank_seconds);
  for (const auto& [index, ranks] : fell_back) {
    if (index < static_cast<uint32_t>(out->layers_size())) {
      out->mutable_layers(static_cast<int>(index))->set_wire_fallback_ranks(ranks);
    }
  }
  double slowest = -1;
  for (const auto& [index, entry] : layers) {
    const auto& [sum, count, name] = entry;
    const double mean = sum / count;
    if (index < static_cast<uint32_t>(out->layers_size())) {
      out->mutable_layers(static_cast<int>(index))->set_sync_seconds(mean);
    }
    if (mean > slowest) {
      slowest = mean;
      out->set_slowest_layer(LayerName(job.plan, index, name));
      out->set_slowest_layer_sync_seconds(mean);
    }
  }
}

void Registry::BeginWait(absl::string_view node_id, absl::Time now) {
  if (Node* node = FindNode(node_id)) {
    ++node->waits;
    node->last_seen = std::max(node->last_seen, now);
  }
}

void Registry::EndWait(absl::string_view node_id, absl::Time now) {
  if (Node* node = FindNode(node_id); node != nullptr && node->waits > 0) {
    --node->waits;
    node->last_seen = std::max(node->last_seen, now);
  }
}

bool Registry::Expire(absl::Time now) {
  bool died = false;
  for (auto& [id, node] : nodes_) {
    if (node.state != v1::NODE_STATE_ALIVE) continue;
    if (node.waits > 0) {
      node.last_seen = now;
      continue;
    }
    const absl::Duration silent = now - node.last_seen;
    // An agent whose peers lost every connection to it since its last heartbeat, and that is
    // suspect (silent for two heartbeat intervals), is gone: its lease is not waited out.
    const bool reported = node.role == v1::NODE_ROLE_AGENT && node.gone_reported > node.last_seen &&
                          silent > 2 * heartbeat_interval();
    if (silent <= options_.lease && !reported) continue;
    node.state = v1::NODE_STATE_DEAD;
    node.state_since = now;
    node.state_reason =
        silent <= options_.lease
            ? absl::StrCat("its connections to ", node.gone_reported_by,
                           " closed and no heartbeat for ", Ago(silent),
                           " (two heartbeat intervals: ", Ago(heartbeat_interval()), ")")
            : absl::StrCat("no heartbeat for ", Ago(silent), "; lease ", Ago(options_.lease));
    ++membership_epoch_;
    died = true;
    PSD_LOG_WARN("{} {} declared dead: {}", RoleName(node.role), node.id, node.state_reason);
  }
  if (died) ++version_;

  // Forget nodes long gone that no job refers to any more.
  absl::flat_hash_set<std::string> referenced;
  for (const auto& [id, job] : jobs_) {
    for (const RankSlot& slot : job.ranks) referenced.insert(slot.node_id);
    referenced.insert(job.world_agents.begin(), job.world_agents.end());
    referenced.insert(job.world_servers.begin(), job.world_servers.end());
    referenced.insert(job.joined_servers.begin(), job.joined_servers.end());
  }
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    const Node& node = it->second;
    if (node.state != v1::NODE_STATE_ALIVE && node.waits == 0 &&
        now - node.state_since > options_.retention && !referenced.contains(node.id)) {
      links_.EraseNode(node.id);
      it = nodes_.erase(it);
    } else {
      ++it;
    }
  }
  return died;
}

std::vector<Registry::NodeCount> Registry::CountNodes(absl::Time now) const {
  std::vector<NodeCount> counts;
  for (const v1::NodeRole role : {v1::NODE_ROLE_SERVER, v1::NODE_ROLE_AGENT}) {
    for (const v1::NodeState state :
         {v1::NODE_STATE_ALIVE, v1::NODE_STATE_SUSPECT, v1::NODE_STATE_DEAD, v1::NODE_STATE_LEFT}) {
      counts.push_back(NodeCount{role, state, 0});
    }
  }
  const absl::Duration suspect_after = 2 * heartbeat_interval();
  for (const auto& [id, node] : nodes_) {
    v1::NodeState state = node.state;
    if (state == v1::NODE_STATE_ALIVE && node.waits == 0 && now - node.last_seen > suspect_after) {
      state = v1::NODE_STATE_SUSPECT;
    }
    for (NodeCount& count : counts) {
      if (count.role == node.role && count.state == state) ++count.count;
    }
  }
  return counts;
}

std::vector<std::pair<std::string, uint64_t>> Registry::PlanEpochs() const {
  std::vector<std::pair<std::string, uint64_t>> epochs;
  for (const auto& [id, job] : jobs_) {
    if (job.plan.has_value()) epochs.emplace_back(id, job.plan->plan_epoch());
  }
  return epochs;
}

}  // namespace poseidon::coordinator
