// The agents' Gloo ring: a context connected among every rank of a world through the rendezvous
// store (agent/gloo_store.h), and the measured cost of one of its ring steps. The agent connects
// it before registering its model, so that the coordinator's first plan can weigh ring
// all-reduce with the step every rank measured (RegisterModelRequest.allreduce_step_ns), and
// the all-reduce syncer then runs its collectives on it (AllreduceSyncer::Ready).
// Thread-safety: ConnectGlooRing blocks until every rank connected (or the timeout); the
// context is then used by the syncer's threads as Gloo allows (one tag per collective).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}  // namespace rendezvous
namespace transport {
class Device;
}  // namespace transport
}  // namespace gloo

namespace poseidon::agent {

// Gloo's tag of the step probes, above every layer's (a layer's collectives are tagged with its
// index, and their other tag spaces start at 2^29).
inline constexpr uint32_t kGlooProbeTag = 0xffffffffu;

struct GlooRing {
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::Context> context;
  // One ring step: the median of kGlooStepProbes 1-element all-reduces over their 2 (P - 1)
  // steps. It holds Gloo's and the threads' per-message overhead, which the network's round
  // trip does not; the planner's ring column weighs each step at least this.
  absl::Duration step;
};

inline constexpr int kGlooStepProbes = 15;

// Gloo's TCP device on `host` (as ConnectGlooRing takes it), for a ring connected later.
absl::StatusOr<std::shared_ptr<gloo::transport::Device>> MakeGlooDevice(std::string host);

// Connects rank `rank` of `world` (>= 2) on `host` (the address the other agents reach this one
// at; brackets around an IPv6 address are dropped) through `store`, every collective bounded by
// `timeout`, and measures the step. UNAVAILABLE names the ring and Gloo's error; INTERNAL a probe
// that did not sum to `world`.
absl::StatusOr<GlooRing> ConnectGlooRing(gloo::rendezvous::Store& store, uint32_t rank,
                                         uint32_t world, std::string host,
                                         absl::Duration timeout);

}  // namespace poseidon::agent
