// The in-process transport: connections between objects of one process, with the same
// semantics as TCP (ordered frames, validated headers, gather send, receive into the caller's
// buffer: the payload is copied once, sender memory to receiver memory). For tests and for
// co-located components.
// Thread model: one callback thread per context runs every completion callback and timer.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace poseidon::transport {

// Listen("name") registers a name in this context; Connect("name") reaches it.
absl::StatusOr<std::shared_ptr<Context>> CreateInprocContext(const ContextOptions& options);

}  // namespace poseidon::transport
