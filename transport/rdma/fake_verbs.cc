// The test verbs provider: see fake_verbs.h. Defines the exported ibv_* functions of libibverbs
// that the RDMA backend calls (so a test executable links this instead of -libverbs, or a daemon
// loads it as libibverbs.so.1) and fills ibv_context::ops for the inline ibv_post_send /
// ibv_post_recv / ibv_poll_cq / ibv_req_notify_cq. The emulated fabric is process-global by
// necessity (the verbs API has no handle to pass one in); it is the only global, and only in test
// executables and the test library.
//
// Between processes (the daemons of a multi-process test, each loading the provider): every
// process listens on the abstract unix socket "poseidon-fake-verbs-<pid>" and its GIDs carry its
// pid, so a QP whose destination GID names another process sends its work requests there over one
// stream per process pair (in posting order: RC's ordering). The responder applies the same checks
// as in process (QP state and peer, receives, rkeys) and answers each request; the requester
// completes its work requests in posting order when the answers arrive. A peer process that dies
// breaks the stream: its outstanding work requests complete with "retry exceeded", as a real HCA's
// do once its transport retries run out.
#include "transport/rdma/fake_verbs.h"

#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// verbs.h turns these into inline wrappers; the exported functions are defined below.
#undef ibv_query_port
#undef ibv_reg_mr

namespace poseidon::transport::fake_verbs {
namespace {

constexpr int kMaxDevices = 4;
constexpr uint32_t kMaxWr = 16384;
constexpr uint32_t kMaxSge = 32;
constexpr int kMaxRdAtomic = 16;

struct FakeMr {
  ibv_mr mr{};
  int access = 0;
};

struct FakeChannel {
  ibv_comp_channel ch{};
  std::deque<ibv_cq*> events;
};

struct FakeCq {
  ibv_cq cq{};
  std::deque<ibv_wc> entries;
  bool armed = false;
};

struct PendingRecv {
  uint64_t wr_id = 0;
  std::vector<ibv_sge> sges;
};

// One stream to another process (see the file comment). A writer thread sends what Enqueue
// queued, in order; a reader thread reads and handles what arrives. Neither holds the fabric's
// mutex while it waits on the socket, and the fabric's mutex is taken before a link's (Enqueue
// under it), never after: two processes' streams cannot wait on each other.
struct Link {
  Link(int fd_in, uint32_t peer_in) : fd(fd_in), peer(peer_in) {}
  ~Link() { ::close(fd); }
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  void Enqueue(std::vector<char> bytes) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (closed) return;  // broken: its requests are failed by LinkBroken
      queue.push_back(std::move(bytes));
    }
    cv.notify_one();
  }
  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu);
      closed = true;
    }
    cv.notify_all();
    ::shutdown(fd, SHUT_RDWR);
  }

  const int fd;
  const uint32_t peer;  // the peer's pid on a stream this process opened; 0 on an accepted one
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::vector<char>> queue;
  bool closed = false;
};

// A SEND waiting at its destination for a receive (a real HCA retries: rnr_retry 7 = forever).
// From a QP of this process (`origin` null) or of another one (answered on `origin`).
struct WaitingSend {
  uint32_t from_qpn = 0;
  uint64_t wr_id = 0;
  bool signaled = false;
  std::vector<char> data;
  std::shared_ptr<Link> origin;
  uint64_t origin_id = 0;
};

// A work request sent to another process, completed when its answer arrives (or its stream
// breaks); completions leave in posting order.
struct Outstanding {
  uint64_t id = 0;
  uint64_t wr_id = 0;
  bool read = false;
  bool signaled = false;
  bool drop_completion = false;  // injected: the completion never appears
  bool half = false;             // injected: the QP breaks with half a READ landed
  std::vector<ibv_sge> sges;
  uint64_t total = 0;
  const Link* link = nullptr;
  bool done = false;
  ibv_wc_status status = IBV_WC_SUCCESS;
};

struct FakeQp {
  ibv_qp qp{};
  ibv_qp_cap cap{};
  bool sq_sig_all = false;
  uint32_t dest_qpn = 0;
  uint32_t dest_pid = 0;  // the destination's process when not this one (from its GID)
  uint8_t rnr_retry = 0;
  std::deque<PendingRecv> recvs;
  std::deque<WaitingSend> waiting;
  std::deque<Outstanding> outstanding;
};

struct ArmedFault {
  bool armed = false;
  bool fired = false;
  Fault fault = Fault::kDropCompletion;
  WorkKind kind = WorkKind::kSend;
  int skip = 0;
};

struct Fabric {
  std::mutex mu;
  int device_count = 1;
  ibv_device devices[kMaxDevices]{};
  std::map<uint32_t, FakeQp*> qps;
  std::map<uint32_t, FakeMr*> mrs;  // by key (lkey == rkey)
  uint32_t next_qpn = 0x111;
  uint32_t next_key = 0x2a01;
  ArmedFault fault;
  Counters counters;
  // Between processes: the stream to each peer process this one sends work requests on, and
  // which local QP each outstanding request id belongs to.
  std::map<uint32_t, std::shared_ptr<Link>> out_links;
  std::map<uint64_t, uint32_t> outstanding_qpn;
  uint64_t next_request_id = 1;

  Fabric();
};

