// Replication between KV servers (DESIGN.md "Faults"): two engines behind real TCP FrameServers
// in one process, each with a KvReplicaSender, the second the backup of the first's keys. The
// multi-process version (four servers, agents, a server killed or frozen at random) is
// tests/agent_e2e_test.cc, Failover.*.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "server/kv_client.h"
#include "server/kv_engine.h"
#include "server/kv_service.h"
#include "server/replicator.h"
#include "server/update_rules.h"
#include "transport/credentials.h"
#include "transport/tcp/tcp_context.h"

namespace poseidon::server {
namespace {

constexpr char kSecret[] = "replication-test";
constexpr absl::Duration kWait = absl::Seconds(30);
constexpr uint64_t kKey = 7;
constexpr size_t kN = 300;

std::vector<float> Grad(uint32_t rank, uint64_t clock, size_t n) {
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = static_cast<float>(static_cast<int64_t>((rank + 1) * 3 + clock * 5 + i % 11) - 20);
  }
  return g;
}

// One poseidon-server: engine, service, frame server, replica sender.
struct Shard {
  explicit Shard(std::shared_ptr<transport::Context> ctx,
                 uint64_t max_memory = EngineOptions{}.max_memory_bytes,
                 absl::Duration replica_connect = KvReplicaSender::kConnectTimeout,
                 const std::string& listen = "127.0.0.1:0") {
    secrets = std::make_shared<transport::SecretStore>();
    secrets->Set(1, kSecret);
    sender = std::make_shared<KvReplicaSender>(ctx, secrets, absl::Seconds(5), replica_connect);
    EngineOptions options;
    options.replica_sender = sender;
    options.max_memory_bytes = max_memory;
    engine = std::make_shared<KvEngine>(options);
    auto listener = ctx->Listen(listen);
    EXPECT_TRUE(listener.ok()) << listener.status();
    service = std::make_shared<KvService>(engine, BufferPool::Create(16 << 20), KvServiceOptions{});
    server = std::make_shared<transport::FrameServer>(*listener, secrets, service);
    server->Start();
  }
  ~Shard() { Kill(); }
  // What a SIGKILL does to its peers: every connection closes.
  void Kill() {
    if (server) server->Stop();
    if (sender) sender->Stop();
    server.reset();
  }
  std::shared_ptr<transport::SecretStore> secrets;
  std::shared_ptr<KvReplicaSender> sender;
  std::shared_ptr<KvEngine> engine;
  std::shared_ptr<KvService> service;
  std::shared_ptr<transport::FrameServer> server;
};

// A backup that is frozen: a listener that takes every connection and never reads it (the
// kernel still accepts for a stopped process).
class SilentBackup {
 public:
  explicit SilentBackup(transport::Context& ctx) {
    auto listener = ctx.Listen("127.0.0.1:0");
    EXPECT_TRUE(listener.ok()) << listener.status();
    listener_ = *listener;
    Take();
  }
  ~SilentBackup() {
    CloseConnections();
    listener_->Close();
  }
  std::string Address() const { return listener_->Address(); }
  size_t Accepted() {
    std::lock_guard<std::mutex> lock(mu_);
    return accepted_;
  }
  void CloseConnections() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& c : held_) c->Close();
    held_.clear();
  }

 private:
  void Take() {
    listener_->Accept([this](absl::StatusOr<std::shared_ptr<transport::Connection>> c) {
      if (!c.ok()) return;
      {
        std::lock_guard<std::mutex> lock(mu_);
        held_.push_back(*c);
        ++accepted_;
      }
      Take();
    });
  }
  std::shared_ptr<transport::Listener> listener_;
  std::mutex mu_;
  std::vector<std::shared_ptr<transport::Connection>> held_;  // accepted, never read
  size_t accepted_ = 0;
};

class ReplicationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ctx = transport::CreateTcpContext(transport::TcpOptions{});
    ASSERT_TRUE(ctx.ok());
    ctx_ = *ctx;
    primary_ = std::make_unique<Shard>(ctx_);
    backup_ = std::make_unique<Shard>(ctx_);
    addresses_ = {primary_->server->Address(), backup_->server->Address()};
  }
  void TearDown() override {
    clients_.clear();
    primary_.reset();
    backup_.reset();
    ctx_->Close();
  }
  // The registration server `index` gets: the key, first held by server 0, one backup.
  v1::RegisterTablesRequest Spec(uint32_t index, v1::UpdateRule rule) const {
    v1::RegisterTablesRequest r;
    r.set_num_workers(2);
    r.set_average_gradients(rule != v1::UPDATE_RULE_SUM);
    for (const auto& a : addresses_) r.add_servers(a);
    r.set_server_index(index);
    r.set_replicas(1);
    auto* t = r.add_tables();
    t->set_name("layer");
    t->set_primary(0);
    t->mutable_update_rule()->set_rule(rule);
    t->mutable_update_rule()->set_learning_rate(0.1);
    t->mutable_update_rule()->set_momentum(0.9);
    if (rule != v1::UPDATE_RULE_SUM) t->set_initial_value(v1::INITIAL_VALUE_PUSHED_BY_RANK0);
    auto* k = t->add_keys();
    k->set_key(kKey);
    k->set_elements(kN);
    return r;
  }
  // The same registration with its table as a standby table (what the agents send a server of
  // the chain that holds no copy from the start).
  static v1::RegisterTablesRequest AsStandby(v1::RegisterTablesRequest r) {
    *r.add_standby_tables() = r.tables(0);
    r.clear_tables();
    return r;
  }
  std::shared_ptr<KvClient> Client(const Shard& shard, uint32_t rank) {
    auto c = KvClient::Connect(*ctx_, shard.server->Address(), 1, rank,
                               transport::RankKey(kSecret, 1, rank), absl::Seconds(10));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *c : nullptr;
  }
  // The ranks' clients, kept connected (a rank whose last connection closes is gone).
  std::shared_ptr<KvClient> Rank(Shard& shard, uint32_t rank) {
    auto& c = clients_[{&shard, rank}];
    if (c == nullptr) c = Client(shard, rank);
    return c;
  }
  // `rank` dies: its connections to `shards` close, and each server removes it (a job with
  // min_workers and no rejoin timeout), which this waits for.
  void LoseRank(std::initializer_list<Shard*> shards, uint32_t rank) {
    for (Shard* shard : shards) {
      clients_[{shard, rank}]->Close();
      clients_.erase({shard, rank});
    }
    for (Shard* shard : shards) {
      const absl::Time deadline = absl::Now() + kWait;
      while (!shard->engine->RankRemoved(1, rank) && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(5));
      }
      ASSERT_TRUE(shard->engine->RankRemoved(1, rank));
    }
  }
  // Rank 0 alone (rank 1 removed) pushes `clock` to `shard` at `epoch`: the answer is its own.
  void Alone(Shard& shard, uint64_t clock, uint32_t epoch) {
    auto c = Rank(shard, 0);
    std::vector<float> out(kN);
    EXPECT_TRUE(c->Wait(c->Push(kKey, clock, Grad(0, clock, kN), false, epoch), kWait).ok());
    const absl::Status s = c->Wait(c->Pull(kKey, clock, out, absl::Seconds(5), epoch), kWait);
    EXPECT_TRUE(s.ok()) << "clock " << clock << ": " << s;
    EXPECT_EQ(out, Grad(0, clock, kN)) << "clock " << clock;
  }
  // Both ranks push `clock` to `shard` at `epoch` and pull it; returns rank 0's result.
  std::vector<float> Clock(Shard& shard, uint64_t clock, uint32_t epoch) {
    std::vector<float> results[2] = {std::vector<float>(kN), std::vector<float>(kN)};
    std::shared_ptr<KvClient> clients[2] = {Rank(shard, 0), Rank(shard, 1)};
    std::thread ranks[2];
    for (uint32_t r = 0; r < 2; ++r) {
      ranks[r] = std::thread([&, r] {
        auto c = clients[r];
        ASSERT_NE(c, nullptr);
        const auto g = Grad(r, clock, kN);
        ASSERT_TRUE(c->Wait(c->Push(kKey, clock, g, false, epoch), kWait).ok());
        const absl::Status s = c->Wait(c->Pull(kKey, clock, results[r], kWait, epoch), kWait);
        ASSERT_TRUE(s.ok()) << s;
      });
    }
    for (auto& t : ranks) t.join();
    EXPECT_EQ(results[0], results[1]);
    return results[0];
  }
  // The rule on one engine that never fails: what each clock must answer (the sum of both
  // ranks' Grad, or the parameters after the rule's step on their average), from `init`.
  struct Reference {
    Reference(const v1::RegisterTablesRequest& spec, std::vector<float> init)
        : rule(spec.tables(0).update_rule().rule()),
          optimizer(MakeOptimizer(rule, *HyperParamsFromSpec(spec.tables(0).update_rule()), kN)),
          params(std::move(init)) {}
    std::vector<float> operator()(uint64_t clock) {
      const bool sum = rule == v1::UPDATE_RULE_SUM;
      std::vector<float> agg(kN);
      for (uint32_t r = 0; r < 2; ++r) {
        const auto g = Grad(r, clock, kN);
        for (size_t i = 0; i < kN; ++i) agg[i] += sum ? g[i] : g[i] * 0.5f;
      }
      if (sum) return agg;
      optimizer->Step(params, agg);
      return params;
    }
    v1::UpdateRule rule;
    std::unique_ptr<Optimizer> optimizer;
    std::vector<float> params;
  };
  struct ChainOfThree {
    std::unique_ptr<Shard> third;
    Reference expected;
  };
  // A third server that stands by for the key (registered with the table as a standby table,
  // what the agents send it; `progress`: its answer), the key registered on the primary and the
  // backup, and for a rule other than the sum rank 0's initial value (i * `scale`) pushed: the
  // never-failing reference starts there.
  ChainOfThree StartChainOfThree(v1::UpdateRule rule, float scale,
                                 std::vector<KeyProgress>* progress = nullptr) {
    auto third = std::make_unique<Shard>(ctx_);
    addresses_.push_back(third->server->Address());
    EXPECT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, rule), kWait).ok());
    EXPECT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, rule), kWait).ok());
    EXPECT_TRUE(Rank(*third, 0)->RegisterTables(AsStandby(Spec(2, rule)), kWait, progress).ok());
    std::vector<float> init(kN);
    for (size_t i = 0; i < kN; ++i) init[i] = scale * static_cast<float>(i);
    if (rule != v1::UPDATE_RULE_SUM) {
      auto c = Rank(*primary_, 0);
      EXPECT_TRUE(c->Wait(c->Push(kKey, 0, init, /*init=*/true), kWait).ok());
    }
    return {std::move(third), Reference(Spec(0, rule), init)};
  }
  std::shared_ptr<transport::Context> ctx_;
  std::unique_ptr<Shard> primary_, backup_;
  std::map<std::pair<const Shard*, uint32_t>, std::shared_ptr<KvClient>> clients_;
  std::vector<std::string> addresses_;
};

