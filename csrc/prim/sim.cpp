// The simulated device: fixed capacity, host memory, controllable events.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../core/fork.h"
#include "prim.h"

namespace supermem {

namespace {
struct SimEvent {
  bool done = false;
  Stream stream = 0;
};
}  // namespace

// A reserved range: which of its pages are mapped, and the physical page each maps (-1: none). A page
// set aside (vm_set_aside) or mapped elsewhere since still names its physical page: a stale view.
struct SimRange {
  size_t size = 0;
  std::vector<bool> mapped;
  std::vector<int64_t> phys;
};

struct SimDevice::State {
  std::mutex mu;
  ForkRegistration fork{&mu, ForkLevel::device};
  size_t used = 0;                     // segments and physical pages (mapped or set aside)
  std::map<char*, SimRange> ranges;    // reserved ranges by base address
  std::unordered_map<int64_t, std::vector<char*>> views;  // physical page -> the pages mapping it
  std::vector<int64_t> aside;          // physical pages set aside for the next vm_map
  int64_t next_phys = 0;
  SimDevice::PageCalls calls;
  bool hold = false;
  std::vector<SimEvent*> held;        // events recorded while holding
  std::unordered_set<SimEvent*> live; // events not yet released
  size_t device_waits = 0;             // vm_unmap calls that waited for the whole device
  size_t event_waits = 0;              // event_wait calls
  std::map<Stream, size_t> waits_by_stream;  // event_wait calls by the stream of the event
};

SimDevice::SimDevice(size_t capacity, size_t page_bytes)
    : st_(new State), capacity_(capacity), page_bytes_(page_bytes) {
  size_t host_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (page_bytes % host_page)  // 0: a device without virtual memory
    throw UsageError("supermem: a simulated device's page_bytes must be a multiple of the host's page size (" +
                     std::to_string(host_page) + " bytes) or 0 for no virtual memory, got " +
                     std::to_string(page_bytes));
}

SimDevice::~SimDevice() {
  for (SimEvent* e : st_->live) delete e;
  // Ranges left reserved belong to an allocator's live blocks: they stay mapped, as segments do.
}

void* SimDevice::segment_alloc(size_t nbytes, Stream) {
  std::lock_guard<std::mutex> g(st_->mu);
  if (nbytes == 0 || nbytes > capacity_ - st_->used) return nullptr;
  // MAP_NORESERVE: untouched pages cost nothing, so a large simulated card fits on a small host.
  void* p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) return nullptr;  // the host is out of address space: same as a full device
  st_->used += nbytes;
  return p;
}

void SimDevice::segment_free(void* ptr, size_t nbytes) {
  std::lock_guard<std::mutex> g(st_->mu);
  munmap(ptr, nbytes);
  st_->used -= nbytes;
}

Event SimDevice::event_record(Stream stream) {
  std::lock_guard<std::mutex> g(st_->mu);
  auto* e = new SimEvent;
  e->done = !st_->hold;
  e->stream = stream;
  if (st_->hold) st_->held.push_back(e);
  st_->live.insert(e);
  return e;
}

bool SimDevice::event_done(Event e) {
  std::lock_guard<std::mutex> g(st_->mu);
  return static_cast<SimEvent*>(e)->done;
}

void SimDevice::event_wait(Event e) {
  // A held event completes when waited on: the simulated "GPU" finishes the work the host waits for.
  std::lock_guard<std::mutex> g(st_->mu);
  static_cast<SimEvent*>(e)->done = true;
  ++st_->event_waits;
  ++st_->waits_by_stream[static_cast<SimEvent*>(e)->stream];
}

void SimDevice::event_release(Event e) {
  std::lock_guard<std::mutex> g(st_->mu);
  auto* se = static_cast<SimEvent*>(e);
  st_->live.erase(se);
  for (auto& h : st_->held)
    if (h == se) h = nullptr;
  delete se;
}