// POSEIDON_FAKE_VERBS_FAULT="<fault>:<send|read>:<skip>" arms a fault in a process that cannot
// call InjectFault (a daemon loading the provider as libibverbs.so.1); <fault> is drop_completion,
// rnr_retry_exceeded, qp_error or remote_access_error. POSEIDON_FAKE_VERBS_DEVICES sets the
// device count (0 to 4). A bad value ends the process with a message: a test that meant to
// inject a fault must not pass without one.
void ConfigureFromEnvironment(int* device_count, ArmedFault* fault) {
  if (const char* devices = std::getenv("POSEIDON_FAKE_VERBS_DEVICES")) {
    char* end = nullptr;
    const long n = std::strtol(devices, &end, 10);
    if (end == devices || *end != '\0' || n < 0 || n > kMaxDevices) {
      std::fprintf(stderr, "fake verbs: POSEIDON_FAKE_VERBS_DEVICES=%s is not a count in [0, %d]\n",
                   devices, kMaxDevices);
      std::_Exit(2);
    }
    *device_count = static_cast<int>(n);
  }
  const char* spec = std::getenv("POSEIDON_FAKE_VERBS_FAULT");
  if (spec == nullptr || *spec == '\0') return;
  char name[32] = {}, kind[8] = {};
  int skip = -1, used = 0;
  static const std::pair<const char*, Fault> kFaults[] = {
      {"drop_completion", Fault::kDropCompletion},
      {"rnr_retry_exceeded", Fault::kRnrRetryExceeded},
      {"qp_error", Fault::kQpErrorMidTransfer},
      {"remote_access_error", Fault::kRemoteAccessError}};
  bool ok = std::sscanf(spec, "%31[a-z_]:%7[a-z]:%d%n", name, kind, &skip, &used) == 3 &&
            spec[used] == '\0' && skip >= 0 &&
            (std::strcmp(kind, "send") == 0 || std::strcmp(kind, "read") == 0);
  bool known = false;
  for (const auto& [fault_name, value] : kFaults) {
    if (ok && std::strcmp(name, fault_name) == 0) {
      *fault = ArmedFault{true, false, value,
                          std::strcmp(kind, "read") == 0 ? WorkKind::kRead : WorkKind::kSend, skip};
      known = true;
    }
  }
  if (!known) {
    std::fprintf(stderr,
                 "fake verbs: POSEIDON_FAKE_VERBS_FAULT=%s is not <drop_completion|"
                 "rnr_retry_exceeded|qp_error|remote_access_error>:<send|read>:<skip>\n",
                 spec);
    std::_Exit(2);
  }
}

Fabric::Fabric() {
  for (int i = 0; i < kMaxDevices; ++i) {
    ibv_device& d = devices[i];
    d.node_type = IBV_NODE_CA;
    d.transport_type = IBV_TRANSPORT_IB;
    std::snprintf(d.name, sizeof d.name, "fake_rxe%d", i);
    std::snprintf(d.dev_name, sizeof d.dev_name, "uverbs%d", i);
  }
  ConfigureFromEnvironment(&device_count, &fault);
}

Fabric& TheFabric() {
  static Fabric* fabric = new Fabric();  // never destroyed: QPs may outlive static destructors
  return *fabric;
}

FakeQp* AsQp(ibv_qp* qp) { return reinterpret_cast<FakeQp*>(qp); }
FakeCq* AsCq(ibv_cq* cq) { return reinterpret_cast<FakeCq*>(cq); }

// ---- everything below runs with the fabric's mutex held ----

void PushWc(Fabric& f, ibv_cq* cq_base, const ibv_wc& wc) {
  FakeCq* cq = AsCq(cq_base);
  cq->entries.push_back(wc);
  if (wc.status != IBV_WC_SUCCESS) ++f.counters.error_completions;
  if (cq->armed && cq->cq.channel != nullptr) {
    cq->armed = false;
    auto* channel = reinterpret_cast<FakeChannel*>(cq->cq.channel);
    channel->events.push_back(cq_base);
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(channel->ch.fd, &one, sizeof one);
    ++f.counters.events;
  }
}

ibv_wc MakeWc(uint64_t wr_id, ibv_wc_status status, ibv_wc_opcode opcode, uint32_t qpn,
              uint32_t byte_len) {
  ibv_wc wc{};
  wc.wr_id = wr_id;
  wc.status = status;
  wc.opcode = opcode;
  wc.qp_num = qpn;
  wc.byte_len = byte_len;
  return wc;
}

void FailWaitingSends(Fabric& f, FakeQp* dest);
void Answer(const std::shared_ptr<Link>& link, uint64_t id, ibv_wc_status status,
            const char* data = nullptr, uint64_t length = 0);
void PostRemote(Fabric& f, FakeQp* qp, ibv_send_wr* wr, bool signaled);

// The QP enters the error state: posted receives are flushed.
void SetError(Fabric& f, FakeQp* qp) {
  qp->qp.state = IBV_QPS_ERR;
  while (!qp->recvs.empty()) {
    PushWc(f, qp->qp.recv_cq,
           MakeWc(qp->recvs.front().wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, qp->qp.qp_num, 0));
    qp->recvs.pop_front();
  }
  FailWaitingSends(f, qp);
}

// Senders waiting at `dest` for a receive give up (the destination is gone or broken).
void FailWaitingSends(Fabric& f, FakeQp* dest) {
  while (!dest->waiting.empty()) {
    WaitingSend w = std::move(dest->waiting.front());
    dest->waiting.pop_front();
    if (w.origin) {
      Answer(w.origin, w.origin_id, IBV_WC_RETRY_EXC_ERR);
      continue;
    }
    auto it = f.qps.find(w.from_qpn);
    if (it == f.qps.end()) continue;
    FakeQp* from = it->second;
    PushWc(f, from->qp.send_cq,
           MakeWc(w.wr_id, IBV_WC_RETRY_EXC_ERR, IBV_WC_SEND, from->qp.qp_num, 0));
    if (from->qp.state != IBV_QPS_ERR) SetError(f, from);
  }
}

// The memory region behind `key` when [addr, addr+len) lies inside it with `access`.
FakeMr* FindMr(Fabric& f, uint32_t key, uint64_t addr, uint64_t len, int access) {
  auto it = f.mrs.find(key);
  if (it == f.mrs.end()) return nullptr;
  FakeMr* mr = it->second;
  const auto start = reinterpret_cast<uint64_t>(mr->mr.addr);
  if (addr < start || addr + len > start + mr->mr.length || addr + len < addr) return nullptr;
  if ((mr->access & access) != access) return nullptr;
  return mr;
}

