// The engine and service behind a real TCP FrameServer, driven by KvClients (one per rank, on
// threads). The multi-process version (separate server and client processes, signals, kill -9)
// is tests/server_multiprocess_test.cc.
#include "server/kv_engine.h"

#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <random>
#include <thread>

#include "common/wire_codec.h"
#include "server/kv_client.h"
#include "server/kv_service.h"
#include "server/server_telemetry.h"
#include "server/update_rules.h"
#include "transport/credentials.h"
#include "transport/tcp/tcp_context.h"

namespace poseidon::server {
namespace {

constexpr char kSecret[] = "engine-test";

v1::RegisterTablesRequest Spec(uint32_t workers, v1::UpdateRule rule, std::vector<uint64_t> sizes,
                               bool average = false) {
  v1::RegisterTablesRequest r;
  r.set_num_workers(workers);
  r.set_average_gradients(average);
  auto* t = r.add_tables();
  t->set_name("layer");
  t->mutable_update_rule()->set_rule(rule);
  t->mutable_update_rule()->set_learning_rate(0.5);
  t->mutable_update_rule()->set_momentum(0.9);
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto* k = t->add_keys();
    k->set_key(100 + i);
    k->set_elements(sizes[i]);
  }
  return r;
}

// Integer-valued gradients: sums are exact in float whatever the arrival order.
std::vector<float> Grad(uint32_t rank, uint64_t clock, uint64_t key, size_t n) {
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = static_cast<float>(static_cast<int64_t>((rank + 1) * 3 + clock * 5 + key + i % 11) - 40);
  }
  return g;
}

// Two ranks of a sum-rule key with a rejoin timeout; rank 1 keeps alive (a PING), both push
// clock 1, rank 0 pushes clock 2 and waits for it (`waiting`, into `out`) while rank 1 says
// nothing more.
struct SilentRank {
  std::shared_ptr<KvClient> c0, c1;
  std::unique_ptr<std::vector<float>> out = std::make_unique<std::vector<float>>(4);
  Ticket waiting{};
};

class KvServerTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(EngineOptions{}); }
  void Start(EngineOptions options, KvServiceOptions service_options = {}) {
    auto ctx = transport::CreateTcpContext(transport::TcpOptions{});
    ASSERT_TRUE(ctx.ok());
    ctx_ = *ctx;
    engine_ = std::make_shared<KvEngine>(options);
    secrets_ = std::make_shared<transport::SecretStore>();
    secrets_->Set(1, kSecret);
    secrets_->Set(2, "other-job");
    auto listener = ctx_->Listen("127.0.0.1:0");
    ASSERT_TRUE(listener.ok());
    pool_ = BufferPool::Create(64 << 20);
    service_ = std::make_shared<KvService>(engine_, pool_, service_options);
    server_ = std::make_shared<transport::FrameServer>(*listener, secrets_, service_);
    server_->Start();
  }
  void TearDown() override {
    server_->Stop();
    ctx_->Close();
  }
  std::shared_ptr<KvClient> Client(uint32_t rank, uint64_t job = 1,
                                   const std::string& secret = kSecret, int connections = 1) {
    auto c = KvClient::Connect(*ctx_, server_->Address(), job, rank,
                               transport::RankKey(secret, job, rank), absl::Seconds(10),
                               connections);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *c : nullptr;
  }

  // Waits for `ticket` while running the service's periodic check (silence, rejoin timeouts)
  // as the daemon does, at most 30 s.
  absl::Status WaitCheckingSilence(KvClient& client, Ticket ticket) {
    absl::Status s;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(50));
      service_->CheckSilence();
      s = client.Wait(ticket, absl::Milliseconds(1));
      if (s.code() != absl::StatusCode::kDeadlineExceeded) break;
    }
    return s;
  }

  SilentRank StartWithASilentRank(absl::Duration peer_timeout, uint32_t rejoin_ms) {
    TearDown();
    KvServiceOptions service;
    service.peer_timeout = peer_timeout;
    Start(EngineOptions{}, service);
    SilentRank job;
    job.c0 = Client(0);
    job.c1 = Client(1);
    v1::RegisterTablesRequest spec = Spec(2, v1::UPDATE_RULE_SUM, {4});
    spec.set_rejoin_timeout_ms(rejoin_ms);
    EXPECT_TRUE(job.c0->RegisterTables(spec, kWaitForSetUp).ok());
    const std::vector<float> g(4, 1.0f);
    EXPECT_TRUE(job.c1->Wait(job.c1->Ping(), kWaitForSetUp).ok());  // rank 1 keeps alive
    for (auto* c : {job.c0.get(), job.c1.get()}) {
      EXPECT_TRUE(c->Wait(c->Push(100, 1, g), kWaitForSetUp).ok());
    }
    EXPECT_TRUE(job.c0->Wait(job.c0->Pull(100, 1, *job.out), kWaitForSetUp).ok());
    EXPECT_TRUE(job.c0->Wait(job.c0->Push(100, 2, g), kWaitForSetUp).ok());
    job.waiting = job.c0->Pull(100, 2, *job.out, absl::Seconds(30));
    return job;
  }
  static constexpr absl::Duration kWaitForSetUp = absl::Seconds(30);

  std::shared_ptr<transport::Context> ctx_;
  std::shared_ptr<KvEngine> engine_;
  std::shared_ptr<transport::SecretStore> secrets_;
  std::shared_ptr<KvService> service_;
  std::shared_ptr<BufferPool> pool_;
  std::shared_ptr<transport::FrameServer> server_;
};

constexpr absl::Duration kWait = absl::Seconds(30);

class KvServerConnectionsTest : public KvServerTest, public ::testing::WithParamInterface<int> {};

TEST_P(KvServerConnectionsTest, SumRuleUnderBspReturnsTheExactSumOfAllRanks) {
  constexpr uint32_t kRanks = 4;
  const std::vector<uint64_t> sizes = {1000, 37, 70000};
  std::vector<std::thread> ranks;
  std::atomic<int> failures{0};
  for (uint32_t r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      auto c = Client(r, 1, kSecret, GetParam());
      if (!c || !c->RegisterTables(Spec(kRanks, v1::UPDATE_RULE_SUM, sizes), kWait).ok()) {
        ++failures;
        return;
      }
      for (uint64_t clock = 1; clock <= 5; ++clock) {
        std::vector<std::vector<float>> grads, results;
        std::vector<Ticket> pushes, pulls;
        for (size_t k = 0; k < sizes.size(); ++k) {
          grads.push_back(Grad(r, clock, 100 + k, sizes[k]));
          results.emplace_back(sizes[k]);
        }
        for (size_t k = 0; k < sizes.size(); ++k)
          pushes.push_back(c->Push(100 + k, clock, grads[k]));
        for (size_t k = 0; k < sizes.size(); ++k)
          pulls.push_back(c->Pull(100 + k, clock, results[k]));
        for (auto t : pushes) {
          if (auto s = c->Wait(t, kWait); !s.ok()) {
            ADD_FAILURE() << s;
            ++failures;
          }
        }
        for (size_t k = 0; k < sizes.size(); ++k) {
          if (auto s = c->Wait(pulls[k], kWait); !s.ok()) {
            ADD_FAILURE() << s;
            ++failures;
            continue;
          }
          std::vector<float> expected(sizes[k], 0.0f);
          for (uint32_t q = 0; q < kRanks; ++q) {
            auto g = Grad(q, clock, 100 + k, sizes[k]);
            for (size_t i = 0; i < sizes[k]; ++i) expected[i] += g[i];
          }
          if (results[k] != expected) {
            ADD_FAILURE() << "rank " << r << " key " << 100 + k << " clock " << clock;
            ++failures;
          }
        }
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(engine_->stats().clocks_completed.load(), 5u * sizes.size());
}

// One connection per client, and keys spread over three connections per client.
INSTANTIATE_TEST_SUITE_P(ConnectionsPerServer, KvServerConnectionsTest, ::testing::Values(1, 3));

TEST_F(KvServerTest, ServerSideMomentumEqualsOneWorkerOnTheDoubledBatch) {
  constexpr size_t kN = 513;
  auto spec = Spec(2, v1::UPDATE_RULE_MOMENTUM, {kN}, /*average=*/true);
  spec.mutable_tables(0)->set_initial_value(v1::INITIAL_VALUE_PUSHED_BY_RANK0);
  std::vector<float> init(kN);
  for (size_t i = 0; i < kN; ++i) init[i] = 0.01f * static_cast<float>(i);
  // Reference: one worker, mean of the two ranks' gradients (the doubled batch), same optimizer.
  auto hp = *HyperParamsFromSpec(spec.tables(0).update_rule());
  auto reference = MakeOptimizer(v1::UPDATE_RULE_MOMENTUM, hp, kN);
  std::vector<float> ref_params = init;
  std::vector<std::vector<float>> seen(2, std::vector<float>(kN));
  std::thread ranks[2];
  for (uint32_t r = 0; r < 2; ++r) {
    ranks[r] = std::thread([&, r] {
      auto c = Client(r);
      ASSERT_TRUE(c->RegisterTables(spec, kWait).ok());
      if (r == 0) ASSERT_TRUE(c->Wait(c->Push(100, 0, init, /*init=*/true), kWait).ok());
      std::vector<float> params(kN);
      ASSERT_TRUE(c->Wait(c->Pull(100, 0, params), kWait).ok());
      EXPECT_EQ(params, init);
      for (uint64_t clock = 1; clock <= 4; ++clock) {
        auto g = Grad(r, clock, 100, kN);
        ASSERT_TRUE(c->Wait(c->Push(100, clock, g), kWait).ok());
        ASSERT_TRUE(c->Wait(c->Pull(100, clock, params), kWait).ok());
      }
      seen[r] = params;
    });
  }
  for (auto& t : ranks) t.join();
  for (uint64_t clock = 1; clock <= 4; ++clock) {
    auto g0 = Grad(0, clock, 100, kN), g1 = Grad(1, clock, 100, kN);
    std::vector<float> mean(kN);
    for (size_t i = 0; i < kN; ++i) mean[i] = (g0[i] + g1[i]) * 0.5f;
    reference->Step(ref_params, mean);
  }
  EXPECT_EQ(seen[0], seen[1]);
  for (size_t i = 0; i < kN; ++i) ASSERT_NEAR(seen[0][i], ref_params[i], 1e-5f) << i;
}

TEST_F(KvServerTest, DuplicatePushIsAcknowledgedAndCountedOnce) {
  auto c0 = Client(0), c1 = Client(1);
  ASSERT_TRUE(c0->RegisterTables(Spec(2, v1::UPDATE_RULE_SUM, {8}), kWait).ok());
  auto g0 = Grad(0, 1, 100, 8), g1 = Grad(1, 1, 100, 8);
  ASSERT_TRUE(c0->Wait(c0->Push(100, 1, g0), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Push(100, 1, g0), kWait).ok()) << "a retransmission is acknowledged";
  ASSERT_TRUE(c1->Wait(c1->Push(100, 1, g1), kWait).ok());
  ASSERT_TRUE(c1->Wait(c1->Push(100, 1, g1), kWait).ok()) << "even after the clock finished";
  std::vector<float> out(8);
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 1, out), kWait).ok());
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(out[i], g0[i] + g1[i]);
  EXPECT_EQ(engine_->stats().duplicate_pushes.load(), 2u);
}

