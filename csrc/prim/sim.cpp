// The simulated device: fixed capacity, host memory, controllable events.
#include <sys/mman.h>

#include <mutex>
#include <unordered_set>
#include <vector>

#include "../core/fork.h"
#include "prim.h"

namespace supermem {

namespace {
struct SimEvent {
  bool done = false;
};
}  // namespace

struct SimDevice::State {
  std::mutex mu;
  ForkRegistration fork{&mu, ForkLevel::device};
  size_t used = 0;
  bool hold = false;
  std::vector<SimEvent*> held;        // events recorded while holding
  std::unordered_set<SimEvent*> live; // events not yet released
};

SimDevice::SimDevice(size_t capacity) : st_(new State), capacity_(capacity) {}

SimDevice::~SimDevice() {
  for (SimEvent* e : st_->live) delete e;
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

Event SimDevice::event_record(Stream) {
  std::lock_guard<std::mutex> g(st_->mu);
  auto* e = new SimEvent;
  e->done = !st_->hold;
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
}

void SimDevice::event_release(Event e) {
  std::lock_guard<std::mutex> g(st_->mu);
  auto* se = static_cast<SimEvent*>(e);
  st_->live.erase(se);
  for (auto& h : st_->held)
    if (h == se) h = nullptr;
  delete se;
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

}  // namespace supermem
