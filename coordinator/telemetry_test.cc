#include "coordinator/telemetry.h"

#include "gtest/gtest.h"

namespace poseidon::coordinator {
namespace {

TEST(TelemetryTest, MedianAndHysteresis) {
  EXPECT_EQ(Median({}), 0);
  EXPECT_EQ(Median({3}), 3);
  EXPECT_EQ(Median({5, 1, 3}), 3);
  EXPECT_EQ(Median({4, 1, 3, 2}), 2.5);
  EXPECT_FALSE(MovedBeyond(100, 120, 0.2));  // exactly 20%: inside the band
  EXPECT_TRUE(MovedBeyond(100, 121, 0.2));
  EXPECT_TRUE(MovedBeyond(100, 79, 0.2));
  EXPECT_FALSE(MovedBeyond(100, 85, 0.2));
}

TEST(TelemetryTest, EstimateUsesFreshLinksBetweenMembers) {
  const absl::Time now = absl::UnixEpoch() + absl::Hours(1);
  LinkTable links;
  links.Record("a", "b", {1e9, 100000, now});
  links.Record("b", "a", {3e9, 300000, now - absl::Seconds(10)});
  links.Record("a", "c", {2e9, 0, now});                     // c is not a member
  links.Record("b", "d", {9e9, 0, now - absl::Minutes(5)});  // too old (and not a member)
  links.Record("d", "a", {0, 40000, now});                   // d not a member
  const absl::flat_hash_set<std::string> members = {"a", "b"};
  NetworkEstimate estimate = links.Estimate(members, now, absl::Minutes(1));
  EXPECT_EQ(estimate.links, 2u);
  EXPECT_EQ(estimate.bandwidth_bytes_per_second, 2e9);
  ASSERT_TRUE(estimate.latency_seconds.has_value());
  EXPECT_DOUBLE_EQ(*estimate.latency_seconds, 100e-6);  // median RTT 200us, one way 100us

  estimate = links.Estimate(members, now, absl::Seconds(5));  // b->a is too old now
  EXPECT_EQ(estimate.bandwidth_bytes_per_second, 1e9);

  EXPECT_EQ(links.MeanOutgoing("a", now, absl::Minutes(1)), 1.5e9);
  links.EraseNode("a");
  EXPECT_EQ(links.size(), 1u);  // only b -> d remains
  EXPECT_FALSE(links.Estimate(members, now, absl::Minutes(1)).bandwidth_bytes_per_second);
}

TEST(TelemetryTest, AchievedThroughputIsALowerBoundFromBusyWindowsOnly) {
  const absl::Time now = absl::UnixEpoch() + absl::Hours(1);
  const absl::flat_hash_set<std::string> members = {"a", "b", "c"};
  const ThroughputRule rule{/*min_bytes=*/1000, /*floor=*/5e9};
  LinkTable links;
  // Idle (100 bytes in 1s): ignored, whatever rate it shows.
  links.Record("a", "b", {100, 0, now, 1000000000, 100});
  EXPECT_FALSE(links.Estimate(members, now, absl::Minutes(1), rule).bandwidth_bytes_per_second);
  EXPECT_FALSE(SampleBandwidth({100, 0, now, 1000000000, 100}, 1000).has_value());
  // Busy but slower than the floor: counts as the floor, never below it.
  links.Record("a", "b", {1e9, 0, now, 1000000000, 1000000000});
  EXPECT_EQ(links.Estimate(members, now, absl::Minutes(1), rule).bandwidth_bytes_per_second, 5e9);
  EXPECT_EQ(SampleBandwidth({1e9, 0, now, 1000000000, 1000000000}, 1000), 1e9);
  // Busy and faster than the floor: the link carried that much, so the estimate rises.
  links.Record("a", "b", {8e9, 0, now, 1000000000, 8000000000});
  EXPECT_EQ(links.Estimate(members, now, absl::Minutes(1), rule).bandwidth_bytes_per_second, 8e9);
  // Capacity measurements (no window) count as they are, below the floor too, and once there are
  // any they decide: the median of 2 and 1 GB/s, the 8 GB/s lower bound aside.
  links.Record("b", "c", {2e9, 0, now});
  links.Record("c", "a", {1e9, 0, now});
  EXPECT_EQ(links.Estimate(members, now, absl::Minutes(1), rule).bandwidth_bytes_per_second, 1.5e9);
}

// A report of one link carrying both kinds: achieved throughput over a window and a capacity
// estimate from the busy time of large transfers.
LinkSample Both(double achieved, double capacity, absl::Time at) {
  LinkSample sample{achieved, 0, at, 1000000000, 1u << 30};
  sample.capacity_bytes_per_second = capacity;
  return sample;
}

TEST(TelemetryTest, CapacitySamplesArePreferredAndCanLowerTheEstimate) {
  const absl::Time now = absl::UnixEpoch() + absl::Hours(1);
  const absl::flat_hash_set<std::string> members = {"a", "b"};
  const ThroughputRule rule{/*min_bytes=*/1000, /*floor=*/5e9};
  LinkTable links;
  // Achieved 1 GB/s alone is floored at the plan's 5 GB/s: a slower link cannot show.
  links.Record("a", "b", {1e9, 0, now, 1000000000, 1000000000});
  EXPECT_EQ(links.Estimate(members, now, absl::Minutes(1), rule).bandwidth_bytes_per_second, 5e9);
  // With a capacity estimate of 0.5 GB/s in the same report: taken as is, below the floor.
  links.Record("a", "b", Both(1e9, 0.5e9, now));
  EXPECT_EQ(links.Estimate(members, now, absl::Minutes(1), rule).bandwidth_bytes_per_second, 0.5e9);
  EXPECT_EQ(SampleBandwidth(Both(1e9, 0.5e9, now), 1000), 0.5e9);
  EXPECT_FALSE(IsLowerBound(Both(1e9, 0.5e9, now)));
  EXPECT_TRUE(IsLowerBound({1e9, 0, now, 1000000000, 1000000000}));
  EXPECT_FALSE(IsLowerBound({1e9, 0, now}));  // a capacity measurement without a window
  // It rises as well: 9 GB/s of capacity while the window achieved only 1.
  links.Record("a", "b", Both(1e9, 9e9, now));
  EXPECT_EQ(links.Estimate(members, now, absl::Minutes(1), rule).bandwidth_bytes_per_second, 9e9);
  // The capacity estimate counts even from a window that moved less than min_bytes (it is a
  // measurement of the busy time, not of the window).
  LinkSample quiet = Both(10, 3e9, now);
  quiet.bytes = 10;
  EXPECT_EQ(SampleBandwidth(quiet, 1000), 3e9);
  // Mixed links: the capacity samples decide (a floored achieved sample, e.g. a server's
  // throughput towards the agents, would hold the median at the plan's bandwidth after the
  // network slowed down): the median of 2 and 1 GB/s, not of 5, 2 and 1.
  links.Record("a", "b", {1e9, 0, now, 1000000000, 1000000000});  // stands for 5e9
  links.Record("b", "a", Both(1e9, 2e9, now));
  const absl::flat_hash_set<std::string> three = {"a", "b", "c"};
  links.Record("c", "a", Both(1e9, 1e9, now));
  EXPECT_EQ(links.Estimate(three, now, absl::Minutes(1), rule).bandwidth_bytes_per_second, 1.5e9);
  // A stale capacity sample does not count.
  links.Record("b", "a", Both(1e9, 2e9, now - absl::Minutes(2)));
  links.Record("c", "a", Both(1e9, 1e9, now - absl::Minutes(2)));
  EXPECT_EQ(links.Estimate(three, now, absl::Minutes(1), rule).bandwidth_bytes_per_second, 5e9);
}

}  // namespace
}  // namespace poseidon::coordinator
