#include "agent/wire_guard.h"

#include <cmath>
#include <limits>

namespace poseidon::agent {

bool ShouldCheckWire(const WireGuardOptions& options, uint64_t clock) {
  if (options.check_every == 0 || clock == 0) return false;
  return (clock - 1) % options.check_every == 0;
}

double RelativeWireError(WireType type, std::span<const float> exact,
                         std::span<const uint16_t> sent) {
  double error = 0, norm = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double e = exact[i];
    const double d = static_cast<double>(FromWire16(type, sent[i])) - e;
    error += d * d;
    norm += e * e;
  }
  if (!std::isfinite(error) || !std::isfinite(norm)) {
    return std::numeric_limits<double>::infinity();
  }
  if (norm == 0) return error == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(error / norm);
}

}  // namespace poseidon::agent
