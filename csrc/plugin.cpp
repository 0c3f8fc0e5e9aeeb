// The PyTorch plug-in. torch.cuda.memory.CUDAPluggableAllocator dlopens this very .so (the handle is
// the one Python already loaded, so these entry points share the module's globals) and calls:
//   supermem_malloc / supermem_free                  for every CUDA tensor
//   supermem_init, _reset (empty_cache), _memory_fraction, _record_stream, _base_alloc,
//   _begin_allocate_to_pool / _end_allocate_to_pool / _release_pool (CUDA graph capture)
// Each is a thin shim over one CachingAllocator per device. OOM is thrown as c10::OutOfMemoryError
// so Python sees torch.OutOfMemoryError. Nothing here is ever destroyed: tensors are freed during
// interpreter shutdown, after static destructors could have run.
#include "plugin.h"

#ifdef SUPERMEM_WITH_CUDA

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
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

using MempoolId = std::pair<unsigned long long, unsigned long long>;  // c10::cuda::MempoolId_t

}  // namespace
}  // namespace supermem

using namespace supermem;

#define SUPERMEM_EXPORT extern "C" __attribute__((visibility("default")))

SUPERMEM_EXPORT void* supermem_malloc(size_t size, int device, cudaStream_t stream) {
  try {
    return allocator_for(device).malloc(size, reinterpret_cast<Stream>(stream));
  } catch (const OutOfMemory& e) {
    throw c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, e.msg);
  } catch (const std::exception& e) {
    throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, e.what());
  }
}

SUPERMEM_EXPORT void supermem_free(void* ptr, size_t, int device, cudaStream_t) {
  // Called from tensor destructors: never throw, report instead.
  try {
    allocator_for(device).free(ptr);
  } catch (const std::exception& e) {
    report("free", e);
  }
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
    CachingAllocator& a = allocator_for(device);
    a.set_limit_bytes(static_cast<size_t>(fraction * a.device()->total_bytes()));
  } catch (const std::exception& e) {
    report("set_per_process_memory_fraction", e);
  }
}

SUPERMEM_EXPORT void supermem_record_stream(void* ptr, cudaStream_t stream) {
  int current = 0;
  cudaGetDevice(&current);
  Plugin& p = plugin();
  // The pointer usually belongs to the current device; try it first, then the others.
  for (int i = -1; i < kMaxDevices; ++i) {
    int d = i < 0 ? current : i;
    if (i == current) continue;
    CachingAllocator* a = p.fast[d].load(std::memory_order_acquire);
    if (!a) continue;
    try {
      a->record_stream(ptr, reinterpret_cast<Stream>(stream));
      return;
    } catch (const UsageError&) {
    }
  }
  std::fprintf(stderr, "supermem: record_stream: %p was not allocated by supermem\n", ptr);
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

void register_plugin(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("plugin_configure", [](size_t limit_bytes, double limit_fraction, bool passthrough, int debug,
                               size_t trace_capacity) {
    Plugin& p = plugin();
    std::lock_guard<std::mutex> g(p.mu);
    p.opts.base.limit_bytes = limit_bytes;
    p.opts.limit_fraction = limit_fraction;
    p.opts.base.passthrough = passthrough;
    p.opts.base.debug = debug;
    p.opts.base.trace_capacity = trace_capacity;
  }, py::arg("limit_bytes"), py::arg("limit_fraction"), py::arg("passthrough"), py::arg("debug"),
        py::arg("trace_capacity"));
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
  m.def("plugin_add_pressure_handler", [add_hook](py::function fn) {
    auto h = pressure_handler_from_py(std::move(fn));
    add_hook([h](CachingAllocator& a) { a.add_pressure_handler(h); });
  }, py::arg("handler"));
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
  m.attr("plugin_symbols") = py::dict(
      py::arg("malloc") = "supermem_malloc", py::arg("free") = "supermem_free",
      py::arg("init") = "supermem_init", py::arg("reset") = "supermem_reset",
      py::arg("memory_fraction") = "supermem_memory_fraction",
      py::arg("record_stream") = "supermem_record_stream", py::arg("base_alloc") = "supermem_base_alloc",
      py::arg("begin_allocate_to_pool") = "supermem_begin_allocate_to_pool",
      py::arg("end_allocate_to_pool") = "supermem_end_allocate_to_pool",
      py::arg("release_pool") = "supermem_release_pool");
}

}  // namespace supermem

#else  // no CUDA: nothing to plug in

namespace supermem {
void register_plugin(pybind11::module_&) {}
}  // namespace supermem

#endif
