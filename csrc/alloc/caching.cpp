#include "caching.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <stdexcept>
#ifdef __GLIBCXX__
#include <cxxabi.h>  // abi::__forced_unwind
#endif

namespace supermem {

namespace {

constexpr size_t kMaxRequest = size_t(1) << 60;  // 1 EiB: beyond this, rounding would overflow

size_t round_size(size_t n) {
  return n < kMinBlockBytes ? kMinBlockBytes : (n + kMinBlockBytes - 1) / kMinBlockBytes * kMinBlockBytes;
}

size_t segment_size(size_t size, bool small) {
  if (small) return kSmallSegmentBytes;
  if (size < kMinLargeAlloc) return kLargeSegmentBytes;
  return (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
  return buf;
}

}  // namespace

std::string format_size(size_t n) {
  char buf[48];
  if (n <= 1024) std::snprintf(buf, sizeof buf, "%zu bytes", n);
  else if (n <= (size_t(1) << 20)) std::snprintf(buf, sizeof buf, "%.2f KiB", n / 1024.0);
  else if (n <= (size_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f MiB", n / 1048576.0);
  else std::snprintf(buf, sizeof buf, "%.2f GiB", n / 1073741824.0);
  return buf;
}

CachingAllocator::CachingAllocator(DevicePtr device, AllocatorOptions options)
    : device_(std::move(device)), opts_(options), limited_(options.limit_bytes > 0),
      trace_(options.trace_capacity) {
  if (!device_) throw UsageError("supermem: CachingAllocator needs a device, got none");
  if (opts_.expandable && opts_.passthrough)
    throw UsageError("supermem: expandable segments cache memory and passthrough caches none: choose one");
  if (opts_.expandable && device_->vm_page_bytes() == 0)
    throw UsageError("supermem: expandable segments need virtual memory, which the device " + device_->name() +
                     " does not have (set expandable_segments:false)");
  live_.reserve(4096);
}

CachingAllocator::~CachingAllocator() {
  // Return what we can. Live blocks belong to someone else's tensors: their memory stays mapped.
  try {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [stream, f] : fences_)
      for (auto& [e, tick] : f.outstanding) device_->event_release(e);
    for (auto& [base, s] : segments_) {
      if (s->expandable()) {
        bool in_use = false;
        for (Block* b = s->head; b; b = b->next)
          in_use |= b->state == BlockState::allocated || b->state == BlockState::pending;
        if (in_use) continue;
        // Free blocks end on page boundaries here: only unmapped blocks or the range's ends border them.
        for (Block* b = s->head; b; b = b->next)
          if (b->state == BlockState::free) device_->vm_unmap(b->ptr, b->size, true);
        device_->vm_release(s->base, s->size);
        continue;
      }
      bool whole_free = s->head->state == BlockState::free && !s->head->next;
      if (whole_free) device_->segment_free(s->base, s->size);
    }
  } catch (...) {
    // The device may already be gone at interpreter shutdown.
  }
  for (auto& [base, s] : segments_) {
    for (Block* b = s->head; b;) {
      Block* n = b->next;
      delete b;
      b = n;
    }
    delete s;
  }
  for (auto& [id, p] : private_pools_) delete p;
  for (Block* b : spare_blocks_) delete b;
}

// ---------------------------------------------------------------- fast path

void* CachingAllocator::malloc(size_t nbytes, Stream stream) {
  if (nbytes == 0) return nullptr;
  Lock lk(mu_);
  if ((!events_.empty() || !deferred_.empty()) && captures_.empty()) process_events();
  if (nbytes > kMaxRequest) throw_oom(lk, nbytes, nbytes, 0);
  size_t size = round_size(nbytes);
  if (soft_limit_ && stats_.allocated_bytes.s[kAll].current + size > soft_limit_) keep_soft_limit(lk, size);
  bool small = size <= kSmallBytes;
  Pool& pool = pool_for(stream);
  Block* b = take_free(pool, small, stream, size);
  bool slow = !b;
  if (slow) b = malloc_slow(lk, pool, small, stream, size, nbytes);
  bool was_split = b->prev || b->next;  // an inactive split block until now
  Block* rest = split(b, size, small);
  if (rest && was_split) {  // the inactive block shrinks by what is handed out
    stats_.inactive_split_bytes.add(small, -static_cast<int64_t>(b->size));
  } else if (rest) {  // a whole segment's block splits: its remainder is a new inactive split block
    stats_.inactive_split.add(small, 1);
    stats_.inactive_split_bytes.add(small, rest->size);
  } else if (was_split) {  // the whole inactive block becomes active
    stats_.inactive_split.add(small, -1);
    stats_.inactive_split_bytes.add(small, -static_cast<int64_t>(b->size));
  }
  b->state = BlockState::allocated;
  b->requested = nbytes;
  live_.emplace(b->ptr, b);
  stats_.allocated_bytes.add(small, b->size);
  allocated_now_.store(stats_.allocated_bytes.s[kAll].current, std::memory_order_relaxed);
  watermark_ = std::max(watermark_, stats_.allocated_bytes.s[kAll].current);
  stats_.requested_bytes.add(small, nbytes);
  stats_.active_bytes.add(small, b->size);
  stats_.allocation.add(small, 1);
  stats_.active.add(small, 1);
  trace_.push(TraceKind::alloc, b->ptr, b->size, stream);
  if (opts_.debug >= 2 || (slow && opts_.debug >= 1)) check_locked();
  return b->ptr;
}

void CachingAllocator::free(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> g(mu_);
  auto it = live_.find(static_cast<char*>(ptr));
  if (it == live_.end()) throw UsageError(describe_bad_pointer(ptr));
  Block* b = it->second;
  live_.erase(it);
  bool small = b->segment->small;
  stats_.allocated_bytes.add(small, -static_cast<int64_t>(b->size));
  allocated_now_.store(stats_.allocated_bytes.s[kAll].current, std::memory_order_relaxed);
  stats_.requested_bytes.add(small, -static_cast<int64_t>(b->requested));
  stats_.allocation.add(small, -1);
  b->requested = 0;
  if (b->stream_uses.empty()) {
    free_block(b);
  } else {
    b->state = BlockState::pending;
    trace_.push(TraceKind::free_requested, b->ptr, b->size, b->stream);
    if (captures_.empty()) insert_events(b);
    else deferred_.push_back(b);  // querying events recorded inside a capture is illegal
  }
  if (opts_.debug >= 2) check_locked();
}

Block* CachingAllocator::take_free(Pool& pool, bool small, Stream stream, size_t size) {
  auto& set = pool.free_set(small);
  Block key;
  key.stream = stream;
  key.size = size;
  auto it = set.lower_bound(&key);
  if (it == set.end() || (*it)->stream != stream) return nullptr;
  Block* b = *it;
  set.erase(it);
  return b;
}

// A free block of another stream's default-pool segments that no work queued on that stream can
// still use: the stream ran past a fence recorded after the block's free (or the block was never used).
// It stays its owner's (its free list, its segment) and goes to `stream` as a use recorded there: its
// free waits for an event on `stream` before the owner reuses it. The best fit over the other streams;
// nullptr if none. A stream whose fitting blocks are all too recent gets a fence for the next miss, or
// with settle_streams (before an out-of-memory error) a wait for its queued work, and then lends.
// Not during a capture (events may not be queried then) nor for private pools.
Block* CachingAllocator::borrow(Pool& pool, bool small, Stream stream, size_t size, bool settle_streams) {
  if (&pool != &default_pool_ || !captures_.empty() || opts_.passthrough) return nullptr;
  auto& set = pool.free_set(small);
  Block* best = nullptr;
  Block key;
  for (auto it = set.begin(); it != set.end();) {
    Stream owner = (*it)->stream;
    if (owner != stream) {
      key.stream = owner;
      key.size = size;
      key.ptr = nullptr;
      auto fit = set.lower_bound(&key);
      bool fits = fit != set.end() && (*fit)->stream == owner;
      uint64_t done = fence_tick(owner);
      if (fits && (*fit)->freed_at > done && settle_streams) {  // (the best fit alone tells: one wait)
        settle(owner);
        done = free_tick_;
      }
      bool recent = false;
      for (auto c = fit; fits && c != set.end() && (*c)->stream == owner; ++c) {
        if ((*c)->freed_at > done) {
          recent = true;
          continue;
        }
        if (!best || (*c)->size < best->size) best = *c;
        break;
      }
      if (recent) add_fence(owner);
    }
    key.stream = owner;  // past the owner's largest: the next stream's first block
    key.size = SIZE_MAX;
    key.ptr = reinterpret_cast<char*>(UINTPTR_MAX);
    it = set.upper_bound(&key);
  }
  if (!best) return nullptr;
  set.erase(best);
  best->stream_uses.push_back(stream);
  ++stats_.num_borrows;
  return best;
}

Block* CachingAllocator::split(Block* b, size_t size, bool small) {
  size_t remaining = b->size - size;
  // An expandable segment splits as the small pool does: its rest is not stranded in a fixed segment
  // (it merges with the pages mapped after it), so no large remainder is needed (PyTorch's rule too).
  bool fine = small || b->segment->expandable();
  bool should = !opts_.passthrough && (fine ? remaining >= kMinBlockBytes : remaining > kSmallBytes);
  if (!should) return nullptr;
  Block* rest = new_block();
  rest->ptr = b->ptr + size;
  rest->size = remaining;
  rest->stream = b->stream;
  rest->segment = b->segment;
  rest->freed_at = b->freed_at;
  rest->prev = b;
  rest->next = b->next;
  if (b->next) b->next->prev = rest;
  b->next = rest;
  b->size = size;
  b->segment->pool->free_set(small).insert(rest);
  return rest;
}

Block* CachingAllocator::new_block() {
  if (spare_blocks_.empty()) return new Block;
  Block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  return b;
}

void CachingAllocator::recycle(Block* b) {
  b->stream_uses.clear();
  b->requested = 0;
  b->pending_events = 0;
  b->freed_at = 0;
  b->state = BlockState::free;
  b->prev = b->next = nullptr;
  spare_blocks_.push_back(b);
}

void CachingAllocator::free_block(Block* b) {
  Segment* s = b->segment;
  bool small = s->small;
  stats_.active_bytes.add(small, -static_cast<int64_t>(b->size));
  stats_.active.add(small, -1);
  b->state = BlockState::free;
  b->stream_uses.clear();
  b->freed_at = ++free_tick_;
  trace_.push(TraceKind::free_completed, b->ptr, b->size, b->stream);
  b = insert_free(b);
  bool pool_gone = s->pool != &default_pool_ && s->pool->users == 0;
  if (!captures_.empty()) return;  // nothing goes back to the device during a capture
  if (s->expandable()) {
    if (pool_gone) unmap_free_pages(b, true);  // may release the segment
    else if (s->pool == &default_pool_) add_fence(s->stream, kFenceEvery);
    return;
  }
  bool whole = !b->prev && !b->next;
  if (whole && (opts_.passthrough || pool_gone)) release_segment(s);
}

Block* CachingAllocator::insert_free(Block* b) {
  Segment* s = b->segment;
  bool small = s->small;
  auto& set = s->pool->free_set(small);
  int64_t split_blocks = 0, split_bytes = 0;  // net change of the inactive split stats
  for (Block* n : {b->prev, b->next}) {  // coalesce with free neighbours
    if (!n || n->state != BlockState::free) continue;
    set.erase(n);
    --split_blocks;  // a free neighbour is always an inactive split block
    split_bytes -= static_cast<int64_t>(n->size);
    if (n == b->prev) {
      b->ptr = n->ptr;
      b->prev = n->prev;
      if (b->prev) b->prev->next = b;
      else s->head = b;
    } else {
      b->next = n->next;
      if (b->next) b->next->prev = b;
    }
    b->size += n->size;
    b->freed_at = std::max(b->freed_at, n->freed_at);
    recycle(n);
  }
  if (b->prev || b->next) ++split_blocks, split_bytes += static_cast<int64_t>(b->size);
  if (split_blocks) stats_.inactive_split.add(small, split_blocks);
  if (split_bytes) stats_.inactive_split_bytes.add(small, split_bytes);
  set.insert(b);
  return b;
}

// ---------------------------------------------------------------- slow path

Pool& CachingAllocator::pool_for(Stream stream) {
  for (auto& [id, filter] : captures_)
    if (filter(stream)) return *private_pools_.at(id);
  return default_pool_;
}

Block* CachingAllocator::malloc_slow(Lock& lk, Pool& pool, bool small, Stream stream, size_t size,
                                     size_t nbytes) {
  if (Block* b = borrow(pool, small, stream, size)) return b;
  if (Block* b = new_segment(pool, small, stream, size)) return b;
  // Stage 2: give cached segments back to the device and try again.
  ++stats_.num_alloc_retries;
  if (release_cached()) {
    if (Block* b = take_free(pool, small, stream, size)) return b;  // a synced block may fit now
    if (Block* b = borrow(pool, small, stream, size, /*settle_streams=*/true)) return b;
    if (Block* b = new_segment(pool, small, stream, size)) return b;
  }
  // Stage 3: ask the pressure handlers (tensor pool eviction) to free memory, then retry.
  size_t evicted = 0;
  if (captures_.empty() && !handlers_.empty()) {
    evicted = run_pressure_handlers(lk, size);
    if (captures_.empty()) process_events();
    Pool& again = pool_for(stream);  // captures may have begun while the lock was released
    if (Block* b = take_free(again, small, stream, size)) return b;
    if (Block* b = new_segment(again, small, stream, size)) return b;
    if (release_cached()) {
      if (Block* b = take_free(again, small, stream, size)) return b;
      if (Block* b = new_segment(again, small, stream, size)) return b;
    }
  }
  if (opts_.debug >= 1) check_locked();
  throw_oom(lk, nbytes, size, evicted);
}

Block* CachingAllocator::new_segment(Pool& pool, bool small, Stream stream, size_t size) {
  if (opts_.expandable) return map_for(pool, small, stream, size);
  size_t limit = opts_.limit_bytes;
  size_t reserved = stats_.reserved_bytes.s[kAll].current;
  // Prefer PyTorch's segment sizes; under a tight limit or a full device fall back to the exact size.
  auto try_alloc = [&](size_t want) -> void* {
    if (limited_ && reserved + want > limit) return nullptr;
    return device_->segment_alloc(want, stream);
  };
  size_t got = opts_.passthrough ? size : std::max(segment_size(size, small), opts_.segment_bytes);
  void* p = try_alloc(got);
  if (!p && got != size) p = try_alloc(got = size);
  if (!p) return nullptr;
  ++stats_.num_device_alloc;
  auto* s = new Segment;
  s->base = static_cast<char*>(p);
  s->size = got;
  s->mapped_bytes = got;
  s->stream = stream;
  s->small = small;
  s->pool = &pool;
  Block* b = new_block();
  b->ptr = s->base;
  b->size = got;
  b->stream = stream;
  b->segment = s;
  s->head = b;
  segments_.emplace(s->base, s);
  grow_reserved(small, got);
  stats_.segment.add(small, 1);
  trace_.push(TraceKind::segment_alloc, s->base, got, stream);
  return b;
}

void CachingAllocator::grow_reserved(bool small, int64_t bytes) {
  stats_.reserved_bytes.add(small, bytes);
  const Stat& r = stats_.reserved_bytes.s[kAll];
  if (r.current == r.peak)
    stats_.pending_at_reserved_peak = stats_.active_bytes.s[kAll].current - stats_.allocated_bytes.s[kAll].current;
}

void CachingAllocator::release_segment(Segment* s) {
  Block* b = s->head;
  if (s->expandable()) {  // all of it unmapped already: only the address space goes back
    device_->vm_release(s->base, s->size);
    stats_.address_space_bytes -= static_cast<int64_t>(s->size);
  } else {
    s->pool->free_set(s->small).erase(b);
    device_->segment_free(s->base, s->size);
    ++stats_.num_device_free;
    stats_.reserved_bytes.add(s->small, -static_cast<int64_t>(s->size));
    trace_.push(TraceKind::segment_free, s->base, s->size, s->stream);
  }
  stats_.segment.add(s->small, -1);
  segments_.erase(s->base);
  recycle(b);
  delete s;
}

bool CachingAllocator::release_cached() {
  if (!captures_.empty()) return false;  // cudaFree and event syncs are illegal during capture
  sync_events();
  std::vector<Segment*> whole, expandable;
  for (auto& [base, s] : segments_) {
    bool freeable = s->pool == &default_pool_ || s->pool->users == 0;
    if (freeable && s->expandable()) expandable.push_back(s);
    else if (freeable && s->head->state == BlockState::free && !s->head->next) whole.push_back(s);
  }
  for (Segment* s : whole) release_segment(s);
  bool wait = true;  // one wait for the device before the first unmap covers them all (under the lock)
  for (Segment* s : expandable) wait = release_expandable(s, wait);
  if (opts_.expandable) device_->vm_trim();  // (memory a failed move left set aside)
  for (auto& [stream, f] : fences_) fence_tick(stream);  // completed fences' events go back
  for (auto it = private_pools_.begin(); it != private_pools_.end();) {  // forget empty dead pools
    Pool* p = it->second;
    bool empty = p->small_free.empty() && p->large_free.empty();
    bool used = std::any_of(segments_.begin(), segments_.end(),
                            [&](auto& kv) { return kv.second->pool == p; });
    if (p->users == 0 && empty && !used && !p->capturing) {
      delete p;
      it = private_pools_.erase(it);
    } else {
      ++it;
    }
  }
  return true;
}

void CachingAllocator::insert_events(Block* b) {
  for (Stream s : b->stream_uses) {
    events_.emplace_back(device_->event_record(s), b);
    ++b->pending_events;
  }
}

void CachingAllocator::process_events() {
  for (Block* b : deferred_) insert_events(b);
  deferred_.clear();
  for (auto it = events_.begin(); it != events_.end();) {
    if (!device_->event_done(it->first)) {
      ++it;
      continue;
    }
    Block* b = it->second;
    device_->event_release(it->first);
    it = events_.erase(it);
    if (--b->pending_events == 0) free_block(b);
  }
}

void CachingAllocator::sync_events() {
  for (Block* b : deferred_) insert_events(b);
  deferred_.clear();
  ++stats_.num_sync_all_streams;  // as PyTorch counts synchronize_and_free_events: every call
  while (!events_.empty()) {
    auto [e, b] = events_.front();
    events_.pop_front();
    device_->event_wait(e);
    device_->event_release(e);
    if (--b->pending_events == 0) free_block(b);
  }
}

size_t CachingAllocator::run_pressure_handlers(Lock& lk, size_t need) {
  auto handlers = handlers_;  // copied: handlers may be added or removed while unlocked
  ++stats_.num_pressure_calls;
  lk.unlock();
  size_t freed = 0;
  std::exception_ptr error;
  try {
    for (auto& [id, h] : handlers) freed += h(need);
#ifdef __GLIBCXX__
  } catch (abi::__forced_unwind&) {
    // A thread being ended (a handler asked for the GIL as the interpreter finalized): let it go on
    // unwinding. Kept, it would abort the process ("FATAL: exception not rethrown").
    throw;
#endif
  } catch (...) {
    error = std::current_exception();
  }
  handlers.clear();  // unlocked: dropping a removed handler's last reference may re-enter us
  lk.lock();
  if (error) std::rethrow_exception(error);
  stats_.pressure_freed_bytes += freed;
  return freed;
}

void CachingAllocator::keep_soft_limit(Lock& lk, size_t size) {
  if (!soft_armed_ || soft_busy_ || !captures_.empty() || handlers_.empty()) return;
  size_t need = stats_.allocated_bytes.s[kAll].current + size - soft_limit_;
  const uint64_t arms = soft_arms_.load();
  soft_busy_ = true;
  size_t freed = 0;
  try {
    freed = run_pressure_handlers(lk, need);
  } catch (...) {
    soft_busy_ = false;
    throw;
  }
  soft_busy_ = false;
  // Nothing more to give until the pool holds more again; unless it was armed meanwhile (a save on
  // another thread, or in a handler, while the handlers ran unlocked): then it holds more already.
  if (freed < need && soft_arms_.load() == arms) soft_armed_ = false;
  if (captures_.empty()) process_events();
}

void CachingAllocator::throw_oom(Lock& lk, size_t nbytes, size_t alloc_size, size_t evicted) {
  ++stats_.num_ooms;
  trace_.push(TraceKind::oom, nullptr, alloc_size, 0);
  // Formatted with snprintf, not iostreams: no locale machinery on this path.
  std::string m = "CUDA out of memory. ";
  if (nbytes > kMaxRequest) {
    m += "Tried to allocate more than 1EB memory.";
  } else {
    size_t total = device_->total_bytes(), free = device_->free_bytes();
    size_t allocated = stats_.allocated_bytes.s[kAll].current;
    size_t reserved = stats_.reserved_bytes.s[kAll].current;
    std::string where = device_->name() == "sim" ? "Simulated device" : "GPU " + std::to_string(device_->index());
    m += "Tried to allocate " + format_size(nbytes) + ". " + where + " has a total capacity of " +
         format_size(total) + " of which " + format_size(free) + " is free.";
    if (limited_) m += " The supermem limit is " + format_size(opts_.limit_bytes) + ".";
    m += " Of the allocated memory " + format_size(allocated) + " is allocated by PyTorch, and " +
         format_size(reserved - allocated) + " is reserved by PyTorch but unallocated (supermem: requested " +
         std::to_string(nbytes) + " bytes, allocated " + std::to_string(allocated) + " bytes, reserved " +
         std::to_string(reserved) + " bytes, evicted " + std::to_string(evicted) + " bytes under pressure).";
    if (opts_.expandable) {
      m += " Expandable segments map " + format_size(reserved) + " in " +
           format_size(static_cast<size_t>(stats_.address_space_bytes)) + " of reserved address space.";
    } else if (reserved - allocated >= alloc_size && !opts_.passthrough && device_->vm_page_bytes()) {
      // Enough cached bytes, none of them in one piece: what expandable segments avoid (PyTorch's hint).
      m += " If reserved but unallocated memory is large try setting SUPERMEM_CONF=expandable_segments:true "
           "to avoid fragmentation.";
    }
  }
  auto observers = oom_observers_;
  std::string msg = std::move(m);
  lk.unlock();  // observers may allocate, free or take the GIL
  // Observers report their own failures (the Python ones as unraisable): what still escapes is the
  // user's (Ctrl-C, sys.exit() from Python) and reaches the caller instead of the OOM, as from a
  // pressure handler.
  for (auto& obs : observers) obs(device_->index(), nbytes, msg);
  throw OutOfMemory(msg, nbytes);
}

// ---------------------------------------------------------------- everything else

void CachingAllocator::record_stream(void* ptr, Stream stream) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = live_.find(static_cast<char*>(ptr));
  if (it == live_.end()) throw UsageError(describe_bad_pointer(ptr));
  Block* b = it->second;
  if (stream == b->stream) return;
  auto& uses = b->stream_uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> g(mu_);
  release_cached();
  if (opts_.debug >= 1) check_locked();
}

size_t CachingAllocator::allocation_size(void* ptr) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = live_.find(static_cast<char*>(ptr));
  if (it == live_.end()) throw UsageError(describe_bad_pointer(ptr));
  return it->second->size;
}

bool CachingAllocator::owns(void* ptr) {
  std::lock_guard<std::mutex> g(mu_);
  return live_.count(static_cast<char*>(ptr)) > 0;
}

size_t CachingAllocator::largest_free_block() {
  std::lock_guard<std::mutex> g(mu_);
  size_t largest = 0;
  for (auto& [base, s] : segments_)
    for (Block* b = s->head; b; b = b->next)
      if (b->state == BlockState::free) largest = std::max(largest, b->size);
  return largest;
}

std::vector<void*> CachingAllocator::pool_live_blocks(PoolId id) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<void*> out;
  auto it = private_pools_.find(id);
  if (it == private_pools_.end()) return out;
  for (auto& [base, s] : segments_)
    if (s->pool == it->second)
      for (Block* b = s->head; b; b = b->next)
        if (b->state == BlockState::allocated) out.push_back(b->ptr);
  return out;
}

