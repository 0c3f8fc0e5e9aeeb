// Expandable segments: the caching allocator's slow path when option `expandable` is on.
//
// A segment is a range of address space reserved once per (pool, stream, size class), 1 1/8 of the
// device's capacity as in PyTorch (room to move pages from a hole to the end). Its blocks tile the
// whole range: allocated, pending and free blocks have memory behind them, unmapped blocks have none.
// A request that no cached block fits takes the run of free and unmapped blocks long enough for it
// that lacks the fewest pages, and maps them; so the free space at a segment's end, which a plain
// segment strands, is part of the next larger request. Free pages are unmapped when cached memory is
// released (the OOM protocol's stage 2, empty_cache, a lower limit), and when new pages would take
// the memory that may count over the allocated peak by more than 1/128 or 32 MiB (reclaim_holes): then
// free pages in holes between live blocks move to where the request lacks them instead. Not at every
// free: unmapping waits for the stream that last used the pages, and mapping costs driver calls.
//
// Stream-ordered reuse is unchanged: a segment belongs to one stream, a block is free only once the
// events of the other streams that used it completed, and unmapping waits for the segment's stream
// (moving holes, unless a completed fence shows that stream ran past their frees) or for the device
// (releasing cached memory).
#include <algorithm>
#include <map>
#include <stdexcept>
#include <unordered_set>

#include "caching.h"