bool LocalSgesValid(Fabric& f, const ibv_sge* sges, int n, bool write) {
  for (int i = 0; i < n; ++i) {
    if (FindMr(f, sges[i].lkey, sges[i].addr, sges[i].length, write ? IBV_ACCESS_LOCAL_WRITE : 0) ==
        nullptr) {
      return false;
    }
  }
  return true;
}

bool IsReady(const FakeQp* qp) {
  return qp->qp.state == IBV_QPS_RTR || qp->qp.state == IBV_QPS_RTS;
}

// Delivers `data` into the next posted receive of `dest`. False when the receive is too small
// (both ends then see the error, as on a real fabric).
bool Deliver(Fabric& f, FakeQp* dest, uint32_t from_qpn, const std::vector<char>& data) {
  PendingRecv recv = std::move(dest->recvs.front());
  dest->recvs.pop_front();
  size_t capacity = 0;
  for (const auto& s : recv.sges) capacity += s.length;
  if (capacity < data.size()) {
    PushWc(f, dest->qp.recv_cq,
           MakeWc(recv.wr_id, IBV_WC_LOC_LEN_ERR, IBV_WC_RECV, dest->qp.qp_num, 0));
    SetError(f, dest);
    return false;
  }
  size_t at = 0;
  for (const auto& s : recv.sges) {
    const size_t n = std::min<size_t>(s.length, data.size() - at);
    if (n > 0) std::memcpy(reinterpret_cast<void*>(s.addr), data.data() + at, n);
    at += n;
  }
  ibv_wc wc = MakeWc(recv.wr_id, IBV_WC_SUCCESS, IBV_WC_RECV, dest->qp.qp_num,
                     static_cast<uint32_t>(data.size()));
  wc.src_qp = from_qpn;
  PushWc(f, dest->qp.recv_cq, wc);
  return true;
}

// Whether the armed fault applies to this work request (and consumes it if so).
bool TakeFault(Fabric& f, WorkKind kind, Fault* fault) {
  ArmedFault& a = f.fault;
  if (!a.armed || a.kind != kind) return false;
  if (a.skip > 0) {
    --a.skip;
    return false;
  }
  a.armed = false;
  a.fired = true;
  *fault = a.fault;
  return true;
}

int FakePostSend(ibv_qp* qp_base, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  FakeQp* qp = AsQp(qp_base);
  for (; wr != nullptr; wr = wr->next) {
    const bool read = wr->opcode == IBV_WR_RDMA_READ;
    const ibv_wc_opcode wc_opcode = read ? IBV_WC_RDMA_READ : IBV_WC_SEND;
    const bool signaled = qp->sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED) != 0;
    if (qp->qp.state == IBV_QPS_ERR && qp->outstanding.empty()) {
      PushWc(f, qp->qp.send_cq, MakeWc(wr->wr_id, IBV_WC_WR_FLUSH_ERR, wc_opcode, qp->qp.qp_num, 0));
      continue;
    }
    if (qp->qp.state != IBV_QPS_ERR &&
        (qp->qp.state != IBV_QPS_RTS || (wr->opcode != IBV_WR_SEND && !read) || wr->num_sge < 0 ||
         static_cast<uint32_t>(wr->num_sge) > qp->cap.max_send_sge)) {
      *bad_wr = wr;
      return EINVAL;
    }
    // To another process, or flushed behind work requests still out there (completions leave
    // in posting order).
    if (qp->dest_pid != 0 || qp->qp.state == IBV_QPS_ERR) {
      PostRemote(f, qp, wr, signaled);
      continue;
    }
    Fault fault{};
    const bool faulty = TakeFault(f, read ? WorkKind::kRead : WorkKind::kSend, &fault);
    uint64_t total = 0;
    for (int i = 0; i < wr->num_sge; ++i) total += wr->sg_list[i].length;
    ibv_wc_status status = IBV_WC_SUCCESS;
    auto it = f.qps.find(qp->dest_qpn);
    FakeQp* dest = it == f.qps.end() ? nullptr : it->second;
    bool deferred = false;  // a SEND waiting at the destination for a receive
    if (dest == nullptr || !IsReady(dest)) {
      status = IBV_WC_RETRY_EXC_ERR;  // nobody answers: the transport retries run out
    } else if (!LocalSgesValid(f, wr->sg_list, wr->num_sge, /*write=*/read)) {
      status = IBV_WC_LOC_PROT_ERR;
    } else if (faulty && fault == Fault::kQpErrorMidTransfer && !read) {
      status = IBV_WC_WR_FLUSH_ERR;
    } else if (faulty && fault == Fault::kRnrRetryExceeded && !read) {
      status = IBV_WC_RNR_RETRY_EXC_ERR;
    } else if (!read) {
      std::vector<char> data;
      data.reserve(total);
      for (int i = 0; i < wr->num_sge; ++i) {
        const char* p = reinterpret_cast<const char*>(wr->sg_list[i].addr);
        data.insert(data.end(), p, p + wr->sg_list[i].length);
      }
      ++f.counters.sends;
      if ((dest->recvs.empty() || !dest->waiting.empty()) && qp->rnr_retry == 7) {
        dest->waiting.push_back({qp->qp.qp_num, wr->wr_id, signaled, std::move(data), nullptr, 0});
        deferred = true;
      } else if (dest->recvs.empty()) {
        status = IBV_WC_RNR_RETRY_EXC_ERR;
      } else if (!Deliver(f, dest, qp->qp.qp_num, data)) {
        status = IBV_WC_REM_INV_REQ_ERR;
      }
    } else {
      uint32_t rkey = wr->wr.rdma.rkey;
      if (faulty && fault == Fault::kRemoteAccessError) rkey ^= 0x00a5a500u;
      FakeMr* remote = FindMr(f, rkey, wr->wr.rdma.remote_addr, total, IBV_ACCESS_REMOTE_READ);
      if (remote == nullptr) {
        status = IBV_WC_REM_ACCESS_ERR;
      } else {
        // A QP error mid-transfer: half the bytes have landed when the QP breaks.
        const uint64_t move = faulty && fault == Fault::kQpErrorMidTransfer ? total / 2 : total;
        const char* from = reinterpret_cast<const char*>(wr->wr.rdma.remote_addr);
        uint64_t done = 0;
        for (int i = 0; i < wr->num_sge && done < move; ++i) {
          const uint64_t n = std::min<uint64_t>(wr->sg_list[i].length, move - done);
          std::memcpy(reinterpret_cast<void*>(wr->sg_list[i].addr), from + done, n);
          done += n;
        }
        ++f.counters.reads;
        f.counters.read_bytes += move;
        if (move != total) status = IBV_WC_WR_FLUSH_ERR;
      }
    }
    if (deferred) continue;
    if (status != IBV_WC_SUCCESS) {
      PushWc(f, qp->qp.send_cq, MakeWc(wr->wr_id, status, wc_opcode, qp->qp.qp_num, 0));
      SetError(f, qp);
      continue;
    }
    if (signaled && !(faulty && fault == Fault::kDropCompletion)) {
      PushWc(f, qp->qp.send_cq,
             MakeWc(wr->wr_id, IBV_WC_SUCCESS, wc_opcode, qp->qp.qp_num,
                    static_cast<uint32_t>(total)));
    }
  }
  return 0;
}