// Rule by rule: the state after each clock (a sum, or parameters and optimizer state) is on the
// backup before the clock is answered, so a backup promoted after the primary died continues
// exactly where an engine that never failed is.
class ReplicationRuleTest : public ReplicationTest,
                            public ::testing::WithParamInterface<v1::UpdateRule> {};

TEST_P(ReplicationRuleTest, ABackupTakesOverEveryAnsweredClockAndContinuesIdentically) {
  const v1::UpdateRule rule = GetParam();
  const bool sum = rule == v1::UPDATE_RULE_SUM;
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, rule), kWait).ok());
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, rule), kWait).ok());
  std::vector<float> init(kN);
  for (size_t i = 0; i < kN; ++i) init[i] = 0.01f * static_cast<float>(i);
  if (!sum) {
    auto c = Rank(*primary_, 0);
    ASSERT_TRUE(c->Wait(c->Push(kKey, 0, init, /*init=*/true), kWait).ok());
  }
  Reference expected(Spec(0, rule), init);
  const std::vector<float>& params = expected.params;
  for (uint64_t clock = 1; clock <= 3; ++clock) {
    EXPECT_EQ(Clock(*primary_, clock, 0), expected(clock)) << "clock " << clock;
  }
  EXPECT_EQ(backup_->engine->stats().replicas_applied.load(), sum ? 3u : 4u);
  EXPECT_EQ(primary_->engine->stats().replicated.load(), sum ? 3u : 4u);
  primary_->Kill();
  // A rank that had not received clock 3's answer asks the backup for it (at epoch 1).
  {
    auto c = Rank(*backup_, 1);
    std::vector<float> out(kN);
    const std::vector<float> last = sum ? expected(3) : params;
    ASSERT_TRUE(c->Wait(c->Push(kKey, 3, Grad(1, 3, kN), false, 1), kWait).ok())
        << "a re-sent push of an answered clock is a duplicate";
    ASSERT_TRUE(c->Wait(c->Pull(kKey, 3, out, kWait, 1), kWait).ok());
    EXPECT_EQ(out, last);
  }
  for (uint64_t clock = 4; clock <= 6; ++clock) {
    EXPECT_EQ(Clock(*backup_, clock, 1), expected(clock)) << "clock " << clock;
  }
  EXPECT_EQ(backup_->engine->stats().promotions.load(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Rules, ReplicationRuleTest,
                         ::testing::Values(v1::UPDATE_RULE_SUM, v1::UPDATE_RULE_MOMENTUM,
                                           v1::UPDATE_RULE_ADAM));

// A primary connects to its keys' backups when the job registers there, before any clock: a
// frozen backup (it takes the connection and answers no handshake) is found while the agents
// register the job, not at the first clock's replica, which then fails at once for that reason
// and gives the backup up (with no other server left, the key goes on degraded, exactly).
TEST_F(ReplicationTest, APrimaryConnectsToItsBackupsWhenTheJobRegisters) {
  SilentBackup silent(*ctx_);
  primary_ = std::make_unique<Shard>(ctx_, EngineOptions{}.max_memory_bytes,
                                     /*replica_connect=*/absl::Milliseconds(300));
  addresses_ = {primary_->server->Address(), silent.Address()};
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, v1::UPDATE_RULE_SUM), kWait).ok());
  const absl::Time deadline = absl::Now() + kWait;
  while (silent.Accepted() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(silent.Accepted(), 1u) << "the primary connects to its backup at registration";
  EXPECT_EQ(primary_->engine->stats().pushes.load(), 0u);
  absl::SleepFor(absl::Milliseconds(400));  // the handshake's 300 ms ran out meanwhile
  Reference expected(Spec(0, v1::UPDATE_RULE_SUM), {});
  for (uint64_t clock = 1; clock <= 2; ++clock) {
    EXPECT_EQ(Clock(*primary_, clock, 0), expected(clock)) << "clock " << clock;
  }
  EXPECT_EQ(primary_->engine->stats().backups_lost.load(), 1u);
  EXPECT_EQ(primary_->engine->stats().replicated.load(), 0u);
  EXPECT_EQ(silent.Accepted(), 1u) << "a backup given up is not tried again";
  const std::vector<ReplicationCounts> status = primary_->engine->ReplicationStatus(kWait);
  ASSERT_EQ(status.size(), 1u);
  EXPECT_EQ(status[0].degraded_keys, 1u);
  clients_.clear();
  primary_.reset();
}