TEST_F(KvServerTest, LateUnknownAheadAndMisSizedPushesGetErrorsAndTheConnectionLives) {
  auto c0 = Client(0);
  ASSERT_TRUE(c0->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM, {8}), kWait).ok());
  std::vector<float> g(8, 1.0f), small(7, 1.0f), out(8);
  for (uint64_t clock = 1; clock <= 3; ++clock) {
    ASSERT_TRUE(c0->Wait(c0->Push(100, clock, g), kWait).ok());
  }
  auto late = c0->Wait(c0->Push(100, 1, g), kWait);
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition) << late;
  EXPECT_NE(late.message().find("finished clock 1"), std::string::npos) << late;
  auto ahead = c0->Wait(c0->Push(100, 9, g), kWait);
  EXPECT_EQ(ahead.code(), absl::StatusCode::kFailedPrecondition) << ahead;
  auto unknown = c0->Wait(c0->Push(555, 4, g), kWait);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  auto sized = c0->Wait(c0->Push(100, 4, small), kWait);
  EXPECT_EQ(sized.code(), absl::StatusCode::kInvalidArgument) << sized;
  EXPECT_NE(sized.message().find("expected 32"), std::string::npos) << sized;
  auto gone = c0->Wait(c0->Pull(100, 1, out), kWait);
  EXPECT_EQ(gone.code(), absl::StatusCode::kFailedPrecondition) << gone;
  // Still served.
  ASSERT_TRUE(c0->Wait(c0->Push(100, 4, g), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 4, out), kWait).ok());
  EXPECT_EQ(out, g);
}

TEST_F(KvServerTest, APushIsCheckedAgainstItsKeyBeforeAnyMemoryIsTakenForIt) {
  // A 48 MiB push for a 32-byte key, and one for a key the job does not have: refused with the
  // sizes, read into nothing (no buffer allocated for them), and the connection lives.
  auto c0 = Client(0);
  ASSERT_TRUE(c0->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM, {8}), kWait).ok());
  std::vector<float> g(8, 1.0f), huge(12u << 20, 1.0f), out(8);
  ASSERT_TRUE(c0->Wait(c0->Push(100, 1, g), kWait).ok());
  const size_t allocations = pool_->allocations();
  auto sized = c0->Wait(c0->Push(100, 2, huge), kWait);
  EXPECT_EQ(sized.code(), absl::StatusCode::kInvalidArgument) << sized;
  EXPECT_NE(sized.message().find("declares 50331648 bytes, expected 32"), std::string::npos)
      << sized;
  auto unknown = c0->Wait(c0->Push(555, 2, huge), kWait);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  EXPECT_EQ(pool_->allocations(), allocations) << "memory was taken for a refused push";
  ASSERT_TRUE(c0->Wait(c0->Push(100, 2, g), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 2, out), kWait).ok());
  EXPECT_EQ(out, g);
}

TEST_F(KvServerTest, APullThatCannotCompleteNamesTheRanksThatHaveNotPushed) {
  auto c0 = Client(0);
  ASSERT_TRUE(c0->RegisterTables(Spec(3, v1::UPDATE_RULE_SUM, {4}), kWait).ok());
  std::vector<float> g(4, 1.0f), out(4);
  ASSERT_TRUE(c0->Wait(c0->Push(100, 1, g), kWait).ok());
  auto s = c0->Wait(c0->Pull(100, 1, out, absl::Milliseconds(300)), kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("ranks [1, 2] have not pushed"), std::string::npos) << s;
}