int FakePostRecv(ibv_qp* qp_base, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  FakeQp* qp = AsQp(qp_base);
  for (; wr != nullptr; wr = wr->next) {
    if (qp->qp.state == IBV_QPS_RESET || wr->num_sge < 0 ||
        static_cast<uint32_t>(wr->num_sge) > qp->cap.max_recv_sge ||
        qp->recvs.size() >= qp->cap.max_recv_wr ||
        !LocalSgesValid(f, wr->sg_list, wr->num_sge, /*write=*/true)) {
      *bad_wr = wr;
      return qp->qp.state == IBV_QPS_RESET ? EINVAL : ENOMEM;
    }
    if (qp->qp.state == IBV_QPS_ERR) {
      PushWc(f, qp->qp.recv_cq, MakeWc(wr->wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, qp->qp.qp_num, 0));
      continue;
    }
    PendingRecv recv;
    recv.wr_id = wr->wr_id;
    recv.sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
    qp->recvs.push_back(std::move(recv));
    ++f.counters.receives_posted;
  }
  // Senders that were retrying for a receive get through now, in order.
  while (!qp->waiting.empty() && !qp->recvs.empty() && IsReady(qp)) {
    WaitingSend w = std::move(qp->waiting.front());
    qp->waiting.pop_front();
    const bool ok = Deliver(f, qp, w.from_qpn, w.data);
    if (w.origin) {
      Answer(w.origin, w.origin_id, ok ? IBV_WC_SUCCESS : IBV_WC_REM_INV_REQ_ERR);
      continue;
    }
    auto it = f.qps.find(w.from_qpn);
    FakeQp* from = it == f.qps.end() ? nullptr : it->second;
    if (from == nullptr) continue;
    if (!ok) {
      PushWc(f, from->qp.send_cq,
             MakeWc(w.wr_id, IBV_WC_REM_INV_REQ_ERR, IBV_WC_SEND, from->qp.qp_num, 0));
      SetError(f, from);
    } else if (w.signaled) {
      PushWc(f, from->qp.send_cq,
             MakeWc(w.wr_id, IBV_WC_SUCCESS, IBV_WC_SEND, from->qp.qp_num,
                    static_cast<uint32_t>(w.data.size())));
    }
  }
  return 0;
}

int FakePollCq(ibv_cq* cq_base, int num_entries, ibv_wc* wc) {
  Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  FakeCq* cq = AsCq(cq_base);
  int n = 0;
  while (n < num_entries && !cq->entries.empty()) {
    wc[n++] = cq->entries.front();
    cq->entries.pop_front();
  }
  return n;
}

int FakeReqNotifyCq(ibv_cq* cq_base, int /*solicited_only*/) {
  Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  AsCq(cq_base)->armed = true;
  return 0;
}

// ---- between processes ----

constexpr uint32_t kWireMagic = 0x50465642;  // "BVFP"
constexpr uint32_t kOpSend = 1;
constexpr uint32_t kOpRead = 2;
constexpr uint64_t kMaxWireBytes = uint64_t{1} << 30;

// Requester to responder; a SEND's bytes follow.
struct WireRequest {
  uint32_t magic = kWireMagic;
  uint32_t op = 0;
  uint32_t src_pid = 0;
  uint32_t src_qpn = 0;
  uint32_t dst_qpn = 0;
  uint32_t rkey = 0;
  uint32_t rnr_retry = 0;
  uint32_t pad = 0;
  uint64_t id = 0;
  uint64_t remote_addr = 0;
  uint64_t length = 0;
};

// Responder to requester; a READ's bytes follow.
struct WireAnswer {
  uint32_t magic = kWireMagic;
  uint32_t status = 0;
  uint64_t id = 0;
  uint64_t length = 0;
};

// The abstract unix socket of process `pid`'s provider on this process's fabric:
// POSEIDON_FAKE_VERBS_FABRIC names it (default "0"). Processes on different fabrics cannot reach
// each other, like two hosts whose devices are on different RDMA networks: a work request to one
// fails with "transport retry counter exceeded".
socklen_t ListenAddress(uint32_t pid, sockaddr_un* addr) {
  static const std::string fabric = [] {
    const char* name = std::getenv("POSEIDON_FAKE_VERBS_FABRIC");
    return std::string(name != nullptr && *name != '\0' ? name : "0").substr(0, 32);
  }();
  *addr = sockaddr_un{};
  addr->sun_family = AF_UNIX;
  const int n = std::snprintf(addr->sun_path + 1, sizeof addr->sun_path - 1,
                              "poseidon-fake-verbs-%s-%u", fabric.c_str(), pid);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + static_cast<size_t>(n));
}

