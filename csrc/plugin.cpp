// The PyTorch plug-in: extern "C" entry points in the shape CUDAPluggableAllocator expects
//   supermem_malloc / supermem_free                  for every CUDA tensor
//   supermem_init, _reset (empty_cache), _memory_fraction, _record_stream, _base_alloc,
//   _begin_allocate_to_pool / _end_allocate_to_pool / _release_pool (CUDA graph capture)
// each a thin shim over one CachingAllocator per device, and TorchAllocator, a subclass of PyTorch's
// CUDAPluggableAllocator wired to them, which also answers what the plain plug-in cannot: cacheInfo
// (cudnn.benchmark), checkPoolLiveAllocations (CUDA graph checks) and the memory stats
// (getDeviceStats / resetPeakStats / resetAccumulatedStats: torch.cuda.* and torch.accelerator.*). OOM is thrown as
// c10::OutOfMemoryError so Python sees torch.OutOfMemoryError. Nothing here is ever destroyed:
// tensors are freed during interpreter shutdown, after static destructors could have run.
#include "plugin.h"

#ifdef SUPERMEM_WITH_TORCH_CUDA

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <pybind11/stl.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <utility>

#include "alloc/caching.h"
#include "py_callbacks.h"

namespace supermem {
namespace {

constexpr int kMaxDevices = 64;

struct PluginOptions {
  AllocatorOptions base;
  double limit_fraction = 0;  // of each device's capacity, when the limit was given as a fraction
};

struct Plugin {
  std::mutex mu;
  PluginOptions opts;
  std::array<std::shared_ptr<CachingAllocator>, kMaxDevices> owners;
  std::array<std::atomic<CachingAllocator*>, kMaxDevices> fast{};  // lock-free lookup on the hot path
  std::vector<std::function<void(CachingAllocator&)>> on_create;   // hooks for new allocators
};

Plugin& plugin() {
  static Plugin* p = new Plugin;  // leaked on purpose (see above)
  return *p;
}

std::shared_ptr<CachingAllocator> create(int device) {
  Plugin& p = plugin();
  std::lock_guard<std::mutex> g(p.mu);
  if (!p.owners[device]) {
    auto dev = std::make_shared<CudaDevice>(device);
    AllocatorOptions o = p.opts.base;
    if (p.opts.limit_fraction > 0) o.limit_bytes = static_cast<size_t>(p.opts.limit_fraction * dev->total_bytes());
    auto a = std::make_shared<CachingAllocator>(dev, o);
    for (auto& hook : p.on_create) hook(*a);
    p.owners[device] = a;
    p.fast[device].store(a.get(), std::memory_order_release);
  }
  return p.owners[device];
}

CachingAllocator& allocator_for(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw UsageError("supermem: device index " + std::to_string(device) + " out of range");
  CachingAllocator* a = plugin().fast[device].load(std::memory_order_acquire);
  return a ? *a : *create(device);
}

void report(const char* where, const std::exception& e) {
  std::fprintf(stderr, "supermem: %s: %s\n", where, e.what());
}

// The allocator holding live block `ptr`, trying the current device first; nullptr if none.
CachingAllocator* owner_of(void* ptr) {
  int current = 0;
  cudaGetDevice(&current);
  Plugin& p = plugin();
  for (int i = -1; i < kMaxDevices; ++i) {
    if (i == current) continue;
    CachingAllocator* a = p.fast[i < 0 ? current : i].load(std::memory_order_acquire);
    if (a && a->owns(ptr)) return a;
  }
  return nullptr;
}

void free_on(int device, void* ptr) {
  try {
    allocator_for(device).free(ptr);
  } catch (const std::exception& e) {  // called from tensor destructors: report, never throw
    report("free", e);
  }
}

// One deleter per device, so a DataPtr frees on its own device without a lookup.
template <int... D>
constexpr std::array<c10::DeleterFnPtr, sizeof...(D)> make_deleters(std::integer_sequence<int, D...>) {
  return {[](void* p) { free_on(D, p); }...};
}
constexpr auto kDeleters = make_deleters(std::make_integer_sequence<int, kMaxDevices>{});

using MempoolId = std::pair<unsigned long long, unsigned long long>;  // c10::cuda::MempoolId_t

}  // namespace
}  // namespace supermem

using namespace supermem;

#define SUPERMEM_EXPORT extern "C" __attribute__((visibility("default")))

SUPERMEM_EXPORT void* supermem_malloc(size_t size, int device, cudaStream_t stream) {
  try {
    return allocator_for(device).malloc(size, reinterpret_cast<Stream>(stream));
  } catch (const pybind11::error_already_set&) {
    // KeyboardInterrupt / SystemExit from a pressure handler: PyTorch's bindings catch this type and
    // restore the Python exception (their pybind11's error_already_set has the same layout).
    throw;
  } catch (const OutOfMemory& e) {
    throw c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, e.msg);
  } catch (const std::exception& e) {
    throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, e.what());
  }
}

