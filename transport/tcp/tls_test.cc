// TLS on the TCP transport (TcpOptions::tls): what the conformance suite cannot show with one
// configuration on both ends. A listener signed by another CA, or naming another host, is
// refused; mutual TLS refuses a client without a certificate; a plaintext peer and a TLS peer
// refuse each other with an error that says why; a handshake that stalls is dropped after the
// header timeout, garbage in place of a handshake is refused, and the listener goes on accepting;
// a byte changed in flight fails the connection; bad settings are refused when the context is
// made. Certificates: common/testing/pki.h.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/testing/pki.h"
#include "transport/error_frame.h"
#include "transport/tcp/tcp_context.h"
#include "transport/transport_test_util.h"

namespace poseidon::transport {
namespace {

using testing::DataHeader;
using ::testing::HasSubstr;
using testing::Pattern;
using testing::SyncAccept;
using testing::SyncReadFrame;
using testing::SyncReadHeader;
using testing::SyncSend;

int PortOf(const std::string& address) {
  int port = 0;
  EXPECT_TRUE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port)) << address;
  return port;
}

// A blocking loopback socket connected to `address` (a peer that is not a Poseidon transport).
int RawConnect(const std::string& address) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(PortOf(address)));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  return fd;
}

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = poseidon::testing::MakeTestPkiDir("poseidon-transport-tls");
    ASSERT_FALSE(dir_.empty()) << "openssl failed";
  }
  static void TearDownTestSuite() { poseidon::testing::RemoveTestPkiDir(dir_); }
  static std::string File(const std::string& name) { return absl::StrCat(dir_, "/", name); }

  // A TLS end with `leaf`'s certificate (empty: none) trusting `ca`.
  static TcpOptions Tls(const std::string& leaf, const std::string& ca = "ca") {
    TcpOptions o;
    o.tls.enabled = true;
    if (!leaf.empty()) {
      o.tls.cert_file = File(leaf + ".pem");
      o.tls.key_file = File(leaf + ".key");
    }
    o.tls.ca_file = File(ca + ".pem");
    o.header_timeout = absl::Seconds(5);
    return o;
  }

  static std::shared_ptr<Context> Make(const TcpOptions& options) {
    auto ctx = CreateTcpContext(options);
    EXPECT_TRUE(ctx.ok()) << ctx.status();
    return ctx.ok() ? *ctx : nullptr;
  }

  void Listen(const TcpOptions& options) {
    server_ctx_ = Make(options);
    ASSERT_NE(server_ctx_, nullptr);
    auto listener = server_ctx_->Listen("127.0.0.1:0");
    ASSERT_TRUE(listener.ok()) << listener.status();
    listener_ = *listener;
  }

  // Connects with `options` and exchanges one frame each way; returns the first error either
  // end saw (OK when the frames arrived intact). `server_status` gets the listener's side.
  absl::Status Exchange(const TcpOptions& options, absl::Status* server_status = nullptr,
                        const std::string& address = "") {
    auto ctx = Make(options);
    if (ctx == nullptr) return absl::InternalError("no context");
    auto client = ctx->Connect(address.empty() ? listener_->Address() : address, absl::Seconds(5));
    if (!client.ok()) return client.status();
    auto server = SyncAccept(*listener_);
    if (!server.ok()) return server.status();
    const auto payload = Pattern(100000, 3);
    auto sent = testing::SendAsync(**client, DataHeader(1, payload.size()), {payload});
    auto at_server = SyncReadFrame(**server, absl::Seconds(5));
    if (server_status != nullptr) *server_status = at_server.status();
    absl::Status status = sent.get();
    if (at_server.ok()) {
      EXPECT_EQ(at_server->payload, payload);
      auto back = testing::SendAsync(**server, DataHeader(2, 10), {std::span(payload).first(10)});
      auto at_client = SyncReadFrame(**client, absl::Seconds(5));
      if (!at_client.ok()) return at_client.status();
      EXPECT_EQ(at_client->header.key, 2u);
      EXPECT_TRUE(back.get().ok());
    }
    ctx->Close();
    if (!status.ok()) return status;
    return at_server.status();
  }

  void TearDown() override {
    if (server_ctx_) server_ctx_->Close();
  }

  static std::string dir_;
  std::shared_ptr<Context> server_ctx_;
  std::shared_ptr<Listener> listener_;
};

std::string TlsTest::dir_;

TEST_F(TlsTest, AClientTrustingTheCaExchangesFrames) {
  Listen(Tls("server"));
  EXPECT_TRUE(Exchange(Tls("")).ok());
}