bool ReadFull(int fd, void* buf, size_t n) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool WriteFull(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

template <typename Header>
std::vector<char> Message(const Header& header, uint64_t body_bytes) {
  std::vector<char> bytes(sizeof header + body_bytes);
  std::memcpy(bytes.data(), &header, sizeof header);
  return bytes;
}

void Answer(const std::shared_ptr<Link>& link, uint64_t id, ibv_wc_status status, const char* data,
            uint64_t length) {
  WireAnswer answer;
  answer.status = static_cast<uint32_t>(status);
  answer.id = id;
  answer.length = length;
  std::vector<char> bytes = Message(answer, length);
  if (length > 0) std::memcpy(bytes.data() + sizeof answer, data, length);
  link->Enqueue(std::move(bytes));
}

// Completes `qp`'s finished remote work requests, in posting order.
void Release(Fabric& f, FakeQp* qp) {
  while (!qp->outstanding.empty() && qp->outstanding.front().done) {
    Outstanding o = std::move(qp->outstanding.front());
    qp->outstanding.pop_front();
    f.outstanding_qpn.erase(o.id);
    const ibv_wc_opcode opcode = o.read ? IBV_WC_RDMA_READ : IBV_WC_SEND;
    ibv_wc_status status = o.status;
    if (status == IBV_WC_SUCCESS && qp->qp.state == IBV_QPS_ERR) status = IBV_WC_WR_FLUSH_ERR;
    if (status != IBV_WC_SUCCESS) {
      PushWc(f, qp->qp.send_cq, MakeWc(o.wr_id, status, opcode, qp->qp.qp_num, 0));
      if (qp->qp.state != IBV_QPS_ERR) SetError(f, qp);
      continue;
    }
    if (o.signaled && !o.drop_completion) {
      PushWc(f, qp->qp.send_cq,
             MakeWc(o.wr_id, IBV_WC_SUCCESS, opcode, qp->qp.qp_num, static_cast<uint32_t>(o.total)));
    }
  }
}

void WriteLoop(const std::shared_ptr<Link>& link) {
  for (;;) {
    std::vector<char> bytes;
    {
      std::unique_lock<std::mutex> lock(link->mu);
      link->cv.wait(lock, [&] { return link->closed || !link->queue.empty(); });
      if (link->closed) return;
      bytes = std::move(link->queue.front());
      link->queue.pop_front();
    }
    if (!WriteFull(link->fd, bytes.data(), bytes.size())) {
      link->Close();
      return;
    }
  }
}

// The stream is gone (its peer died, or sent garbage): work requests out on it complete with
// "retry exceeded"; SENDs it brought that wait for a receive are dropped.
void LinkBroken(Fabric& f, const Link* link) {
  if (link->peer != 0) {
    auto it = f.out_links.find(link->peer);
    if (it != f.out_links.end() && it->second.get() == link) f.out_links.erase(it);
  }
  for (auto& [qpn, qp] : f.qps) {
    bool any = false;
    for (Outstanding& o : qp->outstanding) {
      if (!o.done && o.link == link) {
        o.done = true;
        o.status = IBV_WC_RETRY_EXC_ERR;
        any = true;
      }
    }
    std::erase_if(qp->waiting, [&](const WaitingSend& w) { return w.origin.get() == link; });
    if (any) Release(f, qp);
  }
}

// A request from another process, answered on `link` (a SEND waiting for a receive later).
void HandleRequest(Fabric& f, const std::shared_ptr<Link>& link, const WireRequest& req,
                   std::vector<char> data) {
  auto it = f.qps.find(req.dst_qpn);
  FakeQp* dest = it == f.qps.end() ? nullptr : it->second;
  // Nobody answers a packet for a QP that is gone, not ready or connected elsewhere: the
  // requester's transport retries run out.
  if (dest == nullptr || !IsReady(dest) || dest->dest_pid != req.src_pid ||
      dest->dest_qpn != req.src_qpn) {
    Answer(link, req.id, IBV_WC_RETRY_EXC_ERR);
    return;
  }
  if (req.op == kOpRead) {
    if (FindMr(f, req.rkey, req.remote_addr, req.length, IBV_ACCESS_REMOTE_READ) == nullptr) {
      Answer(link, req.id, IBV_WC_REM_ACCESS_ERR);
      return;
    }
    Answer(link, req.id, IBV_WC_SUCCESS, reinterpret_cast<const char*>(req.remote_addr),
           req.length);
    return;
  }
  if ((dest->recvs.empty() || !dest->waiting.empty()) && req.rnr_retry == 7) {
    dest->waiting.push_back({req.src_qpn, 0, false, std::move(data), link, req.id});
  } else if (dest->recvs.empty()) {
    Answer(link, req.id, IBV_WC_RNR_RETRY_EXC_ERR);
  } else {
    Answer(link, req.id,
           Deliver(f, dest, req.src_qpn, data) ? IBV_WC_SUCCESS : IBV_WC_REM_INV_REQ_ERR);
  }
}

// The answer to a work request this process sent.
void HandleAnswer(Fabric& f, const WireAnswer& answer, const std::vector<char>& data) {
  auto it = f.outstanding_qpn.find(answer.id);
  if (it == f.outstanding_qpn.end()) return;  // its QP was destroyed meanwhile
  auto q = f.qps.find(it->second);
  if (q == f.qps.end()) return;
  FakeQp* qp = q->second;
  for (Outstanding& o : qp->outstanding) {
    if (o.id != answer.id) continue;
    o.done = true;
    o.status = static_cast<ibv_wc_status>(answer.status);
    if (o.read && o.status == IBV_WC_SUCCESS) {
      if (data.size() != o.total) {
        o.status = IBV_WC_REM_INV_REQ_ERR;
        break;
      }
      // A QP error mid-transfer: half the bytes have landed when the QP breaks.
      const uint64_t move = o.half ? o.total / 2 : o.total;
      uint64_t done = 0;
      for (size_t i = 0; i < o.sges.size() && done < move; ++i) {
        const uint64_t n = std::min<uint64_t>(o.sges[i].length, move - done);
        std::memcpy(reinterpret_cast<void*>(o.sges[i].addr), data.data() + done, n);
        done += n;
      }
      ++f.counters.reads;
      f.counters.read_bytes += move;
      if (move != o.total) o.status = IBV_WC_WR_FLUSH_ERR;
    }
    break;
  }
  Release(f, qp);
}

// Reads requests (an accepted stream) or answers (a stream this process opened) until the
// stream ends or carries something malformed.
void ReadLoop(const std::shared_ptr<Link>& link) {
  const bool requests = link->peer == 0;
  for (;;) {
    std::vector<char> data;
    if (requests) {
      WireRequest req;
      if (!ReadFull(link->fd, &req, sizeof req) || req.magic != kWireMagic ||
          (req.op != kOpSend && req.op != kOpRead) || req.length > kMaxWireBytes) {
        break;
      }
      if (req.op == kOpSend) {
        data.resize(req.length);
        if (!ReadFull(link->fd, data.data(), data.size())) break;
      }
      Fabric& f = TheFabric();
      std::lock_guard<std::mutex> lock(f.mu);
      HandleRequest(f, link, req, std::move(data));
    } else {
      WireAnswer answer;
      if (!ReadFull(link->fd, &answer, sizeof answer) || answer.magic != kWireMagic ||
          answer.status > IBV_WC_GENERAL_ERR || answer.length > kMaxWireBytes) {
        break;
      }
      data.resize(answer.length);
      if (!ReadFull(link->fd, data.data(), data.size())) break;
      Fabric& f = TheFabric();
      std::lock_guard<std::mutex> lock(f.mu);
      HandleAnswer(f, answer, data);
    }
  }
  link->Close();
  Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  LinkBroken(f, link.get());
}

void Run(const std::shared_ptr<Link>& link) {
  std::thread([link] { WriteLoop(link); }).detach();
  std::thread([link] { ReadLoop(link); }).detach();
}

// The stream to process `pid`, opened on first use; null when nobody listens there.
std::shared_ptr<Link> OutLink(Fabric& f, uint32_t pid) {
  auto it = f.out_links.find(pid);
  if (it != f.out_links.end()) return it->second;
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  sockaddr_un addr;
  const socklen_t len = ListenAddress(pid, &addr);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    ::close(fd);
    return nullptr;
  }
  auto link = std::make_shared<Link>(fd, pid);
  f.out_links[pid] = link;
  Run(link);
  return link;
}

