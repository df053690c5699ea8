// The syncers in-process: two ranks of one job in this process, each with its own shared-memory
// segments, scheduler and syncers (PS, SFB, bucket and all-reduce from the registration table), a
// KV server and the SFB peer connections over the in-process transport, the all-reduce's Gloo
// ring over loopback TCP (its rendezvous through a store that, like the coordinator's in the
// agent, lets a key be set again). Four iterations in which one FC layer runs SFB, PS, SFB, then all-reduce (what plan
// changes do: its keys are clocked per layer, its inbox slots reused), a two-chunk layer PS, then
// all-reduce twice, then PS again, and a bucket of two small layers: every result is the exact
// sum over both ranks.
#include "agent/syncer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <span>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "agent/layer_table.h"
#include "agent/scheduler.h"
#include "agent/shm_endpoint.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/store.h"
#include "server/buffer_pool.h"
#include "server/kv_engine.h"
#include "server/kv_service.h"
#include "transport/credentials.h"
#include "transport/frame_server.h"
#include "transport/handshake.h"
#include "transport/inproc/inproc_context.h"

namespace poseidon::agent {
namespace {

constexpr char kSecret[] = "syncer-test";

// The rendezvous store as the coordinator keeps it (agent/gloo_store.h): a key may be set again
// (a replacement's question, cleared once answered), get and wait block until the keys exist,
// at most the timeout.
class TestStore final : public gloo::rendezvous::Store {
 public:
  void set(const std::string& key, const std::vector<char>& data) override {
    std::lock_guard<std::mutex> lock(mu_);
    map_[key] = data;
    cv_.notify_all();
  }
  std::vector<char> get(const std::string& key) override {
    wait({key});
    std::lock_guard<std::mutex> lock(mu_);
    return map_.at(key);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, kDefaultTimeout); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    const bool all = cv_.wait_for(lock, timeout, [&] {
      return std::all_of(keys.begin(), keys.end(),
                         [&](const std::string& k) { return map_.count(k) != 0; });
    });
    if (!all) throw gloo::IoException("test store: keys not set within the timeout");
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<char>> map_;
};
constexpr uint32_t kWorld = 2;
constexpr uint64_t kM = 16, kN = 8, kK = 2;  // layer 0: FC [16, 8], K = 2

LayerDesc Desc(const std::string& name, uint32_t kind, std::vector<uint64_t> shape,
               uint32_t k = 0, bool fusable = false) {
  LayerDesc d;
  d.name = name;
  d.kind = kind;
  d.shape = shape;
  d.batch_k = k;
  d.elements = 1;
  for (uint64_t s : shape) d.elements *= s;
  d.fusable = fusable;
  return d;
}

const std::vector<LayerDesc>& Descs() {
  static const std::vector<LayerDesc> descs = {
      Desc("fc", PSD_KIND_FC, {kM, kN}, kK), Desc("b1", PSD_KIND_BIAS, {16}, 0, true),
      Desc("b2", PSD_KIND_BIAS, {8}, 0, true), Desc("conv", PSD_KIND_OTHER, {100})};
  return descs;
}

v1::Plan Plan() {
  v1::Plan plan;
  plan.set_plan_epoch(1);
  plan.add_servers()->set_node_id("kv");
  uint64_t key = 1;
  for (size_t i = 0; i < Descs().size(); ++i) {
    auto* l = plan.add_layers();
    l->set_layer_index(static_cast<uint32_t>(i));
    l->set_scheme(i == 0 ? v1::SYNC_SCHEME_SFB : v1::SYNC_SCHEME_PS);
    const uint64_t bytes = Descs()[i].elements * 4;
    const uint64_t pieces = i == 3 ? 2 : 1;  // the conv layer in two chunks
    for (uint64_t p = 0; p < pieces; ++p) {
      auto* c = l->add_chunks();
      c->set_key(key++);
      c->set_offset(p * bytes / pieces);
      c->set_length(bytes / pieces);
    }
  }
  return plan;
}

// Small integers: sums (and SFB's products) are exact in float.
float Value(uint32_t rank, uint64_t t, uint32_t layer, uint64_t i) {
  return static_cast<float>(static_cast<int64_t>((rank + 1) * 3 + t * 2 + layer + i % 7) - 9);
}

struct Rank {
  uint32_t rank = 0;
  AgentConfig config;
  LayerTable table;
  std::unique_ptr<ShmEndpoint> shm;
  std::unique_ptr<Scheduler> scheduler;
  std::atomic<DeviceStager*> stager{nullptr};
  std::unique_ptr<PeerGate> gate;
  SyncEnv env;
  std::map<SyncerKind, std::unique_ptr<Syncer>> syncers;
  std::shared_ptr<transport::FrameServer> peer_server;
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint32_t, int> parts_left;  // by layer, of the iteration in progress
  std::vector<std::string> errors;
};

class SyncerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ctx = transport::CreateInprocContext({});
    ASSERT_TRUE(ctx.ok());
    ctx_ = *ctx;
    secrets_ = std::make_shared<transport::SecretStore>();
    secrets_->Set(1, kSecret);
    // The KV server.
    engine_ = std::make_shared<server::KvEngine>(server::EngineOptions{});
    service_ = std::make_shared<server::KvService>(engine_, server::BufferPool::Create(8 << 20),
                                                   server::KvServiceOptions{});
    auto kv = ctx_->Listen("kv");
    ASSERT_TRUE(kv.ok()) << kv.status();
    kv_server_ = std::make_shared<transport::FrameServer>(*kv, secrets_, service_);
    kv_server_->Start();
    for (uint32_t r = 0; r < World(); ++r) {
      ranks_.push_back(std::make_unique<Rank>());
      ASSERT_NO_FATAL_FAILURE(MakeRank(*ranks_.back(), r));
    }
    // The SFB connections, once every rank's syncers exist; the PINGs' part: every peer ready.
    for (auto& me : ranks_) {
      me->env.peers.Reset(World());
      for (uint32_t p = 0; p < World(); ++p) {
        if (p == me->rank) continue;
        auto conn = transport::ConnectAuthenticated(*ctx_, absl::StrCat("peer-", p), 1, me->rank,
                                                    transport::RankKey(kSecret, 1, me->rank),
                                                    absl::Seconds(10));
        ASSERT_TRUE(conn.ok()) << conn.status();
        me->env.peers.Set(p, *conn);
        me->gate->MarkReady(p);
      }
    }
    // The Gloo ring: every rank connects at once (registration does it in the agent).
    std::vector<absl::Status> ready(World());
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < World(); ++r) {
      threads.emplace_back(
          [&, r] { ready[r] = ranks_[r]->syncers.at(SyncerKind::kAllreduce)->Ready(); });
    }
    for (auto& t : threads) t.join();
    for (uint32_t r = 0; r < World(); ++r) ASSERT_TRUE(ready[r].ok()) << ready[r];
  }

  void MakeRank(Rank& r, uint32_t rank) {
    r.rank = rank;
    r.config.rank = rank;
    r.config.world_size = World();
    r.config.job_id = 1;
    r.config.secret = kSecret;
    r.config.servers = {"kv"};
    r.config.sync_timeout = absl::Seconds(20);
    auto table = BuildLayerTable(Descs(), Plan(),
                                 {.world_size = World(),
                                  .sfb_possible = true,
                                  .allreduce_possible = true,
                                  .bucket_bytes = 1024});
    ASSERT_TRUE(table.ok()) << table.status();
    r.table = *std::move(table);
    ASSERT_EQ(r.table.buckets.size(), 1u);  // b1 + b2
    ASSERT_TRUE(r.table.layers[0].sfb_capable);
    Adjust(r);
    auto shm = ShmEndpoint::Create(absl::StrCat("/psd-syncer-test-", getpid(), "-", rank), rank,
                                   World(), 1);
    ASSERT_TRUE(shm.ok()) << shm.status();
    r.shm = *std::move(shm);
    std::vector<LayerLayout> layout;
    for (const LayerSpec& l : r.table.layers) layout.push_back(l.layout);
    ASSERT_TRUE(r.shm->PublishLayout(Descs(), layout, r.table.data_bytes).ok());
    // A small credit: the chunks queue behind each other and the parked credit is exercised.
    r.scheduler = std::make_unique<Scheduler>(SchedulerOptions{64, true, 2});
    r.scheduler->Start();
    r.gate = std::make_unique<PeerGate>(World());
    r.env.rendezvous = &store_;
    r.env.own_host = "127.0.0.1";
    r.env.config = &r.config;
    r.env.table = &r.table;
    r.env.shm = r.shm.get();
    r.env.scheduler = r.scheduler.get();
    r.env.stager = &r.stager;
    r.env.peer_gate = r.gate.get();
    r.env.finished = [&r](uint32_t layer, uint64_t, int, const absl::Status& s) {
      std::lock_guard<std::mutex> lock(r.mu);
      if (!s.ok()) r.errors.push_back(std::string(s.message()));
      --r.parts_left[layer];
      r.cv.notify_all();
    };
    auto client = server::KvClient::Connect(*ctx_, "kv", 1, rank, transport::RankKey(kSecret, 1, rank),
                                            absl::Seconds(10));
    ASSERT_TRUE(client.ok()) << client.status();
    r.env.servers = {*client};
    r.env.metrics.push_bytes = {nullptr};
    r.env.metrics.pull_bytes = {nullptr};
    // The tables every rank registers alike (the agent's ConnectServers): one per layer's chunks
    // (the SFB layer's too) but the bucket members', and the bucket's key.
    v1::RegisterTablesRequest request;
    request.set_num_workers(World());
    auto add = [&](const std::string& name, const std::vector<PsChunk>& chunks) {
      auto* t = request.add_tables();
      t->set_name(name);
      t->set_element_type(v1::ELEMENT_TYPE_F32);
      t->mutable_update_rule()->set_rule(v1::UPDATE_RULE_SUM);
      for (const PsChunk& c : chunks) {
        auto* k = t->add_keys();
        k->set_key(c.key);
        k->set_elements(c.length / 4);
      }
    };
    for (const LayerSpec& l : r.table.layers) {
      if (l.bucket < 0) add(l.desc.name, l.chunks);
    }
    for (const BucketSpec& b : r.table.buckets) add(b.name, {b.chunk});
    ASSERT_TRUE((*client)->RegisterTables(request, absl::Seconds(10)).ok());
    for (const SyncerRow& row : SyncerTable()) r.syncers[row.kind] = row.make(r.env);
    auto listener = ctx_->Listen(absl::StrCat("peer-", rank));
    ASSERT_TRUE(listener.ok());
    r.peer_server = std::make_shared<transport::FrameServer>(
        *listener, secrets_, std::shared_ptr<transport::FrameHandler>(
                                 std::shared_ptr<void>(), r.syncers[SyncerKind::kSfb]->peer_handler()));
    r.peer_server->Start();
  }

  // What rank `rank`'s FC layer waits for at iteration t, once it says `want` or 10 s passed
  // (factors still on their way read as waited for a while).
  std::string WaitingOnceSettled(uint32_t rank, uint64_t t, const std::string& want) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    std::string now = ranks_[rank]->syncers.at(SyncerKind::kSfb)->Waiting(0, t, {});
    while (now != want && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
      now = ranks_[rank]->syncers.at(SyncerKind::kSfb)->Waiting(0, t, {});
    }
    return now;
  }

  // Rank `rank`'s rebuilt FC gradient of iteration t is the exact sum over the ranks `of`.
  void ExpectSfbSum(uint32_t rank, uint64_t t, const std::vector<uint32_t>& of) {
    const float* g = ranks_[rank]->shm->Grad(0);
    for (uint64_t m = 0; m < kM; ++m) {
      for (uint64_t n = 0; n < kN; ++n) {
        float want = 0;
        for (uint32_t p : of) {
          for (uint64_t k = 0; k < kK; ++k) {
            want += Value(p, t, 0, k * kM + m) * Value(p, t, 10, k * kN + n);
          }
        }
        ASSERT_EQ(g[m * kN + n], want) << "rank " << rank << " t " << t << " (" << m << ", " << n
                                       << ")";
      }
    }
  }

  // A test's own settings, before the syncers are made.
  virtual void Adjust(Rank&) {}
  // How many ranks the test runs.
  virtual uint32_t World() const { return kWorld; }

  void TearDown() override {
    for (auto& r : ranks_) {
      for (auto& [kind, syncer] : r->syncers) syncer->Stop();
    }
    for (auto& r : ranks_) {
      if (r->peer_server) r->peer_server->Stop();
      if (r->scheduler) r->scheduler->Stop();
    }
    if (kv_server_) kv_server_->Stop();
    for (auto& r : ranks_) {
      for (auto& s : r->env.servers) s->Close();
    }
    ctx_->Close();
    for (auto& r : ranks_) r->env.servers.clear();
  }

  // Writes rank r's input of iteration t for `layer` as `scheme` wants it and starts it.
  void Post(Rank& r, uint32_t layer, uint64_t t, SyncerKind kind) {
    const LayerSpec& spec = r.table.layers[layer];
    if (kind == SyncerKind::kSfb) {
      float* u = r.shm->FactorU(layer);
      float* v = r.shm->FactorV(layer);
      for (uint64_t i = 0; i < kK * kM; ++i) u[i] = Value(r.rank, t, layer, i);
      for (uint64_t i = 0; i < kK * kN; ++i) v[i] = Value(r.rank, t, layer + 10, i);
    } else {
      float* g = r.shm->Grad(layer);
      for (uint64_t i = 0; i < spec.desc.elements; ++i) g[i] = Value(r.rank, t, layer, i);
    }
    Syncer& syncer = *r.syncers.at(kind);
    {
      std::lock_guard<std::mutex> lock(r.mu);
      r.parts_left[layer] += syncer.Parts(layer);
    }
    syncer.Start({layer, t - r.env.clock_base, false, 0, absl::Now()});  // the process's
  }

  void WaitAll(Rank& r) {
    std::unique_lock<std::mutex> lock(r.mu);
    const bool done = r.cv.wait_for(lock, std::chrono::seconds(30), [&] {
      for (const auto& [layer, left] : r.parts_left) {
        if (left != 0) return false;
      }
      return true;
    });
    ASSERT_TRUE(done) << "rank " << r.rank << " still waits";
    EXPECT_TRUE(r.errors.empty()) << r.errors.front();
  }

  std::shared_ptr<transport::Context> ctx_;
  std::shared_ptr<transport::SecretStore> secrets_;
  std::shared_ptr<server::KvEngine> engine_;
  std::shared_ptr<server::KvService> service_;
  std::shared_ptr<transport::FrameServer> kv_server_;
  TestStore store_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