// A backup not up yet when the job registers on its primary (servers started with the agents,
// which register server by server): the primary's early connection is refused, and the first
// replica connects again, as without the early connection: no backup is given up.
TEST_F(ReplicationTest, ABackupNotUpWhenTheJobRegistersIsConnectedAtTheFirstReplica) {
  const std::string address = backup_->server->Address();
  backup_.reset();  // its port is free: a connection there is refused
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, v1::UPDATE_RULE_SUM), kWait).ok());
  absl::SleepFor(absl::Milliseconds(200));  // the early connection is refused meanwhile
  backup_ = std::make_unique<Shard>(ctx_, EngineOptions{}.max_memory_bytes,
                                    KvReplicaSender::kConnectTimeout, address);
  ASSERT_EQ(backup_->server->Address(), address);
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM), kWait).ok());
  Reference expected(Spec(0, v1::UPDATE_RULE_SUM), {});
  for (uint64_t clock = 1; clock <= 2; ++clock) {
    EXPECT_EQ(Clock(*primary_, clock, 0), expected(clock)) << "clock " << clock;
  }
  EXPECT_EQ(primary_->engine->stats().backups_lost.load(), 0u);
  EXPECT_EQ(backup_->engine->stats().replicas_applied.load(), 2u);
}

// The coordinator's word on a backup (HeartbeatResponse.lost_servers, KvReplicaSender::
// DeclaredDead): a backup at another address than the one declared is left alone; once the
// backup itself is declared dead, the next clock's replica to it fails at once and the backup
// is given up (the primary serves on, exact), and the word is taken once.
TEST_F(ReplicationTest, ABackupDeclaredDeadByTheCoordinatorIsGivenUpAtItsNextReplica) {
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, v1::UPDATE_RULE_SUM), kWait).ok());
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM), kWait).ok());
  Reference expected(Spec(0, v1::UPDATE_RULE_SUM), {});
  EXPECT_EQ(Clock(*primary_, 1, 0), expected(1));
  const absl::Status why = absl::UnavailableError("declared dead by the coordinator (test)");
  // Another server once held index 1 at another address: not this backup.
  EXPECT_TRUE(primary_->sender->DeclaredDead(1, 1, {"127.0.0.1:1"}, why));
  EXPECT_EQ(Clock(*primary_, 2, 0), expected(2));
  EXPECT_EQ(primary_->engine->stats().backups_lost.load(), 0u);
  EXPECT_EQ(backup_->engine->stats().replicas_applied.load(), 2u);
  EXPECT_TRUE(primary_->sender->DeclaredDead(1, 1, {addresses_[1]}, why));
  EXPECT_FALSE(primary_->sender->DeclaredDead(1, 1, {addresses_[1]}, why)) << "taken once";
  EXPECT_EQ(Clock(*primary_, 3, 0), expected(3));
  EXPECT_EQ(Clock(*primary_, 4, 0), expected(4));
  EXPECT_EQ(primary_->engine->stats().backups_lost.load(), 1u);
  EXPECT_EQ(backup_->engine->stats().replicas_applied.load(), 2u) << "nothing after the word";
}

// A frozen backup declared dead while the primary's connection to it waits for the handshake:
// the replica queued for that connection fails at once, so the clock is answered long before
// the handshake's timeout (60 s here; the pulls wait 10 s), and the connection is not used
// when the handshake ends.
TEST_F(ReplicationTest, ABackupDeclaredDeadWhileItsConnectionIsMadeFailsTheWaitingReplica) {
  SilentBackup silent(*ctx_);
  primary_ = std::make_unique<Shard>(ctx_, EngineOptions{}.max_memory_bytes,
                                     /*replica_connect=*/absl::Seconds(60));
  addresses_ = {primary_->server->Address(), silent.Address()};
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, v1::UPDATE_RULE_SUM), kWait).ok());
  std::vector<float> results[2] = {std::vector<float>(kN), std::vector<float>(kN)};
  absl::Status pulled[2];
  std::shared_ptr<KvClient> clients[2] = {Rank(*primary_, 0), Rank(*primary_, 1)};
  std::thread ranks[2];
  for (uint32_t r = 0; r < 2; ++r) {
    ranks[r] = std::thread([&, r] {
      auto c = clients[r];
      if (!c->Wait(c->Push(kKey, 1, Grad(r, 1, kN), false, 0), kWait).ok()) return;
      pulled[r] = c->Wait(c->Pull(kKey, 1, results[r], absl::Seconds(10), 0), kWait);
    });
  }
  // The clock completes and its replica is queued for the connection, whose handshake waits.
  const absl::Time deadline = absl::Now() + kWait;
  while (primary_->engine->stats().clocks_completed.load() == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(primary_->engine->stats().clocks_completed.load(), 1u);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(primary_->engine->stats().backups_lost.load(), 0u);
  EXPECT_TRUE(primary_->sender->DeclaredDead(
      1, 1, {addresses_[1]}, absl::UnavailableError("declared dead by the coordinator (test)")));
  for (auto& t : ranks) t.join();
  Reference expected(Spec(0, v1::UPDATE_RULE_SUM), {});
  const std::vector<float> sum = expected(1);
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(pulled[r].ok()) << "rank " << r << ": " << pulled[r];
    EXPECT_EQ(results[r], sum) << "rank " << r;
  }
  EXPECT_EQ(primary_->engine->stats().backups_lost.load(), 1u);
  EXPECT_EQ(Clock(*primary_, 2, 0), expected(2));
  silent.CloseConnections();  // the handshake ends: the sender's thread is free to stop
  clients_.clear();
  primary_.reset();
}

// Fencing: once a backup took a key over (a request at epoch 1 reached it), the old primary can
// no longer answer any clock of it: its replica is refused, and its waiting pulls fail with
// Aborted (which sends the agents on to the new primary), so two primaries never answer one
// clock.
TEST_F(ReplicationTest, APrimaryWhoseBackupTookOverIsFencedAndAnswersNothing) {
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, v1::UPDATE_RULE_SUM), kWait).ok());
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM), kWait).ok());
  Clock(*primary_, 1, 0);
  // Rank 0 lost its primary (a network cut) and goes on at the backup.
  auto b0 = Rank(*backup_, 0);
  ASSERT_TRUE(b0->Wait(b0->Push(kKey, 2, Grad(0, 2, kN), false, 1), kWait).ok());
  // The old primary still gets both ranks' pushes of clock 2 (rank 0's from before the cut).
  auto p0 = Rank(*primary_, 0), p1 = Rank(*primary_, 1);
  ASSERT_TRUE(p0->Wait(p0->Push(kKey, 2, Grad(0, 2, kN), false, 0), kWait).ok());
  ASSERT_TRUE(p1->Wait(p1->Push(kKey, 2, Grad(1, 2, kN), false, 0), kWait).ok());
  std::vector<float> out(kN);
  const absl::Status s = p1->Wait(p1->Pull(kKey, 2, out, kWait, 0), kWait);
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_NE(s.message().find("moved"), std::string::npos) << s;
  EXPECT_EQ(primary_->engine->stats().fenced.load(), 1u);
  // And any later request at the old epoch is refused the same way.
  const absl::Status again = p1->Wait(p1->Pull(kKey, 2, out, kWait, 0), kWait);
  EXPECT_TRUE(absl::IsAborted(again)) << again;
  // Rank 1 follows to the backup and the clock completes there, exactly.
  auto b1 = Rank(*backup_, 1);
  ASSERT_TRUE(b1->Wait(b1->Push(kKey, 2, Grad(1, 2, kN), false, 1), kWait).ok());
  ASSERT_TRUE(b1->Wait(b1->Pull(kKey, 2, out, kWait, 1), kWait).ok());
  std::vector<float> exact(kN);
  for (uint32_t r = 0; r < 2; ++r) {
    const auto g = Grad(r, 2, kN);
    for (size_t i = 0; i < kN; ++i) exact[i] += g[i];
  }
  EXPECT_EQ(out, exact);
}

