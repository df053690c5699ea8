#include "tools/status_command.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "coordinator/client.h"
#include "coordinator/endpoint_choice.h"
#include "coordinator/planner/cost_model.h"
#include "tools/coordinator_cli.h"
#include "tools/json_writer.h"

namespace poseidon::tools {
namespace {

namespace v1 = poseidon::v1;

// The flags of `poseidon status` (environment: POSEIDON_<NAME>; file: --config).
struct StatusFlags {
  std::string coordinator = "127.0.0.1:7070";
  std::string job_id;
  std::string token;
  absl::Duration timeout = absl::Seconds(5);
  POSEIDON_CLI_TLS_FIELDS;
  bool json = false;
};

ConfigSchema<StatusFlags> StatusFlagsSchema() {
  ConfigSchema<StatusFlags> schema("poseidon status", "POSEIDON_");
  schema.Field("coordinator", &StatusFlags::coordinator, "the coordinator (host:port)", NonEmpty())
      .Field("job_id", &StatusFlags::job_id,
             "the job to show (--job also works); empty: every job, with the cluster token")
      .SecretField("token", &StatusFlags::token, "the job's coordinator token (or cluster token)")
      .Field("timeout", &StatusFlags::timeout, "give up on the coordinator after this long")
      .Field("json", &StatusFlags::json, "print JSON instead of tables");
  AddTlsFlags(schema);
  return schema;
}

int Fail(absl::string_view message) {
  return tools::Fail("poseidon status", message);
}

std::string RoleName(v1::NodeRole role) {
  switch (role) {
    case v1::NODE_ROLE_SERVER:
      return "server";
    case v1::NODE_ROLE_AGENT:
      return "agent";
    default:
      return "?";
  }
}

std::string StateName(v1::NodeState state) {
  switch (state) {
    case v1::NODE_STATE_ALIVE:
      return "alive";
    case v1::NODE_STATE_SUSPECT:
      return "suspect";
    case v1::NODE_STATE_DEAD:
      return "dead";
    case v1::NODE_STATE_LEFT:
      return "left";
    default:
      return "?";
  }
}

std::string SchemeName(v1::SyncScheme scheme) {
  switch (scheme) {
    case v1::SYNC_SCHEME_PS:
      return "ps";
    case v1::SYNC_SCHEME_SFB:
      return "sfb";
    case v1::SYNC_SCHEME_ALLREDUCE:
      return "allreduce";
    default:
      return "-";
  }
}

std::string TransportName(v1::TransportKind kind) {
  return std::string(coordinator::TransportKindName(kind));
}

// A link's transport: "none" while its connection is not made (an agent reports the kind once
// connected, after any fall-back to TCP).
std::string LinkTransportName(v1::TransportKind kind) {
  return kind == v1::TRANSPORT_KIND_UNSPECIFIED ? "none" : TransportName(kind);
}

std::string Endpoints(const v1::NodeStatus& node) {
  std::vector<std::string> parts;
  for (const v1::Endpoint& e : node.endpoints()) {
    parts.push_back(absl::StrCat(TransportName(e.transport()), "://", e.address()));
  }
  return parts.empty() ? "-" : absl::StrJoin(parts, ",");
}

std::string Age(uint64_t ms) {
  if (ms < 10000) return absl::StrFormat("%.1fs ago", static_cast<double>(ms) / 1000.0);
  return absl::StrCat(ms / 1000, "s ago");
}

std::string Rate(double bytes_per_second) {
  if (bytes_per_second <= 0) return "-";
  return absl::StrFormat("%.1f MB/s", bytes_per_second / 1e6);
}

// Like Rate, but an idle link shows 0 rather than "-".
std::string Throughput(double bytes_per_second) {
  if (bytes_per_second <= 0) return "0";
  if (bytes_per_second < 1e5) return absl::StrFormat("%.1f kB/s", bytes_per_second / 1e3);
  return Rate(bytes_per_second);
}

std::string Bytes(uint64_t bytes) {
  if (bytes < 10000) return absl::StrCat(bytes, " B");
  if (bytes < 10000000) return absl::StrFormat("%.1f kB", static_cast<double>(bytes) / 1e3);
  return absl::StrFormat("%.1f MB", static_cast<double>(bytes) / 1e6);
}

std::string Seconds(double seconds) {
  if (seconds <= 0) return "-";
  if (seconds < 1) return absl::StrFormat("%.2f ms", seconds * 1e3);
  return absl::StrFormat("%.2f s", seconds);
}

// "rank 2" (from an agent of the same job), "job 7 rank 2" (from a server), "server s-1", the
// node id of anything else.
std::string Peer(const v1::NodeStatus& from, const v1::LinkStatus& link) {
  if (link.peer_role() == v1::NODE_ROLE_AGENT) {
    if (from.role() == v1::NODE_ROLE_AGENT && from.job_id() == link.peer_job_id()) {
      return absl::StrCat("rank ", link.peer_rank());
    }
    return absl::StrCat("job ", link.peer_job_id(), " rank ", link.peer_rank());
  }
  if (link.peer_role() == v1::NODE_ROLE_SERVER) return absl::StrCat("server ", link.peer_node_id());
  return link.peer_node_id();
}

std::string NodeName(const v1::NodeStatus& node) {
  if (node.role() == v1::NODE_ROLE_AGENT) {
    return absl::StrCat("job ", node.job_id(), " rank ", node.rank());
  }
  return absl::StrCat(RoleName(node.role()), " ", node.node_id());
}

// A round trip: "-" when not measured.
std::string Latency(uint64_t ns) {
  if (ns == 0) return "-";
  if (ns < 1000000) return absl::StrFormat("%.0f us", static_cast<double>(ns) / 1e3);
  if (ns < 1000000000) return absl::StrFormat("%.2f ms", static_cast<double>(ns) / 1e6);
  return absl::StrFormat("%.2f s", static_cast<double>(ns) / 1e9);
}

// The planner's bandwidth from a link's sample: ">= X" for achieved throughput (a lower bound).
std::string Bandwidth(const v1::LinkStatus& link) {
  if (link.bandwidth_bytes_per_second() <= 0) return "-";
  return absl::StrCat(link.lower_bound() ? ">=" : "", Rate(link.bandwidth_bytes_per_second()));
}

// The job of an agent, or null.
const v1::JobStatus* JobOf(const v1::NodeStatus& agent,
                           const v1::GetClusterStatusResponse& status) {
  for (const v1::JobStatus& job : status.jobs()) {
    if (job.job_id() == agent.job_id()) return &job;
  }
  return nullptr;
}

// The epoch an agent runs, next to its job's newest: "3", "2 (job: 3)", "-" before it said.
std::string AgentEpoch(const v1::NodeStatus& agent, const v1::GetClusterStatusResponse& status) {
  if (agent.plan_epoch() == 0) return "-";
  const v1::JobStatus* job = JobOf(agent, status);
  if (job == nullptr || job->plan_epoch() == agent.plan_epoch()) {
    return absl::StrCat(agent.plan_epoch());
  }
  return absl::StrCat(agent.plan_epoch(), " (job: ", job->plan_epoch(), ")");
}

// The epochs the job's live agents run, when not all on the job's newest: "; agents on epoch
// 2: 3 of 4".
std::string AgentEpochs(const v1::JobStatus& job, const v1::GetClusterStatusResponse& status) {
  std::map<uint64_t, int> counts;
  int agents = 0;
  for (const v1::NodeStatus& n : status.nodes()) {
    if (n.role() != v1::NODE_ROLE_AGENT || n.job_id() != job.job_id() ||
        (n.state() != v1::NODE_STATE_ALIVE && n.state() != v1::NODE_STATE_SUSPECT)) {
      continue;
    }
    ++agents;
    ++counts[n.plan_epoch()];
  }
  if (agents == 0) return "";
  if (counts.size() == 1 && counts.begin()->first == job.plan_epoch()) {
    return absl::StrCat("; every agent on epoch ", job.plan_epoch());
  }
  std::vector<std::string> parts;
  for (const auto& [epoch, count] : counts) {
    parts.push_back(absl::StrCat(epoch == 0 ? std::string("none yet") : absl::StrCat(epoch), ": ",
                                 count, " of ", agents));
  }
  return absl::StrCat("; agents on epoch ", absl::StrJoin(parts, ", "));
}

// Left-aligned columns, widths from the content.
void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()), 0);
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(widths[i] - row[i].size() + 2, ' ');
    }
    std::printf("%s\n", line.c_str());
  }
}