// Replication::Failover: which errors send the keys of a first primary on to the next server of
// their chain (the epoch moves once), and which stand. The server's connection is live here, so
// only the answer decides.
TEST_F(SyncerTest, AFailoverWalksPastAServerWithoutACopyAndStopsAtTheChainsEnd) {
  Rank& r = *ranks_[0];
  AgentConfig config = r.config;
  config.servers = {"kv-0", "kv-1", "kv-2"};
  SyncEnv env;
  env.config = &config;
  Replication replication;
  replication.replicas = 1;
  replication.servers = 3;
  replication.epoch = std::make_unique<std::atomic<uint32_t>[]>(3);
  server::KvClient& live = *r.env.servers[0];
  const absl::Status no_copy = absl::NotFoundError("this server holds no copy of it");
  // An answer of the server's own stands: a gone rank, a timeout, a refused push.
  for (const absl::Status& stands : {absl::UnavailableError("rank 1 is gone"),
                                     absl::DeadlineExceededError("pull timed out"),
                                     absl::FailedPreconditionError("rank 1 was removed")}) {
    EXPECT_FALSE(replication.Failover(env, 1, 0, live, stands)) << stands;
    EXPECT_EQ(replication.Epoch(1), 0u);
  }
  // A fenced server, then one that holds no copy (a standby that had no room): on to epoch 2.
  EXPECT_TRUE(replication.Failover(env, 1, 0, live, absl::AbortedError("moved")));
  EXPECT_EQ(replication.Epoch(1), 1u);
  EXPECT_TRUE(replication.Failover(env, 1, 1, live, no_copy));
  EXPECT_EQ(replication.Epoch(1), 2u);
  EXPECT_EQ(replication.ServingNow(1), 0u) << "the chain of server 1's keys: 1, 2, 0";
  // A second request that failed at epoch 1 follows without moving the epoch again.
  EXPECT_TRUE(replication.Failover(env, 1, 1, live, no_copy));
  EXPECT_EQ(replication.Epoch(1), 2u);
  // The last server of the chain: the error stands.
  EXPECT_FALSE(replication.Failover(env, 1, 2, live, no_copy));
  EXPECT_FALSE(replication.AwaitsJoin(env, 2, live, no_copy)) << "no server joined";
  EXPECT_EQ(replication.Epoch(1), 2u);
  EXPECT_EQ(replication.Epoch(0), 0u) << "another first primary's keys stay";

  // A server joined the running job (the coordinator listed it) but is not taken up yet: the
  // request waits for it, and once it is taken up goes on to it (epoch 3, after the ring).
  env.joined.announced = 1;
  EXPECT_TRUE(replication.AwaitsJoin(env, 2, live, no_copy));
  EXPECT_FALSE(replication.AwaitsJoin(env, 2, live, absl::UnavailableError("rank 1 is gone")))
      << "the server's own answer still stands";
  int retried = 0;
  env.joined.Park(0, [&] { ++retried; });
  EXPECT_EQ(retried, 0);
  env.joined.clients[0] = r.env.servers[0];
  env.joined.addresses[0] = "kv-3";
  env.joined.count = 1;
  env.joined.Unpark();
  EXPECT_EQ(retried, 1);
  EXPECT_FALSE(replication.AwaitsJoin(env, 2, live, no_copy)) << "taken up: walked on to";
  EXPECT_TRUE(replication.Failover(env, 1, 2, live, no_copy));
  EXPECT_EQ(replication.Epoch(1), 3u);
  EXPECT_EQ(replication.ServingNow(1), 3u) << "the joined server, after the ring";
  // A second one announced whose taking up fails: what waited for it goes on (and fails).
  env.joined.announced = 2;
  EXPECT_TRUE(replication.AwaitsJoin(env, 3, live, no_copy));
  env.joined.Park(1, [&] { ++retried; });
  env.joined.stuck = true;
  env.joined.Unpark();
  EXPECT_EQ(retried, 2);
  EXPECT_FALSE(replication.AwaitsJoin(env, 3, live, no_copy));
  EXPECT_FALSE(replication.Failover(env, 1, 3, live, no_copy));
  // Parked after the count moved (or once stuck): it runs at once.
  env.joined.Park(0, [&] { ++retried; });
  EXPECT_EQ(retried, 3);
}

