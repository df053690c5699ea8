// TelemetryReporter without a coordinator: what one window's report says about links and layers.
#include "agent/telemetry_reporter.h"

#include "gtest/gtest.h"

namespace poseidon::agent {
namespace {

TEST(TelemetryReporterTest, OneWindowPerReport) {
  uint64_t iteration = 7;
  TelemetryReporter reporter(nullptr, absl::Seconds(5), {"server-0", "server-1"},
                             {"agent-0", "agent-1", "agent-2"}, /*rank=*/1,
                             [&] { return iteration; });
  reporter.SetLayers({"conv.weight", "fc.weight", "fc.bias"});
  const absl::Time start = absl::Now();
  reporter.Collect(start);  // the first window starts here

  reporter.AddServerBytes(0, 4000, 1000);
  reporter.AddServerBytes(0, 4000, 3000);
  reporter.AddPeerBytes(2, 500, 700);
  reporter.AddServerBytes(9, 1, 1);  // unknown: ignored
  reporter.LayerReady(0, 8, start);
  reporter.LayerSynced(0, 8, absl::Milliseconds(10));
  reporter.LayerReady(0, 9, start);
  reporter.LayerSynced(0, 9, absl::Milliseconds(30));
  reporter.LayerReady(2, 9, start + absl::Milliseconds(500));  // still waiting
  v1::ReportTelemetryRequest report = reporter.Collect(start + absl::Seconds(2));

  EXPECT_EQ(report.iteration(), 7u);
  EXPECT_EQ(report.window_ns(), 2000000000u);
  ASSERT_EQ(report.links_size(), 4);  // 2 servers, ranks 0 and 2 (not ourselves)
  EXPECT_EQ(report.links(0).peer_node_id(), "server-0");
  EXPECT_EQ(report.links(0).bytes(), 8000u);
  EXPECT_EQ(report.links(0).received_bytes(), 4000u);
  EXPECT_EQ(report.links(0).window_ns(), 2000000000u);
  EXPECT_DOUBLE_EQ(report.links(0).bytes_per_second(), 4000);  // the busier direction
  EXPECT_EQ(report.links(1).bytes(), 0u);
  EXPECT_EQ(report.links(2).peer_node_id(), "agent-0");
  EXPECT_EQ(report.links(3).peer_node_id(), "agent-2");
  EXPECT_DOUBLE_EQ(report.links(3).bytes_per_second(), 350);
  ASSERT_EQ(report.layers_size(), 2);  // fc.weight: nothing in the window
  EXPECT_EQ(report.layers(0).index(), 0u);
  EXPECT_EQ(report.layers(0).name(), "conv.weight");
  EXPECT_EQ(report.layers(0).syncs(), 2u);
  EXPECT_DOUBLE_EQ(report.layers(0).mean_sync_seconds(), 0.020);
  EXPECT_DOUBLE_EQ(report.layers(0).max_sync_seconds(), 0.030);
  EXPECT_EQ(report.layers(0).waiting_seconds(), 0);
  EXPECT_EQ(report.layers(1).index(), 2u);
  EXPECT_EQ(report.layers(1).syncs(), 0u);
  EXPECT_EQ(report.layers(1).waiting_iteration(), 9u);
  EXPECT_DOUBLE_EQ(report.layers(1).waiting_seconds(), 1.5);

  // The next window starts empty.
  reporter.LayerSynced(2, 9, absl::Milliseconds(1600));
  report = reporter.Collect(start + absl::Seconds(3));
  EXPECT_EQ(report.window_ns(), 1000000000u);
  EXPECT_EQ(report.links(0).bytes(), 0u);
  EXPECT_EQ(report.links(0).bytes_per_second(), 0);
  ASSERT_EQ(report.layers_size(), 1);
  EXPECT_EQ(report.layers(0).index(), 2u);
  EXPECT_EQ(report.layers(0).syncs(), 1u);
  EXPECT_EQ(report.layers(0).waiting_seconds(), 0);
  EXPECT_FALSE(report.layers(0).wire_fell_back());

  // A layer whose keys fell back from a lossy wire says so in every report from then on, with or
  // without a synchronisation in the window.
  reporter.LayerWireFellBack(1);
  reporter.LayerWireFellBack(7);  // unknown: ignored
  for (int window = 0; window < 2; ++window) {
    report = reporter.Collect(start + absl::Seconds(4 + window));
    ASSERT_EQ(report.layers_size(), 1);
    EXPECT_EQ(report.layers(0).index(), 1u);
    EXPECT_TRUE(report.layers(0).wire_fell_back());
    EXPECT_EQ(report.layers(0).syncs(), 0u);
  }
}

TEST(TelemetryReporterTest, ServerLinksReportTheShortestPingOfTheWindow) {
  TelemetryReporter reporter(nullptr, absl::Seconds(5), {"server-0", "server-1"},
                             {"agent-0", "agent-1"}, /*rank=*/0, {});
  const absl::Time start = absl::Now();
  reporter.Collect(start);
  std::vector<absl::Duration> round_trips = {absl::Microseconds(300), absl::Microseconds(100),
                                             absl::Microseconds(200)};
  size_t calls = 0;
  reporter.SetServerPing(
      [&](size_t server, absl::Duration timeout) -> absl::StatusOr<absl::Duration> {
        EXPECT_GT(timeout, absl::ZeroDuration());
        EXPECT_LE(timeout, absl::Seconds(1));
        if (server == 1) return absl::DeadlineExceededError("no pong");
        return round_trips[calls++ % round_trips.size()];
      });
  reporter.PingServers();
  EXPECT_EQ(calls, 3u);                                 // three pings per server by default
  reporter.AddServerLatency(9, absl::Microseconds(1));  // unknown: ignored
  v1::ReportTelemetryRequest report = reporter.Collect(start + absl::Seconds(1));
  ASSERT_EQ(report.links_size(), 3);
  EXPECT_EQ(report.links(0).latency_ns(), 100000u);
  EXPECT_EQ(report.links(1).latency_ns(), 0u);  // every ping failed: not measured
  EXPECT_EQ(report.links(2).peer_node_id(), "agent-1");
  EXPECT_EQ(report.links(2).latency_ns(), 0u);  // SFB peers are not pinged
  // Later windows report the minimum over the recent ones: a ping that queued behind data
  // (3 ms) does not raise the latency.
  report = reporter.Collect(start + absl::Seconds(2));
  EXPECT_EQ(report.links(0).latency_ns(), 100000u);
  reporter.AddServerLatency(0, absl::Milliseconds(3));
  report = reporter.Collect(start + absl::Seconds(3));
  EXPECT_EQ(report.links(0).latency_ns(), 100000u);
  // Once the 100 us window is older than kLatencyWindows windows, the newer minimum shows.
  for (size_t w = 0; w < kLatencyWindows; ++w) {
    reporter.AddServerLatency(0, absl::Microseconds(250));
    report = reporter.Collect(start + absl::Seconds(4 + static_cast<int64_t>(w)));
  }
  EXPECT_EQ(report.links(0).latency_ns(), 250000u);
}

// Capacity: bytes over the union of busy time of large transfers from every server (they share
// the agent's link), reported on each server link that had such transfers, from a minimum of
// bytes per window on.
TEST(TelemetryReporterTest, CapacityIsBytesOverTheBusyTimeOfAllServersTransfers) {
  TelemetryReporter reporter(nullptr, absl::Seconds(5), {"server-0", "server-1"}, {"agent-0"},
                             /*rank=*/0, {});
  reporter.SetCapacityMinBytes(1000);
  const absl::Time start = absl::Now();
  reporter.Collect(start);
  // Two transfers at once (each ~ the whole window's busy time): one union, not twice the time.
  reporter.AddServerTransfer(0, 600, absl::Seconds(1));
  reporter.AddServerTransfer(1, 600, absl::Seconds(1));
  v1::ReportTelemetryRequest report = reporter.Collect(start + absl::Seconds(1));
  ASSERT_EQ(report.links_size(), 2);  // two servers; our own rank's peer link is not reported
  const double c0 = report.links(0).capacity_bytes_per_second();
  EXPECT_GT(c0, 1100.0);  // 1200 bytes over ~1 s of union (a little more: the calls' gap)
  EXPECT_LE(c0, 1200.0);
  EXPECT_EQ(report.links(1).capacity_bytes_per_second(), c0);
  // Below the minimum of bytes: no sample; a link without transfers: none either.
  reporter.AddServerTransfer(0, 500, absl::Seconds(1));
  report = reporter.Collect(start + absl::Seconds(2));
  EXPECT_EQ(report.links(0).capacity_bytes_per_second(), 0);
  reporter.AddServerTransfer(0, 5000, absl::Milliseconds(10));
  report = reporter.Collect(start + absl::Seconds(3));
  EXPECT_GT(report.links(0).capacity_bytes_per_second(), 0);
  EXPECT_EQ(report.links(1).capacity_bytes_per_second(), 0);
}

// A link's transport is what its connection uses, reported once it is connected: before that
// it is "unspecified" (the status shows "none"), never the kind planned for it, since a planned
// RDMA link may yet fall back to TCP.
TEST(TelemetryReporterTest, ALinkReportsItsTransportOnlyOnceConnected) {
  TelemetryReporter reporter(nullptr, absl::Seconds(5), {"server-0"}, {"agent-0", "agent-1"},
                             /*rank=*/0, nullptr);
  v1::ReportTelemetryRequest report = reporter.Collect(absl::Now());
  ASSERT_EQ(report.links_size(), 2);  // server-0 and rank 1
  EXPECT_EQ(report.links(0).transport(), v1::TRANSPORT_KIND_UNSPECIFIED);
  EXPECT_EQ(report.links(1).transport(), v1::TRANSPORT_KIND_UNSPECIFIED);
  reporter.SetServerTransport(0, v1::TRANSPORT_KIND_TCP);  // fell back, say
  reporter.SetPeerTransport(1, v1::TRANSPORT_KIND_RDMA);
  reporter.SetPeerTransport(0, v1::TRANSPORT_KIND_RDMA);  // ourselves: never reported
  reporter.SetServerTransport(5, v1::TRANSPORT_KIND_RDMA);  // unknown: ignored
  report = reporter.Collect(absl::Now());
  ASSERT_EQ(report.links_size(), 2);
  EXPECT_EQ(report.links(0).peer_node_id(), "server-0");
  EXPECT_EQ(report.links(0).transport(), v1::TRANSPORT_KIND_TCP);
  EXPECT_EQ(report.links(1).peer_node_id(), "agent-1");
  EXPECT_EQ(report.links(1).transport(), v1::TRANSPORT_KIND_RDMA);
}

TEST(TelemetryReporterTest, StartWithoutAClientAndStopAreHarmless) {
  TelemetryReporter reporter(nullptr, absl::Milliseconds(10), {}, {}, 0, nullptr);
  reporter.Start();  // no client: nothing to report to
  reporter.Stop();
  EXPECT_EQ(reporter.Collect(absl::Now()).links_size(), 0);
}

}  // namespace
}  // namespace poseidon::agent