TEST_F(TlsTest, AListenerSignedByAnotherCaIsRefused) {
  Listen(Tls("stranger", "other-ca"));
  absl::Status at_server;
  const absl::Status status = Exchange(Tls(""), &at_server);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr("TLS handshake with 127.0.0.1:"));
  EXPECT_THAT(status.message(), HasSubstr("certificate verify failed"));
  EXPECT_FALSE(at_server.ok());  // the listener's end fails too (the client's alert)
}

TEST_F(TlsTest, AListenerWhoseCertificateNamesAnotherHostIsRefused) {
  Listen(Tls("elsewhere"));
  const absl::Status status = Exchange(Tls(""));
  EXPECT_THAT(status.message(), HasSubstr("certificate verify failed")) << status;
  // Verified by the name the settings give instead of the address connected to.
  TcpOptions named = Tls("");
  named.tls.server_name = "elsewhere.invalid";
  EXPECT_TRUE(Exchange(named).ok());
}

TEST_F(TlsTest, MutualTlsRefusesAClientWithoutACertificate) {
  TcpOptions options = Tls("server");
  options.tls.verify_clients = true;
  Listen(options);
  absl::Status at_server;
  const absl::Status status = Exchange(Tls(""), &at_server);
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(at_server.message(), HasSubstr("TLS handshake from 127.0.0.1:")) << at_server;
  EXPECT_THAT(at_server.message(), HasSubstr("certificate")) << at_server;
  EXPECT_TRUE(Exchange(Tls("client")).ok());
  // A certificate from another CA is no better than none.
  EXPECT_FALSE(Exchange(Tls("stranger")).ok());
}

TEST_F(TlsTest, APlaintextPeerOnATlsListenerIsToldWhy) {
  Listen(Tls("server"));
  auto plain = Make(TcpOptions{});
  auto client = plain->Connect(listener_->Address(), absl::Seconds(5));
  ASSERT_TRUE(client.ok()) << client.status();
  auto server = SyncAccept(*listener_);
  ASSERT_TRUE(server.ok());
  auto reading = std::async(std::launch::async, [&] { return SyncReadHeader(**server); });
  ASSERT_TRUE(SyncSend(**client, DataHeader(1, 0), {}).ok());
  auto answer = SyncReadFrame(**client, absl::Seconds(5));
  ASSERT_TRUE(answer.ok()) << answer.status();
  ASSERT_EQ(answer->header.type, FrameType::kError);
  const absl::Status told = ParseErrorFrame(answer->header, answer->payload);
  EXPECT_THAT(told.message(), HasSubstr("on a TLS listener")) << told;
  EXPECT_THAT(told.message(), HasSubstr("data_tls")) << told;
  const auto at_server = reading.get();
  // The reason, whether the read was asked for before the close (FailedPrecondition) or after it
  // (Unavailable: closed, with the reason).
  EXPECT_FALSE(at_server.ok());
  EXPECT_THAT(at_server.status().message(), HasSubstr("on a TLS listener")) << at_server.status();
  plain->Close();
  EXPECT_TRUE(Exchange(Tls("")).ok());  // the listener goes on serving TLS peers
}

TEST_F(TlsTest, ATlsPeerOnAPlaintextListenerIsToldWhy) {
  Listen(TcpOptions{});
  absl::Status at_server;
  const absl::Status status = Exchange(Tls(""), &at_server);
  EXPECT_THAT(status.message(), HasSubstr("TLS handshake with")) << status;
  EXPECT_THAT(status.message(), HasSubstr("is the peer serving TLS?")) << status;
  EXPECT_THAT(at_server.message(), HasSubstr("the peer speaks TLS")) << at_server;
}

TEST_F(TlsTest, AStalledHandshakeIsDroppedAndTheListenerGoesOn) {
  TcpOptions options = Tls("server");
  options.header_timeout = absl::Milliseconds(300);
  Listen(options);
  const int fd = RawConnect(listener_->Address());  // connects, never says a word
  auto server = SyncAccept(*listener_);
  ASSERT_TRUE(server.ok());
  const auto header = SyncReadHeader(**server);
  EXPECT_EQ(header.status().code(), absl::StatusCode::kDeadlineExceeded) << header.status();
  EXPECT_THAT(header.status().message(), HasSubstr("did not complete within"));
  ::close(fd);
  EXPECT_TRUE(Exchange(Tls("")).ok());
}