TEST_F(SyncerTest, EverySchemeGivesTheExactSumAcrossAPlanChange) {
  // Layer 0 by SFB at iterations 1 and 3, by PS at 2 (its keys' clock 1 then), all-reduce at 4;
  // layer 3 by PS at 1 and 4 (its keys' clocks 1 and 2), all-reduce at 2 and 3.
  const SyncerKind fc_kind[] = {SyncerKind::kSfb, SyncerKind::kSfb, SyncerKind::kPs,
                                SyncerKind::kSfb, SyncerKind::kAllreduce};
  const SyncerKind conv_kind[] = {SyncerKind::kPs, SyncerKind::kPs, SyncerKind::kAllreduce,
                                  SyncerKind::kAllreduce, SyncerKind::kPs};
  for (uint64_t t = 1; t <= 4; ++t) {
    for (auto& r : ranks_) {
      // The ranks post in opposite orders (the two all-reduces of iteration 4 must not wait
      // for each other).
      if (r->rank == 0) {
        Post(*r, 3, t, conv_kind[t]);
        Post(*r, 2, t, SyncerKind::kBucket);
        Post(*r, 1, t, SyncerKind::kBucket);
        Post(*r, 0, t, fc_kind[t]);
      } else {
        Post(*r, 0, t, fc_kind[t]);
        Post(*r, 1, t, SyncerKind::kBucket);
        Post(*r, 2, t, SyncerKind::kBucket);
        Post(*r, 3, t, conv_kind[t]);
      }
    }
    for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
    for (auto& r : ranks_) {
      for (uint32_t layer = 1; layer <= 3; ++layer) {
        const float* g = r->shm->Grad(layer);
        for (uint64_t i = 0; i < Descs()[layer].elements; ++i) {
          const float want = Value(0, t, layer, i) + Value(1, t, layer, i);
          ASSERT_EQ(g[i], want) << "rank " << r->rank << " layer " << layer << " t " << t
                                << " element " << i;
        }
      }
      const float* g = r->shm->Grad(0);
      for (uint64_t m = 0; m < kM; ++m) {
        for (uint64_t n = 0; n < kN; ++n) {
          float want = 0;
          if (fc_kind[t] == SyncerKind::kSfb) {
            for (uint32_t p = 0; p < kWorld; ++p) {  // sum_p U_p^T V_p
              for (uint64_t k = 0; k < kK; ++k) {
                want += Value(p, t, 0, k * kM + m) * Value(p, t, 10, k * kN + n);
              }
            }
          } else {
            want = Value(0, t, 0, m * kN + n) + Value(1, t, 0, m * kN + n);
          }
          ASSERT_EQ(g[m * kN + n], want) << "rank " << r->rank << " t " << t << " (" << m << ", "
                                         << n << ")";
        }
      }
    }
  }
  // Everything returned its credit.
  for (auto& r : ranks_) EXPECT_EQ(r->scheduler->in_flight_bytes(), 0u);
}

