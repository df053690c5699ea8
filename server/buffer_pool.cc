#include "server/buffer_pool.h"

#include <bit>
#include <cstdlib>

namespace poseidon::server {
namespace {

constexpr size_t kAlignment = 64;

int SizeClass(size_t bytes) {
  const size_t rounded = std::bit_ceil(std::max<size_t>(bytes, kAlignment));
  return std::countr_zero(rounded);
}

}  // namespace

PooledBuffer& PooledBuffer::operator=(PooledBuffer&& other) noexcept {
  if (this != &other) {
    if (pool_ && data_) pool_->Return(data_, size_class_);
    pool_ = std::move(other.pool_);
    data_ = other.data_;
    size_ = other.size_;
    size_class_ = other.size_class_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

PooledBuffer::~PooledBuffer() {
  if (pool_ && data_) pool_->Return(data_, size_class_);
}

std::shared_ptr<BufferPool> BufferPool::Create(size_t max_cached_bytes) {
  return std::shared_ptr<BufferPool>(new BufferPool(max_cached_bytes));
}

BufferPool::~BufferPool() {
  for (auto& list : free_) {
    for (std::byte* p : list) std::free(p);
  }
}

PooledBuffer BufferPool::Get(size_t bytes) {
  PooledBuffer b;
  const int c = SizeClass(bytes);
  b.pool_ = shared_from_this();
  b.size_ = bytes;
  b.size_class_ = c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_[c].empty()) {
      b.data_ = free_[c].back();
      free_[c].pop_back();
      cached_bytes_ -= size_t{1} << c;
      return b;
    }
    ++allocations_;
  }
  b.data_ = static_cast<std::byte*>(std::aligned_alloc(kAlignment, size_t{1} << c));
  if (b.data_ == nullptr) return PooledBuffer();  // out of memory: the caller sees size() == 0
  return b;
}

void BufferPool::Return(std::byte* data, int size_class) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t bytes = size_t{1} << size_class;
    if (cached_bytes_ + bytes <= max_cached_bytes_) {
      free_[size_class].push_back(data);
      cached_bytes_ += bytes;
      return;
    }
  }
  std::free(data);
}

size_t BufferPool::allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocations_;
}

}  // namespace poseidon::server