TEST_F(KvServerTest, ARankWhoseLastConnectionClosesIsNamedToEveryPullThatNeedsIt) {
  auto c0 = Client(0);
  auto c1 = Client(1, 1, kSecret, /*connections=*/2);
  auto c2 = Client(2);
  ASSERT_TRUE(c0->RegisterTables(Spec(3, v1::UPDATE_RULE_SUM, {4}), kWait).ok());
  std::vector<float> g(4, 1.0f), out(4);
  for (auto* c : {c0.get(), c1.get(), c2.get()}) ASSERT_TRUE(c->Wait(c->Push(100, 1, g), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 1, out), kWait).ok());
  // Rank 2 pushes clock 2 and leaves: having pushed, it blocks nothing.
  ASSERT_TRUE(c2->Wait(c2->Push(100, 2, g), kWait).ok());
  c2->Close();
  ASSERT_TRUE(c0->Wait(c0->Push(100, 2, g), kWait).ok());
  const auto waiting = c0->Pull(100, 2, out, absl::Seconds(30));
  // Rank 1 leaves without pushing: the waiting pull fails at once, naming it and what waits.
  c1->Close();
  absl::Status s = c0->Wait(waiting, kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 1 (127.0.0.1:"), std::string::npos) << s;
  EXPECT_NE(s.message().find("is gone"), std::string::npos) << s;
  EXPECT_NE(s.message().find("clock 2 of key 100"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("rank 2"), std::string::npos) << "rank 2 pushed: " << s;
  // So does a later pull of that clock.
  s = c0->Wait(c0->Pull(100, 2, out, absl::Seconds(30)), kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  // Rank 1 comes back and pushes: the clock completes with every rank's push.
  auto again = Client(1);
  ASSERT_TRUE(again->Wait(again->Push(100, 2, g), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 2, out), kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, 3.0f));
}

// Elastic workers (issue 18): with a rejoin timeout the job waits for a rank whose last
// connection closed; a restarted rank that pushes the clock in flight completes it (and a push
// of a clock completed already is taken as a retransmission answered with that clock's sum).
// One that does not come back within the timeout is named, as without one.
TEST_F(KvServerTest, ARankThatClosesIsWaitedForItsRejoinTimeoutAndCompletesTheClockOnItsReturn) {
  auto c0 = Client(0);
  auto c1 = Client(1);
  v1::RegisterTablesRequest spec = Spec(2, v1::UPDATE_RULE_SUM, {4, 4});
  spec.set_rejoin_timeout_ms(60'000);
  ASSERT_TRUE(c0->RegisterTables(spec, kWait).ok());
  std::vector<float> g0(4, 1.0f), g1(4, 2.0f), out(4);
  // Clock 1 of both keys done; rank 1 pushes clock 2 of key 101 only and dies.
  for (uint64_t key : {100, 101}) {
    for (auto* c : {c0.get(), c1.get()}) {
      ASSERT_TRUE(c->Wait(c->Push(key, 1, c == c0.get() ? g0 : g1), kWait).ok());
    }
  }
  ASSERT_TRUE(c0->Wait(c0->Push(101, 2, g0), kWait).ok());
  ASSERT_TRUE(c1->Wait(c1->Push(101, 2, g1), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Push(100, 2, g0), kWait).ok());
  const auto waiting = c0->Pull(100, 2, out, absl::Seconds(30));
  c1->Close();
  service_->CheckSilence();  // within the timeout: nothing fails
  // The restarted rank registers (the same spec) and learns where the keys are.
  auto back = Client(1);
  std::vector<KeyProgress> progress;
  ASSERT_TRUE(back->RegisterTables(spec, kWait, &progress).ok());
  ASSERT_EQ(progress.size(), 2u);
  EXPECT_EQ(progress[0].completed, 1u);  // key 100: rank 1's push of clock 2 missing
  EXPECT_EQ(progress[1].completed, 2u);  // key 101: complete
  // It takes up clock 2 on every key: key 101's is a retransmission.
  ASSERT_TRUE(back->Wait(back->Push(101, 2, g1), kWait).ok());
  ASSERT_TRUE(back->Wait(back->Push(100, 2, g1), kWait).ok());
  ASSERT_TRUE(c0->Wait(waiting, kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, 3.0f));
  for (uint64_t key : {100, 101}) {
    ASSERT_TRUE(back->Wait(back->Pull(key, 2, out), kWait).ok());
    EXPECT_EQ(out, std::vector<float>(4, 3.0f)) << key;
  }
  EXPECT_EQ(engine_->stats().duplicate_pushes.load(), 1u);
}

// Elastic workers, shrinking (issue 18): with min_workers a rank given up is removed instead of
// failing the job. Each key completes without it from the first clock it did not push: the
// clock in flight where it had not pushed, the next one where it had — no clock of a key mixes
// two memberships. Its later pushes are refused; with fewer ranks left than min_workers the
// pulls fail naming it, as without.
TEST_F(KvServerTest, ARankGivenUpIsRemovedWhenMinWorkersAllowAndEachKeyGoesOnWithoutIt) {
  auto c0 = Client(0);
  auto c1 = Client(1);
  auto c2 = Client(2);
  v1::RegisterTablesRequest spec = Spec(3, v1::UPDATE_RULE_SUM, {4, 4});
  spec.set_min_workers(2);
  ASSERT_TRUE(c0->RegisterTables(spec, kWait).ok());
  std::vector<float> g0(4, 1.0f), g1(4, 2.0f), g2(4, 4.0f), out(4);
  auto grad = [&](KvClient* c) { return c == c0.get() ? g0 : c == c1.get() ? g1 : g2; };
  for (uint64_t key : {100, 101}) {
    for (auto* c : {c0.get(), c1.get(), c2.get()}) {
      ASSERT_TRUE(c->Wait(c->Push(key, 1, grad(c)), kWait).ok());
    }
  }
  // Clock 2: rank 2 pushes key 101 only and dies; rank 0 waits on key 100.
  ASSERT_TRUE(c2->Wait(c2->Push(101, 2, g2), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Push(100, 2, g0), kWait).ok());
  ASSERT_TRUE(c1->Wait(c1->Push(100, 2, g1), kWait).ok());
  const auto waiting = c0->Pull(100, 2, out, absl::Seconds(30));
  c2->Close();
  // Key 100 completes clock 2 without rank 2 (it had not pushed it): 1 + 2.
  ASSERT_TRUE(c0->Wait(waiting, kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, 3.0f));
  // Key 101's clock 2 has rank 2's push: 1 + 2 + 4, once ranks 0 and 1 pushed it.
  for (auto* c : {c0.get(), c1.get()}) ASSERT_TRUE(c->Wait(c->Push(101, 2, grad(c)), kWait).ok());
  ASSERT_TRUE(c1->Wait(c1->Pull(101, 2, out), kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, 7.0f));
  // Clock 3 of both keys: the two ranks left.
  for (uint64_t key : {100, 101}) {
    for (auto* c : {c0.get(), c1.get()}) ASSERT_TRUE(c->Wait(c->Push(key, 3, grad(c)), kWait).ok());
    ASSERT_TRUE(c0->Wait(c0->Pull(key, 3, out), kWait).ok());
    EXPECT_EQ(out, std::vector<float>(4, 3.0f)) << key;
  }
  // Rank 2 back: removed, its push is refused, naming why.
  auto back = Client(2);
  const absl::Status refused = back->Wait(back->Push(100, 4, g2), kWait);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("rank 2 was removed from job 1"), std::string::npos) << refused;
  // Rank 1 dies too: one rank would be left, below min_workers 2: the pull fails naming it.
  ASSERT_TRUE(c0->Wait(c0->Push(100, 4, g0), kWait).ok());
  const auto stuck = c0->Pull(100, 4, out, absl::Seconds(30));
  c1->Close();
  const absl::Status s = c0->Wait(stuck, kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 1 (127.0.0.1:"), std::string::npos) << s;
  EXPECT_NE(s.message().find("its min_workers is 2"), std::string::npos) << s;
}

// A server-side rule averaging the gradients divides by the ranks left once the world shrank.
TEST_F(KvServerTest, AnAveragingRuleDividesByTheRanksLeftOnceTheWorldShrank) {
  auto c0 = Client(0);
  auto c1 = Client(1);
  auto c2 = Client(2);
  v1::RegisterTablesRequest spec = Spec(3, v1::UPDATE_RULE_SGD, {4});  // lr 0.5, from 0
  spec.set_average_gradients(true);
  spec.set_min_workers(2);
  ASSERT_TRUE(c0->RegisterTables(spec, kWait).ok());
  std::vector<float> g(4, 3.0f), out(4);
  for (auto* c : {c0.get(), c1.get(), c2.get()}) ASSERT_TRUE(c->Wait(c->Push(100, 1, g), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 1, out), kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, -1.5f));  // -0.5 * mean 3
  c2->Close();
  std::vector<float> h0(4, 2.0f), h1(4, 4.0f);
  ASSERT_TRUE(c0->Wait(c0->Push(100, 2, h0), kWait).ok());
  ASSERT_TRUE(c1->Wait(c1->Push(100, 2, h1), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 2, out), kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, -3.0f));  // -1.5 - 0.5 * mean(2, 4)
  // Readmitted from clock 3: the mean of the three again.
  auto back = Client(2);
  v1::RegisterTablesRequest readmit = spec;
  readmit.set_readmit_from(3);
  ASSERT_TRUE(back->RegisterTables(readmit, kWait).ok());
  std::vector<float> h2(4, 6.0f);
  for (auto* c : {c0.get(), c1.get(), back.get()}) {
    ASSERT_TRUE(c->Wait(c->Push(100, 3, c == c0.get() ? h0 : c == c1.get() ? h1 : h2), kWait).ok());
  }
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 3, out), kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, -5.0f));  // -3 - 0.5 * mean(2, 4, 6)
}

// A sum table with `average` (a framework's local optimizer in a job that may shrink,
// PSD_LAYER_AVERAGE): each clock's result is the mean over the ranks that clock summed — all of
// them, the ranks left once one is removed, all again once it is readmitted — while a plain sum
// table of the same job keeps summing.
TEST_F(KvServerTest, AnAveragedSumTableAnswersTheMeanOverTheRanksEachClockSummed) {
  auto c0 = Client(0);
  auto c1 = Client(1);
  auto c2 = Client(2);
  v1::RegisterTablesRequest spec = Spec(3, v1::UPDATE_RULE_SUM, {4});  // key 100: averaged
  spec.mutable_tables(0)->set_average(true);
  auto* plain = spec.add_tables();
  plain->set_name("plain");
  plain->mutable_update_rule()->set_rule(v1::UPDATE_RULE_SUM);
  plain->add_keys()->set_key(200);
  plain->mutable_keys(0)->set_elements(4);
  spec.set_min_workers(2);
  ASSERT_TRUE(c0->RegisterTables(spec, kWait).ok());
  std::vector<float> mean(4), sum(4);
  auto clock = [&](uint64_t t, std::vector<std::pair<KvClient*, float>> pushes) {
    for (auto [c, v] : pushes) {
      for (uint64_t key : {100, 200}) {
        ASSERT_TRUE(c->Wait(c->Push(key, t, std::vector<float>(4, v)), kWait).ok());
      }
    }
    ASSERT_TRUE(c0->Wait(c0->Pull(100, t, mean), kWait).ok());
    ASSERT_TRUE(c0->Wait(c0->Pull(200, t, sum), kWait).ok());
  };
  clock(1, {{c0.get(), 1.0f}, {c1.get(), 2.0f}, {c2.get(), 6.0f}});
  EXPECT_EQ(mean, std::vector<float>(4, 3.0f));
  EXPECT_EQ(sum, std::vector<float>(4, 9.0f));
  c2->Close();  // removed: clock 2 sums ranks 0 and 1
  clock(2, {{c0.get(), 2.0f}, {c1.get(), 4.0f}});
  EXPECT_EQ(mean, std::vector<float>(4, 3.0f));
  EXPECT_EQ(sum, std::vector<float>(4, 6.0f));
  auto back = Client(2);
  v1::RegisterTablesRequest readmit = spec;
  readmit.set_readmit_from(3);
  ASSERT_TRUE(back->RegisterTables(readmit, kWait).ok());
  clock(3, {{c0.get(), 3.0f}, {c1.get(), 3.0f}, {back.get(), 6.0f}});
  EXPECT_EQ(mean, std::vector<float>(4, 4.0f));
  EXPECT_EQ(sum, std::vector<float>(4, 12.0f));
}