// A job that may shrink (--min_workers) with the FC layer on SFB, averaged (PSD_LAYER_AVERAGE):
// rank 1 is removed after iteration 3, when rank 0 holds its factors of 3. With no other live
// agent to hear from, rank 0's cut is 3: iteration 3 counts rank 1 (the mean of both), 4 and 5
// count rank 0 alone (its own product), and rank 0 sends rank 1 nothing more.
class SfbShrinkTest : public SyncerTest {
 protected:
  void Adjust(Rank& r) override {
    r.config.min_workers = 1;
    r.table.layers[0].desc.average = true;
  }
};

TEST_F(SfbShrinkTest, ARemovedRanksFactorsCountUpToTheAgreedIterationAndTheMeanIsOverTheRest) {
  auto expect = [&](uint64_t t, uint32_t ranks) {
    const float* g = ranks_[0]->shm->Grad(0);
    for (uint64_t m = 0; m < kM; ++m) {
      for (uint64_t n = 0; n < kN; ++n) {
        float want = 0;
        for (uint32_t p = 0; p < ranks; ++p) {
          for (uint64_t k = 0; k < kK; ++k) {
            want += Value(p, t, 0, k * kM + m) * Value(p, t, 10, k * kN + n);
          }
        }
        want /= static_cast<float>(ranks);
        ASSERT_FLOAT_EQ(g[m * kN + n], want) << "t " << t << " (" << m << ", " << n << ")";
      }
    }
  };
  for (uint64_t t = 1; t <= 3; ++t) {
    for (auto& r : ranks_) Post(*r, 0, t, SyncerKind::kSfb);
    for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
    ASSERT_NO_FATAL_FAILURE(expect(t, 2));
  }
  Syncer& sfb = *ranks_[0]->syncers.at(SyncerKind::kSfb);
  sfb.PeerRemoved(1);
  sfb.PeerRemoved(1);  // once is enough: a second is ignored
  for (uint64_t t = 4; t <= 5; ++t) {
    Post(*ranks_[0], 0, t, SyncerKind::kSfb);
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[0]));
    ASSERT_NO_FATAL_FAILURE(expect(t, 1));
  }
  // Rank 1 was sent nothing of 4 on: it still waits for rank 0's factors of 4.
  Post(*ranks_[1], 0, 4, SyncerKind::kSfb);
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(ranks_[1]->syncers.at(SyncerKind::kSfb)->Waiting(0, 4, {}),
            "SFB factors from ranks [0]");
  for (auto& [kind, syncer] : ranks_[1]->syncers) syncer->Stop();
  EXPECT_EQ(ranks_[0]->scheduler->in_flight_bytes(), 0u);
}

// Three ranks: rank 2's factors of iteration 3 reach rank 0 and not rank 1 (it died while
// sending them), and rank 0 completes iteration 3 with them. Once both remove rank 2, rank 0
// passes them on: both agree that rank 2 counts up to iteration 3, rank 1 completes it with
// the same sum over the three ranks, and iteration 4 is the sum over ranks 0 and 1.
class SfbShrinkOfThreeTest : public SfbShrinkTest {
 protected:
  uint32_t World() const override { return 3; }
  void Adjust(Rank& r) override { r.config.min_workers = 1; }
};

TEST_F(SfbShrinkOfThreeTest, FactorsOnlySomeAgentsGotAreRelayedAndEveryAgentAgreesOnTheCut) {
  for (uint64_t t = 1; t <= 2; ++t) {
    for (auto& r : ranks_) Post(*r, 0, t, SyncerKind::kSfb);
    for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
  }
  // Rank 2's connection to rank 1 is gone: its factors of 3 reach rank 0 only.
  ranks_[2]->env.peers.Set(1, nullptr);
  Post(*ranks_[2], 0, 3, SyncerKind::kSfb);
  Post(*ranks_[0], 0, 3, SyncerKind::kSfb);
  Post(*ranks_[1], 0, 3, SyncerKind::kSfb);
  ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[0]));
  ASSERT_NO_FATAL_FAILURE(ExpectSfbSum(0, 3, {0, 1, 2}));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(ranks_[1]->syncers.at(SyncerKind::kSfb)->Waiting(0, 3, {}),
            "SFB factors from ranks [2]");
  ranks_[1]->syncers.at(SyncerKind::kSfb)->PeerRemoved(2);
  absl::SleepFor(absl::Milliseconds(100));  // rank 1 alone cannot decide: rank 0 has not told
  EXPECT_EQ(ranks_[1]->syncers.at(SyncerKind::kSfb)->Waiting(0, 3, {}),
            "SFB factors from ranks [2]");
  ranks_[0]->syncers.at(SyncerKind::kSfb)->PeerRemoved(2);
  ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[1]));
  ASSERT_NO_FATAL_FAILURE(ExpectSfbSum(1, 3, {0, 1, 2}));
  Post(*ranks_[0], 0, 4, SyncerKind::kSfb);
  Post(*ranks_[1], 0, 4, SyncerKind::kSfb);
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectSfbSum(r, 4, {0, 1}));
  }
  for (auto& [kind, syncer] : ranks_[2]->syncers) syncer->Stop();
}

