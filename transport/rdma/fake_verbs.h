// The test verbs provider ("fake verbs"): an in-process implementation of the ibv_* calls the RDMA
// backend makes (device list, PD, MRs, completion channels, CQs, RC QPs; SEND/RECV and RDMA READ,
// filled into ibv_context::ops for the inline post/poll/notify calls), linked into test
// executables in place of libibverbs (transport/CMakeLists.txt: POSEIDON_FAKE_VERBS). Every QP of
// the process is on one emulated fabric; data moves by memcpy when a work request is posted, with
// the checks a real HCA makes (lkeys, rkeys, access flags, bounds, QP states) and the completions
// and error states it produces. This header is the tests' control panel: device count, injected
// faults, counters. Thread-safety: every function is thread-safe (one fabric mutex).
#pragma once

#include <cstdint>

namespace poseidon::transport::fake_verbs {

// Which work requests a fault applies to.
enum class WorkKind { kSend, kRead };

enum class Fault {
  // The requester's completion of the work request never appears (the transfer itself happens).
  kDropCompletion,
  // A SEND completes with IBV_WC_RNR_RETRY_EXC_ERR (the receiver had no receive posted for longer
  // than the retry budget); the QP goes to the error state. Nothing is delivered.
  kRnrRetryExceeded,
  // The QP goes to the error state at this work request: it and every later one (and every
  // posted receive) complete with IBV_WC_WR_FLUSH_ERR. A READ has moved half its bytes first.
  kQpErrorMidTransfer,
  // The work request carries a corrupted rkey: the responder refuses it and the requester gets
  // IBV_WC_REM_ACCESS_ERR (the rkey check is the fabric's, not a shortcut).
  kRemoteAccessError,
};

// Arms `fault` for the (skip + 1)-th work request of `kind` posted after this call, on any QP.
// One fault at a time; arming another replaces it.
void InjectFault(Fault fault, WorkKind kind, int skip = 0);
// Whether the armed fault has fired.
bool FaultFired();

// Devices ibv_get_device_list reports (default 1). 0 emulates a machine without RDMA.
void SetDeviceCount(int count);

struct Counters {
  uint64_t sends = 0;        // SEND work requests executed
  uint64_t reads = 0;        // RDMA READ work requests executed
  uint64_t read_bytes = 0;
  uint64_t receives_posted = 0;
  uint64_t events = 0;       // completion-channel events raised
  uint64_t error_completions = 0;
  uint64_t live_qps = 0;
  uint64_t live_mrs = 0;
};
Counters GetCounters();

// Clears the armed fault and the counters (QPs and MRs stay).
void Reset();

}  // namespace poseidon::transport::fake_verbs