// The world grows again: a removed rank's replacement registers with readmit_from and every
// key counts it from that clock on — after leaving it out of the clocks before — also when a
// first try must move to a later clock (a key had completed it already); an idle key (a layer not
// posted lately) counts it from its own next clock.
TEST_F(KvServerTest, ARemovedRanksReplacementIsReadmittedFromTheClockItAsksAndEveryKeyCountsIt) {
  auto c0 = Client(0);
  auto c1 = Client(1);
  auto c2 = Client(2);
  v1::RegisterTablesRequest spec = Spec(3, v1::UPDATE_RULE_SUM, {4, 4, 4});  // 102: idle
  spec.set_min_workers(2);
  ASSERT_TRUE(c0->RegisterTables(spec, kWait).ok());
  std::vector<float> g0(4, 1.0f), g1(4, 2.0f), g2(4, 4.0f), out(4);
  auto both = [&](uint64_t key, uint64_t clock) {
    ASSERT_TRUE(c0->Wait(c0->Push(key, clock, g0), kWait).ok());
    ASSERT_TRUE(c1->Wait(c1->Push(key, clock, g1), kWait).ok());
  };
  for (uint64_t key : {100, 101}) {
    for (auto* c : {c0.get(), c1.get(), c2.get()}) {
      ASSERT_TRUE(c->Wait(c->Push(key, 1, c == c0.get() ? g0 : c == c1.get() ? g1 : g2), kWait)
                      .ok());
    }
  }
  c2->Close();  // removed: clock 2 sums ranks 0 and 1
  for (uint64_t key : {100, 101}) {
    both(key, 2);
    ASSERT_TRUE(c0->Wait(c0->Pull(key, 2, out), kWait).ok());
    EXPECT_EQ(out, std::vector<float>(4, 3.0f)) << key;
  }
  auto back = Client(2);
  bool removed = false;  // a registration's answer says so
  ASSERT_TRUE(back->RegisterTables(spec, kWait, nullptr, &removed).ok());
  EXPECT_TRUE(removed);
  ASSERT_TRUE(c1->RegisterTables(spec, kWait, nullptr, &removed).ok());
  EXPECT_FALSE(removed);
  v1::RegisterTablesRequest readmit = spec;
  // A clock both keys completed: too late, nothing changes.
  std::vector<KeyProgress> progress;
  readmit.set_readmit_from(2);
  ASSERT_TRUE(back->RegisterTables(readmit, kWait, &progress).ok());
  EXPECT_EQ(progress, (std::vector<KeyProgress>{{2, 0}, {2, 0}, {0, 0}}));  // too late but 102
  const absl::Status still_out = back->Wait(back->Push(100, 3, g2), kWait);
  EXPECT_EQ(still_out.code(), absl::StatusCode::kFailedPrecondition) << still_out;
  // From clock 4: clock 3 still sums the two ranks, clock 4 the three.
  readmit.set_readmit_from(4);
  ASSERT_TRUE(back->RegisterTables(readmit, kWait, &progress, &removed).ok());
  EXPECT_EQ(progress, (std::vector<KeyProgress>{{2, 0}, {2, 0}, {0, 0}}));
  EXPECT_FALSE(removed);
  for (uint64_t key : {100, 101}) {
    both(key, 3);
    ASSERT_TRUE(c0->Wait(c0->Pull(key, 3, out), kWait).ok());
    EXPECT_EQ(out, std::vector<float>(4, 3.0f)) << key;
  }
  both(100, 4);
  const auto waiting = c0->Pull(100, 4, out, absl::Seconds(30));
  ASSERT_TRUE(back->Wait(back->Push(100, 4, g2), kWait).ok());
  ASSERT_TRUE(c0->Wait(waiting, kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, 7.0f));
  // Key 101 has not got rank 2's push of clock 4 when the replacement asks again from clock 5
  // (as it would when another server's key had completed clock 4): key 101's clock 4 goes on
  // without it, key 100 (which has it for clock 4) keeps it.
  readmit.set_readmit_from(5);
  ASSERT_TRUE(back->RegisterTables(readmit, kWait, &progress).ok());
  EXPECT_EQ(progress, (std::vector<KeyProgress>{{4, 0}, {3, 0}, {0, 0}}));
  both(101, 4);
  ASSERT_TRUE(c1->Wait(c1->Pull(101, 4, out), kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, 3.0f));
  for (uint64_t key : {100, 101}) {
    both(key, 5);
    ASSERT_TRUE(back->Wait(back->Push(key, 5, g2), kWait).ok());
    ASSERT_TRUE(back->Wait(back->Pull(key, 5, out), kWait).ok());
    EXPECT_EQ(out, std::vector<float>(4, 7.0f)) << key;
  }
  // Key 102, idle (a layer not posted lately), counts it from its own next clock: 1.
  both(102, 1);
  ASSERT_TRUE(back->Wait(back->Push(102, 1, g2), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Pull(102, 1, out), kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, 7.0f));
  // Readmitted, it can be removed again.
  back->Close();
  both(100, 6);
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 6, out), kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, 3.0f));
}

// A job that cannot shrink has nobody to readmit: refused, naming why.
TEST_F(KvServerTest, ReadmissionNeedsAJobThatMayShrink) {
  auto c0 = Client(0);
  auto c1 = Client(1);
  v1::RegisterTablesRequest spec = Spec(2, v1::UPDATE_RULE_SUM, {4});
  ASSERT_TRUE(c0->RegisterTables(spec, kWait).ok());
  spec.set_readmit_from(1);
  const absl::Status no = c1->RegisterTables(spec, kWait);
  EXPECT_EQ(no.code(), absl::StatusCode::kFailedPrecondition) << no;
  EXPECT_NE(no.message().find("cannot shrink or grow (min_workers 0)"), std::string::npos) << no;
}

// min_workers above the world size is refused at registration; every rank must agree on it.
TEST_F(KvServerTest, MinWorkersIsValidatedAndTheSameOnEveryRank) {
  auto c0 = Client(0);
  v1::RegisterTablesRequest spec = Spec(2, v1::UPDATE_RULE_SUM, {4});
  spec.set_min_workers(3);
  const absl::Status big = c0->RegisterTables(spec, kWait);
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument) << big;
  EXPECT_NE(big.message().find("min_workers (3) exceeds num_workers (2)"), std::string::npos)
      << big;
  spec.set_min_workers(1);
  ASSERT_TRUE(c0->RegisterTables(spec, kWait).ok());
  auto c1 = Client(1);
  spec.set_min_workers(2);
  const absl::Status differs = c1->RegisterTables(spec, kWait);
  EXPECT_EQ(differs.code(), absl::StatusCode::kFailedPrecondition) << differs;
  EXPECT_NE(differs.message().find("registered with min_workers 1, not 2"), std::string::npos)
      << differs;
}

// Under a server-side rule a rejoining rank first re-reads the parameters the iteration in
// flight was computed from: a key that has moved on answers them from the parameters it kept
// before its latest update (a job with a rejoin timeout keeps them), and takes the re-read's
// push as a retransmission. Without a rejoin timeout that clock is gone.
TEST_F(KvServerTest, AServerRuleKeyAnswersARejoiningRanksReReadFromItsPreviousParameters) {
  for (const uint32_t rejoin_ms : {60'000u, 0u}) {
    SCOPED_TRACE(rejoin_ms);
    const uint64_t job = rejoin_ms == 0 ? 2 : 1;
    const std::string secret = job == 1 ? kSecret : "other-job";
    auto c0 = Client(0, job, secret);
    auto c1 = Client(1, job, secret);
    v1::RegisterTablesRequest spec = Spec(2, v1::UPDATE_RULE_SGD, {4, 4});  // lr 0.5, from 0
    spec.set_rejoin_timeout_ms(rejoin_ms);
    ASSERT_TRUE(c0->RegisterTables(spec, kWait).ok());
    std::vector<float> g0(4, 1.0f), g1(4, 2.0f), out(4);
    for (uint64_t key : {100, 101}) {
      ASSERT_TRUE(c0->Wait(c0->Push(key, 1, g0), kWait).ok());
      ASSERT_TRUE(c1->Wait(c1->Push(key, 1, g1), kWait).ok());
    }
    // Clock 2: key 101 completes; rank 1 dies before pushing key 100.
    ASSERT_TRUE(c0->Wait(c0->Push(101, 2, g0), kWait).ok());
    ASSERT_TRUE(c1->Wait(c1->Push(101, 2, g1), kWait).ok());
    ASSERT_TRUE(c0->Wait(c0->Push(100, 2, g0), kWait).ok());
    const auto waiting = c0->Pull(100, 2, out, absl::Seconds(30));
    c1->Close();
    auto back = Client(1, job, secret);
    std::vector<KeyProgress> progress;
    ASSERT_TRUE(back->RegisterTables(spec, kWait, &progress).ok());
    ASSERT_EQ(progress.size(), 2u);
    EXPECT_EQ(progress[0].completed, 1u);
    EXPECT_EQ(progress[1].completed, 2u);
    // The re-read of clock 1 (the parameters after 1 update: -0.5 x 3): a retransmitted push
    // and a pull, on both keys.
    std::vector<float> reread(4);
    ASSERT_TRUE(back->Wait(back->Push(100, 1, g1), kWait).ok());
    ASSERT_TRUE(back->Wait(back->Pull(100, 1, reread), kWait).ok());
    EXPECT_EQ(reread, std::vector<float>(4, -1.5f));
    const absl::Status pushed = back->Wait(back->Push(101, 1, g1), kWait);
    const absl::Status pulled = back->Wait(back->Pull(101, 1, reread), kWait);
    if (rejoin_ms == 0) {
      EXPECT_EQ(pushed.code(), absl::StatusCode::kFailedPrecondition) << pushed;
      EXPECT_EQ(pulled.code(), absl::StatusCode::kFailedPrecondition) << pulled;
      EXPECT_NE(pulled.message().find("is gone"), std::string::npos) << pulled;
      continue;
    }
    ASSERT_TRUE(pushed.ok()) << pushed;
    ASSERT_TRUE(pulled.ok()) << pulled;
    EXPECT_EQ(reread, std::vector<float>(4, -1.5f)) << "key 101's parameters before clock 2";
    // Then clock 2: a retransmission on key 101, the missing push on key 100.
    ASSERT_TRUE(back->Wait(back->Push(101, 2, g1), kWait).ok());
    ASSERT_TRUE(back->Wait(back->Push(100, 2, g1), kWait).ok());
    ASSERT_TRUE(c0->Wait(waiting, kWait).ok());
    EXPECT_EQ(out, std::vector<float>(4, -3.0f));
    for (uint64_t key : {100, 101}) {
      ASSERT_TRUE(back->Wait(back->Pull(key, 2, out), kWait).ok());
      EXPECT_EQ(out, std::vector<float>(4, -3.0f)) << key;
    }
  }
}

TEST_F(KvServerTest, ARankThatDoesNotRejoinWithinItsTimeoutIsNamed) {
  auto c0 = Client(0);
  auto c1 = Client(1);
  v1::RegisterTablesRequest spec = Spec(2, v1::UPDATE_RULE_SUM, {4});
  spec.set_rejoin_timeout_ms(200);
  ASSERT_TRUE(c0->RegisterTables(spec, kWait).ok());
  // Every rank registers the same timeout.
  v1::RegisterTablesRequest other = spec;
  other.set_rejoin_timeout_ms(0);
  absl::Status refused = c1->RegisterTables(other, kWait);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("rejoin timeout of 200 ms"), std::string::npos) << refused;
  std::vector<float> g(4, 1.0f), out(4);
  ASSERT_TRUE(c1->Wait(c1->Push(100, 1, g), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Push(100, 1, g), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 1, out), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Push(100, 2, g), kWait).ok());
  const auto waiting = c0->Pull(100, 2, out, absl::Seconds(30));
  c1->Close();
  // The close is seen on an I/O thread; the timeout is checked periodically (the daemon: every
  // 500 ms).
  const absl::Status s = WaitCheckingSilence(*c0, waiting);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 1 (127.0.0.1:"), std::string::npos) << s;
  EXPECT_NE(s.message().find("did not rejoin within 200ms"), std::string::npos) << s;
}