// A rank that dies before it announced itself (its PING never came): the first iteration's SFB
// layers wait for it at the peer gate, and once it is removed they go on without it at once
// (its factors count up to iteration 0: none), not at sync_timeout (20 s here, which would fail
// the layer).
TEST_F(SfbShrinkOfThreeTest, ARankRemovedBeforeItAnnouncedItselfIsNotWaitedFor) {
  for (uint32_t r = 0; r < 2; ++r) {
    ranks_[r]->gate = std::make_unique<PeerGate>(3);
    ranks_[r]->gate->MarkReady(1 - r);
    ranks_[r]->env.peer_gate = ranks_[r]->gate.get();
  }
  for (uint32_t r = 0; r < 2; ++r) Post(*ranks_[r], 0, 1, SyncerKind::kSfb);
  absl::SleepFor(absl::Milliseconds(200));
  for (uint32_t r = 0; r < 2; ++r) {
    std::lock_guard<std::mutex> lock(ranks_[r]->mu);
    EXPECT_NE(ranks_[r]->parts_left[0], 0) << "rank " << r << " did not wait at the gate";
  }
  for (uint32_t r = 0; r < 2; ++r) ranks_[r]->syncers.at(SyncerKind::kSfb)->PeerRemoved(2);
  // Released by the removal: a gate that timed out would fail the layer (an error here).
  for (uint32_t r = 0; r < 2; ++r) ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
  for (uint32_t r = 0; r < 2; ++r) {
    const float* g = ranks_[r]->shm->Grad(0);
    for (uint64_t m = 0; m < kM; ++m) {
      for (uint64_t n = 0; n < kN; ++n) {
        float want = 0;
        for (uint32_t p : {0u, 1u}) {
          for (uint64_t k = 0; k < kK; ++k) {
            want += Value(p, 1, 0, k * kM + m) * Value(p, 1, 10, k * kN + n);
          }
        }
        ASSERT_EQ(g[m * kN + n], want) << "rank " << r << " (" << m << ", " << n << ")";
      }
    }
  }
  for (auto& [kind, syncer] : ranks_[2]->syncers) syncer->Stop();
}

// The world grows again with SFB layers: rank 2 of 3 is removed after iteration 2 and comes
// back (ComeBack, as a readmitted replacement's agent does). Its question reaches rank 0, which
// has removed it but cannot agree the cut alone, and rank 1, which has not heard of the removal
// (a replacement on the same GPU within the coordinator's lease: it never will) and removes it
// on the question (only a rank the KV servers removed asks). Both answer once the cut is agreed
// (at 2); both sent factors up to iteration 2, so it takes up the job at 4, and their iteration
// 3 waits for its word: once its PING names 4 (PeerBack), iteration 3 is the sum over ranks 0
// and 1, and iteration 4 over all three, on every rank.
class SfbComeBackTest : public SfbShrinkOfThreeTest {
 protected:
  void Adjust(Rank& r) override {
    r.config.min_workers = 1;
    r.config.rejoin_timeout = absl::Seconds(1);  // a job that takes ranks back
  }
};

TEST_F(SfbComeBackTest, ARemovedRankComesBackAtAnIterationEveryAgentHeldAndCountsFromThere) {
  Syncer& sfb0 = *ranks_[0]->syncers.at(SyncerKind::kSfb);
  Syncer& sfb1 = *ranks_[1]->syncers.at(SyncerKind::kSfb);
  Syncer& sfb2 = *ranks_[2]->syncers.at(SyncerKind::kSfb);
  for (uint64_t t = 1; t <= 2; ++t) {
    for (auto& r : ranks_) Post(*r, 0, t, SyncerKind::kSfb);
    for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
  }
  // The answers come back on rank 2's own connections (the agent reads them as its listener's).
  for (uint32_t p = 0; p < 2; ++p) {
    ranks_[2]->peer_server->Serve(ranks_[2]->env.peers.Get(p), transport::PeerIdentity{1, p});
  }
  sfb0.PeerRemoved(2);
  const absl::StatusOr<uint64_t> back = sfb2.ComeBack(absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, 4u);
  // Iteration 3 waits for rank 2's word (it may still take up the job there, for all they know).
  for (uint32_t r = 0; r < 2; ++r) Post(*ranks_[r], 0, 3, SyncerKind::kSfb);
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(WaitingOnceSettled(r, 3, "SFB factors from ranks [2]"),
              "SFB factors from ranks [2]");
  }
  sfb0.PeerBack(2, *back);
  sfb1.PeerBack(2, *back);
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectSfbSum(r, 3, {0, 1}));
  }
  for (auto& r : ranks_) Post(*r, 0, 4, SyncerKind::kSfb);
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectSfbSum(r, 4, {0, 1, 2}));
  }
}

// A replacement that asked to come back and died before it took up the job (no PING): once
// the others hear it is gone (PeerRemoved again), what waited for its word goes on without it,
// and the rank stays out at the cut agreed before.
TEST_F(SfbComeBackTest, AReplacementGoneBeforeItTookUpTheJobIsNotWaitedFor) {
  for (uint64_t t = 1; t <= 2; ++t) {
    for (auto& r : ranks_) Post(*r, 0, t, SyncerKind::kSfb);
    for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
  }
  for (uint32_t p = 0; p < 2; ++p) {
    ranks_[2]->peer_server->Serve(ranks_[2]->env.peers.Get(p), transport::PeerIdentity{1, p});
    ranks_[p]->syncers.at(SyncerKind::kSfb)->PeerRemoved(2);
  }
  const absl::StatusOr<uint64_t> back =
      ranks_[2]->syncers.at(SyncerKind::kSfb)->ComeBack(absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(back.ok()) << back.status();
  for (uint32_t r = 0; r < 2; ++r) Post(*ranks_[r], 0, 3, SyncerKind::kSfb);
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(WaitingOnceSettled(r, 3, "SFB factors from ranks [2]"),
              "SFB factors from ranks [2]");
    ranks_[r]->syncers.at(SyncerKind::kSfb)->PeerRemoved(2);
  }
  // Iteration 3 completes without it, and so does the next.
  for (uint64_t t = 3; t <= 4; ++t) {
    if (t == 4) {
      for (uint32_t r = 0; r < 2; ++r) Post(*ranks_[r], 0, t, SyncerKind::kSfb);
    }
    for (uint32_t r = 0; r < 2; ++r) {
      ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
      ASSERT_NO_FATAL_FAILURE(ExpectSfbSum(r, t, {0, 1}));
    }
  }
}

