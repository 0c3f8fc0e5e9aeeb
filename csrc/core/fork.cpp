#include "fork.h"

#include <pthread.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace supermem {

namespace {

struct Registry {
  std::mutex mu;  // taken first in prepare, released last
  std::vector<std::pair<ForkLevel, std::mutex*>> locks;
};

void prepare();
void after();

Registry& registry() {
  // Leaked: allocators may be destroyed after static destructors ran (interpreter shutdown).
  static Registry* r = [] {
    auto* reg = new Registry;
    pthread_atfork(prepare, after, after);
    return reg;
  }();
  return *r;
}

void prepare() {
  Registry& r = registry();
  r.mu.lock();
  // Stable by level: every allocator lock before any trace ring lock before any device lock.
  std::stable_sort(r.locks.begin(), r.locks.end(),
                   [](auto& a, auto& b) { return a.first < b.first; });
  for (auto& [level, mu] : r.locks) mu->lock();
}

void after() {  // in the parent and in the child: the forking thread holds every lock
  Registry& r = registry();
  for (auto it = r.locks.rbegin(); it != r.locks.rend(); ++it) it->second->unlock();
  r.mu.unlock();
}

}  // namespace

void fork_register(std::mutex* mu, ForkLevel level) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  r.locks.emplace_back(level, mu);
}

void fork_unregister(std::mutex* mu) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  auto it = std::find_if(r.locks.begin(), r.locks.end(), [&](auto& e) { return e.second == mu; });
  if (it != r.locks.end()) r.locks.erase(it);
}

}  // namespace supermem