// A lossy wire (issue 15): pushes and pulls carry 2 bytes an element (bfloat16 or fp16); ranks
// encode with error feedback and the server rounds each result with its own, so that over many
// clocks the pulled sums add up to the exact ones within a few roundings, where plain rounding
// drifts.
class LossyWireTest : public KvServerTest, public ::testing::WithParamInterface<WireType> {};

TEST_P(LossyWireTest, TheSumsOverClocksStayWithinAFewRoundings) {
  const WireType type = GetParam();
  constexpr uint32_t kRanks = 3;
  constexpr size_t kElements = 999;  // odd: a payload that is not a whole number of floats
  constexpr int kClocks = 40;
  v1::RegisterTablesRequest spec = Spec(kRanks, v1::UPDATE_RULE_SUM, {kElements});
  spec.mutable_tables(0)->set_wire_type(type == WireType::kF16 ? v1::ELEMENT_TYPE_F16
                                                               : v1::ELEMENT_TYPE_BF16);
  std::vector<std::shared_ptr<KvClient>> clients;
  for (uint32_t r = 0; r < kRanks; ++r) {
    clients.push_back(Client(r));
    ASSERT_TRUE(clients[r]->RegisterTables(spec, kWait).ok());
  }
  // A float32 payload is the wrong size for this key: refused, naming both sizes.
  std::vector<float> wide(kElements, 1.0f);
  absl::Status refused = clients[0]->Wait(clients[0]->Push(100, 1, wide), kWait);
  EXPECT_NE(refused.message().find("expected 1998"), std::string::npos) << refused;

  // The type's unit just above 1: 2^-7 for bfloat16, 2^-10 for fp16. Everything below is in
  // that unit, so both types face the same test.
  const double unit = type == WireType::kF16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
  const auto scale = static_cast<float>(unit / std::ldexp(1.0, -7));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> noise(-1.0f, 1.0f);
  // 1 + unit/8 is not representable (its next value above 1 is 1 + unit): plain rounding loses
  // the unit/8 of every push.
  const auto bias = static_cast<float>(1.0 + unit / 8);
  std::vector<std::vector<float>> residual(kRanks, std::vector<float>(kElements, 0.0f));
  std::vector<double> exact_total(kElements, 0), pulled_total(kElements, 0),
      plain_total(kElements, 0);
  double worst_clock_error = 0;
  for (int clock = 1; clock <= kClocks; ++clock) {
    std::vector<double> exact(kElements, 0);
    std::vector<std::vector<uint16_t>> wire(kRanks, std::vector<uint16_t>(kElements));
    std::vector<Ticket> pushes;
    for (uint32_t r = 0; r < kRanks; ++r) {
      std::vector<float> g(kElements);
      for (size_t i = 0; i < kElements; ++i) {
        g[i] = bias + 0.01f * scale * noise(rng);
        exact[i] += g[i];
        plain_total[i] += FromWire16(type, ToWire16(type, g[i]));
      }
      EncodeWithFeedback(type, g, residual[r], wire[r]);
      pushes.push_back(clients[r]->PushBytes(100, clock, std::as_bytes(std::span(wire[r]))));
    }
    std::vector<uint16_t> pulled(kElements);
    const Ticket pull = clients[0]->PullBytes(100, clock, std::as_writable_bytes(std::span(pulled)));
    for (uint32_t r = 0; r < kRanks; ++r) ASSERT_TRUE(clients[r]->Wait(pushes[r], kWait).ok());
    ASSERT_TRUE(clients[0]->Wait(pull, kWait).ok());
    for (size_t i = 0; i < kElements; ++i) {
      const double value = FromWire16(type, pulled[i]);
      worst_clock_error = std::max(worst_clock_error, std::abs(value - exact[i]));
      exact_total[i] += exact[i];
      pulled_total[i] += value;
    }
  }
  double drift = 0, plain_drift = 0;
  for (size_t i = 0; i < kElements; ++i) {
    drift = std::max(drift, std::abs(pulled_total[i] - exact_total[i]));
    plain_drift = std::max(plain_drift, std::abs(plain_total[i] - exact_total[i]));
  }
  // One rounding of a value near 3 is at most one unit (half of [2, 4)'s unit of 2·unit); the
  // residuals left at the end (one per rank and the server's) bound the drift whatever the
  // number of clocks.
  EXPECT_LT(worst_clock_error, 0.05 * scale) << "a clock's sum is near the exact one";
  EXPECT_LT(drift, 4 * unit) << "over " << kClocks << " clocks";
  // The control: rounding each push without feedback loses up to unit/8 per push (the noise
  // rounds some up): ~12 units over the 120 pushes, several times the bound above.
  EXPECT_GT(plain_drift, 2 * 4 * unit) << "with feedback: " << drift;
}

INSTANTIATE_TEST_SUITE_P(Types, LossyWireTest, ::testing::Values(WireType::kBf16, WireType::kF16),
                         [](const auto& info) { return std::string(WireName(info.param)); });