// A push re-sent after its server died while answering its clock (kFlagReplay: the agent's
// buffer may be partly overwritten by that answer) is only acknowledged where the clock is
// held; a server that does not hold it refuses it (DataLoss) instead of summing garbage.
TEST_F(ReplicationTest, AReplayedPushIsNeverSummed) {
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, v1::UPDATE_RULE_SUM), kWait).ok());
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM), kWait).ok());
  const std::vector<float> sum1 = Clock(*primary_, 1, 0);
  primary_->Kill();
  std::vector<float> garbage(kN, 12345.0f);
  auto b0 = Rank(*backup_, 0);
  // Clock 1 is held (replicated): acknowledged, and its pull answers the real sum.
  ASSERT_TRUE(b0->Wait(b0->PushBytes(kKey, 1, std::as_bytes(std::span(garbage)), 1, false,
                                     /*replay=*/true),
                       kWait)
                  .ok());
  std::vector<float> out(kN);
  ASSERT_TRUE(b0->Wait(b0->Pull(kKey, 1, out, kWait, 1), kWait).ok());
  EXPECT_EQ(out, sum1);
  // Clock 2 is not: refused, nothing summed.
  const absl::Status s = b0->Wait(
      b0->PushBytes(kKey, 2, std::as_bytes(std::span(garbage)), 1, false, /*replay=*/true), kWait);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_EQ(backup_->engine->stats().pushes.load(), 0u);
}

// Two backups (--replicas=2): the chain survives the loss of its first two servers in turn;
// the second backup was kept up to date by the first one once that one was promoted.
TEST_F(ReplicationTest, TwoBackupsSurviveTwoLossesInTurn) {
  auto third = std::make_unique<Shard>(ctx_);
  addresses_.push_back(third->server->Address());
  auto spec = [&](uint32_t index) {
    auto r = Spec(index, v1::UPDATE_RULE_SUM);
    r.set_replicas(2);
    return r;
  };
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(spec(0), kWait).ok());
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(spec(1), kWait).ok());
  ASSERT_TRUE(Rank(*third, 0)->RegisterTables(spec(2), kWait).ok());
  auto exact = [](uint64_t clock) {
    std::vector<float> sum(kN);
    for (uint32_t r = 0; r < 2; ++r) {
      const auto g = Grad(r, clock, kN);
      for (size_t i = 0; i < kN; ++i) sum[i] += g[i];
    }
    return sum;
  };
  EXPECT_EQ(Clock(*primary_, 1, 0), exact(1));
  EXPECT_EQ(third->engine->stats().replicas_applied.load(), 1u) << "both backups get each clock";
  primary_->Kill();
  EXPECT_EQ(Clock(*backup_, 2, 1), exact(2));
  EXPECT_EQ(third->engine->stats().replicas_applied.load(), 2u) << "from the new primary";
  backup_->Kill();
  EXPECT_EQ(Clock(*third, 3, 2), exact(3));
  EXPECT_EQ(third->engine->stats().promotions.load(), 1u);
  clients_.clear();
  third.reset();
}

// The replication factor is restored among the servers left: three servers, one backup. Server
// 2 stands by for server 0's keys (it is further down their chain). When server 0 gives up its
// backup (server 1, killed), the same clock's state goes to server 2, which adopts the key; a
// second loss in the same chain (server 0 itself) then costs nothing: the ranks walk the chain
// past the dead server 1 to server 2 (epoch 2), which continues exactly where an engine that
// never failed is, optimizer state included.
TEST_P(ReplicationRuleTest, ALostBackupIsReplacedSoASecondLossInTheChainCostsNothing) {
  const v1::UpdateRule rule = GetParam();
  const bool sum = rule == v1::UPDATE_RULE_SUM;
  auto [third, expected] = StartChainOfThree(rule, 0.02f);
  EXPECT_EQ(Clock(*primary_, 1, 0), expected(1));
  EXPECT_EQ(third->engine->stats().replicas_applied.load(), 0u) << "a standby holds nothing";
  // It refuses a request for the key it holds no copy of, saying so.
  {
    auto c = Rank(*third, 1);
    const absl::Status s = c->Wait(c->Push(kKey, 2, Grad(1, 2, kN), false, 2), kWait);
    EXPECT_TRUE(absl::IsNotFound(s)) << s;
    EXPECT_NE(s.message().find("holds no copy"), std::string::npos) << s;
  }
  backup_->Kill();
  // Clock 2's pulls are answered once server 2 took the copy the dead backup could not.
  EXPECT_EQ(Clock(*primary_, 2, 0), expected(2));
  EXPECT_GE(primary_->engine->stats().backups_lost.load(), 1u);
  EXPECT_EQ(third->engine->stats().adopted.load(), 1u);
  EXPECT_EQ(Clock(*primary_, 3, 0), expected(3));
  EXPECT_EQ(third->engine->stats().replicas_applied.load(), 2u) << "clocks 2 and 3";
  {  // Restored: no key of the primary's is degraded again.
    const std::vector<ReplicationCounts> status = primary_->engine->ReplicationStatus(kWait);
    ASSERT_EQ(status.size(), 1u);
    EXPECT_EQ(status[0].degraded_keys, 0u);
    EXPECT_EQ(status[0].primary_keys, 1u);
  }
  primary_->Kill();
  // Epoch 1 is the dead server 1 (an agent's request there fails and moves on); at epoch 2
  // server 2 holds clock 3: a rank that missed its answer gets it, and training continues.
  {
    auto c = Rank(*third, 0);
    std::vector<float> out(kN);
    const std::vector<float> last = sum ? expected(3) : expected.params;
    ASSERT_TRUE(c->Wait(c->Push(kKey, 3, Grad(0, 3, kN), false, 2), kWait).ok());
    ASSERT_TRUE(c->Wait(c->Pull(kKey, 3, out, kWait, 2), kWait).ok());
    EXPECT_EQ(out, last);
  }
  for (uint64_t clock = 4; clock <= 5; ++clock) {
    EXPECT_EQ(Clock(*third, clock, 2), expected(clock)) << "clock " << clock;
  }
  EXPECT_EQ(third->engine->stats().promotions.load(), 1u);
  clients_.clear();
  third.reset();
}

