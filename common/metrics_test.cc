#include "common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace poseidon {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A minimal blocking HTTP/1.0 GET against 127.0.0.1:port; returns the whole response or "".
std::string HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval timeout{};
  timeout.tv_sec = 10;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (;;) {
        const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
        if (n <= 0) break;
        response.append(buffer, static_cast<size_t>(n));
      }
    }
  }
  ::close(fd);
  return response;
}

TEST(MetricsRegistry, CounterIncrementsAndAppearsInExposition) {
  MetricsRegistry registry;
  absl::StatusOr<prometheus::Counter*> pushes =
      registry.GetCounter("poseidon_push_bytes_total", "Bytes pushed", {{"server", "0"}});
  ASSERT_TRUE(pushes.ok()) << pushes.status();
  (*pushes)->Increment(4096);
  (*pushes)->Increment(1024);

  // Asking again returns the same metric.
  absl::StatusOr<prometheus::Counter*> again =
      registry.GetCounter("poseidon_push_bytes_total", "Bytes pushed", {{"server", "0"}});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *pushes);
  EXPECT_DOUBLE_EQ((*again)->Value(), 5120);

  const std::string text = registry.TextExposition();
  EXPECT_THAT(text, HasSubstr("# HELP poseidon_push_bytes_total Bytes pushed"));
  EXPECT_THAT(text, HasSubstr("# TYPE poseidon_push_bytes_total counter"));
  EXPECT_THAT(text, HasSubstr("poseidon_push_bytes_total{server=\"0\"} 5120"));
}

TEST(MetricsRegistry, GaugesAndHistograms) {
  MetricsRegistry registry;
  absl::StatusOr<prometheus::Gauge*> alive = registry.GetGauge("poseidon_nodes_alive", "Nodes");
  ASSERT_TRUE(alive.ok());
  (*alive)->Set(3);
  absl::StatusOr<prometheus::Histogram*> latency =
      registry.GetHistogram("poseidon_rpc_seconds", "RPC latency", {{"rpc", "Heartbeat"}},
                            ExponentialBuckets(0.001, 10, 3));
  ASSERT_TRUE(latency.ok()) << latency.status();
  (*latency)->Observe(0.005);
  const std::string text = registry.TextExposition();
  EXPECT_THAT(text, HasSubstr("poseidon_nodes_alive 3"));
  EXPECT_THAT(text, HasSubstr("poseidon_rpc_seconds_bucket{rpc=\"Heartbeat\",le=\"0.001\"} 0"));
  EXPECT_THAT(text, HasSubstr("poseidon_rpc_seconds_bucket{rpc=\"Heartbeat\",le=\"0.01\"} 1"));
  EXPECT_THAT(text, HasSubstr("poseidon_rpc_seconds_count{rpc=\"Heartbeat\"} 1"));
  EXPECT_EQ(ExponentialBuckets(1, 2, 4), (std::vector<double>{1, 2, 4, 8}));
}

TEST(MetricsRegistry, MisuseIsAStatusNotAnException) {
  MetricsRegistry registry;
  EXPECT_EQ(registry.GetCounter("bad name", "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.GetCounter("ok_total", "", {{"bad-label", "x"}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(registry.GetCounter("shared_name", "").ok());
  EXPECT_EQ(registry.GetGauge("shared_name", "").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.GetHistogram("h_seconds", "", {}, {1, 0.5}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsRegistry, CopiesShareTheRegistry) {
  MetricsRegistry registry;
  MetricsRegistry copy = registry;
  absl::StatusOr<prometheus::Counter*> counter = copy.GetCounter("shared_total", "");
  ASSERT_TRUE(counter.ok());
  (*counter)->Increment();
  EXPECT_THAT(registry.TextExposition(), HasSubstr("shared_total 1"));
}

TEST(MetricsExposer, ServesMetricsOnAnEphemeralPort) {
  MetricsRegistry registry;
  absl::StatusOr<prometheus::Counter*> requests =
      registry.GetCounter("poseidon_test_requests_total", "Requests");
  ASSERT_TRUE(requests.ok());
  (*requests)->Increment();
  absl::StatusOr<std::unique_ptr<MetricsExposer>> exposer =
      MetricsExposer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  ASSERT_GT((*exposer)->port(), 0);
  EXPECT_EQ((*exposer)->address(), "127.0.0.1:" + std::to_string((*exposer)->port()));

  const std::string response = HttpGet((*exposer)->port(), "/metrics");
  EXPECT_THAT(response, HasSubstr("200 OK"));
  EXPECT_THAT(response, HasSubstr("poseidon_test_requests_total 1"));

  // Metrics added after the exposer started are served too.
  absl::StatusOr<prometheus::Gauge*> late = registry.GetGauge("poseidon_test_late", "Late");
  ASSERT_TRUE(late.ok());
  (*late)->Set(7);
  EXPECT_THAT(HttpGet((*exposer)->port(), "/metrics"), HasSubstr("poseidon_test_late 7"));
  EXPECT_THAT(HttpGet((*exposer)->port(), "/other"), Not(HasSubstr("poseidon_test_late")));
}

// Slow clients (a request started and never finished) cannot blind the exporter: scrapes are
// still answered while four of them hold connections.
TEST(MetricsExposer, SlowClientsDoNotBlockScrapes) {
  MetricsRegistry registry;
  ASSERT_TRUE(registry.GetCounter("poseidon_test_scrapes_total", "Scrapes").ok());
  absl::StatusOr<std::unique_ptr<MetricsExposer>> exposer =
      MetricsExposer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  std::vector<int> slow;
  for (int i = 0; i < 4; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>((*exposer)->port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    const std::string partial = "GET /metr";  // and nothing more
    ASSERT_EQ(::send(fd, partial.data(), partial.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(partial.size()));
    slow.push_back(fd);
  }
  // They trickle a header byte now and then, so no read timeout frees their threads.
  std::atomic<bool> done{false};
  std::thread trickle([&] {
    while (!done.load()) {
      for (int fd : slow) (void)::send(fd, "X", 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the server took them
  for (int i = 0; i < 3; ++i) {
    EXPECT_THAT(HttpGet((*exposer)->port(), "/metrics"), HasSubstr("poseidon_test_scrapes_total"))
        << "scrape " << i << " with 4 slow clients connected";
  }
  done.store(true);
  trickle.join();
  for (int fd : slow) ::close(fd);
}

TEST(MetricsExposer, BadAddressesAreErrors) {
  MetricsRegistry registry;
  for (const char* bad : {"", "127.0.0.1", "127.0.0.1:99999", "127.0.0.1:-1", "127.0.0.1:http",
                          "::1:0", "127.0.0.1:0,127.0.0.1:0"}) {
    absl::StatusOr<std::unique_ptr<MetricsExposer>> exposer = MetricsExposer::Start(bad, registry);
    EXPECT_EQ(exposer.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  // 192.0.2.1 (TEST-NET-1) is not an address of this machine: bind fails.
  absl::StatusOr<std::unique_ptr<MetricsExposer>> unbindable =
      MetricsExposer::Start("192.0.2.1:0", registry);
  EXPECT_FALSE(unbindable.ok());
  EXPECT_THAT(std::string(unbindable.status().message()), HasSubstr("192.0.2.1:0"));
}

TEST(MetricsExposer, PortInUseIsAnError) {
  MetricsRegistry registry;
  absl::StatusOr<std::unique_ptr<MetricsExposer>> first =
      MetricsExposer::Start("127.0.0.1:0", registry);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<MetricsExposer>> second =
      MetricsExposer::Start("127.0.0.1:" + std::to_string((*first)->port()), registry);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace poseidon
