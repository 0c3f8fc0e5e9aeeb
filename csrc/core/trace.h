// A bounded ring buffer of allocator and pool events. When full, the oldest events are
// overwritten and counted in `dropped`; Python drains it (drain() empties it).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "fork.h"
#include "types.h"

namespace supermem {

// Kinds mirror PyTorch's snapshot trace actions first, then supermem's pool actions.
enum class TraceKind : uint8_t {
  alloc = 0,
  free_requested,   // the user freed a block that other streams still use (or borrowed): reuse is deferred
  free_completed,   // the block is reusable
  segment_alloc,
  segment_free,
  oom,
  offload,          // pool: device -> host copy started
  prefetch,         // pool: host -> device copy started
  recompute,
  compress,
  drop,             // pool: device copy released (entry stays recomputable or on host)
  restore,          // pool: entry back on device
  annotate,
  count_
};

struct TraceEvent {
  int64_t time_ns;  // steady clock
  uint64_t addr;
  uint64_t size;
  uint64_t stream;
  uint64_t tag;     // free-form: pool entry id, category, ...
  TraceKind kind;
};

class TraceRing {
 public:
  explicit TraceRing(size_t capacity = 0) { set_capacity(capacity); }

  bool enabled() const { return capacity_.load(std::memory_order_relaxed) != 0; }
  // Empties the ring (its undrained events count as dropped) and resizes it. All or nothing: on failure the ring is as it was. Throws
  // UsageError when the ring could never fit in this host's memory (check_capacity), and
  // std::bad_alloc when it could but the memory is not there now.
  void set_capacity(size_t capacity);
  static void check_capacity(size_t capacity);
  void push(TraceKind kind, const void* addr, size_t size, Stream stream, uint64_t tag = 0);
  std::vector<TraceEvent> drain();  // oldest first
  uint64_t dropped() const { return dropped_; }
  size_t capacity() const { return capacity_.load(std::memory_order_relaxed); }

 private:
  std::mutex mu_;
  ForkRegistration fork_{&mu_, ForkLevel::trace};
  struct Unmap {
    size_t bytes;
    void operator()(TraceEvent* p) const;
  };
  using Buffer = std::unique_ptr<TraceEvent[], Unmap>;
  static Buffer map_buffer(size_t capacity);
  Buffer buf_{nullptr, Unmap{0}};  // capacity_ events; untouched (uncommitted) until written
  std::atomic<size_t> capacity_{0};  // read without the lock on every push (the off check)
  size_t head_ = 0, size_ = 0;       // head_: index of the oldest event
  uint64_t dropped_ = 0;
};

int64_t now_ns();

}  // namespace supermem
