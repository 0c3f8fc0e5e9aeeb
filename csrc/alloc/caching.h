// The caching allocator: PyTorch's algorithm (512-byte rounding, small/large pools, per-stream
// best fit, split and coalesce, record_stream events, private pools for CUDA graphs) over any
// Device, plus a hard limit, pressure handlers and a trace ring. Thread-safe.
//
// Fast path: malloc finds a cached block of its stream (one set lookup) and splits it; free
// coalesces it back. Everything else (new segments, recovery from OOM) is in malloc_slow.
//
// Expandable segments (expandable.cpp, option `expandable`): instead of a segment per cudaMalloc, one
// reserved address range per (pool, stream, size class) into which pages are mapped on demand where a
// request lacks the fewest; free pages are unmapped when cached memory is released (the OOM protocol's
// stage 2, empty_cache, a lower limit) and move out of holes before reserved memory outgrows the
// allocated peak. A request that no cached block fits takes the free space at a segment's end plus new
// pages, instead of a new segment beside the unusable rest.
//
// OOM protocol, one retry per stage: (1) a new segment (or new pages); (2) release cached segments
// (and unmap free pages), retry;
// (3) release the lock, call the pressure handlers (they may free through this allocator), retry;
// (4) throw OutOfMemory carrying requested, allocated, reserved and evicted bytes.
#pragma once

#include <atomic>
#include <array>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../core/fork.h"
#include "../core/trace.h"
#include "../core/types.h"
#include "../prim/prim.h"

namespace supermem {

struct AllocatorOptions {
  size_t limit_bytes = 0;     // reserved bytes may not exceed this; 0: only the device's capacity
  bool passthrough = false;   // no caching: one segment per block, returned on free (sanitizers)
  int debug = 0;              // 1: invariant walk after each slow-path call; 2: after every call
  size_t trace_capacity = 0;  // ring buffer size in events; 0: tracing off
  size_t segment_bytes = 0;   // >0: segments are at least this big (host pools: few, large chunks)
  bool expandable = false;    // expandable segments (the device must have virtual memory)
};

// Called under memory pressure with the allocator lock released; returns the bytes it freed.
using PressureHandler = std::function<size_t(size_t need_bytes)>;
// Called with the lock released just before an OutOfMemory is thrown (e.g. to write a snapshot). It
// reports its own failures; an exception it throws (Ctrl-C from Python) propagates instead of the OOM.
using OomObserver = std::function<void(int device, size_t requested_bytes, const std::string& message)>;
using PoolId = std::pair<uint64_t, uint64_t>;
using StreamFilter = std::function<bool(Stream)>;

struct BlockInfo {
  uint64_t addr, size, requested;
  BlockState state;
};
struct SegmentInfo {  // an expandable segment is reported as one SegmentInfo per run of mapped blocks
  uint64_t addr, size, stream;
  bool small;
  bool expandable;
  PoolId pool;
  std::vector<BlockInfo> blocks;
};

class CachingAllocator {
 public:
  CachingAllocator(DevicePtr device, AllocatorOptions options);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  void* malloc(size_t nbytes, Stream stream);  // nullptr for 0 bytes; throws OutOfMemory
  void free(void* ptr);                        // throws UsageError for a pointer it did not hand out
  void record_stream(void* ptr, Stream stream);
  void empty_cache();
  size_t allocation_size(void* ptr);           // rounded size of a live block; throws UsageError
  bool owns(void* ptr);                        // ptr is a live block of this allocator
  size_t largest_free_block();                 // largest cached free block (any pool, any stream)
  std::vector<void*> pool_live_blocks(PoolId id);  // allocated blocks of a private pool

  void begin_allocate_to_pool(PoolId id, StreamFilter filter);
  void end_allocate_to_pool(PoolId id);
  void release_pool(PoolId id);

  int add_pressure_handler(PressureHandler handler);
  void remove_pressure_handler(int id);
  void add_oom_observer(OomObserver observer);