// A rank's divergence guard falls a lossy key back to float32 (kFlagExactWire): its float32
// push switches the key at that clock; the clock's result releases what the server's rounding
// held back, so the pulled sums over clocks are the pushed ones; later 16-bit pushes are refused,
// and a pull that does not accept float32 is told why.
TEST_F(KvServerTest, ALossyKeyFallsBackToFloat32AtTheClockARankPushesFloat32) {
  constexpr size_t kElements = 257;
  v1::RegisterTablesRequest spec = Spec(2, v1::UPDATE_RULE_SUM, {kElements});
  spec.mutable_tables(0)->set_wire_type(v1::ELEMENT_TYPE_BF16);
  auto c0 = Client(0);
  auto c1 = Client(1);
  ASSERT_TRUE(c0->RegisterTables(spec, kWait).ok());
  ASSERT_TRUE(c1->RegisterTables(spec, kWait).ok());
  // Rank 0 sends 1, rank 1 1 + 2^-7 (both bfloat16): their sum 2 + 2^-7 is not one (the unit
  // above 2 is 2^-6), so the server's rounding holds 2^-7 back.
  const float bias = 1.0f + 1.0f / 1024;
  std::vector<float> g(kElements, bias);
  const std::vector<uint16_t> wire0(kElements, ToBf16(1.0f));
  const std::vector<uint16_t> wire(kElements, ToBf16(1.0f + 1.0f / 128));
  const float decoded = FromBf16(wire[0]);
  ASSERT_EQ(decoded, 1.0f + 1.0f / 128);
  double pushed_total = 0, pulled_total = 0;
  // Clock 1, both 16-bit: the answer is 16-bit (received says so).
  ASSERT_TRUE(c0->Wait(c0->PushBytes(100, 1, std::as_bytes(std::span(wire0))), kWait).ok());
  ASSERT_TRUE(c1->Wait(c1->PushBytes(100, 1, std::as_bytes(std::span(wire))), kWait).ok());
  pushed_total += 1.0 + decoded;
  std::vector<float> out(kElements);
  size_t received = 0;
  ASSERT_TRUE(c0->Wait(c0->PullBytes(100, 1, std::as_writable_bytes(std::span(out)), kWait, 0,
                                     kElements * 2, &received),
                       kWait)
                  .ok());
  EXPECT_EQ(received, kElements * 2);
  DecodeWire16InPlace(WireType::kBf16, out);
  pulled_total += out[0];
  // Clock 2: rank 0 falls back (float32 with kFlagExactWire), rank 1 still sends 16 bits.
  ASSERT_TRUE(c0->Wait(c0->PushBytes(100, 2, std::as_bytes(std::span(g)), 0, false, false,
                                     /*exact_wire=*/true),
                       kWait)
                  .ok());
  ASSERT_TRUE(c1->Wait(c1->PushBytes(100, 2, std::as_bytes(std::span(wire))), kWait).ok());
  pushed_total += bias + decoded;
  // A pull that takes only 16 bits is refused, naming the fallback.
  std::vector<uint16_t> narrow(kElements);
  const absl::Status refused =
      c1->Wait(c1->PullBytes(100, 2, std::as_writable_bytes(std::span(narrow))), kWait);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("fell back to float32 at clock 2"), std::string::npos)
      << refused;
  ASSERT_TRUE(c1->Wait(c1->PullBytes(100, 2, std::as_writable_bytes(std::span(out)), kWait, 0,
                                     kElements * 2, &received),
                       kWait)
                  .ok());
  EXPECT_EQ(received, kElements * sizeof(float)) << "answered in float32";
  pulled_total += out[0];
  // The fallback clock released the server's residual: the pulled sums are the pushed ones.
  EXPECT_NEAR(pulled_total, pushed_total, 1e-5);
  EXPECT_NE(1.0 + decoded, pulled_total - out[0]) << "clock 1 was rounded";
  // Clock 3: a 16-bit push is refused; float32 ones are summed and answered in float32.
  const absl::Status late = c1->Wait(c1->PushBytes(100, 3, std::as_bytes(std::span(wire))), kWait);
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition) << late;
  EXPECT_NE(late.message().find("16-bit push of clock 3 is refused"), std::string::npos) << late;
  for (auto* c : {c0.get(), c1.get()}) {
    ASSERT_TRUE(c->Wait(c->PushBytes(100, 3, std::as_bytes(std::span(g)), 0, false, false, true),
                        kWait)
                    .ok());
  }
  ASSERT_TRUE(c0->Wait(c0->PullBytes(100, 3, std::as_writable_bytes(std::span(out)), kWait, 0,
                                     kElements * 2, &received),
                       kWait)
                  .ok());
  EXPECT_EQ(received, kElements * sizeof(float));
  EXPECT_EQ(out, std::vector<float>(kElements, 2 * bias)) << "exact from the fallback on";
  // The fallback is part of the key's state: a checkpoint keeps it and a restored job answers it
  // at registration, so the resumed agents push float32 from the start.
  auto snap = engine_->SnapshotCompleted(1, 3);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->keys[0].exact_from, 2u);
  KvEngine fresh(EngineOptions{});
  ASSERT_TRUE(fresh.Restore(*snap).ok());
  EXPECT_EQ(fresh.KeyProgressOf(1, spec), (std::vector<KeyProgress>{{3, 2}}));
  EXPECT_EQ(engine_->KeyProgressOf(1, spec), (std::vector<KeyProgress>{{3, 2}}));
}

TEST_F(KvServerTest, ALossyWireNeedsTheSumRule) {
  auto c = Client(0);
  v1::RegisterTablesRequest spec = Spec(1, v1::UPDATE_RULE_MOMENTUM, {8});
  spec.mutable_tables(0)->set_wire_type(v1::ELEMENT_TYPE_BF16);
  const absl::Status s = c->RegisterTables(spec, kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("a lossy (bf16) wire needs the sum rule"), std::string::npos) << s;
  spec.mutable_tables(0)->set_wire_type(v1::ELEMENT_TYPE_F16);
  const absl::Status f16 = c->RegisterTables(spec, kWait);
  EXPECT_EQ(f16.code(), absl::StatusCode::kInvalidArgument) << f16;
  EXPECT_NE(f16.message().find("a lossy (fp16) wire needs the sum rule"), std::string::npos) << f16;
  spec.mutable_tables(0)->set_wire_type(v1::ELEMENT_TYPE_F64);
  EXPECT_EQ(c->RegisterTables(spec, kWait).code(), absl::StatusCode::kUnimplemented);
}

// A rank that keeps alive (an empty PING) and then sends nothing for peer_timeout is declared
// silent: the pulls that need its push fail naming it; when it speaks again it is taken back.
TEST_F(KvServerTest, ASilentRankThatKeepsAliveIsNamedAndTakenBackWhenItSpeaks) {
  TearDown();
  KvServiceOptions service;
  service.peer_timeout = absl::Milliseconds(200);
  Start(EngineOptions{}, service);
  auto c0 = Client(0);
  auto c1 = Client(1);
  ASSERT_TRUE(c0->RegisterTables(Spec(2, v1::UPDATE_RULE_SUM, {4}), kWait).ok());
  std::vector<float> g(4, 1.0f), out(4);
  ASSERT_TRUE(c1->Wait(c1->Ping(), kWait).ok());  // rank 1 keeps alive
  ASSERT_TRUE(c0->Wait(c0->Push(100, 1, g), kWait).ok());
  ASSERT_TRUE(c1->Wait(c1->Push(100, 1, g), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 1, out), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Push(100, 2, g), kWait).ok());
  const Ticket waiting = c0->Pull(100, 2, out, absl::Seconds(30));
  service_->CheckSilence();  // rank 1 spoke a moment ago: nothing yet
  absl::SleepFor(absl::Milliseconds(300));
  service_->CheckSilence();
  const absl::Status s = c0->Wait(waiting, kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 1 (127.0.0.1:"), std::string::npos) << s;
  EXPECT_NE(s.message().find("is silent"), std::string::npos) << s;
  // Rank 0 never pinged: its own silence is not judged (it may be a tool, not an agent).
  EXPECT_EQ(s.message().find("rank 0"), std::string::npos) << s;
  // Rank 1 speaks again: its push completes the clock.
  ASSERT_TRUE(c1->Wait(c1->Push(100, 2, g), kWait).ok());
  ASSERT_TRUE(c0->Wait(c0->Pull(100, 2, out), kWait).ok());
  EXPECT_EQ(out, std::vector<float>(4, 2.0f));
}

// With a rejoin timeout a silent rank (frozen: its connections stay open) is waited for as a
// closed one: a replacement that pushes completes the clock; if none comes, it is named.
TEST_F(KvServerTest, ASilentRankIsWaitedForItsRejoinTimeoutAndItsReplacementCompletesTheClock) {
  SilentRank job = StartWithASilentRank(absl::Milliseconds(200), 60'000);
  absl::SleepFor(absl::Milliseconds(300));
  service_->CheckSilence();  // silent: waited for, nothing fails
  service_->CheckSilence();
  EXPECT_EQ(job.c0->Wait(job.waiting, absl::Milliseconds(200)).code(),
            absl::StatusCode::kDeadlineExceeded);
  // Its replacement (rank 1 again, on a new connection) pushes: the clock completes.
  auto replacement = Client(1);
  const std::vector<float> g(4, 1.0f);
  ASSERT_TRUE(replacement->Wait(replacement->Push(100, 2, g), kWait).ok());
  ASSERT_TRUE(job.c0->Wait(job.waiting, kWait).ok());
  EXPECT_EQ(*job.out, std::vector<float>(4, 2.0f));
  replacement->Close();
}

TEST_F(KvServerTest, ASilentRankThatNobodyReplacesIsNamedOnceItsRejoinTimeoutIsOver) {
  SilentRank job = StartWithASilentRank(absl::Milliseconds(100), 300);
  const absl::Status s = WaitCheckingSilence(*job.c0, job.waiting);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 1 (127.0.0.1:"), std::string::npos) << s;
  EXPECT_NE(s.message().find("is silent"), std::string::npos) << s;
  EXPECT_NE(s.message().find("did not come back within 300ms"), std::string::npos) << s;
}

// The service behind which a table registration is answered only after `delay` while PINGs are
// answered at once (a live server slow to register), or nothing is answered at all (`frozen`:
// a SIGSTOPped server whose connections stay open).
class SlowRegistration : public transport::FrameHandler {
 public:
  SlowRegistration(std::shared_ptr<KvService> inner, absl::Duration delay, bool frozen)
      : inner_(std::move(inner)), delay_(delay), frozen_(frozen) {}
  ~SlowRegistration() override {
    for (std::thread& t : held_) t.join();
  }
  absl::StatusOr<transport::PayloadTarget> OnHeader(
      const std::shared_ptr<transport::PeerSession>& peer,
      const transport::FrameHeader& header) override {
    return inner_->OnHeader(peer, header);
  }
  void OnFrame(const std::shared_ptr<transport::PeerSession>& peer,
               const transport::FrameHeader& header, transport::MutableBuffer payload) override {
    if (frozen_) return;
    if (header.type != transport::FrameType::kRegisterTables) {
      inner_->OnFrame(peer, header, payload);
      return;
    }
    auto copy = std::make_shared<std::vector<std::byte>>(payload.begin(), payload.end());
    std::lock_guard<std::mutex> lock(mu_);
    held_.emplace_back([this, peer, header, copy] {
      absl::SleepFor(delay_);
      inner_->OnFrame(peer, header, *copy);
    });
  }
  void OnClose(const std::shared_ptr<transport::PeerSession>& peer,
               const absl::Status& reason) override {
    inner_->OnClose(peer, reason);
  }

 private:
  std::shared_ptr<KvService> inner_;
  absl::Duration delay_;
  bool frozen_;
  std::mutex mu_;
  std::vector<std::thread> held_;
};

// An agent tells a frozen server from a slow one while it registers the job (KvClient::
// WaitAlive, with its peer_timeout): the frozen one is lost after the silence limit, not after
// the registration's 30 s; the slow one, which answers pings, is waited for past that limit.
TEST_F(KvServerTest, ARegistrationTellsAFrozenServerFromASlowOne) {
  for (const bool frozen : {false, true}) {
    SCOPED_TRACE(frozen ? "frozen" : "slow");
    auto handler = std::make_shared<SlowRegistration>(service_, absl::Seconds(1), frozen);
    auto listener = ctx_->Listen("127.0.0.1:0");
    ASSERT_TRUE(listener.ok());
    auto server = std::make_shared<transport::FrameServer>(*listener, secrets_, handler);
    server->Start();
    auto c = KvClient::Connect(*ctx_, server->Address(), 1, 0, transport::RankKey(kSecret, 1, 0),
                               absl::Seconds(10));
    ASSERT_TRUE(c.ok()) << c.status();
    const absl::Status s =
        (*c)->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM, {8}), absl::Seconds(30), nullptr, nullptr,
                             absl::Milliseconds(300));
    if (frozen) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
      EXPECT_NE(s.message().find("table registration on "), std::string::npos) << s;
      EXPECT_NE(s.message().find("is silent"), std::string::npos) << s;
      EXPECT_TRUE((*c)->Broken());
    } else {
      EXPECT_TRUE(s.ok()) << s;
      EXPECT_FALSE((*c)->Broken());
    }
    (*c)->Close();
    server->Stop();
  }
}