void PrintText(const StatusFlags& flags, const v1::GetClusterStatusResponse& status) {
  std::printf("coordinator %s, membership epoch %llu\n\n", flags.coordinator.c_str(),
              static_cast<unsigned long long>(status.membership_epoch()));
  for (v1::NodeRole role : {v1::NODE_ROLE_SERVER, v1::NODE_ROLE_AGENT}) {
    std::vector<std::vector<std::string>> rows;
    if (role == v1::NODE_ROLE_SERVER) {
      rows.push_back({"SERVER", "STATE", "HOST", "ENDPOINTS", "SENDING", "LAST SEEN"});
    } else {
      // RESTARTS last: scripts reading the columns before it keep working.
      rows.push_back({"AGENT", "JOB", "RANK", "STATE", "HOST", "GPU", "ENDPOINTS", "ITERATION",
                      "PLAN EPOCH", "SENDING", "SYNC/ITER", "SLOWEST LAYER", "LAST SEEN",
                      "RESTARTS"});
    }
    for (const v1::NodeStatus& n : status.nodes()) {
      if (n.role() != role) continue;
      if (role == v1::NODE_ROLE_SERVER) {
        rows.push_back({n.node_id(), StateName(n.state()), n.host(), Endpoints(n),
                        Rate(n.bytes_per_second()), Age(n.last_heartbeat_age_ms())});
      } else {
        rows.push_back(
            {n.node_id(), n.job_id(), absl::StrCat(n.rank()), StateName(n.state()), n.host(),
             absl::StrCat(n.gpu_index()), Endpoints(n), absl::StrCat(n.iteration()),
             AgentEpoch(n, status), Rate(n.bytes_per_second()), Seconds(n.sync_seconds()),
             n.slowest_layer().empty() ? "-"
                                       : absl::StrCat(n.slowest_layer(), " (",
                                                      Seconds(n.slowest_layer_sync_seconds()), ")"),
             Age(n.last_heartbeat_age_ms()), absl::StrCat(n.rank_restarts())});
      }
    }
    if (rows.size() == 1) {
      std::printf("no %ss registered\n\n", RoleName(role).c_str());
      continue;
    }
    PrintTable(rows);
    std::printf("\n");
  }
  // Every node's links, from its latest telemetry (achieved throughput over its window).
  std::vector<std::vector<std::string>> links = {{"LINK FROM", "TO", "TRANSPORT", "SENT",
                                                  "RECEIVED", "WINDOW", "BYTES/S", "BANDWIDTH",
                                                  "LATENCY"}};
  for (const v1::NodeStatus& n : status.nodes()) {
    for (const v1::LinkStatus& link : n.links()) {
      links.push_back(
          {NodeName(n), Peer(n, link), LinkTransportName(link.transport()), Bytes(link.sent_bytes()),
           Bytes(link.received_bytes()),
           link.window_ns() == 0 ? "-" : Seconds(static_cast<double>(link.window_ns()) / 1e9),
           Throughput(link.bytes_per_second()), Bandwidth(link), Latency(link.latency_ns())});
    }
  }
  if (links.size() == 1) {
    std::printf("no link telemetry yet\n\n");
  } else {
    PrintTable(links);
    std::printf("\n");
  }
  // Replication (issue 17): per server and replicated job, from the server's latest telemetry.
  std::vector<std::vector<std::string>> replication = {
      {"REPLICATION", "JOB", "PRIMARY KEYS", "BACKUP KEYS", "DEGRADED", "REPLICATING",
       "BACKUP LAG"}};
  uint64_t degraded = 0;
  for (const v1::NodeStatus& n : status.nodes()) {
    for (const v1::ReplicationTelemetry& r : n.replication()) {
      degraded += r.degraded_keys();
      replication.push_back({NodeName(n), r.job_id(), absl::StrCat(r.primary_keys()),
                             absl::StrCat(r.backup_keys()), absl::StrCat(r.degraded_keys()),
                             absl::StrCat(r.replicating_keys()),
                             absl::StrCat(r.max_backup_lag_clocks(), " clocks")});
    }
  }
  if (replication.size() > 1) {
    PrintTable(replication);
    if (degraded > 0) {
      std::printf("%llu primary keys have lost a backup: their replication factor is degraded\n",
                  static_cast<unsigned long long>(degraded));
    }
    std::printf("\n");
  }
  if (status.jobs().empty()) std::printf("no jobs\n");
  for (const v1::JobStatus& job : status.jobs()) {
    // A world that shrank or grew again: the ranks it trains with now.
    const std::string live =
        job.has_live_world()
            ? absl::StrCat(" (training with ", job.live_world(), " now, world generation ",
                           job.world_generation(), ")")
            : "";
    std::printf("job %s: model %s, world size %u%s, plan epoch %llu (from iteration %llu)%s\n",
                job.job_id().c_str(), job.model_name().empty() ? "-" : job.model_name().c_str(),
                job.world_size(), live.c_str(), static_cast<unsigned long long>(job.plan_epoch()),
                static_cast<unsigned long long>(job.effective_iteration()),
                AgentEpochs(job, status).c_str());
    if (job.has_slowest_rank()) {
      std::printf(
          "  slowest rank %u (%s of synchronisation per iteration), slowest layer %s (%s)\n",
          job.slowest_rank(), Seconds(job.slowest_rank_sync_seconds()).c_str(),
          job.slowest_layer().empty() ? "-" : job.slowest_layer().c_str(),
          Seconds(job.slowest_layer_sync_seconds()).c_str());
    }
    // A healthy job always has some layer in flight: only a wait of a second or more is news.
    if (job.has_waiting_rank() && job.waiting_seconds() >= 1) {
      std::printf("  waiting longest: rank %u, layer %s, iteration %llu, for %s\n",
                  job.waiting_rank(), job.waiting_layer().c_str(),
                  static_cast<unsigned long long>(job.waiting_iteration()),
                  Seconds(job.waiting_seconds()).c_str());
    }
    if (job.layers().empty()) {
      std::printf("  no plan yet (the model is registered when every rank has joined)\n");
      continue;
    }
    std::vector<std::vector<std::string>> rows = {{"  LAYER", "SCHEME", "WIRE", "BYTES", "SYNC"}};
    int lossy = 0, fell_back = 0;
    for (const v1::LayerStatus& layer : job.layers()) {
      const std::string wire = layer.lowrank_rank() > 0
                                   ? absl::StrCat("rank ", layer.lowrank_rank())
                                   : planner::WireTypeName(layer.wire_type());
      if (wire != "fp32") ++lossy;
      if (wire != "fp32" && layer.wire_fallback_ranks() > 0) ++fell_back;
      // A lossy layer whose keys fell back (a divergence guard) is float32 now.
      const std::string shown =
          wire == "fp32"                     ? wire
          : layer.wire_fallback_ranks() > 0 ? absl::StrCat(wire, " -> fp32 (guard)")
                                             : absl::StrCat(wire, " (lossy)");
      rows.push_back({absl::StrCat("  ", layer.name()), SchemeName(layer.scheme()), shown,
                      absl::StrCat(layer.bytes()), Seconds(layer.sync_seconds())});
    }
    PrintTable(rows);
    if (lossy > 0) {
      std::printf("  %d of %d layers lossy (a 16-bit wire or low rank; error feedback; the job "
                  "allows it)", lossy,
                  job.layers_size());
      if (fell_back > 0) std::printf("; %d fell back to fp32 (divergence guard)", fell_back);
      std::printf("\n");
    }
  }
}

