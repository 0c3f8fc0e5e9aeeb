// supermem core types: every struct the caching allocator owns, who owns it, and the invariants
// CachingAllocator::check() enforces. Units: bytes unless a name says otherwise.
//
// Ownership
//   CachingAllocator owns its Pools, Segments and Blocks (deleted only by the allocator).
//   A Segment is one allocation obtained from the Device (prim layer); its Blocks tile it exactly.
//   An expandable segment (option expandable_segments) is instead a reserved virtual address range
//   whose pages are mapped on demand; its Blocks tile the whole range, mapped or not.
//   A Block is either allocated (handed to a user), pending (freed by the user, waiting for events
//   recorded on the streams that used it), free (in its pool's free set, ready for reuse) or
//   unmapped (address space of an expandable segment with no memory behind it).
//
// Invariants (checked by the walker)
//   for each segment:  sum(block.size) == segment.size, blocks address-contiguous via prev/next
//   no two address-adjacent blocks are both free                  (coalescing is complete)
//   segment.mapped_bytes == sum(block.size | block.state != unmapped)    (== size for a plain segment)
//   an unmapped block starts and ends on page boundaries, and no two unmapped blocks are adjacent
//   the device maps exactly the pages under a segment's mapped blocks (asked, for each mapped run)
//   pool.free_blocks  == { b | b.state == free }                  (free sets are exact)
//   live_blocks       == { b | b.state == allocated }             (address map is exact)
//   stats.reserved    == sum(segment.mapped_bytes)                 (memory, not address space)
//   stats.address_space == sum(segment.size | expandable)
//   stats.allocated   == sum(b.size | allocated)
//   stats.reserved    == stats.allocated + pending_bytes + cached_free_bytes
//   stats.inactive_split(_bytes) == count (bytes) of free blocks in segments split in several blocks
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace supermem {

using Stream = std::uintptr_t;  // a cudaStream_t as an integer; 0 is the legacy default stream
using Event = void*;            // an opaque event handle from the Device

constexpr size_t kMinBlockBytes = 512;           // every size is rounded up to this
constexpr size_t kSmallBytes = 1 << 20;          // requests <= 1 MiB come from the small pool
constexpr size_t kSmallSegmentBytes = 2 << 20;   // small pool grows by 2 MiB segments
constexpr size_t kLargeSegmentBytes = 20 << 20;  // requests < 10 MiB share 20 MiB segments
constexpr size_t kMinLargeAlloc = 10 << 20;      // requests >= 10 MiB get their own segment...
constexpr size_t kRoundLarge = 2 << 20;          // ...rounded up to 2 MiB

enum class BlockState : uint8_t { free, allocated, pending, unmapped };

struct Pool;
struct Segment;

struct Block {
  char* ptr = nullptr;
  size_t size = 0;        // rounded size, what the block spans
  size_t requested = 0;   // what the user asked for (allocated blocks only)
  Stream stream = 0;      // allocation stream: the block returns to this stream's free list
  BlockState state = BlockState::free;
  Segment* segment = nullptr;
  Block* prev = nullptr;  // address-ordered neighbours inside the segment
  Block* next = nullptr;
  std::vector<Stream> stream_uses;  // other streams that used it (record_stream)
  int pending_events = 0;           // events still outstanding before a pending block is free
  uint64_t freed_at = 0;  // free blocks: the allocator's free tick when its memory was last freed (0: never used)
};

struct BlockLess {  // free sets are ordered (stream, size, address): per-stream best fit
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
  }
};

struct Segment {
  char* base = nullptr;
  size_t size = 0;          // bytes of address space (all mapped for a plain segment)
  size_t mapped_bytes = 0;  // bytes with memory behind them: what counts as reserved
  size_t page_bytes = 0;    // > 0: an expandable segment, mapped and unmapped in pages of this size
  Stream stream = 0;        // stream of the allocation that created it
  bool small = false;       // belongs to the small (<= 1 MiB) size class
  Pool* pool = nullptr;
  Block* head = nullptr;    // lowest-address block
  bool expandable() const { return page_bytes != 0; }
};

