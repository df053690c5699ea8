#include <chrono>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "poseidon/v1/coordinator.grpc.pb.h"
#include "poseidon/v1/coordinator.pb.h"
#include "poseidon/v1/plan.pb.h"

namespace poseidon {
namespace {

namespace v1 = ::poseidon::v1;

v1::Plan MakePlan() {
  v1::Plan plan;
  plan.set_job_id("vgg19");
  plan.set_plan_epoch(3);
  plan.set_effective_iteration(1200);
  plan.set_membership_epoch(7);
  plan.set_max_chunk_bytes(4 << 20);
  for (int s = 0; s < 2; ++s) {
    v1::PlanServer* server = plan.add_servers();
    server->set_node_id("server-" + std::to_string(s));
    v1::Endpoint* endpoint = server->add_endpoints();
    endpoint->set_transport(v1::TRANSPORT_KIND_TCP);
    endpoint->set_address("10.0.0." + std::to_string(s + 1) + ":7100");
  }
  v1::LayerPlan* conv = plan.add_layers();
  conv->set_layer_index(0);
  conv->set_layer_name("conv1.weight");
  conv->set_scheme(v1::SYNC_SCHEME_PS);
  conv->set_priority(0);
  for (int c = 0; c < 3; ++c) {
    v1::Chunk* chunk = conv->add_chunks();
    chunk->set_key(100 + c);
    chunk->set_offset(static_cast<uint64_t>(c) * (4 << 20));
    chunk->set_length(c < 2 ? (4 << 20) : 1234);
    chunk->set_server_index(c % 2);
  }
  v1::LayerPlan* fc = plan.add_layers();
  fc->set_layer_index(1);
  fc->set_layer_name("fc7.weight");
  fc->set_scheme(v1::SYNC_SCHEME_SFB);
  fc->set_priority(1);
  fc->set_predicted_bytes_per_worker(123456789);
  fc->set_predicted_seconds(0.0125);
  return plan;
}

TEST(ProtoPlan, RoundTripsThroughTheWireFormat) {
  const v1::Plan plan = MakePlan();
  std::string wire;
  ASSERT_TRUE(plan.SerializeToString(&wire));

  v1::Plan parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(plan, parsed));
  EXPECT_EQ(parsed.job_id(), "vgg19");
  EXPECT_EQ(parsed.plan_epoch(), 3u);
  EXPECT_EQ(parsed.effective_iteration(), 1200u);
  ASSERT_EQ(parsed.servers_size(), 2);
  EXPECT_EQ(parsed.servers(1).endpoints(0).address(), "10.0.0.2:7100");
  ASSERT_EQ(parsed.layers_size(), 2);
  const v1::LayerPlan& conv = parsed.layers(0);
  EXPECT_EQ(conv.scheme(), v1::SYNC_SCHEME_PS);
  ASSERT_EQ(conv.chunks_size(), 3);
  EXPECT_EQ(conv.chunks(2).key(), 102u);
  EXPECT_EQ(conv.chunks(2).offset(), 2u * (4 << 20));
  EXPECT_EQ(conv.chunks(2).length(), 1234u);
  EXPECT_EQ(conv.chunks(1).server_index(), 1u);
  const v1::LayerPlan& fc = parsed.layers(1);
  EXPECT_EQ(fc.scheme(), v1::SYNC_SCHEME_SFB);
  EXPECT_EQ(fc.layer_name(), "fc7.weight");
  EXPECT_EQ(fc.chunks_size(), 0);
  EXPECT_DOUBLE_EQ(fc.predicted_seconds(), 0.0125);
}

TEST(ProtoPlan, UnknownEnumValuesSurviveARoundTrip) {
  // A newer coordinator may send a scheme this build does not know; proto3 keeps the number so
  // the reader can reject it explicitly instead of misreading it.
  v1::LayerPlan layer;
  layer.set_scheme(static_cast<v1::SyncScheme>(42));
  std::string wire;
  ASSERT_TRUE(layer.SerializeToString(&wire));
  v1::LayerPlan parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  EXPECT_EQ(static_cast<int>(parsed.scheme()), 42);
  EXPECT_FALSE(v1::SyncScheme_IsValid(parsed.scheme()));
  // Zero is always UNSPECIFIED, the value of an unset field.
  EXPECT_EQ(v1::LayerPlan().scheme(), v1::SYNC_SCHEME_UNSPECIFIED);
}

TEST(ProtoModel, OptionalComputeTimesHavePresence) {
  v1::LayerSpec layer;
  layer.set_name("fc6.weight");
  layer.set_kind(v1::LAYER_KIND_FC);
  layer.add_shape(4096);
  layer.add_shape(25088);
  layer.set_element_type(v1::ELEMENT_TYPE_F32);
  layer.set_batch_per_worker(32);
  EXPECT_FALSE(layer.has_forward_time_ns());
  layer.set_backward_time_ns(0);  // measured as zero is not the same as unknown
  v1::LayerSpec parsed;
  ASSERT_TRUE(parsed.ParseFromString(layer.SerializeAsString()));
  EXPECT_FALSE(parsed.has_forward_time_ns());
  EXPECT_TRUE(parsed.has_backward_time_ns());
  EXPECT_EQ(parsed.shape(1), 25088u);
}

// Implements one rpc; every other rpc answers UNIMPLEMENTED.
class FakeCoordinator final : public v1::Coordinator::Service {
 public:
  grpc::Status Heartbeat(grpc::ServerContext* /*context*/, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override {
    if (request->header().token() != "secret") {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "bad token for job " + request->header().job_id());
    }
    response->mutable_header()->set_epoch(request->header().epoch() + 1);
    response->mutable_header()->set_plan_epoch(request->plan_epoch());
    response->set_lease_ms(request->role() == v1::NODE_ROLE_AGENT ? 15000 : 30000);
    return grpc::Status::OK;
  }
};

class CoordinatorRpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
    stub_ = v1::Coordinator::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                                         grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  static void SetDeadline(grpc::ClientContext* context) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  }

  FakeCoordinator service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(CoordinatorRpcTest, HeartbeatWithDeadline) {
  v1::HeartbeatRequest request;
  request.mutable_header()->set_job_id("vgg19");
  request.mutable_header()->set_token("secret");
  request.mutable_header()->set_epoch(4);
  request.mutable_header()->set_node_id("agent-3");
  request.set_role(v1::NODE_ROLE_AGENT);
  request.set_iteration(99);
  request.set_plan_epoch(2);

  grpc::ClientContext context;
  SetDeadline(&context);
  v1::HeartbeatResponse response;
  const grpc::Status status = stub_->Heartbeat(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
  EXPECT_EQ(response.header().epoch(), 5u);
  EXPECT_EQ(response.header().plan_epoch(), 2u);
  EXPECT_EQ(response.lease_ms(), 15000u);
  EXPECT_FALSE(response.shutdown());
}

TEST_F(CoordinatorRpcTest, ErrorsArriveAsStatusCodes) {
  v1::HeartbeatRequest request;
  request.mutable_header()->set_job_id("vgg19");
  request.mutable_header()->set_token("wrong");
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::HeartbeatResponse response;
  const grpc::Status status = stub_->Heartbeat(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(status.error_message(), "bad token for job vgg19");

  grpc::ClientContext plan_context;
  SetDeadline(&plan_context);
  v1::GetPlanResponse plan;
  EXPECT_EQ(stub_->GetPlan(&plan_context, v1::GetPlanRequest(), &plan).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

}  // namespace
}  // namespace poseidon