  Stats stats();
  // Allocated bytes now, without the lock: the tensor pool reads it at every save and use.
  int64_t allocated_now() const { return allocated_now_.load(std::memory_order_relaxed); }
  size_t take_watermark();  // highest allocated bytes since the last call (then restarts at the current)
  // The soft limit (a tensor pool's budget): an allocation that would take allocated bytes over it
  // first asks the pressure handlers for the excess, then goes ahead whatever they freed. After a call
  // that freed less than it asked, they are not asked again until arm_soft_limit() (one made while the
  // handlers ran stands). 0: off.
  void set_soft_limit(size_t bytes);
  size_t soft_limit();
  void arm_soft_limit();  // lock-free
  bool in_soft_limit_call() const { return soft_busy_.load(); }  // the handlers run for the soft limit
  void reset_peak_stats();
  void reset_accumulated_stats();
  size_t limit_bytes();
  void set_limit_bytes(size_t limit);  // 0: no limit; a lower limit than reserved frees the cache
  // torch.cuda.set_per_process_memory_fraction: new segments only up to fraction * capacity (0: none);
  // throws UsageError outside [0, 1]. memory_fraction: the fraction set, else limit / capacity, else 1.
  void set_memory_fraction(double fraction);
  double memory_fraction();
  void check();                        // throws std::logic_error naming the broken invariant
  std::vector<SegmentInfo> snapshot();
  TraceRing& trace() { return trace_; }
  const DevicePtr& device() const { return device_; }
  const AllocatorOptions& options() const { return opts_; }

 private:
  using Lock = std::unique_lock<std::mutex>;
  std::array<StatArray*, 9> all_stat_arrays() {
    return {&stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.active_bytes, &stats_.requested_bytes,
            &stats_.allocation,      &stats_.segment,        &stats_.active,       &stats_.inactive_split,
            &stats_.inactive_split_bytes};
  }
  Pool& pool_for(Stream stream);
  Block* take_free(Pool& pool, bool small, Stream stream, size_t size);
  // Another stream's settled free block; settle: wait for a stream whose fitting blocks are not (OOM path)
  Block* borrow(Pool& pool, bool small, Stream stream, size_t size, bool settle_streams = false);
  Block* malloc_slow(Lock& lk, Pool& pool, bool small, Stream stream, size_t size, size_t nbytes);
  Block* new_segment(Pool& pool, bool small, Stream stream, size_t size);
  // expandable.cpp
  Block* map_for(Pool& pool, bool small, Stream stream, size_t size);  // new_segment's expandable twin
  Block* map_run(Pool& pool, bool small, Stream stream, size_t size);  // map_for before the trim
  Block* find_run(Pool& pool, bool small, Stream stream, size_t size, size_t& map_bytes);
  Segment* reserve_segment(Pool& pool, bool small, Stream stream);
  Block* map_front(Block* unmapped, size_t nbytes);  // the merged free block, or nullptr (no room)
  // A free block's whole pages are unmapped (false: it has none); wait: first wait for the device
  // (false: the caller did since the block was freed); aside: their memory kept for the next mapping (a move)
  bool unmap_free_pages(Block* b, bool wait, bool aside = false);
  bool reclaim_holes(size_t map_bytes, size_t size, const Block* run);  // holes' pages, before growing
  uint64_t fence_tick(Stream stream);  // blocks freed by this tick need no wait before an unmap
  void settle(Stream stream);  // waits for the stream's queued work: every block it freed is settled
  // At most every `every` frees of `stream`: gives its completed fences back and records one at the
  // current free tick if fewer than kMaxFences are outstanding. A device error records none.
  void add_fence(Stream stream, uint64_t every = 1);
  static constexpr size_t kMaxFences = 4;      // outstanding fence events per stream
  static constexpr uint64_t kFenceEvery = 16;  // frees of expandable blocks between fences at a free
  // Unmaps its free pages (waiting first if `wait`), releases it if empty; whether a wait is still due
  bool release_expandable(Segment* s, bool wait);
  Block* insert_free(Block* b);                      // coalesce with free neighbours, into the free set
  void count_inactive_split(Block* b, int sign);     // b in/out of the inactive split stats
  void grow_reserved(bool small, int64_t bytes);     // reserved_bytes up; at a new peak, what is pending
  void check_expandable(Segment* s);                 // the walker's page checks
  Block* new_block();          // from spare_blocks_ when it can: no heap call on the fast path
  void recycle(Block* b);
  Block* split(Block* b, size_t size, bool small);  // the free remainder, or nullptr if not split
  void free_block(Block* b);
  void release_segment(Segment* s);
  bool release_cached();  // frees every wholly free segment it may; false when a capture forbids it
  void process_events();
  void sync_events();
  void insert_events(Block* b);
  size_t run_pressure_handlers(Lock& lk, size_t need);
  void keep_soft_limit(Lock& lk, size_t size);
  void check_locked();
  std::string describe_bad_pointer(void* ptr);
  [[noreturn]] void throw_oom(Lock& lk, size_t nbytes, size_t alloc_size, size_t evicted);

