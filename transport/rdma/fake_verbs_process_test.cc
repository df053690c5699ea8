// The test verbs provider between processes (fake_verbs.cc, "between processes"): this process
// and a fake_verbs_peer process, each with its own copy of the provider, connect RC queue pairs by
// GID and QP number and move bytes as an HCA would: a READ of the other process's registered
// region, SENDs delivered in order and answered, the rkey checked by the responder, completions
// in posting order, and a killed peer failing what is out there and what comes after.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "transport/rdma/fake_verbs_peer.h"

extern char** environ;

namespace {

namespace fv = poseidon::transport::fake_verbs;

constexpr size_t kBytes = size_t{1} << 20;
constexpr auto kWait = std::chrono::seconds(20);

uint8_t PatternAt(size_t i) { return static_cast<uint8_t>(i * 7 + 3); }

class FakeVerbsBetweenProcesses : public ::testing::Test {
 protected:
  void SetUp() override {
    int to_peer[2], from_peer[2];
    ASSERT_EQ(::pipe(to_peer), 0);
    ASSERT_EQ(::pipe(from_peer), 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_peer[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&actions, from_peer[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, to_peer[1]);
    posix_spawn_file_actions_addclose(&actions, from_peer[0]);
    char* argv[] = {const_cast<char*>(FAKE_VERBS_PEER), nullptr};
    ASSERT_EQ(posix_spawn(&peer_, FAKE_VERBS_PEER, &actions, nullptr, argv, environ), 0);
    posix_spawn_file_actions_destroy(&actions);
    ::close(to_peer[0]);
    ::close(from_peer[1]);
    to_peer_ = ::fdopen(to_peer[1], "w");
    from_peer_ = ::fdopen(from_peer[0], "r");
    ASSERT_TRUE(to_peer_ != nullptr && from_peer_ != nullptr);

    unsigned long long addr = 0;
    size_t bytes = 0;
    char gid_hex[64] = {};
    ASSERT_EQ(std::fscanf(from_peer_, "%u %63s %llu %u %zu", &peer_qpn_, gid_hex, &addr,
                          &peer_rkey_, &bytes),
              5)
        << "the peer process printed no address";
    peer_addr_ = addr;
    ASSERT_EQ(bytes, kBytes);

    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    ASSERT_TRUE(list != nullptr && n >= 1);
    ctx_ = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    ASSERT_NE(ctx_, nullptr);
    pd_ = ibv_alloc_pd(ctx_);
    buffer_.assign(kBytes, 0);
    const int local = IBV_ACCESS_LOCAL_WRITE;  // an int: verbs.h's macro tests it against an enum
    mr_ = ibv_reg_mr(pd_, buffer_.data(), buffer_.size(), local);
    ASSERT_NE(mr_, nullptr);
    cq_ = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
    ASSERT_NE(cq_, nullptr);
    ibv_qp_init_attr init{};
    init.send_cq = cq_;
    init.recv_cq = cq_;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = 16;
    init.cap.max_recv_wr = 16;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    qp_ = ibv_create_qp(pd_, &init);
    ASSERT_NE(qp_, nullptr);
    ASSERT_EQ(fv::ToInit(qp_, 0), 0);
    ibv_gid gid{};
    ASSERT_EQ(ibv_query_gid(ctx_, 1, 0, &gid), 0);
    std::fprintf(to_peer_, "%u %s\n", qp_->qp_num, fv::GidHex(gid).c_str());
    std::fflush(to_peer_);
    ibv_gid peer_gid{};
    ASSERT_TRUE(fv::ParseGidHex(gid_hex, &peer_gid)) << gid_hex;
    ASSERT_EQ(fv::ToRts(qp_, peer_qpn_, peer_gid), 0);
    char ready[16] = {};
    ASSERT_EQ(std::fscanf(from_peer_, "%15s", ready), 1);
    ASSERT_STREQ(ready, "ready");
  }

  void TearDown() override {
    if (to_peer_ != nullptr) std::fclose(to_peer_);  // the peer exits when its stdin closes
    if (from_peer_ != nullptr) std::fclose(from_peer_);
    if (peer_ > 0) {
      int status = 0;
      ::waitpid(peer_, &status, 0);
    }
    if (qp_ != nullptr) ibv_destroy_qp(qp_);
    if (cq_ != nullptr) ibv_destroy_cq(cq_);
    if (mr_ != nullptr) ibv_dereg_mr(mr_);
    if (pd_ != nullptr) ibv_dealloc_pd(pd_);
    if (ctx_ != nullptr) ibv_close_device(ctx_);
  }

  // A signaled SEND of buffer_[offset, +length), or a READ into it of the peer's region at the
  // same offset.
  void Post(ibv_wr_opcode opcode, uint64_t wr_id, uint64_t offset, uint32_t length,
            uint32_t rkey = 0) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buffer_.data() + offset), length, mr_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.send_flags = IBV_SEND_SIGNALED;
    if (opcode == IBV_WR_RDMA_READ) {
      wr.wr.rdma.remote_addr = peer_addr_ + offset;
      wr.wr.rdma.rkey = rkey;
    }
    ibv_send_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_send(qp_, &wr, &bad), 0);
  }
  void PostRead(uint64_t wr_id, uint64_t offset, uint32_t length, uint32_t rkey) {
    Post(IBV_WR_RDMA_READ, wr_id, offset, length, rkey);
  }
  void PostSend(uint64_t wr_id, uint64_t offset, uint32_t length) {
    Post(IBV_WR_SEND, wr_id, offset, length);
  }

