// The divergence guard of a lossy wire (issue 15; docs/agent.md, "Lossy wires"): on sampled
// clocks, how far what a PS key's 16-bit encoding sends is from the exact gradient, as the
// relative error ||decode(sent) − exact||₂ / ||exact||₂. bfloat16 and fp16 round each element by
// at most half a unit (2^-9 and 2^-12 of it), so a healthy wire stays far below the default
// limit (0.05); what exceeds it is a gradient the type cannot carry (fp16 beyond ±65504 or below
// its subnormals, an infinity or NaN) or a broken encoder, and the key falls back to float32 for
// the rest of the job (the server switches every rank at the same clock: docs/server.md).
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>

#include "common/wire_codec.h"

namespace poseidon::agent {

struct WireGuardOptions {
  uint64_t check_every = 100;  // clock 1 and every check_every-th clock after it; 0: off
  double max_error = 0.05;     // the relative error above which the key falls back
};

// Whether the guard looks at `clock` (clocks start at 1).
bool ShouldCheckWire(const WireGuardOptions& options, uint64_t clock);

// ||decode(sent) − exact||₂ / ||exact||₂ in double precision; 0 when both are zero, infinite
// when only `sent` is non-zero or anything is not finite. The sizes must match.
double RelativeWireError(WireType type, std::span<const float> exact,
                         std::span<const uint16_t> sent);

// Whether `error` (RelativeWireError) is beyond the limit: NaN is.
inline bool WireDiverged(const WireGuardOptions& options, double error) {
  return !(error <= options.max_error);
}

}  // namespace poseidon::agent
