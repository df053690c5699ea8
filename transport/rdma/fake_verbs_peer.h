// What fake_verbs_peer.cc and fake_verbs_process_test.cc share: a GID as text on their pipes, and
// the RC queue pair's INIT and RTR/RTS steps (as the RDMA backend takes them, minus the options).
// Tests only. Thread-safety: pure functions of their arguments (and the QP's verbs calls).
#pragma once

#include <infiniband/verbs.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace poseidon::transport::fake_verbs {

inline std::string GidHex(const ibv_gid& gid) {
  std::string s;
  char b[3];
  for (const uint8_t byte : gid.raw) {
    std::snprintf(b, sizeof b, "%02x", byte);
    s += b;
  }
  return s;
}

// False unless `text` is exactly 32 hex digits.
inline bool ParseGidHex(const char* text, ibv_gid* gid) {
  if (std::strlen(text) != 2 * sizeof gid->raw) return false;
  for (size_t i = 0; i < sizeof gid->raw; ++i) {
    unsigned v = 0;
    if (std::sscanf(text + 2 * i, "%2x", &v) != 1) return false;
    gid->raw[i] = static_cast<uint8_t>(v);
  }
  return true;
}

// RESET -> INIT on port 1 with `access` for the remote side; 0 or the errno of ibv_modify_qp.
inline int ToInit(ibv_qp* qp, int access) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.port_num = 1;
  attr.qp_access_flags = static_cast<unsigned>(access);
  return ibv_modify_qp(qp, &attr,
                       IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

// INIT -> RTR (to `peer_qpn` at `peer_gid`) -> RTS with rnr_retry 7; 0 or the errno.
inline int ToRts(ibv_qp* qp, uint32_t peer_qpn, const ibv_gid& peer_gid) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = IBV_MTU_4096;
  attr.dest_qp_num = peer_qpn;
  attr.ah_attr.is_global = 1;
  attr.ah_attr.grh.dgid = peer_gid;
  attr.ah_attr.port_num = 1;
  if (const int rc = ibv_modify_qp(qp, &attr,
                                   IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN);
      rc != 0) {
    return rc;
  }
  attr = ibv_qp_attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.rnr_retry = 7;
  return ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_RNR_RETRY);
}

}  // namespace poseidon::transport::fake_verbs
