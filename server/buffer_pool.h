// Reusable payload buffers for the receive path: a push is read into a pooled buffer, summed by
// the key's worker, and the buffer goes back to the pool. In steady state no push allocates.
// Thread-safety: Get and the PooledBuffer destructor may run on any thread.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

namespace poseidon::server {

class BufferPool;

// A buffer of at least size() bytes, 64-byte aligned, returned to its pool when destroyed.
class PooledBuffer {
 public:
  PooledBuffer() = default;
  PooledBuffer(PooledBuffer&& other) noexcept { *this = std::move(other); }
  PooledBuffer& operator=(PooledBuffer&& other) noexcept;
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  ~PooledBuffer();

  std::span<std::byte> bytes() const { return {data_, size_}; }
  std::span<float> floats() const {
    return {reinterpret_cast<float*>(data_), size_ / sizeof(float)};
  }
  size_t size() const { return size_; }

 private:
  friend class BufferPool;
  std::shared_ptr<BufferPool> pool_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  int size_class_ = -1;
};

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // Keeps at most `max_cached_bytes` of idle buffers; beyond that, returned buffers are freed.
  static std::shared_ptr<BufferPool> Create(size_t max_cached_bytes);
  ~BufferPool();

  PooledBuffer Get(size_t bytes);

  size_t allocations() const;  // buffers ever allocated (for tests: steady state stops growing)

 private:
  explicit BufferPool(size_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}
  friend class PooledBuffer;
  void Return(std::byte* data, int size_class);

  static constexpr int kClasses = 48;
  size_t max_cached_bytes_;
  mutable std::mutex mu_;
  std::vector<std::byte*> free_[kClasses];
  size_t cached_bytes_ = 0;
  size_t allocations_ = 0;
};

}  // namespace poseidon::server