// Sends one FACTORS frame with `flags` and `sequence` to rank 0's agent as rank 1 (a connection
// of its own) and returns the ERROR frame's message it answers with ("" when it answers none).
std::string RefusalOfFactorsFrame(transport::Context& ctx, uint8_t flags, uint64_t sequence) {
  auto conn = transport::ConnectAuthenticated(ctx, "peer-0", 1, 1,
                                              transport::RankKey(kSecret, 1, 1),
                                              absl::Seconds(10));
  if (!conn.ok()) return absl::StrCat("cannot connect: ", conn.status().ToString());
  transport::FrameHeader h;
  h.type = transport::FrameType::kFactors;
  h.flags = flags;
  h.job_id = 1;
  h.sender_rank = 1;
  h.sequence = sequence;
  h.key = 0;
  h.clock = 3;
  (*conn)->Send(h, {}, [](absl::Status) {});
  std::promise<absl::StatusOr<transport::FrameHeader>> header;
  (*conn)->ReadHeader([&](absl::StatusOr<transport::FrameHeader> got) {
    header.set_value(std::move(got));
  }, absl::Seconds(10));
  const absl::StatusOr<transport::FrameHeader> got = header.get_future().get();
  std::string message;
  if (got.ok() && got->type == transport::FrameType::kError) {
    message.assign(got->payload_length, '\0');
    std::promise<absl::Status> read;
    (*conn)->ReadPayload(std::as_writable_bytes(std::span(message.data(), message.size())),
                         [&](absl::Status st) { read.set_value(st); });
    if (!read.get_future().get().ok()) message.clear();
  }
  (*conn)->Close();
  return message;
}

// RETURN frames: an answer to a return this agent did not ask for, and a sequence that is
// neither ask nor answer, are refused with an ERROR frame saying why.
TEST_F(SfbComeBackTest, AReturnFrameThisAgentCannotTakeIsRefusedSayingWhy) {
  EXPECT_THAT(RefusalOfFactorsFrame(*ctx_, transport::kFlagReturn, 1),
              ::testing::HasSubstr("rank 1 answers a return this agent did not ask for"));
  EXPECT_THAT(RefusalOfFactorsFrame(*ctx_, transport::kFlagReturn, 2),
              ::testing::HasSubstr("rank 1 sent a malformed RETURN frame (sequence 2"));
}

// A relayed FACTORS frame must name a third rank whose factors it passes on: one naming its
// sender or a rank beyond the world is refused with an ERROR frame saying why, and the
// connection closed.
TEST_F(SfbShrinkTest, RelayedFactorsNamingNoThirdRankAreRefusedSayingWhy) {
  for (const uint64_t origin : {uint64_t{1}, uint64_t{7}}) {
    EXPECT_THAT(RefusalOfFactorsFrame(*ctx_, transport::kFlagRelayed, origin),
                ::testing::HasSubstr(
                    absl::StrCat("rank 1 passes on factors of rank ", origin, " (of 2)")));
  }
}

// Elastic jobs (--min_workers): the all-reduce syncer goes on in a ring of the ranks left
// (allreduce_syncer.cc). Three ranks; the 100-element layer 3 by all-reduce.
class AllreduceShrinkTest : public SyncerTest {
 protected:
  uint32_t World() const override { return 3; }
  void Adjust(Rank& r) override { r.config.min_workers = 2; }

  void PostRing(uint32_t rank, uint64_t t) { Post(*ranks_[rank], 3, t, SyncerKind::kAllreduce); }

  // Rank `rank`'s layer 3 holds the exact sum of iteration t over the ranks `of`.
  void ExpectRingSum(uint32_t rank, uint64_t t, const std::vector<uint32_t>& of) {
    const float* g = ranks_[rank]->shm->Grad(3);
    for (uint64_t i = 0; i < 100; ++i) {
      float want = 0;
      for (uint32_t p : of) want += Value(p, t, 3, i);
      ASSERT_EQ(g[i], want) << "rank " << rank << " t " << t << " element " << i;
    }
  }

  // Rank 2 dies: its syncer (and its Gloo connections) go away; ranks 0 and 1 remove it.
  void KillRank2AndRemoveIt() {
    ranks_[2]->syncers.erase(SyncerKind::kAllreduce);
    for (uint32_t r : {0u, 1u}) ranks_[r]->syncers.at(SyncerKind::kAllreduce)->PeerRemoved(2);
  }
};

// Rank 2 dies before it posts iteration 2: the all-reduces of ranks 0 and 1 fail in the ring of
// three and go again, from the gradients they posted, in the ring of the two left.
TEST_F(AllreduceShrinkTest, AnAllreduceInARingThatLostARankGoesAgainInTheRingOfTheRanksLeft) {
  for (uint32_t r = 0; r < 3; ++r) PostRing(r, 1);
  for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
  for (uint32_t r = 0; r < 3; ++r) ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 1, {0, 1, 2}));
  PostRing(0, 2);
  PostRing(1, 2);
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_THAT(ranks_[0]->syncers.at(SyncerKind::kAllreduce)->Waiting(3, 2, {}),
              ::testing::HasSubstr("in the Gloo ring of 3 ranks (neighbours: ranks 2 and 1)"));
  KillRank2AndRemoveIt();
  for (uint32_t r : {0u, 1u}) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 2, {0, 1}));
  }
  for (uint32_t r : {0u, 1u}) PostRing(r, 3);
  for (uint32_t r : {0u, 1u}) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 3, {0, 1}));
  }
}

// Rank 1's all-reduce of iteration 2 breaks after ranks 0 and 2 completed it (its last receive
// failed), then rank 2 dies: in the ring of ranks 0 and 1, rank 0 hands its result of 2 (the sum
// over all three) to rank 1, and iteration 3 is the sum over the two — every rank ends every
// iteration with the same bits.
TEST_F(AllreduceShrinkTest, AResultSomeRanksCompletedBeforeTheRingBrokeIsHandedToTheOthers) {
  ranks_[1]->env.allreduce_fault = [](uint32_t, uint64_t t) {
    return t == 2 ? absl::UnavailableError("forged: the last receive broke")
                  : absl::OkStatus();
  };
  for (uint32_t r = 0; r < 3; ++r) PostRing(r, 1);
  for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
  for (uint32_t r = 0; r < 3; ++r) PostRing(r, 2);
  for (uint32_t r : {0u, 2u}) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 2, {0, 1, 2}));
  }
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_THAT(ranks_[1]->syncers.at(SyncerKind::kAllreduce)->Waiting(3, 2, {}),
              ::testing::HasSubstr("failed; waiting for the ring of the ranks left"));
  KillRank2AndRemoveIt();
  PostRing(0, 3);  // rank 0 is at 3: its first collective in the new ring says it has 2
  ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[1]));
  ASSERT_NO_FATAL_FAILURE(ExpectRingSum(1, 2, {0, 1, 2}));
  PostRing(1, 3);
  for (uint32_t r : {0u, 1u}) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 3, {0, 1}));
  }
}

// Four ranks; ranks 2 and 3 die. Rank 1 hears of both at once, rank 0 of rank 3 0.5 s later and
// of rank 2 0.5 s after that: rank 0's first ring (without rank 3) waits for rank 2, and leaves
// it for the ring without both once it hears, where rank 1 waits for it. Ranks 0 and 1 end in
// one ring of the two, their all-reduce the sum over the two.
class AllreduceShrinkOfFourTest : public AllreduceShrinkTest {
 protected:
  uint32_t World() const override { return 4; }
  void Adjust(Rank& r) override {
    r.config.min_workers = 2;
    r.config.sync_timeout = absl::Seconds(4);  // a ring that does not come fails in 8 s
  }
};

