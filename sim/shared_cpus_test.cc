#include "sim/shared_cpus.h"

#include <map>

#include "gtest/gtest.h"

namespace poseidon::sim {
namespace {

// One host books a burst of three pieces on two CPUs, one after the other (its work is serial):
// 0-1, 1-2, 2-3. A second host's work that can start at 0 takes the CPU the first left free
// meanwhile, not a stretch after the burst.
TEST(SharedCpusTest, AnotherHostsWorkTakesTheCpuAHostsBurstLeavesFree) {
  SharedCpus cpus(2);
  double host = 0;
  for (int i = 0; i < 3; ++i) host = cpus.Book(0, host, 1) + 1;
  EXPECT_EQ(host, 3);
  EXPECT_EQ(cpus.Book(0, 0, 1), 0);
  EXPECT_EQ(cpus.Book(0, 0, 2), 1);
  // Both CPUs are now booked to 3: the next piece waits.
  EXPECT_EQ(cpus.Book(0, 0, 1), 3);
}

// A gap too short for the work is passed over; one long enough is used, before bookings made
// earlier.
TEST(SharedCpusTest, WorkGoesIntoTheFirstGapLongEnoughForIt) {
  SharedCpus cpus(1);
  EXPECT_EQ(cpus.Book(0, 0, 1), 0);    // 0-1
  EXPECT_EQ(cpus.Book(0, 2, 1), 2);    // 2-3
  EXPECT_EQ(cpus.Book(0, 5, 1), 5);    // 5-6
  EXPECT_EQ(cpus.Book(0, 0, 1.5), 3);  // 1-2 is too short; 3-4.5
  EXPECT_EQ(cpus.Book(0, 0, 0.5), 1);  // 1-1.5
  EXPECT_EQ(cpus.Book(0, 4, 1), 6);    // 4.5-5 is too short
  const std::map<double, double> expected = {{0, 1.5}, {2, 4.5}, {5, 7}};
  EXPECT_EQ(cpus.Bookings(0), expected) << "adjacent bookings are merged";
}

// With as many CPUs as hosts, nobody waits for another host's work; no work, no booking.
TEST(SharedCpusTest, AsManyCpusAsHostsIsEveryHostItsOwn) {
  SharedCpus cpus(3);
  double hosts[3] = {0, 0, 0};
  for (int i = 0; i < 10; ++i) {
    for (double& free : hosts) {
      const double start = cpus.Book(0, free, 1);
      EXPECT_EQ(start, free);
      free = start + 1;
    }
  }
  EXPECT_EQ(cpus.Book(0, 4, 0), 4);
  EXPECT_TRUE(SharedCpus(0).empty());
  EXPECT_EQ(SharedCpus(0).Book(0, 7, 1), 7) << "no shared CPUs: the host's own";
}

// Bookings that ended by the clock are forgotten: a later gap is found from there.
TEST(SharedCpusTest, BookingsThatEndedAreForgotten) {
  SharedCpus cpus(1);
  cpus.Book(0, 0, 1);
  cpus.Book(0, 1, 1);
  EXPECT_EQ(cpus.Bookings(0).size(), 1u);
  EXPECT_EQ(cpus.Book(5, 5, 1), 5);
  const std::map<double, double> expected = {{5, 6}};
  EXPECT_EQ(cpus.Bookings(0), expected);
}

}  // namespace
}  // namespace poseidon::sim
