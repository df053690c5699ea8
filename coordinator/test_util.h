// Helpers for the coordinator's tests: an in-process CoordinatorServer on 127.0.0.1:0 with two
// jobs and a cluster token, clients, servers and agents, small models, and a world formed by agent
// threads. Thread-safety: a fixture is used from its test's thread; FormWorld runs its own threads.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "coordinator/client.h"
#include "coordinator/server.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"

namespace poseidon::coordinator::testing {

namespace v1 = ::poseidon::v1;

inline constexpr char kJobA[] = "job-a";
inline constexpr char kTokenA[] = "secret-a";
inline constexpr char kJobB[] = "job-b";
inline constexpr char kTokenB[] = "secret-b";
inline constexpr char kClusterToken[] = "cluster-secret";

// conv.weight [16,3,3,3], conv.bias [16], fc.weight [10, fc_inputs], fc.bias [10]; K = 32.
inline v1::ModelSpec TinyModel(uint64_t fc_inputs = 32) {
  v1::ModelSpec model;
  model.set_name("tiny");
  auto add = [&](const char* name, v1::LayerKind kind, std::vector<uint64_t> shape) {
    v1::LayerSpec* layer = model.add_layers();
    layer->set_name(name);
    layer->set_kind(kind);
    for (uint64_t d : shape) layer->add_shape(d);
    layer->set_element_type(v1::ELEMENT_TYPE_F32);
    layer->set_batch_per_worker(32);
  };
  add("conv.weight", v1::LAYER_KIND_CONV, {16, 3, 3, 3});
  add("conv.bias", v1::LAYER_KIND_BIAS, {16});
  add("fc.weight", v1::LAYER_KIND_FC, {10, fc_inputs});
  add("fc.bias", v1::LAYER_KIND_BIAS, {10});
  return model;
}

// A model whose FC layer sits near the SFB/PS boundary on 2 colocated machines: SFB moves 16,384
// bytes more than PS per iteration but saves one latency leg, so with 7us of latency SFB is
// faster while 16,384 <= 2 * bandwidth * 7us, i.e. above 9.36 Gbit/s.
inline v1::ModelSpec BoundaryModel() {
  v1::ModelSpec model;
  model.set_name("boundary");
  v1::LayerSpec* fc = model.add_layers();
  fc->set_name("fc.weight");
  fc->set_kind(v1::LAYER_KIND_FC);
  fc->add_shape(1024);
  fc->add_shape(1024);
  fc->set_batch_per_worker(513);
  v1::LayerSpec* bias = model.add_layers();
  bias->set_name("fc.bias");
  bias->set_kind(v1::LAYER_KIND_BIAS);
  bias->add_shape(1024);
  bias->set_batch_per_worker(513);
  return model;
}

inline CoordinatorServerOptions DefaultServerOptions() {
  CoordinatorServerOptions options;
  options.listen = "127.0.0.1:0";
  options.service.registry.lease = absl::Seconds(30);
  options.service.rendezvous_timeout = absl::Seconds(30);
  options.service.plan_wait_timeout = absl::Seconds(30);
  return options;
}

inline TokenStore DefaultTokens() {
  TokenStore tokens;
  EXPECT_TRUE(tokens.AddJob(kJobA, kTokenA).ok());
  EXPECT_TRUE(tokens.AddJob(kJobB, kTokenB).ok());
  EXPECT_TRUE(tokens.SetClusterToken(kClusterToken).ok());
  return tokens;
}

inline AgentRegistration Agent(uint32_t gpu, uint32_t world_size,
                               std::optional<uint32_t> rank = std::nullopt,
                               const std::string& host = "127.0.0.1") {
  AgentRegistration agent;
  agent.host = host;
  agent.gpu_index = gpu;
  agent.endpoints.push_back(
      MakeEndpoint(v1::TRANSPORT_KIND_TCP, absl::StrCat("127.0.0.1:", 7200 + gpu)));
  agent.world_size = world_size;
  agent.requested_rank = rank;
  return agent;
}

// An agent of a formed world and its client.
struct Member {
  std::unique_ptr<CoordinatorClient> client;
  World world;
};

class CoordinatorFixture : public ::testing::Test {
 protected:
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }

  void StartServer(CoordinatorServerOptions options = DefaultServerOptions(),
                   TokenStore tokens = DefaultTokens()) {
    auto server = CoordinatorServer::Start(std::move(tokens), std::move(options));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  std::unique_ptr<CoordinatorClient> Client(const std::string& job = kJobA,
                                            const std::string& token = kTokenA,
                                            const ClientTlsOptions& tls = {}) {
    CoordinatorClientOptions options;
    options.address = server_->address();
    options.job_id = job;
    options.token = token;
    options.tls = tls;
    auto client = CoordinatorClient::Connect(std::move(options));
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  // A cluster-wide server registered with the cluster token, listening (nominally) on `port`.
  // `jobs`: the only jobs it serves (empty: every job).
  std::unique_ptr<CoordinatorClient> AddServer(int port, const std::string& host = "127.0.0.1",
                                               std::vector<std::string> jobs = {}) {
    std::unique_ptr<CoordinatorClient> client = Client("", kClusterToken);
    ServerRegistration server;
    server.host = host;
    server.jobs = std::move(jobs);
    server.endpoints.push_back(
        MakeEndpoint(v1::TRANSPORT_KIND_TCP, absl::StrCat("127.0.0.1:", port)));
    server.capacity.set_memory_bytes(uint64_t{1} << 30);
    auto registered = client->RegisterServer(server);
    EXPECT_TRUE(registered.ok()) << registered.status();
    return client;
  }

  // `n` agents of `job` registering and rendezvousing from threads of their own (GPU i).
  std::vector<Member> FormWorld(uint32_t n, const std::string& job = kJobA,
                                const std::string& token = kTokenA) {
    std::vector<Member> members(n);
    std::vector<absl::Status> errors(n);
    std::vector<std::thread> threads;
    for (uint32_t i = 0; i < n; ++i) {
      members[i].client = Client(job, token);
      threads.emplace_back([&, i] {
        auto world = members[i].client->RegisterAgentAndRendezvous(Agent(i, n), absl::Seconds(30));
        if (world.ok()) {
          members[i].world = *world;
        } else {
          errors[i] = world.status();
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (const absl::Status& error : errors) EXPECT_TRUE(error.ok()) << error;
    return members;
  }

  // Every member registers `model` from its own thread; the plans they get back.
  std::vector<absl::StatusOr<v1::Plan>> RegisterModels(std::vector<Member>& members,
                                                       const v1::ModelSpec& model) {
    std::vector<absl::StatusOr<v1::Plan>> plans(members.size(),
                                                absl::UnknownError("not registered"));
    std::vector<std::thread> threads;
    for (size_t i = 0; i < members.size(); ++i) {
      threads.emplace_back([&, i] {
        plans[i] = members[i].client->RegisterModel(model, {}, {}, absl::Seconds(30));
      });
    }
    for (std::thread& thread : threads) thread.join();
    return plans;
  }

  // A raw stub, for requests the client would never send.
  std::unique_ptr<v1::Coordinator::Stub> RawStub() {
    return v1::Coordinator::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }

  static void Deadline(grpc::ClientContext* context, absl::Duration timeout = absl::Seconds(10)) {
    context->set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout));
  }

  std::unique_ptr<CoordinatorServer> server_;
};

}  // namespace poseidon::coordinator::testing
