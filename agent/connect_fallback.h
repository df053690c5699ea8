// Connecting to a server or a peer agent over the transport chosen for it (RDMA where both ends
// can), falling back to TCP when RDMA fails while TCP to the same peer works.
// Thread-safety: a function of its arguments; `attempt` is called on the calling thread.
#pragma once

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "transport/handshake.h"

namespace poseidon::agent {

// Where to connect and over what; ConnectWithFallback updates it to what it used.
struct ConnectTarget {
  bool rdma = false;
  std::string address;
  std::string tcp_fallback;  // the peer's TCP endpoint (empty: no fallback)
};

// Tries `attempt(rdma, address)` until it succeeds or `deadline` passes, every `retry`. When an
// RDMA attempt fails and the target has a TCP fallback, TCP is tried at once: if it succeeds,
// the peer is up and its RDMA path is what fails (no device on its fabric, a port down, a
// provider error), so the target moves to TCP for good, the fallback is logged once naming
// `what`, and `on_fallback` is told why (may be null); if it fails too, the peer is not up yet,
// and both are tried again next time (RDMA first). Returns the last attempt's error, naming the
// transports tried. `give_up_when_silent`: an attempt whose error says the peer took the
// connection and said nothing (transport::kPeerSilentPayload: frozen) ends the tries at once.
template <typename T>
absl::StatusOr<T> ConnectWithFallback(
    const std::string& what, ConnectTarget& target,
    const std::function<absl::StatusOr<T>(bool rdma, const std::string& address)>& attempt,
    absl::Time deadline, absl::Duration retry,
    const std::function<void(const absl::Status& rdma_error)>& on_fallback,
    bool give_up_when_silent = false) {
  while (true) {
    absl::StatusOr<T> result = attempt(target.rdma, target.address);
    if (result.ok()) return result;
    if (target.rdma && !target.tcp_fallback.empty()) {
      absl::StatusOr<T> tcp = attempt(false, target.tcp_fallback);
      if (tcp.ok()) {
        target.rdma = false;
        target.address = target.tcp_fallback;
        target.tcp_fallback.clear();
        PSD_LOG_WARN("{}: RDMA connection failed ({}) while TCP at {} works: this link falls "
                     "back to TCP",
                     what, result.status().message(), target.address);
        if (on_fallback) on_fallback(result.status());
        return tcp;
      }
      absl::Status both(result.status().code(),
                        absl::StrCat("over RDMA: ", result.status().message(), "; over TCP (",
                                     target.tcp_fallback, "): ", tcp.status().message()));
      // Silent over TCP: the peer is there and frozen, whatever RDMA said.
      if (tcp.status().GetPayload(transport::kPeerSilentPayload).has_value()) {
        both.SetPayload(transport::kPeerSilentPayload, absl::Cord("1"));
      }
      result = std::move(both);
    }
    if (absl::Now() + retry > deadline) return result;
    if (give_up_when_silent &&
        result.status().GetPayload(transport::kPeerSilentPayload).has_value()) {
      return result;
    }
    absl::SleepFor(retry);
  }
}

}  // namespace poseidon::agent
