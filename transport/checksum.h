// CRC-32C (Castagnoli) for frame headers and, optionally, payloads. Uses the SSE4.2 crc32
// instruction when the CPU has it, a table otherwise; both give the same value.
// Thread-safety: pure functions, safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace poseidon::transport {

// Extends `crc` (0 to start) over `data`. Crc32c(Crc32c(0, a), b) == Crc32c(0, a ++ b).
uint32_t Crc32c(uint32_t crc, std::span<const std::byte> data);

}  // namespace poseidon::transport