  DevicePtr device_;
  AllocatorOptions opts_;
  bool limited_;         // opts_.limit_bytes applies (a fraction of 0 makes a real limit of 0 bytes)
  double fraction_ = -1; // the memory fraction last set; -1: none (the limit came as bytes)
  std::mutex mu_;
  ForkRegistration fork_{&mu_, ForkLevel::allocator};  // a forked child gets it unlocked
  Pool default_pool_;
  std::map<PoolId, Pool*> private_pools_;
  std::vector<std::pair<PoolId, StreamFilter>> captures_;  // graph captures routing allocations
  std::map<char*, Segment*> segments_;                     // by base address
  std::unordered_map<char*, Block*> live_;                 // allocated blocks by address
  std::deque<std::pair<Event, Block*>> events_;            // outstanding record_stream events
  std::vector<Block*> deferred_;   // freed during a capture: events recorded once it ends
  std::vector<Block*> spare_blocks_;  // Block objects to reuse (split/merge churn)
  std::vector<std::pair<int, PressureHandler>> handlers_;
  std::vector<OomObserver> oom_observers_;
  int next_handler_id_ = 1;
  Stats stats_;
  size_t soft_limit_ = 0;
  // Atomic: arm_soft_limit() takes no lock (the pool calls it at every save), and the handlers, which
  // run unlocked, read soft_busy_ to tell a soft-limit call from an out-of-memory one.
  std::atomic<bool> soft_armed_{true};
  std::atomic<uint64_t> soft_arms_{0};  // arm_soft_limit() calls: one during a pressure call keeps it armed
  std::atomic<bool> soft_busy_{false};  // handlers are running for the soft limit: their own allocations go ahead
  std::atomic<int64_t> allocated_now_{0};  // stats_.allocated_bytes' current, for allocated_now()
  int64_t allocated_high_ = 0;  // the allocated peak before the last reset_peak_stats (reclaim_holes')
  int64_t watermark_ = 0;  // like the allocated peak, but the tensor pool's own (user peaks untouched)
  // Fences (reclaim_holes, borrow): per stream, events recorded with the free tick then; once one
  // completed, the stream has run all work queued before any block freed by that tick.
  struct Fences {
    std::deque<std::pair<Event, uint64_t>> outstanding;  // (event, free tick when recorded), oldest first
    uint64_t done = 0;    // the free tick of the newest completed one
    uint64_t polled = 0;  // the free tick when add_fence last looked (it looks every `every` frees)
  };
  uint64_t free_tick_ = 0;
  std::map<Stream, Fences> fences_;
  TraceRing trace_;
};

}  // namespace supermem