TEST_F(TlsTest, GarbageInPlaceOfAHandshakeIsRefused) {
  Listen(Tls("server"));
  for (const uint8_t first : {uint8_t{0x16}, uint8_t{0x00}, uint8_t{0xFF}}) {
    const int fd = RawConnect(listener_->Address());
    // A whole record of garbage: type `first`, version 3.x, 16 bytes long, and more after it.
    auto garbage = Pattern(4096, first);
    garbage[0] = std::byte{first};
    garbage[1] = std::byte{0x03};
    garbage[3] = std::byte{0x00};
    garbage[4] = std::byte{0x10};
    ASSERT_EQ(::send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(garbage.size()));
    auto server = SyncAccept(*listener_);
    ASSERT_TRUE(server.ok());
    const auto header = SyncReadHeader(**server);
    EXPECT_EQ(header.status().code(), absl::StatusCode::kUnavailable) << header.status();
    EXPECT_THAT(header.status().message(), HasSubstr("TLS handshake from"));
    ::close(fd);
  }
  EXPECT_TRUE(Exchange(Tls("")).ok());
}

// A man in the middle that forwards every byte, and changes one of the client's bytes once the
// handshake is over (the 20,000th byte of the client's stream: inside the payload's records).
TEST_F(TlsTest, AByteChangedInFlightFailsTheConnection) {
  Listen(Tls("server"));
  const int proxy = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(proxy, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(::listen(proxy, 1), 0);
  socklen_t len = sizeof(sa);
  ::getsockname(proxy, reinterpret_cast<sockaddr*>(&sa), &len);
  const std::string proxy_address = absl::StrCat("127.0.0.1:", ntohs(sa.sin_port));
  std::thread mitm([&] {
    const int in = ::accept(proxy, nullptr, nullptr);
    const int out = RawConnect(listener_->Address());
    std::thread back([in, out] {
      char buf[4096];
      ssize_t n;
      while ((n = ::recv(out, buf, sizeof(buf), 0)) > 0) ::send(in, buf, n, MSG_NOSIGNAL);
      ::shutdown(in, SHUT_WR);
    });
    char buf[4096];
    size_t total = 0;
    ssize_t n;
    while ((n = ::recv(in, buf, sizeof(buf), 0)) > 0) {
      constexpr size_t kAt = 20000;
      if (total <= kAt && kAt < total + static_cast<size_t>(n)) buf[kAt - total] ^= 0x01;
      total += static_cast<size_t>(n);
      ::send(out, buf, n, MSG_NOSIGNAL);
    }
    ::shutdown(out, SHUT_WR);
    back.join();
    ::close(in);
    ::close(out);
  });
  absl::Status at_server;
  const absl::Status status = Exchange(Tls(""), &at_server, proxy_address);
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(at_server.code(), absl::StatusCode::kUnavailable) << at_server;
  EXPECT_THAT(at_server.message(), HasSubstr("read from 127.0.0.1:")) << at_server;
  server_ctx_->Close();
  mitm.join();
  ::close(proxy);
}

TEST_F(TlsTest, BadSettingsAreRefusedWhenTheContextIsMade) {
  auto code_and = [](const TcpOptions& o, absl::string_view text) {
    auto ctx = CreateTcpContext(o);
    EXPECT_EQ(ctx.status().code(), absl::StatusCode::kInvalidArgument) << ctx.status();
    EXPECT_THAT(ctx.status().message(), HasSubstr(text)) << ctx.status();
  };
  TcpOptions o = Tls("server");
  o.tls.cert_file = File("missing.pem");
  code_and(o, "cannot read data_tls_cert");
  o = Tls("server");
  o.tls.key_file = File("client.key");
  code_and(o, "data_tls_key");
  code_and(o, "key values mismatch");
  o = Tls("server");
  o.tls.key_file.clear();
  code_and(o, "set both or neither");
  o = Tls("server");
  o.tls.ca_file = File("server.csr");  // PEM, but not a certificate
  code_and(o, "data_tls_ca");
  code_and(o, "cannot be used");
  o = Tls("server");
  o.tls.ca_file = File("server.ext");  // not PEM at all
  code_and(o, "is not a PEM file");
  o = Tls("server");
  o.tls.ca_file.clear();
  o.tls.verify_clients = true;
  code_and(o, "data_tls_verify_clients needs data_tls_ca");
  // A client needs no certificate; listening does.
  auto client_only = Make(Tls(""));
  ASSERT_NE(client_only, nullptr);
  auto listener = client_only->Listen("127.0.0.1:0");
  EXPECT_EQ(listener.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(listener.status().message(), HasSubstr("data_tls_cert"));
  client_only->Close();
}

}  // namespace
}  // namespace poseidon::transport
