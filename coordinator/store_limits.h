// The limits of a job's rendezvous key-value store (StoreSet, StoreGet), shared by the client and
// the coordinator, which enforces them. They bound the memory one job can make the coordinator
// hold: kMaxStoreKeys keys and kMaxStoreBytes of keys plus values (so a whole StoreGet answer stays
// well below the client's 64 MiB message limit).
// Thread-safety: constants only.
#pragma once

#include <cstddef>

namespace poseidon::coordinator {

inline constexpr size_t kMaxStoreKeyBytes = 512;
inline constexpr size_t kMaxStoreValueBytes = size_t{64} << 10;  // 64 KiB
inline constexpr size_t kMaxStoreKeys = 16384;                   // per job
inline constexpr size_t kMaxStoreBytes = size_t{32} << 20;       // keys + values, per job
inline constexpr size_t kMaxStoreGetKeys = 1024;                 // per StoreGet

}  // namespace poseidon::coordinator