// Sends one work request to the destination's process (or flushes it behind the ones out
// there); its completion comes with the answer.
void PostRemote(Fabric& f, FakeQp* qp, ibv_send_wr* wr, bool signaled) {
  const bool read = wr->opcode == IBV_WR_RDMA_READ;
  Outstanding o;
  o.id = f.next_request_id++;
  o.wr_id = wr->wr_id;
  o.read = read;
  o.signaled = signaled;
  for (int i = 0; i < wr->num_sge; ++i) o.total += wr->sg_list[i].length;
  auto finish = [&](ibv_wc_status status) {
    o.done = true;
    o.status = status;
    qp->outstanding.push_back(std::move(o));
    Release(f, qp);
  };
  if (qp->qp.state == IBV_QPS_ERR) return finish(IBV_WC_WR_FLUSH_ERR);
  Fault fault{};
  const bool faulty = TakeFault(f, read ? WorkKind::kRead : WorkKind::kSend, &fault);
  if (!LocalSgesValid(f, wr->sg_list, wr->num_sge, /*write=*/read)) {
    return finish(IBV_WC_LOC_PROT_ERR);
  }
  if (faulty && !read && fault == Fault::kQpErrorMidTransfer) return finish(IBV_WC_WR_FLUSH_ERR);
  if (faulty && !read && fault == Fault::kRnrRetryExceeded) return finish(IBV_WC_RNR_RETRY_EXC_ERR);
  std::shared_ptr<Link> link = OutLink(f, qp->dest_pid);
  if (link == nullptr) return finish(IBV_WC_RETRY_EXC_ERR);  // the process is gone
  WireRequest req;
  req.op = read ? kOpRead : kOpSend;
  req.src_pid = static_cast<uint32_t>(::getpid());
  req.src_qpn = qp->qp.qp_num;
  req.dst_qpn = qp->dest_qpn;
  req.rnr_retry = qp->rnr_retry;
  req.id = o.id;
  req.length = o.total;
  std::vector<char> bytes;
  if (read) {
    req.rkey = wr->wr.rdma.rkey;
    if (faulty && fault == Fault::kRemoteAccessError) req.rkey ^= 0x00a5a500u;
    req.remote_addr = wr->wr.rdma.remote_addr;
    o.sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
    o.half = faulty && fault == Fault::kQpErrorMidTransfer;
    bytes = Message(req, 0);
  } else {
    bytes = Message(req, o.total);
    size_t at = sizeof req;
    for (int i = 0; i < wr->num_sge; ++i) {
      std::memcpy(bytes.data() + at, reinterpret_cast<const void*>(wr->sg_list[i].addr),
                  wr->sg_list[i].length);
      at += wr->sg_list[i].length;
    }
    ++f.counters.sends;
  }
  o.drop_completion = faulty && fault == Fault::kDropCompletion;
  o.link = link.get();
  f.outstanding_qpn[o.id] = qp->qp.qp_num;
  qp->outstanding.push_back(std::move(o));
  link->Enqueue(std::move(bytes));
}

// Listens for other processes' streams (once per process, from the first ibv_open_device).
void StartListener() {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr;
  const socklen_t len = ListenAddress(static_cast<uint32_t>(::getpid()), &addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0 ||
      ::listen(fd, 128) != 0) {
    std::fprintf(stderr, "fake verbs: cannot listen for other processes: %s\n",
                 std::strerror(errno));
    if (fd >= 0) ::close(fd);
    return;
  }
  std::thread([fd] {
    for (;;) {
      const int c = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) {
        if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) {
          if (errno != EINTR && errno != ECONNABORTED) ::usleep(10000);
          continue;
        }
        return;
      }
      Run(std::make_shared<Link>(c, 0));
    }
  }).detach();
}

}  // namespace