// A pool is a set of segments whose blocks are only reused among themselves: the default pool,
// or a private pool that a CUDA graph captured into (its memory is frozen until the graph is gone).
struct Pool {
  uint64_t id_hi = 0, id_lo = 0;  // (0, 0) for the default pool, else torch's MempoolId_t
  std::set<Block*, BlockLess> small_free, large_free;
  int users = 0;                  // graphs holding the pool (private pools only)
  bool capturing = false;         // allocations are being routed here right now
  std::set<Block*, BlockLess>& free_set(bool small) { return small ? small_free : large_free; }
};

// current / peak / total counters of one quantity, split like PyTorch's: [all, small, large]
struct Stat {
  int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void add(int64_t n) {
    current += n;
    if (n > 0) allocated += n; else freed -= n;
    if (current > peak) peak = current;
  }
};
enum StatKind { kAll = 0, kSmallPool = 1, kLargePool = 2 };
struct StatArray {
  Stat s[3];
  void add(bool small, int64_t n) { s[kAll].add(n); s[small ? kSmallPool : kLargePool].add(n); }
  void reset_peak() { for (auto& x : s) x.peak = x.current; }
  void reset_totals() { for (auto& x : s) x.allocated = x.freed = 0; }
};

struct Stats {
  StatArray allocated_bytes, reserved_bytes, active_bytes, requested_bytes;
  StatArray allocation, segment, active;  // counts of blocks / segments
  // Free blocks that share their segment with other blocks (cached, but not returnable to the device
  // as they are), counted as PyTorch counts them: updated on split, shrink, free and merge.
  StatArray inactive_split, inactive_split_bytes;
  int64_t num_alloc_retries = 0, num_ooms = 0, num_sync_all_streams = 0;
  int64_t num_device_alloc = 0, num_device_free = 0, num_pressure_calls = 0;
  int64_t pressure_freed_bytes = 0;
  int64_t address_space_bytes = 0;  // reserved by expandable segments (their memory is in reserved_bytes)
  int64_t num_reclaims = 0;  // free blocks whose pages an expandable segment moved to a request
  int64_t num_reclaim_waits = 0;  // host waits for a stream before such moves (a fence spared the rest)
  int64_t reclaimed_bytes = 0;    // the pages those moves took (their memory mapped again where needed)
  int64_t num_borrows = 0;  // misses served by another stream's free block whose last use completed
  // Pending bytes (freed, awaiting another stream's event: record_stream or a borrow) when reserved bytes
  // last set their peak: the part of reserved - allocated at the peak that is copies in flight, not
  // cached free memory.
  int64_t pending_at_reserved_peak = 0;
};

// What the user did wrong; the binding turns it into a Python ValueError subclass.
struct UsageError : std::exception {
  std::string msg;
  explicit UsageError(std::string m) : msg(std::move(m)) {}
  const char* what() const noexcept override { return msg.c_str(); }
};

// Out of device memory after every recovery step; message reads like PyTorch's.
struct OutOfMemory : std::exception {
  std::string msg;
  size_t requested = 0;
  explicit OutOfMemory(std::string m, size_t req) : msg(std::move(m)), requested(req) {}
  const char* what() const noexcept override { return msg.c_str(); }
};

// The device or driver failed in a way that is not a lack of memory.
struct DeviceError : std::exception {
  std::string msg;
  explicit DeviceError(std::string m) : msg(std::move(m)) {}
  const char* what() const noexcept override { return msg.c_str(); }
};

// "1.50 GiB": exactly as PyTorch's format_size (c10/cuda/CUDACachingAllocator.cpp) writes sizes in its OOM
// messages, which tools parse: up to 1024 in bytes, then KiB, MiB, and GiB from 1 GiB + 1 on.
std::string format_size(size_t n);

}  // namespace supermem
