#include "coordinator/endpoint_choice.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace poseidon::coordinator {

namespace v1 = ::poseidon::v1;

namespace {

const v1::Endpoint* Find(const google::protobuf::RepeatedPtrField<v1::Endpoint>& endpoints,
                         v1::TransportKind kind) {
  for (const v1::Endpoint& e : endpoints) {
    if (e.transport() == kind && !e.address().empty()) return &e;
  }
  return nullptr;
}

}  // namespace

absl::string_view TransportKindName(v1::TransportKind kind) {
  switch (kind) {
    case v1::TRANSPORT_KIND_TCP:
      return "tcp";
    case v1::TRANSPORT_KIND_RDMA:
      return "rdma";
    case v1::TRANSPORT_KIND_INPROC:
      return "inproc";
    default:
      return "unspecified";
  }
}

absl::StatusOr<ChosenEndpoint> ChooseEndpoint(
    const google::protobuf::RepeatedPtrField<v1::Endpoint>& endpoints, LocalTransports local,
    absl::string_view peer) {
  for (const v1::TransportKind kind : {v1::TRANSPORT_KIND_RDMA, v1::TRANSPORT_KIND_TCP}) {
    const bool usable = kind == v1::TRANSPORT_KIND_RDMA ? local.rdma : local.tcp;
    if (!usable) continue;
    if (const v1::Endpoint* e = Find(endpoints, kind)) {
      ChosenEndpoint chosen{kind, e->address(), ""};
      if (kind == v1::TRANSPORT_KIND_RDMA && local.tcp) {
        if (const v1::Endpoint* tcp = Find(endpoints, v1::TRANSPORT_KIND_TCP)) {
          chosen.tcp_fallback = tcp->address();
        }
      }
      return chosen;
    }
  }
  std::vector<std::string> offered;
  for (const v1::Endpoint& e : endpoints) {
    offered.push_back(absl::StrCat(TransportKindName(e.transport()), "://", e.address()));
  }
  std::vector<std::string> here;
  if (local.rdma) here.push_back("rdma");
  if (local.tcp) here.push_back("tcp");
  return absl::FailedPreconditionError(absl::StrCat(
      peer, " advertises no endpoint this side can use (it offers ",
      offered.empty() ? std::string("none") : absl::StrJoin(offered, ", "), "; this side has ",
      here.empty() ? std::string("no transport") : absl::StrJoin(here, " and "),
      "): start both with a --transport they share"));
}

template <typename Server>
absl::StatusOr<std::vector<std::string>> CommonAddresses(
    const google::protobuf::RepeatedPtrField<Server>& servers) {
  for (const v1::TransportKind kind : {v1::TRANSPORT_KIND_TCP, v1::TRANSPORT_KIND_RDMA}) {
    std::vector<std::string> addresses;
    std::vector<std::string> other;  // servers that serve TCP (asked for RDMA)
    for (const Server& server : servers) {
      if (const v1::Endpoint* e = Find(server.endpoints(), kind)) addresses.push_back(e->address());
      if (kind == v1::TRANSPORT_KIND_RDMA && Find(server.endpoints(), v1::TRANSPORT_KIND_TCP)) {
        other.push_back(server.node_id());
      }
    }
    if (addresses.size() == static_cast<size_t>(servers.size()) && other.empty()) {
      return addresses;
    }
  }
  std::vector<std::string> rdma_only, with_tcp;
  for (const Server& server : servers) {
    (Find(server.endpoints(), v1::TRANSPORT_KIND_TCP) ? with_tcp : rdma_only)
        .push_back(server.node_id());
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "the servers cannot reach each other by one transport (replication): ",
      absl::StrJoin(rdma_only, ", "), " serve RDMA only (--transport=rdma), ",
      absl::StrJoin(with_tcp, ", "), " serve TCP; start every server with the same --transport"));
}

absl::StatusOr<std::vector<std::string>> ServerToServerAddresses(
    const google::protobuf::RepeatedPtrField<v1::PlanServer>& servers) {
  return CommonAddresses(servers);
}

absl::StatusOr<std::vector<std::string>> ServerToServerAddresses(
    const google::protobuf::RepeatedPtrField<v1::ServerInfo>& servers) {
  return CommonAddresses(servers);
}

}  // namespace poseidon::coordinator