namespace {

// The reserved range holding [addr, addr + nbytes), and the first page's index; DeviceError for a range
// that is not page-aligned or not inside one reservation (the allocator's bug: the sim says so).
std::pair<SimRange*, size_t> find_range(std::map<char*, SimRange>& ranges, void* addr, size_t nbytes,
                                        size_t page, const char* what) {
  char* p = static_cast<char*>(addr);
  auto it = ranges.upper_bound(p);
  if (it != ranges.begin()) {
    --it;
    size_t off = static_cast<size_t>(p - it->first);
    if (p >= it->first && off % page == 0 && nbytes % page == 0 && nbytes <= it->second.size - off)
      return {&it->second, off / page};
  }
  throw DeviceError(std::string("supermem: simulated ") + what + " of " + std::to_string(nbytes) +
                    " bytes at an address that is not whole pages of a reserved range");
}

// Replaces [p, p + n) with a fresh mapping: zeroed and writable, or inaccessible.
bool remap(void* p, size_t n, bool accessible) {
  int prot = accessible ? PROT_READ | PROT_WRITE : PROT_NONE;
  return mmap(p, n, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) != MAP_FAILED;
}

// The mapped pages [addr, addr + nbytes) made inaccessible and marked unmapped (their physical pages are
// the caller's to free or set aside): the range and its first page. DeviceError for a page not mapped.
std::pair<SimRange*, size_t> unmap_range(std::map<char*, SimRange>& ranges, void* addr, size_t nbytes,
                                         size_t page, const char* what) {
  auto [r, first] = find_range(ranges, addr, nbytes, page, what);
  size_t n = nbytes / page;
  for (size_t i = first; i < first + n; ++i)
    if (!r->mapped[i]) throw DeviceError(std::string("supermem: simulated ") + what + " of a page not mapped");
  if (!remap(addr, nbytes, false)) throw DeviceError(std::string("supermem: simulated ") + what + ": mmap failed");
  for (size_t i = first; i < first + n; ++i) r->mapped[i] = false;
  return {r, first};
}

}  // namespace