// Two servers, so once the backup is lost no server is left to take a copy: the key is degraded.
// A replacement server then joins the running job (its registration names three servers, the
// first two the ring: ring_servers), and the primary, told of it by a registration that extends
// its server list, copies the key there at its next clock. So the loss of the primary itself
// costs nothing: the ranks walk the chain past the dead backup to the joined server (epoch 2),
// which continues exactly where an engine that never failed is, optimizer state included.
TEST_P(ReplicationRuleTest, AServerJoiningTheRunningJobRestoresTheCopiesOfADegradedKey) {
  const v1::UpdateRule rule = GetParam();
  const bool sum = rule == v1::UPDATE_RULE_SUM;
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, rule), kWait).ok());
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, rule), kWait).ok());
  std::vector<float> init(kN);
  for (size_t i = 0; i < kN; ++i) init[i] = 0.03f * static_cast<float>(i);
  if (!sum) {
    auto c = Rank(*primary_, 0);
    ASSERT_TRUE(c->Wait(c->Push(kKey, 0, init, /*init=*/true), kWait).ok());
  }
  Reference expected(Spec(0, rule), init);
  const v1::RegisterTablesRequest before = Spec(0, rule);  // two servers
  EXPECT_EQ(Clock(*primary_, 1, 0), expected(1));
  backup_->Kill();
  EXPECT_EQ(Clock(*primary_, 2, 0), expected(2));
  auto degraded = [&] {
    const std::vector<ReplicationCounts> status = primary_->engine->ReplicationStatus(kWait);
    return status.size() == 1 ? status[0].degraded_keys : 99u;
  };
  EXPECT_EQ(degraded(), 1u) << "no server is left to take a copy";

  auto joined = std::make_unique<Shard>(ctx_);
  addresses_.push_back(joined->server->Address());
  auto with_ring = [&](uint32_t index) {
    v1::RegisterTablesRequest r = Spec(index, rule);
    r.set_ring_servers(2);
    return r;
  };
  std::vector<KeyProgress> progress;
  ASSERT_TRUE(Rank(*joined, 0)->RegisterTables(AsStandby(with_ring(2)), kWait, &progress).ok());
  ASSERT_EQ(progress.size(), 1u);
  EXPECT_EQ(progress[0].completed, 0u) << "it holds nothing yet";
  ASSERT_TRUE(Rank(*primary_, 1)->RegisterTables(with_ring(0), kWait).ok());
  // A rank that has not heard of the joined server yet registers the list without it: the same.
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(before, kWait).ok());
  EXPECT_EQ(Clock(*primary_, 3, 0), expected(3));
  EXPECT_EQ(joined->engine->stats().adopted.load(), 1u);
  EXPECT_EQ(degraded(), 0u);
  EXPECT_EQ(Clock(*primary_, 4, 0), expected(4));
  EXPECT_EQ(joined->engine->stats().replicas_applied.load(), 2u) << "clocks 3 and 4";
  {  // A checkpoint keeps the ring only: a resumed job's servers start afresh, none joined.
    absl::StatusOr<JobSnapshot> snap = primary_->engine->SnapshotCompleted(1, 4);
    ASSERT_TRUE(snap.ok()) << snap.status();
    EXPECT_EQ(snap->spec.servers_size(), 2);
    EXPECT_EQ(snap->spec.ring_servers(), 0u);
  }

  primary_->Kill();
  {  // A rank that missed clock 4's answer gets it from the joined server, at epoch 2.
    auto c = Rank(*joined, 1);
    std::vector<float> out(kN);
    const std::vector<float> last = sum ? expected(4) : expected.params;
    ASSERT_TRUE(c->Wait(c->Push(kKey, 4, Grad(1, 4, kN), false, 2), kWait).ok());
    ASSERT_TRUE(c->Wait(c->Pull(kKey, 4, out, kWait, 2), kWait).ok());
    EXPECT_EQ(out, last);
  }
  for (uint64_t clock = 5; clock <= 6; ++clock) {
    EXPECT_EQ(Clock(*joined, clock, 2), expected(clock)) << "clock " << clock;
  }
  EXPECT_EQ(joined->engine->stats().promotions.load(), 1u);
  clients_.clear();
  joined.reset();
}

// The same for a key whose first primary is server 1 and was lost: server 0, its backup, was
// promoted (epoch 1) and holds its only copy; the joined server, after the ring in its chain
// (1, 0, 2), adopts it at epoch 1 and takes over at epoch 2 once server 0 is lost too.
TEST_F(ReplicationTest, AJoinedServerTakesACopyFromAPromotedPrimary) {
  auto spec = [&](uint32_t index, uint32_t ring) {
    v1::RegisterTablesRequest r = Spec(index, v1::UPDATE_RULE_SUM);
    r.mutable_tables(0)->set_primary(1);
    if (ring != 0) r.set_ring_servers(ring);
    return r;
  };
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(spec(1, 0), kWait).ok());  // the primary
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(spec(0, 0), kWait).ok());
  Reference expected(spec(0, 0), {});
  EXPECT_EQ(Clock(*backup_, 1, 0), expected(1));
  backup_->Kill();
  EXPECT_EQ(Clock(*primary_, 2, 1), expected(2)) << "server 0 promoted";
  auto joined = std::make_unique<Shard>(ctx_);
  addresses_.push_back(joined->server->Address());
  ASSERT_TRUE(Rank(*joined, 0)->RegisterTables(AsStandby(spec(2, 2)), kWait).ok());
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(spec(0, 2), kWait).ok());
  EXPECT_EQ(Clock(*primary_, 3, 1), expected(3));
  EXPECT_EQ(joined->engine->stats().adopted.load(), 1u);
  primary_->Kill();
  EXPECT_EQ(Clock(*joined, 4, 2), expected(4)) << "the joined server promoted";
  EXPECT_EQ(joined->engine->stats().promotions.load(), 1u);
  clients_.clear();
  joined.reset();
}

// A checkpoint after two losses in one chain: the adopter's file holds the key it adopted, and
// its restore brings it back as adopted (with the memory an adoption takes), so a job resumed
// without the two lost servers goes on from it at its epoch exactly, optimizer state included.
TEST_P(ReplicationRuleTest, AnAdoptedKeyIsCheckpointedAndRestoredForAJobThatLostTheRestOfItsChain) {
  const v1::UpdateRule rule = GetParam();
  const bool sum = rule == v1::UPDATE_RULE_SUM;
  std::vector<KeyProgress> none;
  auto [third, expected] = StartChainOfThree(rule, 0.01f, &none);
  EXPECT_EQ(none, std::vector<KeyProgress>{{}}) << "a standby key without a copy answers 0";
  EXPECT_EQ(Clock(*primary_, 1, 0), expected(1));
  backup_->Kill();
  EXPECT_EQ(Clock(*primary_, 2, 0), expected(2));
  ASSERT_EQ(third->engine->stats().adopted.load(), 1u);
  primary_->Kill();
  EXPECT_EQ(Clock(*third, 3, 2), expected(3));
  auto snap = third->engine->Snapshot(1, kWait);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_EQ(snap->keys.size(), 1u) << "the adopted key is in the file";
  EXPECT_EQ(snap->keys[0].completed_clock, 3u);
  clients_.clear();
  primary_.reset();
  backup_.reset();
  third.reset();
  // The resumed job: servers 0 and 1 were lost before the checkpoint (nothing listens at their
  // addresses); server 2 restores its file.
  third = std::make_unique<Shard>(ctx_);
  ASSERT_TRUE(third->engine->Restore(*snap).ok());
  EXPECT_GT(third->engine->memory_used(), kN * sizeof(float)) << "the adopted key's memory";
  addresses_ = {"127.0.0.1:1", "127.0.0.1:2", third->server->Address()};
  for (uint32_t r = 0; r < 2; ++r) {
    std::vector<KeyProgress> keys;
    ASSERT_TRUE(Rank(*third, r)->RegisterTables(AsStandby(Spec(2, rule)), kWait, &keys).ok());
    EXPECT_EQ(keys, (std::vector<KeyProgress>{{3, 0}}))
        << "the answer names the adopted copy's restored clock, from which the agents go on";
  }
  // Clock 3 is answered again from the restored state, then training goes on at epoch 2.
  {
    auto c = Rank(*third, 0);
    std::vector<float> out(kN);
    ASSERT_TRUE(c->Wait(c->Push(kKey, 3, Grad(0, 3, kN), false, 2), kWait).ok());
    const absl::Status pulled = c->Wait(c->Pull(kKey, 3, out, kWait, 2), kWait);
    ASSERT_TRUE(pulled.ok()) << pulled;
    EXPECT_EQ(out, sum ? expected(3) : expected.params);
  }
  for (uint64_t clock = 4; clock <= 5; ++clock) {
    EXPECT_EQ(Clock(*third, clock, 2), expected(clock)) << "clock " << clock;
  }
  clients_.clear();
  third.reset();
}

