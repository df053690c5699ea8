// Which of a peer's advertised data-plane endpoints a connecting side uses (docs/wire.md, "RDMA
// backend"; issue 16). A daemon advertises one endpoint per transport kind it serves: an RDMA
// listener serves RDMA clients only, so a daemon with a usable device listens twice and
// advertises both. A connecting side takes the peer's RDMA endpoint when its own RDMA context is
// viable and the peer offers one, else its TCP endpoint; never by position.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "poseidon/v1/common.pb.h"
#include "poseidon/v1/coordinator.pb.h"
#include "poseidon/v1/plan.pb.h"

namespace poseidon::coordinator {

// The transport contexts this side holds.
struct LocalTransports {
  bool tcp = true;
  bool rdma = false;  // a viable RDMA context
};

struct ChosenEndpoint {
  poseidon::v1::TransportKind kind = poseidon::v1::TRANSPORT_KIND_UNSPECIFIED;
  std::string address;
  // With RDMA chosen: the peer's TCP endpoint when it advertises one and this side has TCP,
  // the fallback if RDMA connections fail while TCP ones succeed (agent/connect_fallback.h).
  std::string tcp_fallback;
};

// RDMA when `local.rdma` and the peer advertises an RDMA endpoint, else TCP when `local.tcp`
// and it advertises one (the first of a kind when it lists several). FailedPrecondition naming
// `peer` and what it advertises when nothing it offers is usable here.
absl::StatusOr<ChosenEndpoint> ChooseEndpoint(
    const google::protobuf::RepeatedPtrField<poseidon::v1::Endpoint>& endpoints,
    LocalTransports local, absl::string_view peer);

// The addresses the job's servers reach each other at (the replication list an agent sends each
// server): every server's TCP endpoint when all of them advertise one (a server holding a TCP
// context replicates over it), else every server's RDMA endpoint when none advertises TCP (they
// all run --transport=rdma). FailedPrecondition when the servers mix the two: no single kind
// reaches all of them.
absl::StatusOr<std::vector<std::string>> ServerToServerAddresses(
    const google::protobuf::RepeatedPtrField<poseidon::v1::PlanServer>& servers);
absl::StatusOr<std::vector<std::string>> ServerToServerAddresses(
    const google::protobuf::RepeatedPtrField<poseidon::v1::ServerInfo>& servers);

// "tcp", "rdma", "inproc" or "unspecified": the label metrics and logs use.
absl::string_view TransportKindName(poseidon::v1::TransportKind kind);

}  // namespace poseidon::coordinator