void* SimDevice::vm_reserve(size_t nbytes) {
  if (!page_bytes_ || nbytes == 0 || nbytes % page_bytes_)
    throw DeviceError("supermem: simulated vm_reserve of a partial page, or on a device without virtual memory");
  void* p = mmap(nullptr, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  std::lock_guard<std::mutex> g(st_->mu);
  SimRange& r = st_->ranges[static_cast<char*>(p)];
  r.size = nbytes;
  r.mapped.assign(nbytes / page_bytes_, false);
  r.phys.assign(nbytes / page_bytes_, -1);
  return p;
}

void SimDevice::vm_release(void* base, size_t nbytes) {
  std::lock_guard<std::mutex> g(st_->mu);
  auto it = st_->ranges.find(static_cast<char*>(base));
  if (it == st_->ranges.end() || it->second.size != nbytes)
    throw DeviceError("supermem: simulated vm_release of a range that was not reserved");
  for (bool m : it->second.mapped)
    if (m) throw DeviceError("supermem: simulated vm_release of a range with pages still mapped");
  for (size_t i = 0; i < it->second.phys.size(); ++i)  // stale views: their pages live on elsewhere
    if (it->second.phys[i] >= 0) drop_view(it->second.phys[i], static_cast<char*>(base) + i * page_bytes_);
  st_->ranges.erase(it);
  munmap(base, nbytes);
}

void SimDevice::drop_view(int64_t phys, char* page) {
  auto& v = st_->views[phys];
  v.erase(std::find(v.begin(), v.end(), page));
  if (v.empty()) st_->views.erase(phys);
  ++st_->calls.unmapped;
}

void SimDevice::free_phys(int64_t phys) {
  auto it = st_->views.find(phys);
  if (it != st_->views.end()) {
    for (char* page : it->second) {
      auto [r, i] = find_range(st_->ranges, page, page_bytes_, page_bytes_, "unmap");
      r->phys[i] = -1;
      ++st_->calls.unmapped;
    }
    st_->views.erase(it);
  }
  st_->used -= page_bytes_;
}

bool SimDevice::vm_map(void* addr, size_t nbytes) {
  std::lock_guard<std::mutex> g(st_->mu);
  auto [r, first] = find_range(st_->ranges, addr, nbytes, page_bytes_, "vm_map");
  size_t n = nbytes / page_bytes_;
  for (size_t i = first; i < first + n; ++i)
    if (r->mapped[i]) throw DeviceError("supermem: simulated vm_map of a page already mapped");
  size_t fresh = n > st_->aside.size() ? n - st_->aside.size() : 0;
  if (fresh * page_bytes_ > capacity_ - st_->used) return false;
  if (!remap(addr, nbytes, true)) return false;  // the host is out of memory maps: a full device
  auto& aside = st_->aside;
  std::vector<bool> done(n);
  std::unordered_set<int64_t> kept(aside.begin(), aside.end());
  for (size_t k = 0; k < n; ++k) {  // a page set aside that this page still maps: taken where it is
    int64_t p = r->phys[first + k];
    if (p < 0 || !kept.erase(p)) continue;
    done[k] = true;
    ++st_->calls.in_place;
  }
  aside.erase(std::remove_if(aside.begin(), aside.end(), [&](int64_t p) { return !kept.count(p); }), aside.end());
  for (size_t k = 0; k < n; ++k) {
    if (done[k]) continue;
    char* page = static_cast<char*>(addr) + k * page_bytes_;
    int64_t& p = r->phys[first + k];
    if (p >= 0) drop_view(p, page);
    if (!aside.empty()) {  // mapped here too: no new memory
      p = aside.back();
      aside.pop_back();
      ++st_->calls.aliased;
    } else {
      p = st_->next_phys++;
      st_->used += page_bytes_;
      ++st_->calls.created;
    }
    st_->views[p].push_back(page);
  }
  for (size_t i = first; i < first + n; ++i) r->mapped[i] = true;
  return true;
}

void SimDevice::vm_unmap(void* addr, size_t nbytes, bool wait) {
  std::lock_guard<std::mutex> g(st_->mu);
  if (wait) ++st_->device_waits;  // (nothing runs on it: counted for the tests)
  auto [r, first] = unmap_range(st_->ranges, addr, nbytes, page_bytes_, "vm_unmap");
  for (size_t i = first; i < first + nbytes / page_bytes_; ++i)
    free_phys(r->phys[i]);  // (every view of it, this one included)
}

void SimDevice::vm_set_aside(void* addr, size_t nbytes) {
  std::lock_guard<std::mutex> g(st_->mu);
  auto [r, first] = unmap_range(st_->ranges, addr, nbytes, page_bytes_, "vm_set_aside");
  for (size_t i = first; i < first + nbytes / page_bytes_; ++i) st_->aside.push_back(r->phys[i]);
}

void SimDevice::vm_trim() {
  std::lock_guard<std::mutex> g(st_->mu);
  for (int64_t p : st_->aside) free_phys(p);
  st_->aside.clear();
}

std::map<Stream, size_t> SimDevice::stream_waits() {
  std::lock_guard<std::mutex> g(st_->mu);
  return st_->waits_by_stream;
}

SimDevice::PageCalls SimDevice::page_calls() {
  std::lock_guard<std::mutex> g(st_->mu);
  return st_->calls;
}

size_t SimDevice::vm_mapped_bytes(void* addr, size_t nbytes) {
  std::lock_guard<std::mutex> g(st_->mu);
  char* p = static_cast<char*>(addr);
  size_t total = 0;
  for (auto& [base, r] : st_->ranges) {  // any range, any alignment: the walker asks with block bounds
    char* lo = std::max(p, base);
    char* hi = std::min(p + nbytes, base + r.size);
    for (char* q = lo; q < hi;) {
      size_t i = static_cast<size_t>(q - base) / page_bytes_;
      char* page_end = std::min(hi, base + (i + 1) * page_bytes_);
      if (r.mapped[i]) total += static_cast<size_t>(page_end - q);
      q = page_end;
    }
  }
  return total;
}

size_t SimDevice::free_bytes() {
  std::lock_guard<std::mutex> g(st_->mu);
  return capacity_ - st_->used;
}

void SimDevice::hold_events(bool hold) {
  std::lock_guard<std::mutex> g(st_->mu);
  st_->hold = hold;
  if (!hold) {
    for (SimEvent* e : st_->held)
      if (e) e->done = true;
    st_->held.clear();
  }
}

size_t SimDevice::used_bytes() {
  std::lock_guard<std::mutex> g(st_->mu);
  return st_->used;
}

size_t SimDevice::live_events() {
  std::lock_guard<std::mutex> g(st_->mu);
  return st_->live.size();
}

std::pair<size_t, size_t> SimDevice::waits() {
  std::lock_guard<std::mutex> g(st_->mu);
  return {st_->device_waits, st_->event_waits};
}

}  // namespace supermem