SUPERMEM_EXPORT void supermem_free(void* ptr, size_t, int device, cudaStream_t) {
  free_on(device, ptr);
}

SUPERMEM_EXPORT void supermem_init(int) {}

SUPERMEM_EXPORT void supermem_reset() {
  Plugin& p = plugin();
  for (auto& a : p.fast) {
    CachingAllocator* al = a.load(std::memory_order_acquire);
    if (!al) continue;
    try {
      al->empty_cache();
    } catch (const std::exception& e) {
      report("empty_cache", e);
    }
  }
}

SUPERMEM_EXPORT void supermem_memory_fraction(double fraction, int device) {
  try {
    allocator_for(device).set_memory_fraction(fraction);  // 0 is a limit of 0 bytes, as in PyTorch
  } catch (const std::exception& e) {
    report("set_per_process_memory_fraction", e);
  }
}

SUPERMEM_EXPORT void supermem_record_stream(void* ptr, cudaStream_t stream) {
  if (CachingAllocator* a = owner_of(ptr)) a->record_stream(ptr, reinterpret_cast<Stream>(stream));
  else std::fprintf(stderr, "supermem: record_stream: %p was not allocated by supermem\n", ptr);
}

SUPERMEM_EXPORT void* supermem_base_alloc(void* ptr, size_t* size) {
  // Used by legacy storage sharing; answering with the block itself is always correct.
  return ptr;
}

SUPERMEM_EXPORT void supermem_begin_allocate_to_pool(int device, MempoolId id,
                                                     std::function<bool(cudaStream_t)> filter) {
  allocator_for(device).begin_allocate_to_pool(
      id, [filter = std::move(filter)](Stream s) { return filter(reinterpret_cast<cudaStream_t>(s)); });
}

SUPERMEM_EXPORT void supermem_end_allocate_to_pool(int device, MempoolId id) {
  allocator_for(device).end_allocate_to_pool(id);
}

SUPERMEM_EXPORT void supermem_release_pool(int device, MempoolId id) {
  allocator_for(device).release_pool(id);
}

namespace supermem {
namespace {

class TorchAllocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  TorchAllocator() : CUDAPluggableAllocator(supermem_malloc, supermem_free) {
    set_init_fn(supermem_init);
    set_reset_fn(supermem_reset);
    set_memory_fraction_fn(supermem_memory_fraction);
    set_base_alloc_fn(supermem_base_alloc);
    set_record_stream_fn(supermem_record_stream);
    set_begin_allocate_to_pool(supermem_begin_allocate_to_pool);
    set_end_allocate_to_pool_fn(supermem_end_allocate_to_pool);
    set_release_pool(supermem_release_pool);
  }

  static void delete_raw(void* ptr) {
    if (!ptr) return;
    if (CachingAllocator* a = owner_of(ptr)) a->free(ptr);
    else std::fprintf(stderr, "supermem: raw_delete: %p was not allocated by supermem\n", ptr);
  }

  // As PyTorch's: the largest cached block, or more when *largest starts at 0 (the device's free
  // memory). cudnn.benchmark sizes its workspace search with it.
  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    CachingAllocator& a = allocator_for(device);
    if (*largest == 0) *largest = a.device()->free_bytes();
    *largest = std::max(*largest, a.largest_free_block());
  }

  // allocate / raw_alloc / raw_delete / recordStream go straight to supermem, skipping the base
  // class's mutex and address map (supermem keeps its own).
  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    void* p = supermem_malloc(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {p, p, kDeleters[device], c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_raw; }
  void* raw_alloc(size_t nbytes) override {
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream().stream());
  }
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return supermem_malloc(nbytes, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override { delete_raw(ptr); }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (!ptr.get()) return;
    allocator_for(ptr.device().index()).record_stream(ptr.get(), reinterpret_cast<Stream>(stream.stream()));
  }

  // torch.cuda.memory_stats and torch.accelerator.memory_stats (and C++ callers) all ask this, and
  // PyTorch turns the struct into the dict: the key set is native's by construction.
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    Stats s = allocator_for(device).stats();
    c10::CachingDeviceAllocator::DeviceStats d;
    auto copy = [](const StatArray& from, c10::CachingDeviceAllocator::StatArray& to) {
      for (size_t i = 0; i < 3; ++i) {  // StatType: AGGREGATE, SMALL_POOL, LARGE_POOL, as kAll/kSmall/kLarge
        to[i].current = from.s[i].current;
        to[i].peak = from.s[i].peak;
        to[i].allocated = from.s[i].allocated;
        to[i].freed = from.s[i].freed;
      }
    };
    copy(s.allocation, d.allocation);
    copy(s.segment, d.segment);
    copy(s.active, d.active);
    copy(s.inactive_split, d.inactive_split);
    copy(s.allocated_bytes, d.allocated_bytes);
    copy(s.reserved_bytes, d.reserved_bytes);
    copy(s.active_bytes, d.active_bytes);
    copy(s.inactive_split_bytes, d.inactive_split_bytes);
    copy(s.requested_bytes, d.requested_bytes);
    d.num_alloc_retries = s.num_alloc_retries;
    d.num_ooms = s.num_ooms;
    d.num_sync_all_streams = s.num_sync_all_streams;
    d.num_device_alloc = s.num_device_alloc;
    d.num_device_free = s.num_device_free;
    d.max_split_size = -1;  // PyTorch's default (no max_split_size_mb): SIZE_MAX read as int64; nothing oversize
    return d;
  }
  void resetPeakStats(c10::DeviceIndex device) override { allocator_for(device).reset_peak_stats(); }
  void resetAccumulatedStats(c10::DeviceIndex device) override { allocator_for(device).reset_accumulated_stats(); }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    std::vector<void*> live = allocator_for(device).pool_live_blocks(id);
    if (live.size() != expected.size()) return false;
    for (void* p : live)
      if (!expected.count(p)) return false;
    return true;
  }
};

}  // namespace

