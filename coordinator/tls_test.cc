// TLS on the coordinator's channel: a throwaway CA, server and client certificates made with the
// openssl command line; a TLS client connects, an insecure one (or one trusting another CA) does
// not; with a client CA configured, only clients with a certificate get in.
#include <fstream>
#include <iterator>
#include <string>

#include "common/testing/pki.h"
#include "coordinator/auth.h"
#include "coordinator/test_util.h"
#include "grpcpp/security/credentials.h"

namespace poseidon::coordinator::testing {
namespace {

using ::testing::HasSubstr;

class CoordinatorTlsTest : public CoordinatorFixture {
 protected:
  static void SetUpTestSuite() {
    // The server certificate names 127.0.0.1 and localhost.
    dir_ = poseidon::testing::MakeTestPkiDir("poseidon-coordinator-tls");
    ASSERT_FALSE(dir_.empty()) << "openssl failed";
  }

  static void TearDownTestSuite() { poseidon::testing::RemoveTestPkiDir(dir_); }

  static std::string File(const std::string& name) { return absl::StrCat(dir_, "/", name); }

  void StartTlsServer(bool require_client_certificates) {
    CoordinatorServerOptions options = DefaultServerOptions();
    options.tls.cert_file = File("server.pem");
    options.tls.key_file = File("server.key");
    if (require_client_certificates) options.tls.client_ca_file = File("ca.pem");
    StartServer(options);
    ASSERT_TRUE(server_->tls());
  }

  // A cluster-status call: the cheapest call that needs the channel and a token.
  absl::Status Probe(const ClientTlsOptions& tls) {
    CoordinatorClientOptions options;
    options.address = server_->address();
    options.job_id = kJobA;
    options.token = kTokenA;
    options.tls = tls;
    options.call_timeout = absl::Seconds(10);
    auto client = CoordinatorClient::Connect(options);
    if (!client.ok()) return client.status();
    return (*client)->GetClusterStatus().status();
  }

  static ClientTlsOptions Tls(const std::string& ca, bool with_certificate = false) {
    ClientTlsOptions tls;
    tls.enabled = true;
    tls.ca_file = File(ca);
    if (with_certificate) {
      tls.cert_file = File("client.pem");
      tls.key_file = File("client.key");
    }
    return tls;
  }

  static std::string dir_;
};

std::string CoordinatorTlsTest::dir_;

TEST_F(CoordinatorTlsTest, TlsClientConnects) {
  StartTlsServer(false);
  EXPECT_TRUE(Probe(Tls("ca.pem")).ok()) << Probe(Tls("ca.pem"));
  // Registration and the rest work the same over TLS.
  auto agent = Client(kJobA, kTokenA, Tls("ca.pem"));
  auto registered = agent->RegisterAgent(Agent(0, 1));
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ(registered->rank(), 0u);
}

// With TLS the job and token metadata are checked before the request is read: a caller with a
// wrong token (or none) is refused with the metadata check's own message, whatever it sends.
TEST_F(CoordinatorTlsTest, UnauthenticatedCallsAreRefusedBeforeTheirRequestIsRead) {
  StartTlsServer(false);
  grpc::SslCredentialsOptions ssl;
  std::ifstream ca(File("ca.pem"));
  ssl.pem_root_certs.assign(std::istreambuf_iterator<char>(ca), {});
  auto stub = poseidon::v1::Coordinator::NewStub(
      grpc::CreateChannel(server_->address(), grpc::SslCredentials(ssl)));
  // A body of ~8 MiB (a model of many layers) with the right token in its header.
  poseidon::v1::RegisterModelRequest big;
  big.mutable_header()->set_job_id(kJobA);
  big.mutable_header()->set_token(kTokenA);
  for (int i = 0; i < 80000; ++i) {
    auto* layer = big.mutable_model()->add_layers();
    layer->set_name(absl::StrCat("layer-", i, std::string(80, 'x')));
    layer->add_shape(4);
  }
  struct Case {
    std::string job, token;  // metadata; empty token: none sent
    std::string why;
  };
  const Case cases[] = {
      {kJobA, "", "carries no poseidon-token-bin metadata"},
      {kJobA, "wrong", "wrong token for job 'job-a'"},
      {"job-z", kTokenA, "job 'job-z' is not configured"},
  };
  for (const Case& c : cases) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    context.AddMetadata(kJobMetadata, c.job);
    if (!c.token.empty()) context.AddMetadata(kTokenMetadata, c.token);
    poseidon::v1::RegisterModelResponse response;
    const grpc::Status s = stub->RegisterModel(&context, big, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.why));
    EXPECT_THAT(s.error_message(), HasSubstr("refused before reading"));
  }
  // The client library sends both: its calls get through.
  EXPECT_TRUE(Probe(Tls("ca.pem")).ok());
}

TEST_F(CoordinatorTlsTest, InsecureClientToTlsServerFails) {
  StartTlsServer(false);
  const absl::Status status = Probe(ClientTlsOptions{});
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
}

TEST_F(CoordinatorTlsTest, ClientTrustingAnotherCaFails) {
  StartTlsServer(false);
  const absl::Status status = Probe(Tls("other-ca.pem"));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
}

TEST_F(CoordinatorTlsTest, MutualTlsNeedsAClientCertificate) {
  StartTlsServer(true);
  const absl::Status without = Probe(Tls("ca.pem"));
  EXPECT_EQ(without.code(), absl::StatusCode::kUnavailable) << without;
  EXPECT_TRUE(Probe(Tls("ca.pem", /*with_certificate=*/true)).ok());
}

TEST_F(CoordinatorTlsTest, IncompleteTlsConfigurationIsRefused) {
  CoordinatorServerOptions options = DefaultServerOptions();
  options.tls.key_file = File("server.key");
  auto server = CoordinatorServer::Start(DefaultTokens(), options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("tls_key is set but tls_cert"));

  options.tls.cert_file = File("missing.pem");
  server = CoordinatorServer::Start(DefaultTokens(), options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("cannot read tls_cert"));

  options.tls.cert_file = File("server.csr");  // PEM, but a request: gRPC would fail later
  options.tls.key_file = File("server.ext");   // not PEM at all
  server = CoordinatorServer::Start(DefaultTokens(), options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("is not a PEM file"));
}

}  // namespace
}  // namespace poseidon::coordinator::testing