void CachingAllocator::begin_allocate_to_pool(PoolId id, StreamFilter filter) {
  std::lock_guard<std::mutex> g(mu_);
  Pool*& p = private_pools_[id];
  if (!p) {
    p = new Pool;
    p->id_hi = id.first;
    p->id_lo = id.second;
  }
  ++p->users;
  p->capturing = true;
  captures_.emplace_back(id, std::move(filter));
}

void CachingAllocator::end_allocate_to_pool(PoolId id) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = captures_.begin(); it != captures_.end(); ++it) {
    if (it->first == id) {
      captures_.erase(it);
      break;
    }
  }
  auto p = private_pools_.find(id);
  if (p != private_pools_.end()) {
    p->second->capturing = std::any_of(captures_.begin(), captures_.end(),
                                       [&](auto& c) { return c.first == id; });
  }
}

void CachingAllocator::release_pool(PoolId id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = private_pools_.find(id);
  if (it == private_pools_.end()) return;
  if (it->second->users > 0) --it->second->users;
  if (it->second->users == 0) release_cached();  // its wholly free segments go back now
}

int CachingAllocator::add_pressure_handler(PressureHandler handler) {
  std::lock_guard<std::mutex> g(mu_);
  handlers_.emplace_back(next_handler_id_, std::move(handler));
  return next_handler_id_++;
}