// An adoption is only taken from the key's primary at its epoch, for a server further down the
// chain, and of a standby table's key: anything else is refused and creates no key.
TEST_F(ReplicationTest, AForgedAdoptionIsRefusedAndCreatesNoKey) {
  auto third = std::make_unique<Shard>(ctx_);
  addresses_.push_back(third->server->Address());
  ASSERT_TRUE(Rank(*third, 0)->RegisterTables(AsStandby(Spec(2, v1::UPDATE_RULE_SUM)), kWait).ok());
  // Listed as standby where the server holds a copy from the start: refused.
  const auto wrong = AsStandby(Spec(1, v1::UPDATE_RULE_SUM));
  EXPECT_TRUE(absl::IsInvalidArgument(Rank(*backup_, 0)->RegisterTables(wrong, kWait)));
  auto as_server = [&](uint32_t index) {
    auto c = KvClient::Connect(*ctx_, third->server->Address(), 1, transport::ServerRank(index),
                               transport::RankKey(kSecret, 1, transport::ServerRank(index)),
                               absl::Seconds(10));
    EXPECT_TRUE(c.ok()) << c.status();
    return *c;
  };
  std::vector<float> state(kN, 1.0f);
  // Server 1 is not the primary at epoch 0.
  auto s1 = as_server(1);
  absl::Status s = s1->Wait(s1->Replicate(kKey, 4, 0, 0, {std::as_bytes(std::span(state))}), kWait);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  // Epoch 2 is server 2 itself: nobody before it in the chain sends at that epoch.
  auto s0 = as_server(0);
  s = s0->Wait(s0->Replicate(kKey, 4, 2, 0, {std::as_bytes(std::span(state))}), kWait);
  EXPECT_FALSE(s.ok()) << s;
  // A key of no table.
  s = s0->Wait(s0->Replicate(kKey + 1, 4, 0, 0, {std::as_bytes(std::span(state))}), kWait);
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_EQ(third->engine->stats().adopted.load(), 0u);
  EXPECT_EQ(third->engine->stats().replicas_applied.load(), 0u);
  // None created: a request at its epoch still finds no copy.
  auto c = Rank(*third, 1);
  s = c->Wait(c->Push(kKey, 4, Grad(1, 4, kN), false, 2), kWait);
  EXPECT_NE(s.message().find("holds no copy"), std::string::npos) << s;
  // The real primary at epoch 0 is taken, from any clock (a full state).
  s = s0->Wait(s0->Replicate(kKey, 4, 0, 0, {std::as_bytes(std::span(state))}), kWait);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(third->engine->stats().adopted.load(), 1u);
  // And from then on it is a backup like any other: a gap is refused.
  s = s0->Wait(s0->Replicate(kKey, 6, 0, 0, {std::as_bytes(std::span(state))}), kWait);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  clients_.clear();
  third.reset();
}

// Adoption is bounded by --max_memory: a standby server with no room for a lost backup's keys
// refuses them, and the primary copies them to the next server of the chain instead. When the
// primary is lost too, an agent's request at the server without a copy gets NotFound (it walks
// on, Replication::Failover), and the server that adopted them continues exactly.
TEST_F(ReplicationTest, AServerWithNoRoomRefusesToAdoptAndTheNextOneOfTheChainDoes) {
  // Server 2 has room for none of the key's 2 * 300 floats; server 3 has.
  auto third = std::make_unique<Shard>(ctx_, /*max_memory=*/1000);
  auto fourth = std::make_unique<Shard>(ctx_);
  addresses_.push_back(third->server->Address());
  addresses_.push_back(fourth->server->Address());
  auto standby = [&](uint32_t index) { return AsStandby(Spec(index, v1::UPDATE_RULE_SUM)); };
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, v1::UPDATE_RULE_SUM), kWait).ok());
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM), kWait).ok());
  ASSERT_TRUE(Rank(*third, 0)->RegisterTables(standby(2), kWait).ok()) << "a standby takes none";
  ASSERT_TRUE(Rank(*fourth, 0)->RegisterTables(standby(3), kWait).ok());
  Reference expected(Spec(0, v1::UPDATE_RULE_SUM), {});
  EXPECT_EQ(Clock(*primary_, 1, 0), expected(1));
  backup_->Kill();
  EXPECT_EQ(Clock(*primary_, 2, 0), expected(2));
  EXPECT_EQ(third->engine->stats().adopted.load(), 0u);
  EXPECT_EQ(fourth->engine->stats().adopted.load(), 1u);
  // What --max_memory counts: the key's sum and aggregate (2 * 300 floats) on the primary, the
  // backup and the adopter, none on the server that had no room.
  EXPECT_EQ(primary_->engine->memory_used(), 2 * kN * sizeof(float));
  EXPECT_EQ(third->engine->memory_used(), 0u);
  EXPECT_EQ(fourth->engine->memory_used(), 2 * kN * sizeof(float));
  EXPECT_EQ(Clock(*primary_, 3, 0), expected(3));
  EXPECT_EQ(fourth->engine->stats().replicas_applied.load(), 2u) << "clocks 2 and 3";
  primary_->Kill();
  {
    auto c = Rank(*third, 0);
    const absl::Status s = c->Wait(c->Push(kKey, 4, Grad(0, 4, kN), false, 2), kWait);
    EXPECT_TRUE(absl::IsNotFound(s)) << s;
    EXPECT_NE(s.message().find("holds no copy"), std::string::npos) << s;
  }
  // At epoch 3: a rank that missed clock 3's answer gets it, and training continues.
  {
    auto c = Rank(*fourth, 1);
    std::vector<float> out(kN);
    ASSERT_TRUE(c->Wait(c->Push(kKey, 3, Grad(1, 3, kN), false, 3), kWait).ok());
    ASSERT_TRUE(c->Wait(c->Pull(kKey, 3, out, kWait, 3), kWait).ok());
    EXPECT_EQ(out, expected(3));
  }
  EXPECT_EQ(Clock(*fourth, 4, 3), expected(4));
  EXPECT_EQ(Clock(*fourth, 5, 3), expected(5));
  clients_.clear();
  third.reset();
  fourth.reset();
}

