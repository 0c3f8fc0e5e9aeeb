#include "trace.h"

#include <chrono>

namespace supermem {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void TraceRing::set_capacity(size_t capacity) {
  std::lock_guard<std::mutex> g(mu_);
  capacity_ = capacity;
  buf_.assign(capacity, TraceEvent{});
  head_ = size_ = 0;
}

void TraceRing::push(TraceKind kind, const void* addr, size_t size, Stream stream, uint64_t tag) {
  if (capacity_.load(std::memory_order_relaxed) == 0) return;
  TraceEvent ev{now_ns(), reinterpret_cast<uint64_t>(addr), size, stream, tag, kind};
  std::lock_guard<std::mutex> g(mu_);
  size_t capacity = capacity_.load(std::memory_order_relaxed);
  if (capacity == 0) return;
  if (size_ == capacity) {  // overwrite the oldest
    buf_[head_] = ev;
    head_ = (head_ + 1) % capacity;
    ++dropped_;
  } else {
    buf_[(head_ + size_) % capacity] = ev;
    ++size_;
  }
}

std::vector<TraceEvent> TraceRing::drain() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<TraceEvent> out;
  out.reserve(size_);
  size_t capacity = capacity_.load(std::memory_order_relaxed);
  for (size_t i = 0; i < size_; ++i) out.push_back(buf_[(head_ + i) % capacity]);
  head_ = size_ = 0;
  return out;
}

}  // namespace supermem
