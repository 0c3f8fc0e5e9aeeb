#include "trace.h"

#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <new>

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

void TraceRing::Unmap::operator()(TraceEvent* p) const {
  if (p) munmap(p, bytes);
}

// Anonymous memory on 2 MiB pages where the kernel gives them (transparent huge pages in "madvise"
// mode), its pages made when the ring is (Linux 5.14+): touched as events reach them, a fresh ring's
// first pass took a page fault per 85 events on 4 KiB pages, half a push's cost on the development
// CPU, and an H200 host gave 4 KiB pages to the advised ring all the same (44 faults a step of an HF
// Llama at 2.55 us each; docs/trace.md). Where the kernel cannot, they are made as events reach them.
TraceRing::Buffer TraceRing::map_buffer(size_t capacity) {
  if (capacity == 0) return Buffer(nullptr, Unmap{0});
  size_t bytes = capacity * sizeof(TraceEvent);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);  // (advice: ignored where the kernel has none)
#endif
#ifdef MADV_POPULATE_WRITE
  madvise(p, bytes, MADV_POPULATE_WRITE);  // (EINVAL on an older kernel: pages come as events do)
#endif
  return Buffer(static_cast<TraceEvent*>(p), Unmap{bytes});
}

void TraceRing::set_capacity(size_t capacity) {
  check_capacity(capacity);
  // Allocate first, swap under the lock: a failed allocation leaves the ring as it was.
  Buffer fresh = map_buffer(capacity);
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
    if (++head_ == capacity) head_ = 0;
    ++dropped_;
  } else {
    size_t i = head_ + size_;  // (no division: a push is ~50 ns)
    buf_[i < capacity ? i : i - capacity] = ev;
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