void CachingAllocator::add_oom_observer(OomObserver observer) {
  std::lock_guard<std::mutex> g(mu_);
  oom_observers_.push_back(std::move(observer));
}

void CachingAllocator::remove_pressure_handler(int id) {
  PressureHandler removed;  // destroyed after the lock is released: its destructor may re-enter us
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = handlers_.begin(); it != handlers_.end(); ++it) {
    if (it->first == id) {
      removed = std::move(it->second);
      handlers_.erase(it);
      break;
    }
  }
}

Stats CachingAllocator::stats() {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

size_t CachingAllocator::take_watermark() {
  std::lock_guard<std::mutex> g(mu_);
  size_t w = watermark_;
  watermark_ = stats_.allocated_bytes.s[kAll].current;
  return w;
}

void CachingAllocator::set_soft_limit(size_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  soft_limit_ = bytes;
  soft_armed_ = true;
}

size_t CachingAllocator::soft_limit() {
  std::lock_guard<std::mutex> g(mu_);
  return soft_limit_;
}

void CachingAllocator::arm_soft_limit() {
  soft_arms_.fetch_add(1);
  soft_armed_ = true;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard<std::mutex> g(mu_);
  allocated_high_ = std::max(allocated_high_, stats_.allocated_bytes.s[kAll].peak);
  for (StatArray* a : all_stat_arrays()) a->reset_peak();
  stats_.pending_at_reserved_peak = stats_.active_bytes.s[kAll].current - stats_.allocated_bytes.s[kAll].current;
}

void CachingAllocator::reset_accumulated_stats() {
  std::lock_guard<std::mutex> g(mu_);
  for (StatArray* a : all_stat_arrays()) a->reset_totals();
  stats_.num_alloc_retries = stats_.num_ooms = stats_.num_sync_all_streams = 0;
  stats_.num_device_alloc = stats_.num_device_free = stats_.num_reclaims = stats_.num_reclaim_waits = 0;
  stats_.num_borrows = 0;
  stats_.reclaimed_bytes = 0;
  stats_.num_pressure_calls = stats_.pressure_freed_bytes = 0;
}

size_t CachingAllocator::limit_bytes() {
  std::lock_guard<std::mutex> g(mu_);
  return opts_.limit_bytes;
}

void CachingAllocator::set_limit_bytes(size_t limit) {
  std::lock_guard<std::mutex> g(mu_);
  opts_.limit_bytes = limit;
  limited_ = limit > 0;
  fraction_ = -1;
  if (limit && static_cast<size_t>(stats_.reserved_bytes.s[kAll].current) > limit) release_cached();
}

void CachingAllocator::set_memory_fraction(double fraction) {
  if (!(fraction >= 0 && fraction <= 1))  // also NaN
    throw UsageError("supermem: a memory fraction must be in [0, 1], got " + std::to_string(fraction));
  size_t limit = static_cast<size_t>(fraction * static_cast<double>(device_->total_bytes()));
  std::lock_guard<std::mutex> g(mu_);
  // As PyTorch's setMemoryFraction: a limit on new segments (0 allows none); the cache stays.
  opts_.limit_bytes = limit;
  limited_ = true;
  fraction_ = fraction;
}

double CachingAllocator::memory_fraction() {
  size_t total = device_->total_bytes();
  std::lock_guard<std::mutex> g(mu_);
  if (fraction_ >= 0) return fraction_;
  return limited_ && total ? static_cast<double>(opts_.limit_bytes) / static_cast<double>(total) : 1.0;
}

std::string CachingAllocator::describe_bad_pointer(void* ptr) {
  char* p = static_cast<char*>(ptr);
  auto it = segments_.upper_bound(p);
  if (it != segments_.begin()) {
    Segment* s = std::prev(it)->second;
    if (p < s->base + s->size) {
      for (Block* b = s->head; b; b = b->next) {
        if (b->ptr == p)
          return "supermem: double free or free of a block that is not allocated: " + hex(p) + " is a " +
                 (b->state == BlockState::pending ? "pending" : b->state == BlockState::unmapped ? "free (unmapped)" : "free") +
                 " block";
        if (p > b->ptr && p < b->ptr + b->size && b->state != BlockState::unmapped)
          return "supermem: " + hex(p) + " points inside the block at " + hex(b->ptr) + " (" +
                 format_size(b->size) + "); pass the address malloc returned";
      }
    }
  }
  // Also what a double free looks like once the block's segment went back to the device.
  return "supermem: " + hex(p) + " was not allocated by this allocator (foreign pointer), or its " +
         "block was freed already (double free) and its memory returned to the device";
}

void CachingAllocator::check() {
  std::lock_guard<std::mutex> g(mu_);
  check_locked();
}

void CachingAllocator::check_locked() {
  auto fail = [](const std::string& what) { throw std::logic_error("supermem invariant violated: " + what); };
  int64_t reserved = 0, allocated = 0, pending = 0, cached = 0, split_free = 0, split_free_bytes = 0;
  int64_t address_space = 0;
  size_t n_free = 0, n_live = 0;
  for (auto& [base, s] : segments_) {
    if (s->base != base || s->head->ptr != s->base || s->head->prev) fail("segment head at " + hex(base));
    reserved += s->mapped_bytes;
    if (s->expandable()) address_space += s->size, check_expandable(s);
    size_t covered = 0, mapped = 0;
    for (Block* b = s->head; b; b = b->next) {
      if (b->ptr != s->base + covered) fail("blocks of segment " + hex(base) + " are not contiguous");
      if (b->segment != s) fail("block " + hex(b->ptr) + " names the wrong segment");
      if (b->next && b->next->prev != b) fail("broken prev/next links at " + hex(b->ptr));
      covered += b->size;
      if (b->state != BlockState::unmapped) mapped += b->size;
      auto& set = s->pool->free_set(s->small);
      bool in_set = set.count(b) > 0;
      switch (b->state) {
        case BlockState::free:
          ++n_free;
          cached += b->size;
          if (!in_set) fail("free block " + hex(b->ptr) + " missing from its free set");
          if (b->next && b->next->state == BlockState::free) fail("uncoalesced free blocks at " + hex(b->ptr));
          if (b->prev || b->next) ++split_free, split_free_bytes += b->size;
          break;
        case BlockState::allocated:
          ++n_live;
          allocated += b->size;
          if (in_set) fail("allocated block " + hex(b->ptr) + " is in a free set");
          if (!live_.count(b->ptr) || live_.at(b->ptr) != b) fail("allocated block " + hex(b->ptr) + " missing from the live map");
          break;
        case BlockState::pending:
          pending += b->size;
          if (in_set) fail("pending block " + hex(b->ptr) + " is in a free set");
          break;
        case BlockState::unmapped:
          if (in_set) fail("unmapped block " + hex(b->ptr) + " is in a free set");
          if (!s->expandable()) fail("unmapped block " + hex(b->ptr) + " in a plain segment");
          break;
      }
    }
    if (covered != s->size) fail("blocks of segment " + hex(base) + " do not cover it");
    if (mapped != s->mapped_bytes) fail("mapped blocks of segment " + hex(base) + " != its mapped bytes");
  }
  if (address_space != stats_.address_space_bytes) fail("address_space stat != sum of expandable segments");
  size_t set_total = default_pool_.small_free.size() + default_pool_.large_free.size();
  for (auto& [id, p] : private_pools_) set_total += p->small_free.size() + p->large_free.size();
  if (set_total != n_free) fail("free sets hold " + std::to_string(set_total) + " blocks, segments " + std::to_string(n_free));
  if (live_.size() != n_live) fail("live map holds " + std::to_string(live_.size()) + " blocks, segments " + std::to_string(n_live));
  if (reserved != stats_.reserved_bytes.s[kAll].current) fail("reserved stat != sum of segments");
  if (allocated != stats_.allocated_bytes.s[kAll].current) fail("allocated stat != sum of allocated blocks");
  if (allocated_now_.load() != stats_.allocated_bytes.s[kAll].current) fail("allocated_now != allocated stat");
  if (allocated + pending != stats_.active_bytes.s[kAll].current) fail("active stat != allocated + pending");
  if (reserved != allocated + pending + cached) fail("reserved != allocated + pending + cached free");
  if (split_free != stats_.inactive_split.s[kAll].current) fail("inactive_split stat != free blocks of split segments");
  if (split_free_bytes != stats_.inactive_split_bytes.s[kAll].current)
    fail("inactive_split_bytes stat != bytes of free blocks of split segments");
}

std::vector<SegmentInfo> CachingAllocator::snapshot() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<SegmentInfo> out;
  for (auto& [base, s] : segments_) {
    // As PyTorch reports an expandable segment: one segment per run of mapped blocks.
    for (Block* b = s->head; b;) {
      if (b->state == BlockState::unmapped) {
        b = b->next;
        continue;
      }
      SegmentInfo si{reinterpret_cast<uint64_t>(b->ptr), 0, s->stream, s->small, s->expandable(),
                     {s->pool->id_hi, s->pool->id_lo}, {}};
      for (; b && b->state != BlockState::unmapped; b = b->next) {
        si.blocks.push_back({reinterpret_cast<uint64_t>(b->ptr), b->size, b->requested, b->state});
        si.size += b->size;
      }
      out.push_back(std::move(si));
    }
  }
  return out;
}

}  // namespace supermem
