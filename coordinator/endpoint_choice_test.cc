#include "coordinator/endpoint_choice.h"

#include "coordinator/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace poseidon::coordinator {
namespace {

namespace v1 = ::poseidon::v1;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

google::protobuf::RepeatedPtrField<v1::Endpoint> Endpoints(
    std::initializer_list<std::pair<v1::TransportKind, const char*>> list) {
  google::protobuf::RepeatedPtrField<v1::Endpoint> out;
  for (const auto& [kind, address] : list) *out.Add() = MakeEndpoint(kind, address);
  return out;
}

constexpr LocalTransports kBoth{true, true};
constexpr LocalTransports kTcpOnly{true, false};
constexpr LocalTransports kRdmaOnly{false, true};

TEST(ChooseEndpoint, RdmaWhenBothSidesCanWhateverItsPosition) {
  const auto endpoints = Endpoints(
      {{v1::TRANSPORT_KIND_TCP, "10.0.0.1:7100"}, {v1::TRANSPORT_KIND_RDMA, "10.0.0.1:7101"}});
  auto chosen = ChooseEndpoint(endpoints, kBoth, "server s-1");
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(chosen->kind, v1::TRANSPORT_KIND_RDMA);
  EXPECT_EQ(chosen->address, "10.0.0.1:7101");
  EXPECT_EQ(chosen->tcp_fallback, "10.0.0.1:7100");  // if RDMA connections fail, TCP ones not
}

TEST(ChooseEndpoint, TcpWhenThisSideHasNoRdma) {
  const auto endpoints = Endpoints(
      {{v1::TRANSPORT_KIND_RDMA, "10.0.0.1:7101"}, {v1::TRANSPORT_KIND_TCP, "10.0.0.1:7100"}});
  auto chosen = ChooseEndpoint(endpoints, kTcpOnly, "server s-1");
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(chosen->kind, v1::TRANSPORT_KIND_TCP);
  EXPECT_EQ(chosen->address, "10.0.0.1:7100");
}

TEST(ChooseEndpoint, TcpWhenThePeerHasNoRdma) {
  const auto endpoints = Endpoints({{v1::TRANSPORT_KIND_TCP, "10.0.0.1:7100"}});
  auto chosen = ChooseEndpoint(endpoints, kBoth, "server s-1");
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(chosen->kind, v1::TRANSPORT_KIND_TCP);
  EXPECT_EQ(chosen->address, "10.0.0.1:7100");
}

TEST(ChooseEndpoint, RdmaOnlySideTakesTheRdmaEndpoint) {
  const auto endpoints = Endpoints(
      {{v1::TRANSPORT_KIND_TCP, "10.0.0.1:7100"}, {v1::TRANSPORT_KIND_RDMA, "10.0.0.1:7101"}});
  auto chosen = ChooseEndpoint(endpoints, kRdmaOnly, "server s-1");
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(chosen->kind, v1::TRANSPORT_KIND_RDMA);
  EXPECT_EQ(chosen->tcp_fallback, "");  // no TCP here to fall back to
}

TEST(ChooseEndpoint, NothingUsableIsAnErrorNamingThePeerAndWhatItOffers) {
  // A TCP-only side and an RDMA-only peer.
  auto chosen = ChooseEndpoint(Endpoints({{v1::TRANSPORT_KIND_RDMA, "10.0.0.1:7101"}}), kTcpOnly,
                               "server s-1");
  ASSERT_FALSE(chosen.ok());
  EXPECT_EQ(chosen.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(chosen.status().message(), HasSubstr("server s-1"));
  EXPECT_THAT(chosen.status().message(), HasSubstr("rdma://10.0.0.1:7101"));
  // An RDMA-only side and a TCP-only peer.
  chosen = ChooseEndpoint(Endpoints({{v1::TRANSPORT_KIND_TCP, "10.0.0.1:7100"}}), kRdmaOnly,
                          "peer agent of rank 3");
  ASSERT_FALSE(chosen.ok());
  EXPECT_THAT(chosen.status().message(), HasSubstr("peer agent of rank 3"));
  // No endpoint, or only kinds nobody connects to across processes.
  chosen = ChooseEndpoint({}, kBoth, "server s-2");
  ASSERT_FALSE(chosen.ok());
  EXPECT_THAT(chosen.status().message(), HasSubstr("offers none"));
  chosen = ChooseEndpoint(Endpoints({{v1::TRANSPORT_KIND_INPROC, "x"}}), kBoth, "server s-2");
  EXPECT_FALSE(chosen.ok());
}

TEST(ChooseEndpoint, AnEmptyAddressIsNotAnEndpoint) {
  const auto endpoints =
      Endpoints({{v1::TRANSPORT_KIND_RDMA, ""}, {v1::TRANSPORT_KIND_TCP, "10.0.0.1:7100"}});
  auto chosen = ChooseEndpoint(endpoints, kBoth, "server s-1");
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(chosen->kind, v1::TRANSPORT_KIND_TCP);
}

v1::PlanServer Server(const char* id,
                      std::initializer_list<std::pair<v1::TransportKind, const char*>> list) {
  v1::PlanServer s;
  s.set_node_id(id);
  *s.mutable_endpoints() = Endpoints(list);
  return s;
}

TEST(ServerToServerAddresses, TcpWhenEveryServerServesIt) {
  google::protobuf::RepeatedPtrField<v1::PlanServer> servers;
  *servers.Add() =
      Server("s-1", {{v1::TRANSPORT_KIND_RDMA, "a:2"}, {v1::TRANSPORT_KIND_TCP, "a:1"}});
  *servers.Add() = Server("s-2", {{v1::TRANSPORT_KIND_TCP, "b:1"}});
  auto addresses = ServerToServerAddresses(servers);
  ASSERT_TRUE(addresses.ok()) << addresses.status();
  EXPECT_THAT(*addresses, ElementsAre("a:1", "b:1"));
}

TEST(ServerToServerAddresses, RdmaWhenEveryServerIsRdmaOnly) {
  google::protobuf::RepeatedPtrField<v1::PlanServer> servers;
  *servers.Add() = Server("s-1", {{v1::TRANSPORT_KIND_RDMA, "a:2"}});
  *servers.Add() = Server("s-2", {{v1::TRANSPORT_KIND_RDMA, "b:2"}});
  auto addresses = ServerToServerAddresses(servers);
  ASSERT_TRUE(addresses.ok()) << addresses.status();
  EXPECT_THAT(*addresses, ElementsAre("a:2", "b:2"));
}

TEST(ServerToServerAddresses, MixedIsAnErrorNamingThem) {
  google::protobuf::RepeatedPtrField<v1::PlanServer> servers;
  *servers.Add() = Server("s-1", {{v1::TRANSPORT_KIND_RDMA, "a:2"}});
  *servers.Add() =
      Server("s-2", {{v1::TRANSPORT_KIND_RDMA, "b:2"}, {v1::TRANSPORT_KIND_TCP, "b:1"}});
  auto addresses = ServerToServerAddresses(servers);
  ASSERT_FALSE(addresses.ok());
  EXPECT_EQ(addresses.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(addresses.status().message(), HasSubstr("s-1 serve RDMA only"));
  EXPECT_THAT(addresses.status().message(), HasSubstr("s-2 serve TCP"));
}

}  // namespace
}  // namespace poseidon::coordinator
