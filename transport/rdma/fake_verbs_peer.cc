// A second process on the test verbs provider's fabric, for fake_verbs_process_test.cc. Opens the
// first device, registers a pattern region (remote read) and receive buffers, creates an RC queue
// pair and prints "<qpn> <gid hex> <pattern address> <rkey> <pattern bytes>"; reads the test's
// "<qpn> <gid hex>" from stdin, connects (INIT, RTR, RTS with rnr_retry 7) and prints "ready";
// then answers every SEND it receives with a SEND of the same bytes, until stdin closes.
// Exit codes: 0 stdin closed, 2 a verbs call failed (named on stderr), 3 bad input.
#include <infiniband/verbs.h>
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "transport/rdma/fake_verbs_peer.h"

namespace {

namespace fv = poseidon::transport::fake_verbs;

constexpr int kSlots = 16;
constexpr size_t kSlotBytes = 4096;
constexpr size_t kPatternBytes = size_t{1} << 20;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "fake_verbs_peer: %s failed\n", what);
  std::exit(2);
}

}  // namespace

int main() {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr || n < 1) Die("ibv_get_device_list");
  ibv_context* ctx = ibv_open_device(list[0]);
  if (ctx == nullptr) Die("ibv_open_device");
  ibv_pd* pd = ibv_alloc_pd(ctx);
  if (pd == nullptr) Die("ibv_alloc_pd");
  std::vector<uint8_t> pattern(kPatternBytes);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 7 + 3);
  ibv_mr* pattern_mr = ibv_reg_mr(pd, pattern.data(), pattern.size(),
                                  IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  std::vector<char> recv(kSlots * kSlotBytes), send(kSlots * kSlotBytes);
  const int local = IBV_ACCESS_LOCAL_WRITE;  // an int: verbs.h's macro tests it against an enum
  ibv_mr* recv_mr = ibv_reg_mr(pd, recv.data(), recv.size(), local);
  ibv_mr* send_mr = ibv_reg_mr(pd, send.data(), send.size(), local);
  if (pattern_mr == nullptr || recv_mr == nullptr || send_mr == nullptr) Die("ibv_reg_mr");
  ibv_cq* cq = ibv_create_cq(ctx, 4 * kSlots, nullptr, nullptr, 0);
  if (cq == nullptr) Die("ibv_create_cq");
  ibv_qp_init_attr init{};
  init.send_cq = cq;
  init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = kSlots;
  init.cap.max_recv_wr = kSlots;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(pd, &init);
  if (qp == nullptr) Die("ibv_create_qp");
  if (fv::ToInit(qp, IBV_ACCESS_REMOTE_READ) != 0) Die("INIT");
  auto post_recv = [&](int slot) {
    ibv_sge sge{reinterpret_cast<uint64_t>(recv.data() + slot * kSlotBytes),
                static_cast<uint32_t>(kSlotBytes), recv_mr->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = static_cast<uint64_t>(slot);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (ibv_post_recv(qp, &wr, &bad) != 0) Die("ibv_post_recv");
  };
  for (int i = 0; i < kSlots; ++i) post_recv(i);
  ibv_gid gid{};
  if (ibv_query_gid(ctx, 1, 0, &gid) != 0) Die("ibv_query_gid");
  std::printf("%u %s %llu %u %zu\n", qp->qp_num, fv::GidHex(gid).c_str(),
              static_cast<unsigned long long>(reinterpret_cast<uint64_t>(pattern.data())),
              pattern_mr->rkey, pattern.size());
  std::fflush(stdout);

  unsigned peer_qpn = 0;
  char peer_gid_hex[64] = {};
  if (std::scanf("%u %63s", &peer_qpn, peer_gid_hex) != 2) return 3;
  ibv_gid peer_gid{};
  if (!fv::ParseGidHex(peer_gid_hex, &peer_gid)) return 3;
  if (fv::ToRts(qp, peer_qpn, peer_gid) != 0) Die("RTR/RTS");
  std::printf("ready\n");
  std::fflush(stdout);

  int next_send = 0;
  for (;;) {
    pollfd in{STDIN_FILENO, POLLIN, 0};
    if (::poll(&in, 1, 1) > 0) {
      char c;
      if (::read(STDIN_FILENO, &c, 1) <= 0) return 0;  // the test closed stdin: done
    }
    ibv_wc wc[8];
    const int got = ibv_poll_cq(cq, 8, wc);
    for (int i = 0; i < got; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS || wc[i].opcode != IBV_WC_RECV) continue;
      const int slot = static_cast<int>(wc[i].wr_id);
      char* out = send.data() + next_send * kSlotBytes;
      std::memcpy(out, recv.data() + slot * kSlotBytes, wc[i].byte_len);
      next_send = (next_send + 1) % kSlots;
      post_recv(slot);
      ibv_sge sge{reinterpret_cast<uint64_t>(out), wc[i].byte_len, send_mr->lkey};
      ibv_send_wr wr{};
      wr.wr_id = 1000 + static_cast<uint64_t>(slot);
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_SEND;
      wr.send_flags = IBV_SEND_SIGNALED;
      ibv_send_wr* bad = nullptr;
      if (ibv_post_send(qp, &wr, &bad) != 0) Die("ibv_post_send");
    }
  }
}