void InjectFault(Fault fault, WorkKind kind, int skip) {
  Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  f.fault = ArmedFault{true, false, fault, kind, skip};
}

bool FaultFired() {
  Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  return f.fault.fired;
}

void SetDeviceCount(int count) {
  Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  f.device_count = std::clamp(count, 0, kMaxDevices);
}

Counters GetCounters() {
  Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  Counters c = f.counters;
  c.live_qps = f.qps.size();
  c.live_mrs = f.mrs.size();
  return c;
}

void Reset() {
  Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  f.fault = ArmedFault{};
  f.counters = Counters{};
}

}  // namespace poseidon::transport::fake_verbs

// ---- the exported libibverbs functions ----
using poseidon::transport::fake_verbs::TheFabric;
namespace fv = poseidon::transport::fake_verbs;

extern "C" {

ibv_device** ibv_get_device_list(int* num_devices) {
  fv::Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  auto** list = new ibv_device*[static_cast<size_t>(f.device_count) + 1];
  for (int i = 0; i < f.device_count; ++i) list[i] = &f.devices[i];
  list[f.device_count] = nullptr;
  if (num_devices != nullptr) *num_devices = f.device_count;
  return list;
}

void ibv_free_device_list(ibv_device** list) { delete[] list; }

const char* ibv_get_device_name(ibv_device* device) { return device->name; }

ibv_context* ibv_open_device(ibv_device* device) {
  static std::once_flag listening;
  std::call_once(listening, fv::StartListener);
  auto* ctx = new ibv_context{};
  ctx->device = device;
  ctx->cmd_fd = -1;
  ctx->async_fd = -1;
  ctx->num_comp_vectors = 1;
  ctx->abi_compat = nullptr;  // not an extended context: the inline wrappers use the exports
  ctx->ops.post_send = fv::FakePostSend;
  ctx->ops.post_recv = fv::FakePostRecv;
  ctx->ops.poll_cq = fv::FakePollCq;
  ctx->ops.req_notify_cq = fv::FakeReqNotifyCq;
  pthread_mutex_init(&ctx->mutex, nullptr);
  return ctx;
}

int ibv_close_device(ibv_context* context) {
  pthread_mutex_destroy(&context->mutex);
  delete context;
  return 0;
}

int ibv_query_device(ibv_context* /*context*/, ibv_device_attr* attr) {
  *attr = ibv_device_attr{};
  std::snprintf(attr->fw_ver, sizeof attr->fw_ver, "fake-1");
  attr->max_mr_size = uint64_t{1} << 40;
  attr->max_qp = 1 << 16;
  attr->max_qp_wr = static_cast<int>(fv::kMaxWr);
  attr->max_sge = static_cast<int>(fv::kMaxSge);
  attr->max_cq = 1 << 16;
  attr->max_cqe = 1 << 20;
  attr->max_mr = 1 << 20;
  attr->max_pd = 1 << 16;
  attr->max_qp_rd_atom = fv::kMaxRdAtomic;
  attr->max_qp_init_rd_atom = fv::kMaxRdAtomic;
  attr->phys_port_cnt = 1;
  return 0;
}

int ibv_query_port(ibv_context* /*context*/, uint8_t port_num, _compat_ibv_port_attr* out) {
  if (port_num != 1) return EINVAL;
  // The inline ___ibv_query_port passes a whole struct ibv_port_attr.
  auto* attr = reinterpret_cast<ibv_port_attr*>(out);
  attr->state = IBV_PORT_ACTIVE;
  attr->max_mtu = IBV_MTU_4096;
  attr->active_mtu = IBV_MTU_4096;
  attr->gid_tbl_len = 1;
  attr->lid = 0;
  attr->link_layer = IBV_LINK_LAYER_ETHERNET;
  attr->max_msg_sz = 1u << 31;
  return 0;
}

int ibv_query_gid(ibv_context* context, uint8_t port_num, int index, ibv_gid* gid) {
  if (port_num != 1 || index != 0) return EINVAL;
  *gid = ibv_gid{};
  gid->raw[0] = 0xfe;
  gid->raw[1] = 0x80;
  const auto pid = static_cast<uint32_t>(::getpid());  // names this process on the fabric
  std::memcpy(gid->raw + 8, &pid, sizeof pid);
  gid->raw[15] = static_cast<uint8_t>(context->device->name[8]);
  return 0;
}

ibv_pd* ibv_alloc_pd(ibv_context* context) {
  auto* pd = new ibv_pd{};
  pd->context = context;
  return pd;
}

int ibv_dealloc_pd(ibv_pd* pd) {
  delete pd;
  return 0;
}

ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  if (addr == nullptr || length == 0) {
    errno = EINVAL;
    return nullptr;
  }
  fv::Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  auto* mr = new fv::FakeMr;
  mr->access = access;
  mr->mr.context = pd->context;
  mr->mr.pd = pd;
  mr->mr.addr = addr;
  mr->mr.length = length;
  const uint32_t key = (f.next_key++ << 8) | 0x5du;
  mr->mr.lkey = key;
  mr->mr.rkey = key;
  f.mrs[key] = mr;
  return &mr->mr;
}

ibv_mr* ibv_reg_mr_iova2(ibv_pd* pd, void* addr, size_t length, uint64_t /*iova*/,
                         unsigned int access) {
  return ibv_reg_mr(pd, addr, length, static_cast<int>(access));
}

int ibv_dereg_mr(ibv_mr* mr) {
  fv::Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  f.mrs.erase(mr->lkey);
  delete reinterpret_cast<fv::FakeMr*>(mr);
  return 0;
}

ibv_comp_channel* ibv_create_comp_channel(ibv_context* context) {
  const int fd = ::eventfd(0, EFD_SEMAPHORE | EFD_CLOEXEC);
  if (fd < 0) return nullptr;
  auto* channel = new fv::FakeChannel;
  channel->ch.context = context;
  channel->ch.fd = fd;
  return &channel->ch;
}

int ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  ::close(channel->fd);
  delete reinterpret_cast<fv::FakeChannel*>(channel);
  return 0;
}

ibv_cq* ibv_create_cq(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                      int /*comp_vector*/) {
  if (cqe <= 0 || cqe > (1 << 20)) {
    errno = EINVAL;
    return nullptr;
  }
  auto* cq = new fv::FakeCq;
  cq->cq.context = context;
  cq->cq.channel = channel;
  cq->cq.cq_context = cq_context;
  cq->cq.cqe = cqe;
  return &cq->cq;
}

int ibv_destroy_cq(ibv_cq* cq_base) {
  fv::Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  if (cq_base->channel != nullptr) {
    auto* channel = reinterpret_cast<fv::FakeChannel*>(cq_base->channel);
    // Events not yet read for this CQ go with it (their eventfd counts too).
    const auto removed = std::erase(channel->events, cq_base);
    for (size_t i = 0; i < removed; ++i) {
      uint64_t value;
      const int flags = ::fcntl(channel->ch.fd, F_GETFL);
      ::fcntl(channel->ch.fd, F_SETFL, flags | O_NONBLOCK);
      [[maybe_unused]] ssize_t n = ::read(channel->ch.fd, &value, sizeof value);
      ::fcntl(channel->ch.fd, F_SETFL, flags);
    }
  }
  delete fv::AsCq(cq_base);
  return 0;
}

int ibv_get_cq_event(ibv_comp_channel* channel_base, ibv_cq** cq, void** cq_context) {
  uint64_t value;
  if (::read(channel_base->fd, &value, sizeof value) != static_cast<ssize_t>(sizeof value)) {
    return -1;  // errno from read: EAGAIN on a non-blocking channel with no event
  }
  fv::Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  auto* channel = reinterpret_cast<fv::FakeChannel*>(channel_base);
  if (channel->events.empty()) {
    errno = EAGAIN;
    return -1;
  }
  *cq = channel->events.front();
  channel->events.pop_front();
  *cq_context = (*cq)->cq_context;
  return 0;
}

void ibv_ack_cq_events(ibv_cq* cq, unsigned int nevents) {
  fv::Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  cq->comp_events_completed += nevents;
}

ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* init) {
  if (init->qp_type != IBV_QPT_RC || init->send_cq == nullptr || init->recv_cq == nullptr ||
      init->srq != nullptr || init->cap.max_send_wr > fv::kMaxWr ||
      init->cap.max_recv_wr > fv::kMaxWr || init->cap.max_send_sge > fv::kMaxSge ||
      init->cap.max_recv_sge > fv::kMaxSge) {
    errno = EINVAL;
    return nullptr;
  }
  fv::Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  auto* qp = new fv::FakeQp;
  qp->qp.context = pd->context;
  qp->qp.qp_context = init->qp_context;
  qp->qp.pd = pd;
  qp->qp.send_cq = init->send_cq;
  qp->qp.recv_cq = init->recv_cq;
  qp->qp.qp_num = f.next_qpn++;
  qp->qp.state = IBV_QPS_RESET;
  qp->qp.qp_type = IBV_QPT_RC;
  qp->cap = init->cap;
  qp->sq_sig_all = init->sq_sig_all != 0;
  f.qps[qp->qp.qp_num] = qp;
  return &qp->qp;
}

int ibv_modify_qp(ibv_qp* qp_base, ibv_qp_attr* attr, int attr_mask) {
  fv::Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  fv::FakeQp* qp = fv::AsQp(qp_base);
  if ((attr_mask & IBV_QP_STATE) == 0) return 0;
  const ibv_qp_state from = qp->qp.state;
  const ibv_qp_state to = attr->qp_state;
  const bool ok = to == IBV_QPS_ERR || to == IBV_QPS_RESET ||
                  (from == IBV_QPS_RESET && to == IBV_QPS_INIT) ||
                  (from == IBV_QPS_INIT && to == IBV_QPS_RTR &&
                   (attr_mask & IBV_QP_DEST_QPN) != 0) ||
                  (from == IBV_QPS_RTR && to == IBV_QPS_RTS);
  if (!ok) return EINVAL;
  if (to == IBV_QPS_RTR) {
    qp->dest_qpn = attr->dest_qp_num;
    qp->dest_pid = 0;
    if ((attr_mask & IBV_QP_AV) != 0 && attr->ah_attr.is_global != 0) {
      uint32_t pid = 0;
      std::memcpy(&pid, attr->ah_attr.grh.dgid.raw + 8, sizeof pid);
      if (pid != 0 && pid != static_cast<uint32_t>(::getpid())) qp->dest_pid = pid;
    }
  }
  if (to == IBV_QPS_RTS && (attr_mask & IBV_QP_RNR_RETRY) != 0) qp->rnr_retry = attr->rnr_retry;
  if (to == IBV_QPS_ERR) {
    fv::SetError(f, qp);
  } else {
    qp->qp.state = to;
  }
  return 0;
}

int ibv_destroy_qp(ibv_qp* qp_base) {
  fv::Fabric& f = TheFabric();
  std::lock_guard<std::mutex> lock(f.mu);
  fv::FakeQp* qp = fv::AsQp(qp_base);
  f.qps.erase(qp->qp.qp_num);
  for (const fv::Outstanding& o : qp->outstanding) f.outstanding_qpn.erase(o.id);
  fv::FailWaitingSends(f, qp);
  // A SEND from this QP still waiting at another QP dies with it.
  for (auto& [qpn, other] : f.qps) {
    std::erase_if(other->waiting, [&](const fv::WaitingSend& w) {
      return !w.origin && w.from_qpn == qp->qp.qp_num;
    });
  }
  delete qp;
  return 0;
}

const char* ibv_wc_status_str(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "Work Request Flushed Error";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request error";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    default: return "other error";
  }
}

}  // extern "C"
