// ConnectWithFallback: RDMA where chosen, TCP when RDMA fails and TCP to the same peer works,
// and no fallback while the peer is simply not up yet (both fail).
#include "agent/connect_fallback.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace poseidon::agent {
namespace {

struct Attempts {
  std::vector<std::string> tried;  // "rdma:<address>" / "tcp:<address>"
  int rdma_failures_left = 0;      // RDMA attempts that fail before one succeeds (-1: all fail)
  int tcp_failures_left = 0;
  std::function<absl::StatusOr<int>(bool, const std::string&)> Fn() {
    return [this](bool rdma, const std::string& address) -> absl::StatusOr<int> {
      tried.push_back(absl::StrCat(rdma ? "rdma:" : "tcp:", address));
      int& left = rdma ? rdma_failures_left : tcp_failures_left;
      if (left != 0) {
        if (left > 0) --left;
        return absl::UnavailableError(rdma ? "rdma refused" : "tcp refused");
      }
      return rdma ? 1 : 2;
    };
  }
};

TEST(ConnectWithFallback, RdmaWhenItWorks) {
  ConnectTarget target{true, "s:7101", "s:7100"};
  Attempts a;
  int fallbacks = 0;
  auto r = ConnectWithFallback<int>("server s", target, a.Fn(), absl::Now() + absl::Seconds(5),
                                    absl::Milliseconds(1), [&](const absl::Status&) { ++fallbacks; });
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 1);
  EXPECT_TRUE(target.rdma);
  EXPECT_EQ(fallbacks, 0);
  EXPECT_EQ(a.tried, (std::vector<std::string>{"rdma:s:7101"}));
}

TEST(ConnectWithFallback, TcpWhenRdmaFailsAndTcpWorks) {
  ConnectTarget target{true, "s:7101", "s:7100"};
  Attempts a;
  a.rdma_failures_left = -1;
  absl::Status why;
  auto r = ConnectWithFallback<int>("server s", target, a.Fn(), absl::Now() + absl::Seconds(5),
                                    absl::Milliseconds(1), [&](const absl::Status& s) { why = s; });
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 2);
  EXPECT_FALSE(target.rdma);
  EXPECT_EQ(target.address, "s:7100");
  EXPECT_TRUE(target.tcp_fallback.empty());
  EXPECT_EQ(why.message(), "rdma refused");
  EXPECT_EQ(a.tried, (std::vector<std::string>{"rdma:s:7101", "tcp:s:7100"}));
}

TEST(ConnectWithFallback, APeerNotUpYetKeepsRdmaAndIsTriedAgain) {
  // Both fail twice (the peer is starting), then RDMA works: no fallback.
  ConnectTarget target{true, "s:7101", "s:7100"};
  Attempts a;
  a.rdma_failures_left = 2;
  a.tcp_failures_left = 2;
  int fallbacks = 0;
  auto r = ConnectWithFallback<int>("server s", target, a.Fn(), absl::Now() + absl::Seconds(5),
                                    absl::Milliseconds(1), [&](const absl::Status&) { ++fallbacks; });
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 1);
  EXPECT_TRUE(target.rdma);
  EXPECT_EQ(fallbacks, 0);
  EXPECT_EQ(a.tried, (std::vector<std::string>{"rdma:s:7101", "tcp:s:7100", "rdma:s:7101",
                                               "tcp:s:7100", "rdma:s:7101"}));
}

TEST(ConnectWithFallback, WithoutAFallbackOrPastTheDeadlineTheErrorNamesWhatWasTried) {
  ConnectTarget target{true, "s:7101", "s:7100"};
  Attempts a;
  a.rdma_failures_left = -1;
  a.tcp_failures_left = -1;
  auto r = ConnectWithFallback<int>("server s", target, a.Fn(), absl::Now(), absl::Milliseconds(1), nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(r.status().message(), "over RDMA: rdma refused; over TCP (s:7100): tcp refused");
  EXPECT_TRUE(target.rdma);

  ConnectTarget tcp_only{false, "s:7100", ""};
  Attempts b;
  b.tcp_failures_left = -1;
  auto t = ConnectWithFallback<int>("server s", tcp_only, b.Fn(), absl::Now(), absl::Milliseconds(1), nullptr);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "tcp refused");
  EXPECT_EQ(b.tried, (std::vector<std::string>{"tcp:s:7100"}));
}

// A peer that took the connection and said nothing (transport::kPeerSilentPayload: frozen) ends
// the tries at once where the caller asks for it, over TCP alone or after RDMA's failure too; a
// peer not up yet, or a caller that does not ask, is tried again until the deadline.
TEST(ConnectWithFallback, ASilentPeerEndsTheTriesWhereAsked) {
  int calls = 0;
  bool silent = true;
  const std::function<absl::StatusOr<int>(bool, const std::string&)> attempt =
      [&](bool rdma, const std::string&) -> absl::StatusOr<int> {
    ++calls;
    absl::Status s = absl::DeadlineExceededError(rdma ? "rdma: no answer" : "tcp: no answer");
    if (silent && !rdma) s.SetPayload(transport::kPeerSilentPayload, absl::Cord("1"));
    return s;
  };
  const absl::Time far = absl::Now() + absl::Seconds(30);
  ConnectTarget tcp_only{false, "s:7100", ""};
  auto r = ConnectWithFallback<int>("server s", tcp_only, attempt, far, absl::Milliseconds(1),
                                    nullptr, /*give_up_when_silent=*/true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(r.status().GetPayload(transport::kPeerSilentPayload).has_value());

  calls = 0;
  ConnectTarget both{true, "s:7101", "s:7100"};
  r = ConnectWithFallback<int>("server s", both, attempt, far, absl::Milliseconds(1), nullptr,
                               /*give_up_when_silent=*/true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(calls, 2);  // RDMA, then TCP: silent
  EXPECT_EQ(r.status().message(), "over RDMA: rdma: no answer; over TCP (s:7100): tcp: no answer");

  calls = 0;
  ConnectTarget not_asked{false, "s:7100", ""};
  r = ConnectWithFallback<int>("server s", not_asked, attempt, absl::Now() + absl::Milliseconds(50),
                               absl::Milliseconds(1), nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_GT(calls, 1);

  calls = 0;
  silent = false;  // not up yet: tried again
  ConnectTarget not_up{false, "s:7100", ""};
  r = ConnectWithFallback<int>("server s", not_up, attempt, absl::Now() + absl::Milliseconds(50),
                               absl::Milliseconds(1), nullptr, /*give_up_when_silent=*/true);
  ASSERT_FALSE(r.ok());
  EXPECT_GT(calls, 1);
}

}  // namespace
}  // namespace poseidon::agent