  void PostRecv(uint64_t wr_id, uint64_t offset, uint32_t length) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buffer_.data() + offset), length, mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_recv(qp_, &wr, &bad), 0);
  }

  // The next `n` completions, in the order the CQ gives them (fewer when kWait passes).
  std::vector<ibv_wc> Completions(size_t n) {
    std::vector<ibv_wc> out;
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    while (out.size() < n && std::chrono::steady_clock::now() < deadline) {
      ibv_wc wc{};
      if (ibv_poll_cq(cq_, 1, &wc) == 1) {
        out.push_back(wc);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    EXPECT_EQ(out.size(), n) << "completions missing after " << kWait.count() << " s";
    return out;
  }

  pid_t peer_ = -1;
  FILE* to_peer_ = nullptr;
  FILE* from_peer_ = nullptr;
  uint32_t peer_qpn_ = 0;
  uint32_t peer_rkey_ = 0;
  uint64_t peer_addr_ = 0;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_mr* mr_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  std::vector<uint8_t> buffer_;
};

TEST_F(FakeVerbsBetweenProcesses, AReadMovesTheOtherProcesssRegisteredBytes) {
  PostRead(7, 0, static_cast<uint32_t>(kBytes), peer_rkey_);
  auto wc = Completions(1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc[0].status);
  EXPECT_EQ(wc[0].wr_id, 7u);
  EXPECT_EQ(wc[0].opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(wc[0].byte_len, kBytes);
  size_t wrong = 0;
  for (size_t i = 0; i < kBytes; ++i) wrong += buffer_[i] != PatternAt(i);
  EXPECT_EQ(wrong, 0u) << "bytes that differ from the peer's region";
}

TEST_F(FakeVerbsBetweenProcesses, SendsArriveInOrderAndCompleteInPostingOrder) {
  // The peer answers each SEND with the same bytes; a READ posted between the SENDs completes
  // between their completions (RC: a send queue completes in posting order).
  for (uint64_t i = 0; i < 3; ++i) PostRecv(100 + i, 8192 + i * 4096, 4096);
  for (uint64_t i = 0; i < 3; ++i) {
    std::memset(buffer_.data() + i * 1024, static_cast<int>('a' + i), 1000);
  }
  PostSend(1, 0, 1000);
  PostRead(2, 65536, 262144, peer_rkey_);
  PostSend(3, 1024, 1000);
  PostSend(4, 2048, 1000);
  auto wc = Completions(7);
  std::vector<uint64_t> sends, recvs;
  for (const ibv_wc& w : wc) {
    EXPECT_EQ(w.status, IBV_WC_SUCCESS) << w.wr_id << ": " << ibv_wc_status_str(w.status);
    (w.opcode == IBV_WC_RECV ? recvs : sends).push_back(w.wr_id);
  }
  EXPECT_EQ(sends, (std::vector<uint64_t>{1, 2, 3, 4}));
  EXPECT_EQ(recvs, (std::vector<uint64_t>{100, 101, 102}));
  for (uint64_t i = 0; i < 3; ++i) {
    const uint8_t* echoed = buffer_.data() + 8192 + i * 4096;
    EXPECT_EQ(echoed[0], 'a' + i);
    EXPECT_EQ(echoed[999], 'a' + i);
  }
  EXPECT_EQ(buffer_[65536 + 5], PatternAt(65536 + 5));
}

TEST_F(FakeVerbsBetweenProcesses, ABadRkeyIsARemoteAccessErrorAndWhatFollowsIsFlushed) {
  PostRead(1, 0, 4096, peer_rkey_ ^ 0x100);
  auto wc = Completions(1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_REM_ACCESS_ERR) << ibv_wc_status_str(wc[0].status);
  PostRead(2, 0, 4096, peer_rkey_);  // valid, but the QP is in the error state now
  wc = Completions(1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_WR_FLUSH_ERR) << ibv_wc_status_str(wc[0].status);
  EXPECT_EQ(buffer_[5], 0) << "a refused READ moved bytes";
}

TEST_F(FakeVerbsBetweenProcesses, AKilledPeerProcessIsRetryExceeded) {
  PostRead(1, 0, 4096, peer_rkey_);  // the stream to the peer is up
  auto first = Completions(1);
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(first[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(first[0].status);
  ASSERT_EQ(::kill(peer_, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(peer_, &status, 0), peer_);
  peer_ = -1;
  PostRead(2, 0, 4096, peer_rkey_);
  auto wc = Completions(1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(wc[0].status);
}

}  // namespace
