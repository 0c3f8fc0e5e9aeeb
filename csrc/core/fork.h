// Fork safety. A child process gets a copy of every lock as it was at fork(); one held by another
// thread stays locked forever (that thread does not exist in the child), and the child's next malloc
// deadlocks. supermem's locks register here; pthread_atfork handlers take all of them before fork()
// (so the state they guard is consistent) and release them afterwards in parent and child.
//
// Lock order (prepare takes them in this order; normal code only ever nests in this order):
//   allocator lock  ->  trace ring lock  ->  device lock
// Allocator locks are never nested with each other (handlers and observers run unlocked).
#pragma once

#include <mutex>

namespace supermem {

enum class ForkLevel { allocator = 0, trace = 1, device = 2 };

// Registers `mu` until the matching fork_unregister (call it before `mu` is destroyed).
void fork_register(std::mutex* mu, ForkLevel level);
void fork_unregister(std::mutex* mu);

// RAII registration for a member mutex, declared right after it.
class ForkRegistration {
 public:
  ForkRegistration(std::mutex* mu, ForkLevel level) : mu_(mu) { fork_register(mu, level); }
  ~ForkRegistration() { fork_unregister(mu_); }
  ForkRegistration(const ForkRegistration&) = delete;
  ForkRegistration& operator=(const ForkRegistration&) = delete;

 private:
  std::mutex* mu_;
};

}  // namespace supermem