TEST_F(AllreduceShrinkOfFourTest, TwoRemovalsHeardInDifferentOrdersEndInOneRing) {
  for (uint32_t r = 0; r < 4; ++r) PostRing(r, 1);
  for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
  for (uint32_t r : {2u, 3u}) ranks_[r]->syncers.erase(SyncerKind::kAllreduce);
  Syncer& zero = *ranks_[0]->syncers.at(SyncerKind::kAllreduce);
  Syncer& one = *ranks_[1]->syncers.at(SyncerKind::kAllreduce);
  one.PeerRemoved(2);
  one.PeerRemoved(3);
  absl::SleepFor(absl::Milliseconds(500));
  zero.PeerRemoved(3);
  absl::SleepFor(absl::Milliseconds(500));  // rank 0's keeper waits in the ring without rank 3
  zero.PeerRemoved(2);
  PostRing(0, 2);
  PostRing(1, 2);
  for (uint32_t r : {0u, 1u}) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 2, {0, 1}));
  }
  EXPECT_THAT(zero.Waiting(3, 2, {}), ::testing::Not(::testing::HasSubstr("failed")));
}

// Two ranks, --min_workers 1: rank 1 dies while rank 0's all-reduce of iteration 2 waits for it;
// rank 0 goes on alone, each all-reduce its own gradient.
class AllreduceShrinkToOneTest : public AllreduceShrinkTest {
 protected:
  uint32_t World() const override { return 2; }
  void Adjust(Rank& r) override { r.config.min_workers = 1; }
};

TEST_F(AllreduceShrinkToOneTest, TheLastRankLeftGoesOnAlone) {
  for (uint32_t r = 0; r < 2; ++r) PostRing(r, 1);
  for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
  ASSERT_NO_FATAL_FAILURE(ExpectRingSum(0, 1, {0, 1}));
  PostRing(0, 2);
  ranks_[1]->syncers.erase(SyncerKind::kAllreduce);
  ranks_[0]->syncers.at(SyncerKind::kAllreduce)->PeerRemoved(1);
  for (uint64_t t = 2; t <= 3; ++t) {
    if (t > 2) PostRing(0, t);
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[0]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(0, t, {0}));
  }
}

// The world grows again: rank 2, removed, comes back. Its replacement (a new syncer, its agent
// started with --rejoin) asks the live agents where they are (ComeBack); they hold their
// all-reduces from the iteration after the highest they started until it names the iteration it
// takes up (Ready), run those below it in the ring of two and those from it in the ring of three.
class AllreduceComeBackTest : public AllreduceShrinkTest {
 protected:
  void Adjust(Rank& r) override {
    r.config.min_workers = 2;
    r.config.sync_timeout = absl::Seconds(10);
  }

  Syncer& Ring(uint32_t rank) { return *ranks_[rank]->syncers.at(SyncerKind::kAllreduce); }

  // Rank 2's replacement: a new syncer that asks to come back once ranks 0 and 1 heard of it;
  // the iteration it may take up from.
  absl::StatusOr<uint64_t> Replace2() {
    ranks_[2]->syncers[SyncerKind::kAllreduce] = MakeAllreduceSyncer(ranks_[2]->env);
    for (uint32_t r : {0u, 1u}) Ring(r).PeerReturning(2);
    return Ring(2).ComeBack(absl::Now() + absl::Seconds(20));
  }

  // Waits (at most 10 s) until `rank`'s collective of the ring layer's iteration `t` runs in its
  // ring: the replacement's question then finds that iteration started there.
  void AwaitRunning(uint32_t rank, uint64_t t) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    std::string waiting;
    while (absl::Now() < deadline) {
      waiting = Ring(rank).Waiting(3, t, {});
      if (absl::StrContains(waiting, "collectives in the ring") ||
          absl::StrContains(waiting, "failed; waiting for the ring")) {
        return;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    ADD_FAILURE() << "rank " << rank << "'s iteration " << t
                  << " never ran in its ring: " << waiting;
  }

  // The replacement takes up job iteration `from` (its process's iteration 1) and connects the
  // ring with the others (on a thread of its own: it waits for them; joined however the test
  // ends).
  std::jthread TakeUp(uint64_t from, absl::Status* ready) {
    ranks_[2]->env.clock_base = from - 1;
    return std::jthread([this, ready] { *ready = Ring(2).Ready(); });
  }
};

TEST_F(AllreduceComeBackTest, ARemovedRankComesBackIntoTheRingFromTheIterationItNames) {
  for (uint64_t t = 1; t <= 2; ++t) {
    for (uint32_t r = 0; r < 3; ++r) PostRing(r, t);
    for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
  }
  KillRank2AndRemoveIt();
  for (uint32_t r : {0u, 1u}) PostRing(r, 3);
  for (uint32_t r : {0u, 1u}) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 3, {0, 1}));
  }
  const absl::StatusOr<uint64_t> back = Replace2();
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, 4u);  // they started 3
  // Iteration 4 waits for the replacement's word; it takes up 5 (its KV servers' keys asked for
  // a later one, say): 4 goes in the ring of two, 5 on in the ring of three.
  for (uint32_t r : {0u, 1u}) PostRing(r, 4);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_THAT(Ring(0).Waiting(3, 4, {}),
              ::testing::HasSubstr("waiting for rank 2 coming back into the ring to name"));
  absl::Status ready;
  std::jthread taking_up = TakeUp(5, &ready);
  for (uint32_t r : {0u, 1u}) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 4, {0, 1}));
  }
  taking_up.join();
  ASSERT_TRUE(ready.ok()) << ready;
  for (uint64_t t = 5; t <= 6; ++t) {
    for (uint32_t r = 0; r < 3; ++r) PostRing(r, t);
    for (uint32_t r = 0; r < 3; ++r) {
      ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
      ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, t, {0, 1, 2}));
    }
  }
  // Told of that replacement again (an agent that registers later hears of every replacement
  // alive): it asked and came in, its question is answered — nothing to hold for.
  Ring(0).PeerReturning(2);
  absl::SleepFor(absl::Milliseconds(300));
  for (uint32_t r = 0; r < 3; ++r) PostRing(r, 7);
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 7, {0, 1, 2}));
  }
  // And it can leave again: the ring of the two left goes on.
  KillRank2AndRemoveIt();
  for (uint32_t r : {0u, 1u}) PostRing(r, 8);
  for (uint32_t r : {0u, 1u}) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 8, {0, 1}));
  }
}