namespace supermem {

namespace {

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Growth within this much over the allocated peak (or 1/128 of it, if more) moves no pages: a small
// workload's few pages are not worth a device synchronisation.
constexpr int64_t kReclaimFloor = 32 << 20;

// [lo, hi): the whole pages inside block b (lo >= hi: none).
std::pair<char*, char*> whole_pages(const Block* b) {
  const Segment* s = b->segment;
  char* lo = s->base + round_up(static_cast<size_t>(b->ptr - s->base), s->page_bytes);
  char* hi = s->base + static_cast<size_t>(b->ptr + b->size - s->base) / s->page_bytes * s->page_bytes;
  return {lo, hi};
}

bool is_free(const Block* b) { return b && b->state == BlockState::free; }
bool is_unmapped(const Block* b) { return b && b->state == BlockState::unmapped; }

}  // namespace

Block* CachingAllocator::map_for(Pool& pool, bool small, Stream stream, size_t size) {
  Block* b = nullptr;
  try {
    b = map_run(pool, small, stream, size);
  } catch (...) {  // (a wait, the driver): what was set aside still goes back
    try {
      device_->vm_trim();
    } catch (...) {
    }
    throw;
  }
  try {
    device_->vm_trim();  // the moved pages no new mapping took go back
  } catch (...) {
    if (b) b->segment->pool->free_set(small).insert(b);  // (map_run took it out)
    throw;
  }
  return b;
}

Block* CachingAllocator::map_run(Pool& pool, bool small, Stream stream, size_t size) {
  size_t map_bytes = 0;
  Block* b = find_run(pool, small, stream, size, map_bytes);
  if (!b) {  // a new range; none for a request larger than any range (it cannot fit the device either)
    size_t page = device_->vm_page_bytes(), total = device_->total_bytes();
    if (size > round_up(total + total / 8, page)) return nullptr;
    map_bytes = round_up(size, page);
  }
  if (map_bytes > 0 && reclaim_holes(map_bytes, size, b)) {  // the layout changed: look again
    if (!(b = find_run(pool, small, stream, size, map_bytes)))
      map_bytes = round_up(size, device_->vm_page_bytes());
  }
  Segment* fresh = nullptr;
  if (limited_ && stats_.reserved_bytes.s[kAll].current + static_cast<int64_t>(map_bytes) >
                      static_cast<int64_t>(opts_.limit_bytes))
    return nullptr;
  if (!b) {
    if (!(fresh = reserve_segment(pool, small, stream))) return nullptr;
    b = fresh->head;
  }
  size_t page = b->segment->page_bytes;
  // The run is free, unmapped, free, ... (coalesced): map each unmapped block's front until b spans
  // size. Pages mapped before a failure stay, as free blocks; a fresh range with none goes back.
  if (is_unmapped(b)) b = map_front(b, std::min(b->size, round_up(size, page)));
  while (b && b->size < size) {
    Block* next = b->next;  // unmapped: a free block's neighbours are not free
    b = map_front(next, std::min(next->size, round_up(size - b->size, page)));
  }
  if (!b) {
    if (fresh && fresh->mapped_bytes == 0) release_segment(fresh);
    return nullptr;
  }
  b->segment->pool->free_set(small).erase(b);  // handed to malloc, which splits it
  return b;
}

// The run in this pool's segments of (stream, size class) that holds `size` bytes and lacks the fewest
// pages (the lowest address of those): a free block followed by unmapped ones, or an unmapped block,
// with its free and unmapped successors. Its first block, and in map_bytes the pages it lacks; nullptr
// if there is none.
Block* CachingAllocator::find_run(Pool& pool, bool small, Stream stream, size_t size, size_t& map_bytes) {
  Block* best = nullptr;
  for (auto& [base, s] : segments_) {
    if (!s->expandable() || s->pool != &pool || s->small != small || s->stream != stream) continue;
    for (Block* u = s->head; u; u = u->next) {
      if (!is_unmapped(u)) continue;
      Block* start = is_free(u->prev) ? u->prev : u;
      size_t bytes = 0, lacking = 0;
      for (Block* c = start; c && bytes < size && (is_free(c) || is_unmapped(c)); c = c->next) {
        if (is_unmapped(c)) lacking += std::min(c->size, round_up(size - bytes, s->page_bytes));
        bytes += c->size;
      }
      if (bytes >= size && (!best || lacking < map_bytes)) {
        best = start;
        map_bytes = lacking;
      }
    }
  }
  return best;
}

// Before map_bytes more pages are mapped for a request of `size` bytes whose run starts at `run` (or
// nullptr: a fresh range): unmaps whole free pages of holes, the smallest free blocks first (large ones
// are the cache's most useful), so that live bytes, the holes' pages left, the run's free blocks and
// the new pages stay within 1/128 (or kReclaimFloor) over the highest allocated bytes since the
// allocator began (this request counted). What no reclaim can move (pending blocks, pages shared with
// live blocks, private pools) counts on neither side, so it never makes the allocator squeeze the holes
// at every miss. Only the default pool's holes move (a captured graph's kernels still address its
// pool's free blocks), never during a capture (the wait before the unmap is illegal then), and only
// when they cover the excess. At most one wait per stream whose holes move. The holes' pages are set
// aside, not freed: the mapping that follows takes their memory (vm_set_aside). True if it moved any.
bool CachingAllocator::reclaim_holes(size_t map_bytes, size_t size, const Block* run) {
  if (!captures_.empty()) return false;
  std::unordered_set<const Block*> in_run;  // the request's run: its free blocks are about to be used
  size_t covered = 0;
  int64_t run_free = 0;
  for (const Block* c = run; c && covered < size && (is_free(c) || is_unmapped(c)); c = c->next) {
    in_run.insert(c);
    covered += c->size;
    if (is_free(c)) run_free += static_cast<int64_t>(c->size);
  }
  struct Hole {
    size_t bytes;  // its whole pages'
    Block* b;
    bool fenced;  // its stream ran all work queued before it was freed: it moves without a wait
  };
  std::vector<Hole> holes;
  std::map<Stream, uint64_t> ticks;  // each hole stream's fence_tick, read once
  int64_t movable = 0;
  for (auto& [base, s] : segments_) {
    if (!s->expandable() || s->pool != &default_pool_) continue;
    for (Block* b = s->head; b; b = b->next) {
      if (!is_free(b) || in_run.count(b)) continue;
      auto [lo, hi] = whole_pages(b);
      if (hi <= lo) continue;
      auto t = ticks.try_emplace(s->stream, 0);
      if (t.second) t.first->second = fence_tick(s->stream);
      holes.push_back({static_cast<size_t>(hi - lo), b, b->freed_at <= t.first->second});
      movable += hi - lo;
    }
  }
  const StatArray& allocated = stats_.allocated_bytes;  // its peak since ever: a user's reset does not count
  int64_t now = allocated.s[kAll].current;
  int64_t peak = std::max({allocated_high_, allocated.s[kAll].peak, now + static_cast<int64_t>(size)});
  int64_t after = now + movable + run_free + static_cast<int64_t>(map_bytes);  // what may count, grown
  int64_t excess = after - (peak + std::max<int64_t>(peak / 128, kReclaimFloor));
  // A free block's pages were last used by work queued on its segment's stream before it was freed (a
  // use on another stream keeps the block pending, not free, until that stream's event completes).
  // A fence recorded at a miss lets a later one move the holes freed before it without a wait.
  auto unfenced = [&](const Block* b) { return b->freed_at > fences_[b->segment->stream].done; };
  auto fence_rest = [&](size_t from) {
    for (size_t i = from; i < holes.size(); ++i)
      if (unfenced(holes[i].b)) add_fence(holes[i].b->segment->stream);
  };
  if (excess <= 0 || movable < excess) {
    fence_rest(0);
    return false;
  }
  // Smallest first (fenced first among equals): an unfenced one waits for its stream (only it, as
  // PyTorch's ExpandableSegment does: the pool's copies on their own streams run on), once per stream.
  std::sort(holes.begin(), holes.end(), [](const Hole& x, const Hole& y) {
    return x.bytes != y.bytes ? x.bytes < y.bytes : x.fenced > y.fenced;
  });
  int64_t freed = 0;
  size_t moved = 0;
  for (; moved < holes.size() && freed < excess; ++moved) {  // (unmapping one relinks only its own
    const Hole& h = holes[moved];                              // neighbours, never another hole)
    Stream st = h.b->segment->stream;
    if (unfenced(h.b)) {  // (after the wait none of its stream's is: no block is freed until we are done)
      settle(st);
      ++stats_.num_reclaim_waits;
    }
    unmap_free_pages(h.b, /*wait=*/false, /*aside=*/true);
    freed += static_cast<int64_t>(h.bytes);
    ++stats_.num_reclaims;
    stats_.reclaimed_bytes += static_cast<int64_t>(h.bytes);
  }
  fence_rest(moved);
  return true;
}

void CachingAllocator::settle(Stream stream) {
  Event e = device_->event_record(stream);
  try {
    device_->event_wait(e);
  } catch (...) {
    device_->event_release(e);
    throw;
  }
  device_->event_release(e);
  fences_[stream].done = free_tick_;
}

// The free tick of `stream`'s newest completed fence (completed fences are given back on the way).
uint64_t CachingAllocator::fence_tick(Stream stream) {
  auto it = fences_.find(stream);
  if (it == fences_.end()) return 0;
  Fences& f = it->second;
  while (!f.outstanding.empty() && device_->event_done(f.outstanding.front().first)) {
    f.done = std::max(f.done, f.outstanding.front().second);
    device_->event_release(f.outstanding.front().first);
    f.outstanding.pop_front();
  }
  return f.done;
}

void CachingAllocator::add_fence(Stream stream, uint64_t every) {
  Fences& f = fences_[stream];
  if (free_tick_ < f.polled + every) return;  // (no device call on most frees' way)
  f.polled = free_tick_;
  try {
    fence_tick(stream);
    if (f.outstanding.size() < kMaxFences) f.outstanding.emplace_back(device_->event_record(stream), free_tick_);
  } catch (const DeviceError&) {  // (at exit, say): a fence less only means a wait before a move
  }
}

Segment* CachingAllocator::reserve_segment(Pool& pool, bool small, Stream stream) {
  size_t page = device_->vm_page_bytes();
  size_t total = device_->total_bytes();
  size_t range = round_up(total + total / 8, page);
  if (range == 0) return nullptr;
  void* p = device_->vm_reserve(range);
  if (!p) return nullptr;
  auto* s = new Segment;
  s->base = static_cast<char*>(p);
  s->size = range;
  s->page_bytes = page;
  s->stream = stream;
  s->small = small;
  s->pool = &pool;
  Block* b = new_block();
  b->ptr = s->base;
  b->size = range;
  b->stream = stream;
  b->segment = s;
  b->state = BlockState::unmapped;
  s->head = b;
  segments_.emplace(s->base, s);
  stats_.segment.add(small, 1);
  stats_.address_space_bytes += static_cast<int64_t>(range);
  return s;
}

// Maps the first nbytes (whole pages) of an unmapped block; the mapped part becomes a free block and
// merges with a free neighbour. nullptr when the device has no room (nothing changed then).
Block* CachingAllocator::map_front(Block* u, size_t nbytes) {
  Segment* s = u->segment;
  if (!device_->vm_map(u->ptr, nbytes)) return nullptr;
  Block* m = u;
  if (nbytes < u->size) {  // the rest stays unmapped, after the new block
    m = new_block();
    m->ptr = u->ptr;
    m->size = nbytes;
    m->stream = u->stream;
    m->segment = s;
    m->prev = u->prev;
    m->next = u;
    if (m->prev) m->prev->next = m;
    else s->head = m;
    u->prev = m;
    u->ptr += nbytes;
    u->size -= nbytes;
  }
  m->state = BlockState::free;
  m->freed_at = 0;  // fresh pages: no work queued before this used them
  s->mapped_bytes += nbytes;
  grow_reserved(s->small, static_cast<int64_t>(nbytes));
  ++stats_.num_device_alloc;
  trace_.push(TraceKind::segment_alloc, m->ptr, nbytes, s->stream);
  return insert_free(m);
}

void CachingAllocator::count_inactive_split(Block* b, int sign) {
  if (!b->prev && !b->next) return;
  stats_.inactive_split.add(b->segment->small, sign);
  stats_.inactive_split_bytes.add(b->segment->small, sign * static_cast<int64_t>(b->size));
}

// Unmaps the whole pages inside free block b (PyTorch's unmap_block): what is left of b at either end
// stays a free block (a page shared with a neighbour stays mapped). Releases the segment once nothing
// of it is mapped.
bool CachingAllocator::unmap_free_pages(Block* b, bool wait, bool aside) {
  Segment* s = b->segment;
  auto [lo, hi] = whole_pages(b);
  if (lo >= hi) return false;
  if (aside) device_->vm_set_aside(lo, static_cast<size_t>(hi - lo));
  else device_->vm_unmap(lo, static_cast<size_t>(hi - lo), wait);
  auto& set = s->pool->free_set(s->small);
  set.erase(b);
  count_inactive_split(b, -1);
  auto carve = [&](char* ptr, size_t size, Block* prev, Block* next) {  // a free remainder
    Block* r = new_block();
    r->ptr = ptr;
    r->size = size;
    r->stream = b->stream;
    r->segment = s;
    r->freed_at = b->freed_at;
    r->prev = prev;
    r->next = next;
    if (prev) prev->next = r;
    else s->head = r;
    if (next) next->prev = r;
    return r;
  };
  std::vector<Block*> rest;
  if (lo > b->ptr) rest.push_back(carve(b->ptr, static_cast<size_t>(lo - b->ptr), b->prev, b));
  if (hi < b->ptr + b->size) rest.push_back(carve(hi, static_cast<size_t>(b->ptr + b->size - hi), b, b->next));
  b->ptr = lo;
  b->size = static_cast<size_t>(hi - lo);
  b->state = BlockState::unmapped;
  for (Block* r : rest) {
    set.insert(r);
    count_inactive_split(r, +1);
  }
  s->mapped_bytes -= b->size;
  stats_.reserved_bytes.add(s->small, -static_cast<int64_t>(b->size));
  ++stats_.num_device_free;
  trace_.push(TraceKind::segment_free, b->ptr, b->size, s->stream);
  for (Block* n : {b->prev, b->next}) {  // coalesce with unmapped neighbours
    if (!is_unmapped(n)) continue;
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
    recycle(n);
  }
  if (!b->prev && !b->next) release_segment(s);
  return true;
}

bool CachingAllocator::release_expandable(Segment* s, bool wait) {
  std::vector<Block*> free_blocks;  // gathered first: unmapping relinks the list (and may free s)
  for (Block* b = s->head; b; b = b->next)
    if (b->state == BlockState::free) free_blocks.push_back(b);
  for (Block* b : free_blocks)
    if (unmap_free_pages(b, wait)) wait = false;
  return wait;
}

void CachingAllocator::check_expandable(Segment* s) {
  auto fail = [&](const std::string& what) {
    throw std::logic_error("supermem invariant violated: expandable segment at " +
                           std::to_string(reinterpret_cast<uintptr_t>(s->base)) + ": " + what);
  };
  size_t page = s->page_bytes;
  if (s->size % page) fail("its size is not whole pages");
  for (Block* b = s->head; b;) {
    if (b->stream != s->stream) fail("a block of another stream");
    if (is_unmapped(b)) {
      if (static_cast<size_t>(b->ptr - s->base) % page || b->size % page) fail("an unmapped block is not whole pages");
      if (is_unmapped(b->next)) fail("uncoalesced unmapped blocks");
      if (device_->vm_mapped_bytes(b->ptr, b->size) != 0) fail("the device maps pages under an unmapped block");
      b = b->next;
      continue;
    }
    char* run = b->ptr;  // a run of mapped blocks: whole pages, every one mapped on the device
    for (; b && !is_unmapped(b); b = b->next) {}
    char* end = b ? b->ptr : s->base + s->size;
    size_t n = static_cast<size_t>(end - run);
    if (static_cast<size_t>(run - s->base) % page || n % page) fail("a mapped run is not whole pages");
    if (device_->vm_mapped_bytes(run, n) != n) fail("the device does not map every page under mapped blocks");
  }
}

}  // namespace supermem