void register_plugin(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("plugin_configure", [](size_t limit_bytes, double limit_fraction, bool passthrough, int debug,
                               size_t trace_capacity, bool expandable) {
    // Checked now, not at the first CUDA malloc (where a failure would read as an allocation error).
    TraceRing::check_capacity(trace_capacity);
    if (!(limit_fraction >= 0 && limit_fraction <= 1))
      throw UsageError("supermem: limit_fraction must be in [0, 1], got " + std::to_string(limit_fraction));
    if (debug < 0 || debug > 2) throw UsageError("supermem: debug must be 0, 1 or 2, got " + std::to_string(debug));
    if (expandable && passthrough)
      throw UsageError("supermem: expandable_segments:true caches memory and passthrough:true caches none: choose one");
    Plugin& p = plugin();
    std::lock_guard<std::mutex> g(p.mu);
    p.opts.base.limit_bytes = limit_bytes;
    p.opts.limit_fraction = limit_fraction;
    p.opts.base.passthrough = passthrough;
    p.opts.base.debug = debug;
    p.opts.base.trace_capacity = trace_capacity;
    p.opts.base.expandable = expandable;  // allocators made from now on (at each device's first malloc)
  }, py::arg("limit_bytes"), py::arg("limit_fraction"), py::arg("passthrough"), py::arg("debug"),
        py::arg("trace_capacity"), py::arg("expandable_segments") = false);
  m.def("plugin_allocator", [](int device, bool create_if_missing) -> std::shared_ptr<CachingAllocator> {
    if (device < 0 || device >= kMaxDevices) throw UsageError("supermem: bad device index");
    CachingAllocator* a = plugin().fast[device].load(std::memory_order_acquire);
    if (a || !create_if_missing) return a ? plugin().owners[device] : nullptr;
    return create(device);
  }, py::arg("device"), py::arg("create") = true);
  // Handlers and observers apply to every device's allocator, including those created later.
  auto add_hook = [](std::function<void(CachingAllocator&)> hook) {
    Plugin& p = plugin();
    std::lock_guard<std::mutex> g(p.mu);
    for (auto& a : p.owners)
      if (a) hook(*a);
    p.on_create.push_back(std::move(hook));
  };
  // device >= 0: only that device's allocator asks this handler (a pool frees memory on its own device
  // only: asked for another device's shortage, it would offload for nothing).
  m.def("plugin_add_pressure_handler", [add_hook](py::function fn, int device) {
    auto h = pressure_handler_from_py(std::move(fn));
    add_hook([h, device](CachingAllocator& a) {
      if (device < 0 || a.device()->index() == device) a.add_pressure_handler(h);
    });
  }, py::arg("handler"), py::arg("device") = -1);
  m.def("plugin_add_oom_observer", [add_hook](py::function fn) {
    auto o = oom_observer_from_py(std::move(fn));
    add_hook([o](CachingAllocator& a) { a.add_oom_observer(o); });
  }, py::arg("observer"));
  m.def("plugin_devices", []() {
    std::vector<int> out;
    for (int d = 0; d < kMaxDevices; ++d)
      if (plugin().fast[d].load(std::memory_order_acquire)) out.push_back(d);
    return out;
  });
  m.def("plugin_install", []() {
    // Fails (c10::Error: "Can't swap an already initialized allocator") once CUDA is initialised.
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(std::make_shared<TorchAllocator>());
    // changeCurrentAllocator swaps what c10::cuda::CUDACachingAllocator::get() returns, but not c10's
    // registry of allocators per device type, which torch.accelerator.* reads (at::getDeviceAllocator):
    // left alone, it asks PyTorch's idle native allocator ("Invalid device argument"). Priority 1 beats
    // the native allocator's static registration (0).
    c10::SetAllocator(c10::DeviceType::CUDA, c10::cuda::CUDACachingAllocator::get(), 1);
  });
}

}  // namespace supermem

#else  // no CUDA build of torch: nothing to plug in

namespace supermem {
void register_plugin(pybind11::module_&) {}
}  // namespace supermem

#endif