// Rank 2 dies and its replacement comes before the others removed it (--rejoin_timeout): their
// ring broke with its predecessor, and rank 0 had completed iteration 2 before (rank 1's last
// receive broke). The replacement takes up 2, the highest completed: rank 0 hands its result
// over to rank 1 and to it in the new ring of three, and iteration 3 is the sum over all three.
TEST_F(AllreduceComeBackTest, ARankRejoiningBeforeItsRemovalGetsTheIterationSomeRankCompleted) {
  ranks_[1]->env.allreduce_fault = [](uint32_t, uint64_t t) {
    return t == 2 ? absl::UnavailableError("forged: the last receive broke") : absl::OkStatus();
  };
  for (uint32_t r = 0; r < 3; ++r) PostRing(r, 1);
  for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
  for (uint32_t r = 0; r < 3; ++r) PostRing(r, 2);
  ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[0]));
  ASSERT_NO_FATAL_FAILURE(ExpectRingSum(0, 2, {0, 1, 2}));
  ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[2]));
  ranks_[2]->syncers.erase(SyncerKind::kAllreduce);  // dies; nobody removes it
  PostRing(0, 3);
  const absl::StatusOr<uint64_t> back = Replace2();
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, 2u);
  absl::Status ready;
  TakeUp(*back, &ready).join();
  ASSERT_TRUE(ready.ok()) << ready;
  PostRing(2, 2);
  for (uint32_t r : {1u, 2u}) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 2, {0, 1, 2}));
  }
  for (uint32_t r : {1u, 2u}) PostRing(r, 3);
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 3, {0, 1, 2}));
  }
}

// Rank 2 dies and its replacement comes before the others removed it, but its KV servers had
// (their rejoin timeout ran out first; the replacement holds the rank now, so the coordinator's
// word that it died never reaches the others): its question says so, and the others' ring
// leaves it out first, as the servers' keys do — iteration 2 goes again in the ring of the two
// left — then answers; it comes back from the iteration after.
TEST_F(AllreduceComeBackTest, AReplacementItsServersRemovedIsLeftOutOfTheRingFirst) {
  for (uint32_t r = 0; r < 3; ++r) PostRing(r, 1);
  for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
  ranks_[2]->syncers.erase(SyncerKind::kAllreduce);  // dies; not removed by the others
  for (uint32_t r : {0u, 1u}) PostRing(r, 2);
  // Iteration 2 started in the old ring (it cannot complete there) before the question comes:
  // without this the question could come first, and the answer would be 2, not 3.
  for (uint32_t r : {0u, 1u}) ASSERT_NO_FATAL_FAILURE(AwaitRunning(r, 2));
  ranks_[2]->env.removed_by_servers = true;
  const absl::StatusOr<uint64_t> back = Replace2();  // answered once the ring left rank 2 out
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, 3u);
  // A live rank whose iteration 2 had not started in the old ring when the question came holds
  // it until the replacement names its first iteration (3): iteration 2 completes in the ring
  // of the two left once it did, not necessarily before.
  absl::Status ready;
  std::jthread taking_up = TakeUp(3, &ready);
  for (uint32_t r : {0u, 1u}) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 2, {0, 1}));
  }
  for (uint32_t r : {0u, 1u}) PostRing(r, 3);
  taking_up.join();
  ASSERT_TRUE(ready.ok()) << ready;
  PostRing(2, 3);
  for (uint32_t r = 0; r < 3; ++r) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 3, {0, 1, 2}));
  }
}

// A replacement that asked and is removed again before it named its iteration: the others go on
// in the ring they had.
TEST_F(AllreduceComeBackTest, AReplacementRemovedBeforeItTookUpTheJobIsNotWaitedFor) {
  for (uint32_t r = 0; r < 3; ++r) PostRing(r, 1);
  for (auto& r : ranks_) ASSERT_NO_FATAL_FAILURE(WaitAll(*r));
  KillRank2AndRemoveIt();
  ASSERT_TRUE(Replace2().ok());
  for (uint32_t r : {0u, 1u}) PostRing(r, 2);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_THAT(Ring(1).Waiting(3, 2, {}), ::testing::HasSubstr("waiting for rank 2 coming back"));
  for (uint32_t r : {0u, 1u}) Ring(r).PeerRemoved(2);
  for (uint32_t r : {0u, 1u}) {
    ASSERT_NO_FATAL_FAILURE(WaitAll(*ranks_[r]));
    ASSERT_NO_FATAL_FAILURE(ExpectRingSum(r, 2, {0, 1}));
  }
}

// A resumed job: a layer goes on from its keys' restored clock, which must agree. A rank
// rejoining a running job (rejoin_top: the highest completed clock of the job's keys): a layer
// there or one behind starts one below it (its first push is that clock, a retransmission where
// the key completed it); one further behind (not posted lately) goes on from its own.
TEST(RestoredClockTest, AResumedLayerGoesOnFromItsClockAndARejoiningRankFromTheJobsHighest) {
  SyncEnv env;
  const std::vector<PsChunk> current = {{1, 0, 8, 0}, {2, 8, 8, 1}};
  const std::vector<PsChunk> behind = {{3, 0, 8, 0}};
  const std::vector<PsChunk> stale = {{4, 0, 8, 1}};
  env.restored[1] = {7, 0};
  env.restored[2] = {7, 0};
  env.restored[3] = {6, 0};
  env.restored[4] = {2, 0};
  EXPECT_EQ(*RestoredClock(env, "current", current), 7u);
  EXPECT_EQ(*RestoredClock(env, "stale", stale), 2u);
  env.restored[2] = {6, 0};
  const absl::StatusOr<uint64_t> split = RestoredClock(env, "split", current);
  EXPECT_EQ(split.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(split.status().message().find("split: its keys were restored at clocks 7 and 6"),
            std::string::npos) << split.status();
  env.rejoin_top = 7;
  EXPECT_EQ(*RestoredClock(env, "split", current), 6u);
  EXPECT_EQ(*RestoredClock(env, "behind", behind), 6u);
  env.restored[2] = {7, 0};
  EXPECT_EQ(*RestoredClock(env, "current", current), 6u);
  EXPECT_EQ(*RestoredClock(env, "stale", stale), 2u);
  // A layer of its own iterations (PSD_LAYER_OWN_CLOCK) goes on from one below its own
  // clock, ahead of the job's or behind: its first post retransmits its last completed clock.
  env.restored[3] = {9, 0};
  EXPECT_EQ(*RestoredClock(env, "ahead", behind, /*own_clock=*/true), 8u);
  EXPECT_EQ(*RestoredClock(env, "stale", stale, /*own_clock=*/true), 1u);
  env.rejoin_top = 0;  // a job that has not completed a clock: from the start
  EXPECT_EQ(*RestoredClock(env, "current", current), 0u);
  env.restored[4] = {0, 0};
  EXPECT_EQ(*RestoredClock(env, "new", stale, /*own_clock=*/true), 0u);
}

}  // namespace
}  // namespace poseidon::agent