void PrintJson(const StatusFlags& flags, const v1::GetClusterStatusResponse& status) {
  JsonWriter w;
  w.BeginObject();
  w.Key("coordinator");
  w.String(flags.coordinator);
  w.Key("membership_epoch");
  w.Unsigned(status.membership_epoch());
  w.Key("nodes");
  w.BeginArray();
  for (const v1::NodeStatus& n : status.nodes()) {
    w.BeginObject();
    w.Key("node_id");
    w.String(n.node_id());
    w.Key("role");
    w.String(RoleName(n.role()));
    w.Key("state");
    w.String(StateName(n.state()));
    w.Key("alive");
    w.Bool(n.state() == v1::NODE_STATE_ALIVE);
    w.Key("host");
    w.String(n.host());
    w.Key("endpoints");
    w.BeginArray();
    for (const v1::Endpoint& e : n.endpoints()) {
      w.BeginObject();
      w.Key("transport");
      w.String(TransportName(e.transport()));
      w.Key("address");
      w.String(e.address());
      w.EndObject();
    }
    w.EndArray();
    if (n.role() == v1::NODE_ROLE_AGENT) {
      w.Key("job_id");
      w.String(n.job_id());
      w.Key("rank");
      w.Unsigned(n.rank());
      w.Key("rank_restarts");
      w.Unsigned(n.rank_restarts());
      w.Key("gpu_index");
      w.Unsigned(n.gpu_index());
      w.Key("iteration");
      w.Unsigned(n.iteration());
      w.Key("plan_epoch");
      w.Unsigned(n.plan_epoch());
    }
    w.Key("bytes_per_second");
    w.Number(n.bytes_per_second());
    w.Key("last_heartbeat_age_ms");
    w.Unsigned(n.last_heartbeat_age_ms());
    w.Key("telemetry_age_ms");
    if (n.has_telemetry_age_ms()) {
      w.Unsigned(n.telemetry_age_ms());
    } else {
      w.Null();
    }
    if (n.role() == v1::NODE_ROLE_AGENT) {
      w.Key("sync_seconds");
      w.Number(n.sync_seconds());
      w.Key("slowest_layer");
      w.String(n.slowest_layer());
      w.Key("slowest_layer_sync_seconds");
      w.Number(n.slowest_layer_sync_seconds());
    }
    if (n.role() == v1::NODE_ROLE_SERVER) {
      w.Key("replication");
      w.BeginArray();
      for (const v1::ReplicationTelemetry& r : n.replication()) {
        w.BeginObject();
        w.Key("job_id");
        w.String(r.job_id());
        w.Key("primary_keys");
        w.Unsigned(r.primary_keys());
        w.Key("backup_keys");
        w.Unsigned(r.backup_keys());
        w.Key("degraded_keys");
        w.Unsigned(r.degraded_keys());
        w.Key("replicating_keys");
        w.Unsigned(r.replicating_keys());
        w.Key("max_backup_lag_clocks");
        w.Unsigned(r.max_backup_lag_clocks());
        w.EndObject();
      }
      w.EndArray();
    }
    w.Key("links");
    w.BeginArray();
    for (const v1::LinkStatus& link : n.links()) {
      w.BeginObject();
      w.Key("peer_node_id");
      w.String(link.peer_node_id());
      w.Key("peer_role");
      w.String(RoleName(link.peer_role()));
      w.Key("peer_host");
      w.String(link.peer_host());
      if (link.peer_role() == v1::NODE_ROLE_AGENT) {
        w.Key("peer_job_id");
        w.String(link.peer_job_id());
        w.Key("peer_rank");
        w.Unsigned(link.peer_rank());
      }
      w.Key("transport");
      w.String(LinkTransportName(link.transport()));
      w.Key("sent_bytes");
      w.Unsigned(link.sent_bytes());
      w.Key("received_bytes");
      w.Unsigned(link.received_bytes());
      w.Key("window_ns");
      w.Unsigned(link.window_ns());
      w.Key("bytes_per_second");
      w.Number(link.bytes_per_second());
      w.Key("bandwidth_bytes_per_second");
      w.Number(link.bandwidth_bytes_per_second());
      w.Key("lower_bound");
      w.Bool(link.lower_bound());
      w.Key("latency_ns");
      w.Unsigned(link.latency_ns());
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
  }
  w.EndArray();
  w.Key("jobs");
  w.BeginArray();
  for (const v1::JobStatus& job : status.jobs()) {
    w.BeginObject();
    w.Key("job_id");
    w.String(job.job_id());
    w.Key("model_name");
    w.String(job.model_name());
    w.Key("world_size");
    w.Unsigned(job.world_size());
    if (job.has_live_world()) {
      w.Key("live_world");
      w.Unsigned(job.live_world());
      w.Key("world_generation");
      w.Unsigned(job.world_generation());
    }
    w.Key("plan_epoch");
    w.Unsigned(job.plan_epoch());
    w.Key("effective_iteration");
    w.Unsigned(job.effective_iteration());
    w.Key("layers");
    w.BeginArray();
    for (const v1::LayerStatus& layer : job.layers()) {
      w.BeginObject();
      w.Key("name");
      w.String(layer.name());
      w.Key("scheme");
      w.String(SchemeName(layer.scheme()));
      w.Key("wire");
      w.String(planner::WireTypeName(layer.wire_type()));
      w.Key("lowrank_rank");
      w.Unsigned(layer.lowrank_rank());
      w.Key("wire_fallback_ranks");
      w.Unsigned(layer.wire_fallback_ranks());
      w.Key("bytes");
      w.Unsigned(layer.bytes());
      w.Key("sync_seconds");
      w.Number(layer.sync_seconds());
      w.EndObject();
    }
    w.EndArray();
    w.Key("slowest_rank");
    if (job.has_slowest_rank()) {
      w.Unsigned(job.slowest_rank());
    } else {
      w.Null();
    }
    w.Key("slowest_rank_sync_seconds");
    w.Number(job.slowest_rank_sync_seconds());
    w.Key("slowest_layer");
    w.String(job.slowest_layer());
    w.Key("slowest_layer_sync_seconds");
    w.Number(job.slowest_layer_sync_seconds());
    w.Key("waiting");
    if (job.has_waiting_rank()) {
      w.BeginObject();
      w.Key("rank");
      w.Unsigned(job.waiting_rank());
      w.Key("layer");
      w.String(job.waiting_layer());
      w.Key("iteration");
      w.Unsigned(job.waiting_iteration());
      w.Key("seconds");
      w.Number(job.waiting_seconds());
      w.EndObject();
    } else {
      w.Null();
    }
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  std::printf("%s\n", w.str().c_str());
}

}  // namespace

int RunStatusCommand(const std::vector<std::string>& args) {
  const ConfigSchema<StatusFlags> schema = StatusFlagsSchema();
  LoadedConfig<StatusFlags> loaded;
  if (std::optional<int> code =
          ParseOrExit("poseidon status", schema, NormalizeJobFlag(args), &loaded)) {
    return *code;
  }
  const StatusFlags& flags = loaded.value;
  absl::StatusOr<std::unique_ptr<coordinator::CoordinatorClient>> client =
      coordinator::CoordinatorClient::Connect(ClientOptions(flags));
  if (!client.ok()) return Fail(client.status().message());
  absl::StatusOr<v1::GetClusterStatusResponse> status = (*client)->GetClusterStatus();
  if (!status.ok()) return Fail(CoordinatorError(flags.coordinator, status.status()));
  if (flags.json) {
    PrintJson(flags, *status);
  } else {
    PrintText(flags, *status);
  }
  return 0;
}

}  // namespace poseidon::tools