// A removed rank readmitted from clock F (the world grows again, docs/operations.md) is counted
// from F by the key's backup too, which follows the primary's clocks by replicas only: promoted
// before F, it waits for the rank's push of F and sums it.
TEST_F(ReplicationTest, ABackupPromotedBeforeAReadmittedRanksFirstClockCountsItFromThere) {
  auto spec = [&](uint32_t index) {
    auto s = Spec(index, v1::UPDATE_RULE_SUM);
    s.set_min_workers(1);
    return s;
  };
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(spec(0), kWait).ok());
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(spec(1), kWait).ok());
  // Rank 1's agent registers with every server too (its connection to each is one of its).
  ASSERT_TRUE(Rank(*backup_, 1)->RegisterTables(spec(1), kWait).ok());
  Reference expected(spec(0), {});
  EXPECT_EQ(Clock(*primary_, 1, 0), expected(1));
  ASSERT_NO_FATAL_FAILURE(LoseRank({primary_.get(), backup_.get()}, 1));
  Alone(*primary_, 2, 0);
  // Its replacement is readmitted from clock 4 on every server (as Agent::ReadmitToJob asks).
  for (auto [shard, index] : {std::pair{primary_.get(), 0u}, std::pair{backup_.get(), 1u}}) {
    auto readmit = spec(index);
    readmit.set_readmit_from(4);
    std::vector<KeyProgress> progress;
    ASSERT_TRUE(Rank(*shard, 1)->RegisterTables(readmit, kWait, &progress).ok());
    ASSERT_EQ(progress.size(), 1u);
    EXPECT_EQ(progress[0].completed, 2u);
  }
  Alone(*primary_, 3, 0);
  primary_->Kill();
  // Clock 4 at the backup, promoted: both ranks' pushes, summed.
  EXPECT_EQ(Clock(*backup_, 4, 1), expected(4));
  EXPECT_EQ(Clock(*backup_, 5, 1), expected(5));
}

// The same for a key adopted by a third server (a standby of it), readmitted before the
// adoption (the adopted key leaves the rank out until its clock) or after it (the readmission
// reaches the adopted key): promoted, it counts the rank from that clock, not before.
class AdoptedReadmissionTest : public ReplicationTest,
                               public ::testing::WithParamInterface<bool> {};

TEST_P(AdoptedReadmissionTest, AnAdoptedKeyCountsAReadmittedRankFromItsClock) {
  const bool readmitted_first = GetParam();
  auto third = std::make_unique<Shard>(ctx_);
  addresses_.push_back(third->server->Address());
  auto spec = [&](uint32_t index) {
    auto s = Spec(index, v1::UPDATE_RULE_SUM);
    s.set_min_workers(1);
    return index == 2 ? AsStandby(s) : s;
  };
  Shard* shards[3] = {primary_.get(), backup_.get(), third.get()};
  for (uint32_t i = 0; i < 3; ++i) {
    for (uint32_t rank = 0; rank < 2; ++rank) {
      ASSERT_TRUE(Rank(*shards[i], rank)->RegisterTables(spec(i), kWait).ok());
    }
  }
  Reference expected(spec(0), {});
  EXPECT_EQ(Clock(*primary_, 1, 0), expected(1));
  ASSERT_NO_FATAL_FAILURE(LoseRank({shards[0], shards[1], shards[2]}, 1));
  // Readmitted from clock 5 on the servers alive.
  auto readmit = [&](std::initializer_list<uint32_t> servers) {
    for (uint32_t i : servers) {
      auto r = spec(i);
      r.set_readmit_from(5);
      ASSERT_TRUE(Rank(*shards[i], 1)->RegisterTables(r, kWait).ok()) << "server " << i;
    }
  };
  Alone(*primary_, 2, 0);
  if (readmitted_first) readmit({0, 1, 2});
  backup_->Kill();
  Alone(*primary_, 3, 0);  // server 2 adopts the key at clock 3
  EXPECT_EQ(third->engine->stats().adopted.load(), 1u);
  if (!readmitted_first) readmit({0, 2});
  primary_->Kill();
  Alone(*third, 4, 2);  // promoted: clock 4 without rank 1
  EXPECT_EQ(Clock(*third, 5, 2), expected(5));  // and clock 5 with it
  clients_.clear();
  third.reset();
}

INSTANTIATE_TEST_SUITE_P(BeforeOrAfter, AdoptedReadmissionTest, ::testing::Bool());

// A dead backup does not stop its primary: the replica fails, the backup is given up, and the
// clock is answered.
TEST_F(ReplicationTest, ADeadBackupIsGivenUpAndThePrimaryServesOn) {
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, v1::UPDATE_RULE_SUM), kWait).ok());
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM), kWait).ok());
  Clock(*primary_, 1, 0);
  backup_->Kill();
  Clock(*primary_, 2, 0);
  Clock(*primary_, 3, 0);
  EXPECT_GE(primary_->engine->stats().backups_lost.load(), 1u);
}

// What `poseidon status` shows (ReplicationStatus, reported as ReplicationTelemetry): each
// server's primary and backup keys, the keys whose backups were given up, and the backup lag.
TEST_F(ReplicationTest, TheStatusCountsPrimariesBackupsAndDegradedKeys) {
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, v1::UPDATE_RULE_SUM), kWait).ok());
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM), kWait).ok());
  Clock(*primary_, 1, 0);
  auto one = [](KvEngine& engine) {
    bool complete = false;
    const std::vector<ReplicationCounts> all = engine.ReplicationStatus(kWait, &complete);
    EXPECT_TRUE(complete);
    EXPECT_EQ(all.size(), 1u);
    return all.empty() ? ReplicationCounts{} : all[0];
  };
  ReplicationCounts p = one(*primary_->engine);
  EXPECT_EQ(p.job_id, 1u);
  EXPECT_EQ(p.primary_keys, 1u);
  EXPECT_EQ(p.backup_keys, 0u);
  EXPECT_EQ(p.degraded_keys, 0u);
  EXPECT_EQ(p.replicating_keys, 0u) << "clock 1 is answered: its replica is in";
  EXPECT_EQ(p.max_backup_lag_clocks, 0u);
  ReplicationCounts b = one(*backup_->engine);
  EXPECT_EQ(b.primary_keys, 0u);
  EXPECT_EQ(b.backup_keys, 1u);
  // The backup dies: the primary gives it up at the next clock and its key is degraded.
  backup_->Kill();
  Clock(*primary_, 2, 0);
  p = one(*primary_->engine);
  EXPECT_EQ(p.primary_keys, 1u);
  EXPECT_EQ(p.degraded_keys, 1u);
}

