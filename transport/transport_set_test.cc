// MakeTransportSet: what each --transport value gives a daemon, over the test verbs provider
// (a machine with a device, and SetDeviceCount(0): one without).
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/rdma/fake_verbs.h"
#include "transport/rdma/rdma_context.h"
#include "transport/tcp/tcp_context.h"
#include "transport/transport.h"

namespace poseidon::transport {
namespace {

using ::testing::HasSubstr;

class TransportSetTest : public ::testing::Test {
 protected:
  void TearDown() override { fake_verbs::SetDeviceCount(1); }
  TcpOptions tcp_;
  RdmaOptions rdma_;
};

TEST_F(TransportSetTest, AutoWithADeviceHoldsRdmaAndTcp) {
  fake_verbs::SetDeviceCount(1);
  auto set = MakeTransportSet("auto", tcp_, rdma_);
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_NE(set->rdma, nullptr);
  ASSERT_NE(set->tcp, nullptr);
  EXPECT_EQ(set->rdma->Name(), "rdma");
  EXPECT_TRUE(set->rdma->IsViable());
  EXPECT_EQ(set->tcp->Name(), "tcp");
  EXPECT_EQ(set->For(true), set->rdma.get());
  EXPECT_EQ(set->For(false), set->tcp.get());
  EXPECT_THAT(set->choice, HasSubstr("rdma and tcp"));
  // Both listen at once (a daemon advertises both endpoints).
  auto tcp_listener = set->tcp->Listen("127.0.0.1:0");
  auto rdma_listener = set->rdma->Listen("127.0.0.1:0");
  ASSERT_TRUE(tcp_listener.ok()) << tcp_listener.status();
  ASSERT_TRUE(rdma_listener.ok()) << rdma_listener.status();
  EXPECT_NE((*tcp_listener)->Address(), (*rdma_listener)->Address());
  set->Close();
}

TEST_F(TransportSetTest, AutoWithoutADeviceIsTcpOnlyAndSaysWhy) {
  fake_verbs::SetDeviceCount(0);
  auto set = MakeTransportSet("auto", tcp_, rdma_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->rdma, nullptr);
  ASSERT_NE(set->tcp, nullptr);
  EXPECT_EQ(&set->Primary(), set->tcp.get());
  EXPECT_THAT(set->choice, HasSubstr("tcp (--transport=auto; RDMA not usable"));
  set->Close();
}

TEST_F(TransportSetTest, RdmaIsRdmaOnly) {
  fake_verbs::SetDeviceCount(1);
  auto set = MakeTransportSet("rdma", tcp_, rdma_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->tcp, nullptr);
  ASSERT_NE(set->rdma, nullptr);
  EXPECT_EQ(&set->Primary(), set->rdma.get());
  EXPECT_EQ(set->For(false), nullptr);
  set->Close();
}

TEST_F(TransportSetTest, RdmaWithoutADeviceIsRefusedWithTheReason) {
  fake_verbs::SetDeviceCount(0);
  auto set = MakeTransportSet("rdma", tcp_, rdma_);
  ASSERT_FALSE(set.ok());
  EXPECT_EQ(set.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(set.status().message(), HasSubstr("--transport=rdma, but RDMA is not usable here"));
}

TEST_F(TransportSetTest, TcpIsTcpOnlyEvenWithADevice) {
  fake_verbs::SetDeviceCount(1);
  auto set = MakeTransportSet("tcp", tcp_, rdma_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->rdma, nullptr);
  ASSERT_NE(set->tcp, nullptr);
  EXPECT_EQ(set->choice, "tcp (--transport=tcp)");
  set->Close();
}

TEST_F(TransportSetTest, AnUnknownKindIsInvalid) {
  auto set = MakeTransportSet("infiniband", tcp_, rdma_);
  ASSERT_FALSE(set.ok());
  EXPECT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(set.status().message(), HasSubstr("infiniband"));
}

}  // namespace
}  // namespace poseidon::transport