// A connection idle for longer than the silence limit (nothing owed: an agent connecting its
// other servers, say) is not a silent one: the silence of a request counts from when requests
// began to wait.
TEST_F(KvServerTest, AnIdleConnectionIsNotASilentOne) {
  auto c = Client(0);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->RegisterTables(Spec(2, v1::UPDATE_RULE_SUM, {4}), kWait).ok());
  absl::SleepFor(absl::Milliseconds(400));  // idle: nothing owed, nothing heard
  // A pull the server holds (rank 1 never pushes): it waits from now.
  std::vector<float> out(4);
  const Ticket waiting = c->Pull(100, 1, out, absl::Seconds(10));
  EXPECT_FALSE(c->FailIfSilent(absl::Milliseconds(300)));  // it was idle, not silent
  EXPECT_FALSE(c->Broken());
  // Once it has waited that long with nothing heard, it is.
  absl::SleepFor(absl::Milliseconds(350));
  EXPECT_TRUE(c->FailIfSilent(absl::Milliseconds(300)));
  const absl::Status s = c->Wait(waiting, kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("is silent"), std::string::npos) << s;
}

// A server lost by someone else's word (the coordinator declared it dead): the waiting request
// and every later one fail with that word, and the client is broken, as a lost one's.
TEST_F(KvServerTest, AClientFailedByTheCoordinatorsWordFailsWaitingAndLaterRequests) {
  auto c = Client(0);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->RegisterTables(Spec(2, v1::UPDATE_RULE_SUM, {4}), kWait).ok());
  std::vector<float> out(4);
  const Ticket waiting = c->Pull(100, 1, out, absl::Seconds(10));  // rank 1 never pushes
  c->Fail(absl::UnavailableError("declared dead by the coordinator: no heartbeat for 2s"));
  EXPECT_TRUE(c->Broken());
  const absl::Status s = c->Wait(waiting, kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("declared dead by the coordinator"), std::string::npos) << s;
  const absl::Status later = c->Wait(c->Push(100, 1, std::vector<float>(4, 1.0f)), kWait);
  EXPECT_EQ(later.code(), absl::StatusCode::kUnavailable) << later;
  EXPECT_NE(later.message().find("declared dead by the coordinator"), std::string::npos) << later;
  c->Fail(absl::UnavailableError("a second word"));  // already broken: the first word stays
  const absl::Status again = c->Wait(c->Push(100, 1, std::vector<float>(4, 1.0f)), kWait);
  EXPECT_NE(again.message().find("declared dead by the coordinator"), std::string::npos) << again;
}

TEST_F(KvServerTest, ARegistrationBeyondTheMemoryLimitIsRefusedAndOthersAreServed) {
  TearDown();
  EngineOptions options;
  options.max_key_bytes = 1 << 20;
  options.max_memory_bytes = 8 << 20;
  Start(options);
  auto a = Client(0, 1), b = Client(0, 2, "other-job");
  // One key larger than a frame may carry, then tables larger than the server's memory.
  auto too_big_key = a->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM, {(1 << 18) + 1}), kWait);
  EXPECT_EQ(too_big_key.code(), absl::StatusCode::kResourceExhausted) << too_big_key;
  auto too_much =
      a->RegisterTables(Spec(1, v1::UPDATE_RULE_ADAM, {1 << 18, 1 << 18, 1 << 18}), kWait);
  EXPECT_EQ(too_much.code(), absl::StatusCode::kResourceExhausted) << too_much;
  // 6 MiB fit; another job's 6 MiB then do not: the limit is the server's, across jobs.
  ASSERT_TRUE(
      a->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM, {1 << 18, 1 << 18, 1 << 18}), kWait).ok());
  auto second = b->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM, {1 << 18, 1 << 18, 1 << 18}), kWait);
  EXPECT_EQ(second.code(), absl::StatusCode::kResourceExhausted) << second;
  std::vector<float> g(1 << 18, 1.0f), out(1 << 18);
  ASSERT_TRUE(a->Wait(a->Push(100, 1, g), kWait).ok());
  ASSERT_TRUE(a->Wait(a->Pull(100, 1, out), kWait).ok());
  EXPECT_EQ(out, g);
}

TEST_F(KvServerTest, JobsAreIsolatedNamespaces) {
  auto a = Client(0, 1), b = Client(0, 2, "other-job");
  ASSERT_TRUE(a->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM, {4}), kWait).ok());
  ASSERT_TRUE(b->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM, {4}), kWait).ok());
  std::vector<float> ga(4, 1.0f), gb(4, 2.0f), oa(4), ob(4);
  ASSERT_TRUE(a->Wait(a->Push(100, 1, ga), kWait).ok());
  ASSERT_TRUE(b->Wait(b->Push(100, 1, gb), kWait).ok());
  ASSERT_TRUE(a->Wait(a->Pull(100, 1, oa), kWait).ok());
  ASSERT_TRUE(b->Wait(b->Pull(100, 1, ob), kWait).ok());
  EXPECT_EQ(oa, ga);
  EXPECT_EQ(ob, gb);
  // A registration that differs from the job's is refused, naming what differs.
  auto diff = a->RegisterTables(Spec(2, v1::UPDATE_RULE_SUM, {4}), kWait);
  EXPECT_EQ(diff.code(), absl::StatusCode::kFailedPrecondition) << diff;
  EXPECT_NE(diff.message().find("workers"), std::string::npos) << diff;
}

TEST_F(KvServerTest, SnapshotRestoresIntoAFreshEngineThatContinuesIdentically) {
  auto spec = Spec(1, v1::UPDATE_RULE_ADAM, {64, 3});
  auto c = Client(0);
  ASSERT_TRUE(c->RegisterTables(spec, kWait).ok());
  std::vector<float> out(64);
  for (uint64_t clock = 1; clock <= 3; ++clock) {
    ASSERT_TRUE(c->Wait(c->Push(100, clock, Grad(0, clock, 100, 64)), kWait).ok());
    ASSERT_TRUE(c->Wait(c->Push(101, clock, Grad(0, clock, 101, 3)), kWait).ok());
  }
  auto snap = engine_->Snapshot(1, absl::Seconds(10));
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->clock, 3u);
  KvEngine fresh(EngineOptions{});
  ASSERT_TRUE(fresh.Restore(*snap).ok());
  auto again = fresh.Snapshot(1, absl::Seconds(10));
  ASSERT_TRUE(again.ok());
  ASSERT_EQ(again->keys.size(), snap->keys.size());
  for (size_t i = 0; i < snap->keys.size(); ++i) {
    EXPECT_EQ(again->keys[i].params, snap->keys[i].params);
    EXPECT_EQ(again->keys[i].optimizer_state, snap->keys[i].optimizer_state);
    EXPECT_EQ(again->keys[i].optimizer_steps, 3u);
  }
}