// Requests that break the chain's rules get errors naming the rule; nothing is applied.
TEST_F(ReplicationTest, MisdirectedRequestsAndForgedReplicasAreRefused) {
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, v1::UPDATE_RULE_SUM), kWait).ok());
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, v1::UPDATE_RULE_SUM), kWait).ok());
  std::vector<float> out(kN);
  const auto g = Grad(0, 1, kN);
  // A push to the backup at epoch 0 (it is not the primary then).
  auto b0 = Rank(*backup_, 0);
  absl::Status s = b0->Wait(b0->Push(kKey, 1, g, false, 0), kWait);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  // An epoch beyond the chain.
  s = b0->Wait(b0->Push(kKey, 1, g, false, 5), kWait);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  // A registration naming a server outside the chain of the table.
  auto bad = Spec(1, v1::UPDATE_RULE_SUM);
  bad.mutable_tables(0)->set_primary(5);
  EXPECT_TRUE(absl::IsInvalidArgument(b0->RegisterTables(bad, kWait)));
  // A ring larger than the servers listed; a joined server (after the ring) holding a table
  // from the start; a joined list that changes a server of the ring.
  bad = Spec(1, v1::UPDATE_RULE_SUM);
  bad.set_ring_servers(3);
  EXPECT_TRUE(absl::IsInvalidArgument(b0->RegisterTables(bad, kWait)));
  bad = Spec(1, v1::UPDATE_RULE_SUM);
  bad.add_servers("127.0.0.1:1");
  bad.set_ring_servers(2);
  bad.set_server_index(2);
  const absl::Status held = b0->RegisterTables(bad, kWait);
  EXPECT_TRUE(absl::IsInvalidArgument(held)) << held;
  EXPECT_NE(held.message().find("holds no copy"), std::string::npos) << held;
  bad = Spec(1, v1::UPDATE_RULE_SUM);
  bad.set_servers(0, "127.0.0.1:2");
  bad.add_servers("127.0.0.1:1");
  bad.set_ring_servers(2);
  EXPECT_TRUE(absl::IsFailedPrecondition(b0->RegisterTables(bad, kWait)));
  // A REPLICATE from an agent's rank: refused, and its connection closed.
  auto forged = Client(*backup_, 1);
  std::vector<float> state(kN, 1.0f);
  s = forged->Wait(forged->Replicate(kKey, 1, 0, 0, {std::as_bytes(std::span(state))}), kWait);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(backup_->server->Stats().protocol_errors, 1u) << "disconnected for it";
  EXPECT_EQ(backup_->engine->stats().replicas_applied.load(), 0u);
  // A replica from a server that is not the key's primary at that epoch (the backup itself),
  // and one with a gap, from a client holding server 0's key (as the primary would).
  auto as_server = [&](uint32_t index) {
    auto c = KvClient::Connect(*ctx_, backup_->server->Address(), 1, transport::ServerRank(index),
                               transport::RankKey(kSecret, 1, transport::ServerRank(index)),
                               absl::Seconds(10));
    EXPECT_TRUE(c.ok()) << c.status();
    return *c;
  };
  auto s1 = as_server(1);
  s = s1->Wait(s1->Replicate(kKey, 1, 0, 0, {std::as_bytes(std::span(state))}), kWait);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  auto s0 = as_server(0);
  s = s0->Wait(s0->Replicate(kKey, 3, 0, 0, {std::as_bytes(std::span(state))}), kWait);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("gap"), std::string::npos) << s;
  std::vector<float> short_state(kN - 1, 1.0f);
  s = s0->Wait(s0->Replicate(kKey, 1, 0, 0, {std::as_bytes(std::span(short_state))}), kWait);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(backup_->engine->stats().replicas_applied.load(), 0u);
  // The real primary still replicates fine afterwards.
  Clock(*primary_, 1, 0);
  EXPECT_EQ(backup_->engine->stats().replicas_applied.load(), 1u);
}

// `poseidon run --resume`: both servers checkpointed at clock 3 and start afresh at new
// addresses. The restored job takes the first registration naming them (only the addresses may
// differ), replicates to the new backup and continues exactly where it stopped; a job that was
// not restored refuses a change of addresses.
TEST_F(ReplicationTest, AResumedJobTakesItsServersNewAddressesAndContinuesIdentically) {
  const v1::UpdateRule rule = v1::UPDATE_RULE_MOMENTUM;
  std::vector<KeyProgress> fresh;
  ASSERT_TRUE(Rank(*primary_, 0)->RegisterTables(Spec(0, rule), kWait, &fresh).ok());
  EXPECT_EQ(fresh, std::vector<KeyProgress>{{}}) << "a new job's keys are at clock 0";
  ASSERT_TRUE(Rank(*backup_, 0)->RegisterTables(Spec(1, rule), kWait).ok());
  std::vector<float> init(kN, 0.5f);
  {
    auto c = Rank(*primary_, 0);
    ASSERT_TRUE(c->Wait(c->Push(kKey, 0, init, /*init=*/true), kWait).ok());
  }
  Reference expected(Spec(0, rule), init);
  const std::vector<float>& params = expected.params;
  for (uint64_t clock = 1; clock <= 3; ++clock) {
    EXPECT_EQ(Clock(*primary_, clock, 0), expected(clock)) << "clock " << clock;
  }
  auto snap0 = primary_->engine->Snapshot(1, kWait);
  auto snap1 = backup_->engine->Snapshot(1, kWait);
  ASSERT_TRUE(snap0.ok()) << snap0.status();
  ASSERT_TRUE(snap1.ok()) << snap1.status();
  EXPECT_EQ(snap0->clock, 3u);
  EXPECT_EQ(snap1->clock, 3u);
  // A running job does not take other addresses.
  std::vector<std::string> old = addresses_;
  addresses_ = {"127.0.0.1:1", "127.0.0.1:2"};
  auto moved = Rank(*primary_, 1)->RegisterTables(Spec(0, rule), kWait);
  EXPECT_EQ(moved.code(), absl::StatusCode::kFailedPrecondition) << moved;
  clients_.clear();
  primary_.reset();
  backup_.reset();
  // The resumed job: fresh servers, restored from the snapshots, at new addresses.
  primary_ = std::make_unique<Shard>(ctx_);
  backup_ = std::make_unique<Shard>(ctx_);
  ASSERT_TRUE(primary_->engine->Restore(*snap0).ok());
  ASSERT_TRUE(backup_->engine->Restore(*snap1).ok());
  addresses_ = {primary_->server->Address(), backup_->server->Address()};
  ASSERT_NE(addresses_, old);
  v1::RegisterTablesRequest other = Spec(0, rule);
  other.mutable_tables(0)->mutable_keys(0)->set_elements(kN + 1);
  auto differs = Rank(*primary_, 0)->RegisterTables(other, kWait);
  EXPECT_EQ(differs.code(), absl::StatusCode::kFailedPrecondition) << differs;
  for (uint32_t r = 0; r < 2; ++r) {
    std::vector<KeyProgress> keys;
    ASSERT_TRUE(Rank(*primary_, r)->RegisterTables(Spec(0, rule), kWait, &keys).ok());
    EXPECT_EQ(keys, (std::vector<KeyProgress>{{3, 0}})) << "the answer names the restored clock";
    ASSERT_TRUE(Rank(*backup_, r)->RegisterTables(Spec(1, rule), kWait, &keys).ok());
    EXPECT_EQ(keys, (std::vector<KeyProgress>{{3, 0}}));
  }
  // Clock 3 is answered again (a re-sent push is a duplicate), then training goes on.
  {
    auto c = Rank(*primary_, 0);
    std::vector<float> out(kN);
    ASSERT_TRUE(c->Wait(c->Push(kKey, 3, Grad(0, 3, kN)), kWait).ok());
    ASSERT_TRUE(c->Wait(c->Pull(kKey, 3, out, kWait), kWait).ok());
    EXPECT_EQ(out, params);
  }
  for (uint64_t clock = 4; clock <= 6; ++clock) {
    EXPECT_EQ(Clock(*primary_, clock, 0), expected(clock)) << "clock " << clock;
  }
  EXPECT_EQ(backup_->engine->stats().replicas_applied.load(), 3u)
      << "the primary replicates to the backup at its new address";
  // Once registered, the addresses are fixed again.
  addresses_ = {"127.0.0.1:1", "127.0.0.1:2"};
  auto again = Rank(*primary_, 1)->RegisterTables(Spec(0, rule), kWait);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
}

}  // namespace
}  // namespace poseidon::server
