#include "trace.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>

namespace supermem {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void TraceRing::check_capacity(size_t capacity) {
  // A ring larger than the host's RAM could only be paged to death; refusing it gives a clear error
  // where overcommit would otherwise decide (and a size * capacity overflow is impossible past here).
  long pages = sysconf(_SC_PHYS_PAGES), page_bytes = sysconf(_SC_PAGESIZE);
  size_t host_bytes = pages > 0 && page_bytes > 0 ? size_t(pages) * size_t(page_bytes) : SIZE_MAX;
  if (capacity > host_bytes / sizeof(TraceEvent))
    throw UsageError("supermem: a trace ring of " + std::to_string(capacity) + " events needs " +
                     (capacity > SIZE_MAX / sizeof(TraceEvent) ? std::string("more than 16 EiB")
                                                               : format_size(capacity * sizeof(TraceEvent))) +
                     ", more than this host's memory (" + format_size(host_bytes) + ")");
}

void TraceRing::set_capacity(size_t capacity) {
  check_capacity(capacity);
  // Allocate first, swap under the lock: a failed allocation leaves the ring as it was.
  std::unique_ptr<TraceEvent[]> fresh(capacity ? new TraceEvent[capacity] : nullptr);
  std::lock_guard<std::mutex> g(mu_);
  buf_.swap(fresh);
  capacity_ = capacity;
  dropped_ += size_;  // the events not drained are lost with the old buffer: count them
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