// Rank 0's agent asks for a checkpoint between two of its iterations: every key's completed
// state, whatever clock each is at (a layer that ran fewer times is behind), with a clock half
// aggregated left out. Restored, the job answers each key's clock and continues exactly like
// the engine that went on.
TEST_F(KvServerTest, ASnapshotOfCompletedStateTakesEachKeyAtItsOwnClock) {
  auto spec = Spec(2, v1::UPDATE_RULE_SUM, {8, 8});
  auto c0 = Client(0), c1 = Client(1);
  ASSERT_TRUE(c0->RegisterTables(spec, kWait).ok());
  ASSERT_TRUE(c1->RegisterTables(spec, kWait).ok());
  std::vector<float> out(8);
  for (uint64_t clock = 1; clock <= 3; ++clock) {
    for (uint64_t key : {uint64_t{100}, uint64_t{101}}) {
      if (key == 101 && clock == 3) continue;  // key 101's layer ran twice only
      ASSERT_TRUE(c0->Wait(c0->Push(key, clock, Grad(0, clock, key, 8)), kWait).ok());
      ASSERT_TRUE(c1->Wait(c1->Push(key, clock, Grad(1, clock, key, 8)), kWait).ok());
    }
  }
  // Rank 1 is ahead: its push of clock 4 is half an aggregation, not part of the snapshot.
  ASSERT_TRUE(c1->Wait(c1->Push(100, 4, Grad(1, 4, 100, 8)), kWait).ok());
  EXPECT_EQ(engine_->Snapshot(1, absl::Milliseconds(200)).status().code(),
            absl::StatusCode::kDeadlineExceeded)
      << "the keys are never at one clock boundary";
  auto snap = engine_->SnapshotCompleted(1, 7);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->clock, 7u) << "labelled with the agent's iteration";
  ASSERT_EQ(snap->keys.size(), 2u);
  EXPECT_EQ(snap->keys[0].completed_clock, 3u);
  EXPECT_EQ(snap->keys[1].completed_clock, 2u);
  EXPECT_EQ(SnapshotProgress(*snap), 2u + 3 + 2) << "initialised keys count one each";
  EXPECT_EQ(engine_->Progress(1), SnapshotProgress(*snap));
  KvEngine fresh(EngineOptions{});
  ASSERT_TRUE(fresh.Restore(*snap).ok());
  const std::vector<KeyProgress> want = {{3, 0}, {2, 0}};
  EXPECT_EQ(fresh.KeyProgressOf(1, spec), want);
  EXPECT_EQ(engine_->KeyProgressOf(1, spec), want);
  // The restored key holds clock 3's sum, as the running engine does.
  auto again = fresh.SnapshotCompleted(1, 7);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->keys[0].result, snap->keys[0].result);
  std::vector<float> expected(8);
  for (uint32_t r = 0; r < 2; ++r) {
    const auto g = Grad(r, 3, 100, 8);
    for (size_t i = 0; i < 8; ++i) expected[i] += g[i];
  }
  EXPECT_EQ(again->keys[0].result, expected);
}

TEST_F(KvServerTest, PingMeasuresARoundTripOnEveryConnection) {
  auto c = Client(0, 1, kSecret, /*connections=*/2);
  ASSERT_NE(c, nullptr);
  for (size_t conn = 0; conn < 2; ++conn) {
    EXPECT_TRUE(c->Wait(c->Ping(conn), kWait).ok());
    const absl::StatusOr<absl::Duration> rtt = c->MeasureRoundTrip(kWait, conn);
    ASSERT_TRUE(rtt.ok()) << rtt.status();
    EXPECT_GT(*rtt, absl::ZeroDuration());
  }
  // Pings interleave with data on the same connection; the service does not count them as data.
  const std::vector<float> grad = Grad(0, 1, 100, 16);
  ASSERT_TRUE(c->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM, {16}), kWait).ok());
  const Ticket push = c->Push(100, 1, grad);
  const Ticket ping = c->Ping();
  EXPECT_TRUE(c->Wait(push, kWait).ok());
  EXPECT_TRUE(c->Wait(ping, kWait).ok());
  c->Close();
  const absl::StatusOr<absl::Duration> closed = c->MeasureRoundTrip(kWait);
  EXPECT_FALSE(closed.ok());
}

// The agent's start-up bandwidth probe: a PING with a payload, read and dropped by the server
// (a measured rate, finite and positive); the bound is the client's and the server's.
TEST_F(KvServerTest, ABandwidthProbeIsAnsweredAndBounded) {
  auto c = Client(0);
  ASSERT_NE(c, nullptr);
  const absl::StatusOr<KvClient::Probe> probe = c->MeasureBandwidth(uint64_t{1} << 20, 2, kWait);
  ASSERT_TRUE(probe.ok()) << probe.status();
  EXPECT_GT(probe->bytes_per_second, 0);
  EXPECT_TRUE(std::isfinite(probe->bytes_per_second));
  EXPECT_GT(probe->round_trip, absl::ZeroDuration());
  // The largest probe the server takes, then data on the same connection as before.
  ASSERT_TRUE(c->MeasureBandwidth(kMaxProbeBytes, 1, kWait).ok());
  ASSERT_TRUE(c->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM, {16}), kWait).ok());
  EXPECT_TRUE(c->Wait(c->Push(100, 1, Grad(0, 1, 100, 16)), kWait).ok());
  EXPECT_EQ(c->MeasureBandwidth(kMaxProbeBytes + 1, 1, kWait).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->MeasureBandwidth(0, 1, kWait).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(KvServerTest, TrafficIsCountedPerRankAndReportedPerWindow) {
  constexpr uint64_t kElements = 1000;
  ServerTelemetry telemetry([this] { return service_->TakeTraffic(); }, absl::Seconds(5));
  std::vector<std::shared_ptr<KvClient>> clients = {Client(0), Client(1)};
  ASSERT_NE(clients[0], nullptr);
  ASSERT_NE(clients[1], nullptr);
  for (auto& c : clients) {
    ASSERT_TRUE(c->RegisterTables(Spec(2, v1::UPDATE_RULE_SUM, {kElements}), kWait).ok());
  }
  // Two clocks; rank 1 pulls only the first.
  for (uint64_t clock = 1; clock <= 2; ++clock) {
    std::vector<std::vector<float>> results(2, std::vector<float>(kElements));
    std::vector<std::vector<float>> grads;
    std::vector<Ticket> pushes, pulls;
    for (uint32_t r = 0; r < 2; ++r) grads.push_back(Grad(r, clock, 100, kElements));
    for (uint32_t r = 0; r < 2; ++r) pushes.push_back(clients[r]->Push(100, clock, grads[r]));
    for (uint32_t r = 0; r < (clock == 1 ? 2u : 1u); ++r) {
      pulls.push_back(clients[r]->Pull(100, clock, results[r]));
    }
    for (uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(clients[r]->Wait(pushes[r], kWait).ok());
    for (size_t i = 0; i < pulls.size(); ++i) ASSERT_TRUE(clients[i]->Wait(pulls[i], kWait).ok());
  }
  constexpr uint64_t kBytes = kElements * sizeof(float);
  const v1::ReportTelemetryRequest first = telemetry.Collect(absl::Now());
  const double seconds = static_cast<double>(first.window_ns()) / 1e9;
  ASSERT_EQ(first.links_size(), 2);
  for (uint32_t r = 0; r < 2; ++r) {
    const v1::LinkTelemetry& link = first.links(static_cast<int>(r));
    EXPECT_EQ(link.peer_node_id(), "");
    EXPECT_EQ(link.peer_job_id(), "1");
    EXPECT_EQ(link.peer_rank(), r);
    EXPECT_EQ(link.received_bytes(), 2 * kBytes) << "rank " << r;
    EXPECT_EQ(link.bytes(), (r == 0 ? 2 : 1) * kBytes) << "rank " << r;
    EXPECT_EQ(link.window_ns(), first.window_ns());
    EXPECT_DOUBLE_EQ(link.bytes_per_second(), static_cast<double>(2 * kBytes) / seconds);
  }
  // An idle window: the connected ranks are reported with zero bytes.
  const v1::ReportTelemetryRequest idle = telemetry.Collect(absl::Now());
  ASSERT_EQ(idle.links_size(), 2);
  EXPECT_EQ(idle.links(0).bytes(), 0u);
  EXPECT_EQ(idle.links(0).received_bytes(), 0u);
  EXPECT_EQ(idle.links(0).bytes_per_second(), 0);
  // Another job is a namespace of its own.
  auto other = Client(0, 2, "other-job");
  ASSERT_NE(other, nullptr);
  ASSERT_TRUE(other->Wait(other->Ping(), kWait).ok());  // a frame: the peer is known
  // Rank 1 leaves: reported once more (with zero bytes), then forgotten.
  clients[1]->Close();
  clients[1].reset();
  const absl::Time deadline = absl::Now() + kWait;
  std::vector<PeerTrafficTotals> totals;
  while (absl::Now() < deadline) {
    totals = service_->TakeTraffic();
    if (totals.size() == 3 && totals[1].connections == 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(totals.size(), 3u);  // (1, 0), (1, 1) closed, (2, 0)
  EXPECT_EQ(totals[0].connections, 1);
  EXPECT_EQ(totals[1].rank, 1u);
  EXPECT_EQ(totals[1].connections, 0);
  EXPECT_EQ(totals[2].job_id, 2u);
  EXPECT_EQ(totals[2].received, 0u);
  const std::vector<PeerTrafficTotals> after = service_->TakeTraffic();
  ASSERT_EQ(after.size(), 2u);
  EXPECT_EQ(after[0].rank, 0u);
  EXPECT_EQ(after[1].job_id, 2u);
}

}  // namespace
}  // namespace poseidon::server
