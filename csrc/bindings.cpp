// supermem._C: the Python face of the core. Thin: argument checks, GIL handling, conversions.
// Allocator calls release the GIL (they may block on events or call pressure handlers, which take it).
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <optional>
#include <stdexcept>
#include <thread>
#include <type_traits>

#ifdef __GLIBCXX__
#include <cxxabi.h>  // abi::__forced_unwind: a thread being ended (pthread_exit)
#include <execinfo.h>  // backtrace: the stack where std::terminate was called
#include <unistd.h>
#endif

#include "alloc/caching.h"
#include "kernels/bindings_kernels.h"
#include "plugin.h"
#include "prim/prim.h"
#include "py_callbacks.h"

namespace py = pybind11;
using namespace supermem;

namespace {

// Exit. Once the interpreter is finalizing, a thread other than the finalizing one that asks for the
// GIL is ended by pthread_exit (Python 3.11-3.13; 3.14 parks it). That unwinding, run through a
// destructor or a noexcept frame (pybind11's gil_scoped_release gives the GIL back in one), is
// std::terminate: "terminate called without an active exception", the process aborts. So supermem
// never asks for it then where it can tell (a callback is skipped, a held callable leaked, a binding
// that let the GIL go parks its thread for good, as 3.14 would), and takes it back outside destructors
// (without_gil), where being ended unwinds cleanly.
std::atomic<unsigned long> finalizing_thread{0};  // the thread that ran atexit: it finalizes

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Whether this thread may wait for the GIL now without being ended for it.
bool may_take_gil() {
  if (!Py_IsInitialized()) return false;
  return !interpreter_finalizing() || PyThread_get_thread_ident() == finalizing_thread.load();
}

// std::terminate names no place ("terminate called without an active exception"): supermem's handler
// first writes the native stack of the thread that called it (the frame that let an unwinding through,
// and its callers), then hands over to the handler before it, which says the rest and aborts.
std::terminate_handler previous_terminate = nullptr;

[[noreturn]] void terminate_with_stack() {
  static std::atomic<bool> entered{false};
  if (entered.exchange(true)) std::abort();  // the handler before it chained back here (set again at exit)
  static const char head[] = "supermem: std::terminate called; the native stack:\n";
  [[maybe_unused]] auto n = write(2, head, sizeof head - 1);
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  if (previous_terminate != nullptr) previous_terminate();
  std::abort();
}

[[noreturn]] void park() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));  // the process ends around it
}

// f() with the GIL released (allocator calls may block on events, or call pressure handlers, which
// take it). The GIL is taken back in plain code, not in a destructor as py::gil_scoped_release does:
// a thread that waits for it there as finalization begins is ended, and ended here it unwinds cleanly
// (pybind11 lets the unwinding through). One that comes back once finalization began parks.
template <class F>
auto without_gil(F&& f) -> decltype(f()) {
  using R = decltype(f());
  PyThreadState* state = PyEval_SaveThread();
  std::exception_ptr error;
  [[maybe_unused]] std::optional<std::conditional_t<std::is_void_v<R>, char, R>> result;
  try {
    if constexpr (std::is_void_v<R>) f();
    else result.emplace(f());
#ifdef __GLIBCXX__
  } catch (abi::__forced_unwind&) {
    throw;  // ended in a callback that asked for the GIL: unwinding, without it
#endif
  } catch (...) {
    error = std::current_exception();
  }
  if (!may_take_gil()) park();
  PyEval_RestoreThread(state);
  if (error) std::rethrow_exception(error);
  if constexpr (!std::is_void_v<R>) return std::move(*result);
}

// f() with the GIL, from a thread that may not hold it (a callback's). Not py::gil_scoped_acquire: a
// thread ended while it waits for the GIL (in here, or in f's Python code) unwinds through that
// destructor, which then gives back a GIL it does not hold: the finalizing thread's, whose thread
// state is set to NULL under it ("PyThreadState_Get: ... the GIL is released", a fatal error).
template <class F>
auto with_gil(F&& f) -> decltype(f()) {
  PyGILState_STATE state = PyGILState_Ensure();
  try {
    if constexpr (std::is_void_v<decltype(f())>) {
      f();
      PyGILState_Release(state);
    } else {
      auto r = f();
      PyGILState_Release(state);
      return r;
    }
#ifdef __GLIBCXX__
  } catch (abi::__forced_unwind&) {
    throw;  // ended waiting for the GIL: it holds none to give back
#endif
  } catch (...) {
    PyGILState_Release(state);
    throw;
  }
}

// A member function as a binding that runs it without the GIL.
template <class R, class C, class... A>
auto nogil(R (C::*m)(A...)) {
  return [m](C& self, A... args) -> R { return without_gil([&]() -> R { return (self.*m)(args...); }); };
}
template <class R, class C, class... A>
auto nogil(R (C::*m)(A...) const) {
  return [m](const C& self, A... args) -> R { return without_gil([&]() -> R { return (self.*m)(args...); }); };
}

struct InvariantError : std::logic_error {
  using std::logic_error::logic_error;
};

// Raises supermem.errors.<name>(msg); the classes live in Python so they can subclass torch's.
void raise_py(const char* name, const char* msg) {
  py::object cls = py::module_::import("supermem.errors").attr(name);
  PyErr_SetString(cls.ptr(), msg);
}

constexpr uint64_t kMaxSize = INT64_MAX;  // sizes and counts: what the stats (int64) can hold
constexpr uint64_t kMaxWord = UINT64_MAX;  // addresses, streams, tags

std::string short_repr(py::handle v) {
  std::string r = py::repr(v);
  return r.size() > 40 ? r.substr(0, 20) + "..." + r.substr(r.size() - 10) + " (" + std::to_string(r.size()) + " digits)" : r;
}

// An integer argument from Python, checked here so the user sees its name and range instead of pybind's
// overload listing: TypeError for anything but an int (bool included), UsageError when out of range.
uint64_t int_arg(py::handle v, const char* name, uint64_t max) {
  if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr()))
    throw py::type_error(std::string("supermem: ") + name + " must be an int, got " + short_repr(v) + " (" +
                         Py_TYPE(v.ptr())->tp_name + ")");
  auto i = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
  if (!i) throw py::error_already_set();
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  uint64_t u = static_cast<uint64_t>(x);
  bool ok = overflow == 0 ? x >= 0 : overflow > 0;
  if (ok && overflow > 0) {
    u = PyLong_AsUnsignedLongLong(i.ptr());
    if (PyErr_Occurred()) PyErr_Clear(), ok = false;  // past 2**64
  }
  if (!ok || u > max)
    throw UsageError(std::string("supermem: ") + name + " must be an int >= 0 and <= " +
                     (max == kMaxSize ? "2**63 - 1" : max == kMaxWord ? "2**64 - 1" : std::to_string(max)) +
                     ", got " + short_repr(i));
  return u;
}

bool bool_arg(py::handle v, const char* name) {
  if (!PyBool_Check(v.ptr()))
    throw py::type_error(std::string("supermem: ") + name + " must be True or False, got " + short_repr(v));
  return v.ptr() == Py_True;
}

// The host failing to allocate a trace ring: a MemoryError naming the size asked for.
[[noreturn]] void raise_trace_ring_memory_error(size_t capacity) {
  std::string msg = "supermem: cannot allocate a trace ring of " + std::to_string(capacity) + " events";
  PyErr_SetString(PyExc_MemoryError, msg.c_str());
  throw py::error_already_set();
}

// Resizes a trace ring (left as it was when the new one cannot be allocated).
void set_trace_capacity(TraceRing& ring, size_t capacity) {
  try {
    ring.set_capacity(capacity);
  } catch (const std::bad_alloc&) {
    raise_trace_ring_memory_error(capacity);
  }
}

// A malloc size from Python. Past int64 it is still a size, just more than any device has: the
// allocator answers with its "more than 1EB" OOM, as PyTorch does, rather than a TypeError.
size_t request_size(py::handle n) {
  if (PyBool_Check(n.ptr())) throw py::type_error("supermem: nbytes must be an int, got " + short_repr(n));
  auto v = py::reinterpret_steal<py::object>(PyNumber_Index(n.ptr()));
  if (!v) throw py::error_already_set();
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (overflow > 0) return SIZE_MAX;
  if (overflow < 0 || x < 0) throw UsageError("supermem: nbytes must be >= 0, got " + std::string(py::str(v)));
  return static_cast<size_t>(x);
}

void* as_ptr(uint64_t address) { return reinterpret_cast<void*>(address); }

py::dict stat_dict(const Stat& s) {
  py::dict d;
  d["current"] = s.current;
  d["peak"] = s.peak;
  d["allocated"] = s.allocated;
  d["freed"] = s.freed;
  return d;
}

py::dict stat_array(const StatArray& a) {
  py::dict d;
  d["all"] = stat_dict(a.s[kAll]);
  d["small_pool"] = stat_dict(a.s[kSmallPool]);
  d["large_pool"] = stat_dict(a.s[kLargePool]);
  return d;
}

// Stats in the nested shape of torch.cuda.memory_stats_as_nested_dict, plus supermem's own keys.
py::dict nested_stats(CachingAllocator& a) {
  Stats s;
  std::vector<SegmentInfo> segs;
  size_t limit = 0;
  {
    without_gil([&] {  // never wait for the allocator lock while holding the GIL
      s = a.stats();
      segs = a.snapshot();
      limit = a.limit_bytes();
    });
  }
  uint64_t cached = 0, largest = 0;
  for (auto& seg : segs)
    for (auto& b : seg.blocks)
      if (b.state == BlockState::free) cached += b.size, largest = std::max(largest, b.size);
  py::dict d;
  d["allocated_bytes"] = stat_array(s.allocated_bytes);
  d["reserved_bytes"] = stat_array(s.reserved_bytes);
  d["active_bytes"] = stat_array(s.active_bytes);
  d["requested_bytes"] = stat_array(s.requested_bytes);
  d["allocation"] = stat_array(s.allocation);
  d["segment"] = stat_array(s.segment);
  d["active"] = stat_array(s.active);
  d["inactive_split"] = stat_array(s.inactive_split);
  d["inactive_split_bytes"] = stat_array(s.inactive_split_bytes);
  // With no max_split_size (PyTorch's default) nothing is oversize, and max_split_size reads -1.
  d["oversize_allocations"] = stat_dict(Stat{});
  d["oversize_segments"] = stat_dict(Stat{});
  d["num_alloc_retries"] = s.num_alloc_retries;
  d["num_ooms"] = s.num_ooms;
  d["num_sync_all_streams"] = s.num_sync_all_streams;
  d["num_device_alloc"] = s.num_device_alloc;
  d["num_device_free"] = s.num_device_free;
  d["max_split_size"] = -1;
  d["supermem"] = py::dict(py::arg("cached_free_bytes") = cached, py::arg("largest_free_block_bytes") = largest,
                           py::arg("num_pressure_calls") = s.num_pressure_calls,
                           py::arg("pressure_freed_bytes") = s.pressure_freed_bytes,
                           py::arg("limit_bytes") = limit,
                           py::arg("expandable_segments") = a.options().expandable,
                           py::arg("address_space_bytes") = s.address_space_bytes,
                           py::arg("num_reclaims") = s.num_reclaims,
                           py::arg("num_reclaim_waits") = s.num_reclaim_waits,
                           py::arg("reclaimed_bytes") = s.reclaimed_bytes,
                           py::arg("num_borrows") = s.num_borrows,
                           py::arg("pending_at_reserved_peak") = s.pending_at_reserved_peak);
  return d;
}

const char* kTraceNames[] = {"alloc",    "free_requested", "free_completed", "segment_alloc",
                             "segment_free", "oom",        "offload",        "prefetch",
                             "recompute", "compress",      "drop",           "restore",
                             "annotate"};
static_assert(sizeof(kTraceNames) / sizeof(*kTraceNames) == size_t(TraceKind::count_));

const char* state_name(BlockState s) {
  switch (s) {
    case BlockState::allocated: return "active_allocated";
    case BlockState::pending: return "active_pending_free";
    default: return "inactive";  // free (unmapped blocks are never reported)
  }
}

// A Python callable kept alive by C++ and released with the GIL held (leaked at interpreter exit).
std::shared_ptr<py::object> hold(py::function fn) {
  return std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* o) {
    if (!may_take_gil()) return;  // leak: Python is gone or going (a deleter is noexcept)
    with_gil([o] { delete o; });
  });
}

}  // namespace

namespace supermem {

PressureHandler pressure_handler_from_py(py::function fn) {
  return [f = hold(std::move(fn))](size_t need) -> size_t {
    if (!may_take_gil()) return 0;  // at exit: frees nothing
    return with_gil([&]() -> size_t {
      py::object r;
      try {
        r = (*f)(need);
        return r.is_none() ? 0 : r.cast<size_t>();
      } catch (py::error_already_set& e) {
        // Ctrl-C and sys.exit() are the user's, not the handler's: they reach the caller of malloc.
        if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit)) throw;
        e.discard_as_unraisable("supermem pressure handler");
      } catch (const py::cast_error&) {  // a bad return is a handler error too, not malloc's
        std::string msg = "supermem pressure handler returned " + std::string(py::repr(r)) +
                          "; expected the bytes it freed (an int >= 0) or None";
        PyErr_SetString(PyExc_TypeError, msg.c_str());
        py::error_already_set().discard_as_unraisable("supermem pressure handler");
      }
      return 0;
    });
  };
}

OomObserver oom_observer_from_py(py::function fn) {
  return [f = hold(std::move(fn))](int device, size_t requested, const std::string& message) {
    if (!may_take_gil()) return;  // at exit: unobserved
    with_gil([&] {
      try {
        (*f)(device, requested, message);
      } catch (py::error_already_set& e) {
        // As in a pressure handler: Ctrl-C and sys.exit() reach the caller of malloc, instead of the OOM.
        if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit)) throw;
        e.discard_as_unraisable("supermem OOM observer");
      }
    });
  };
}

}  // namespace supermem

PYBIND11_MODULE(_C, m) {
  m.doc() = "supermem core: caching allocator, devices, trace ring (C++)";
  if (std::get_terminate() != terminate_with_stack) previous_terminate = std::set_terminate(terminate_with_stack);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfMemory& e) {
      raise_py("OutOfMemoryError", e.what());
    } catch (const UsageError& e) {
      raise_py("UsageError", e.what());
    } catch (const DeviceError& e) {
      raise_py("DeviceError", e.what());
    } catch (const InvariantError& e) {
      raise_py("InvariantError", e.what());
    }
  });

  py::class_<Device, DevicePtr>(m, "Device")
      .def_property_readonly("total_bytes", &Device::total_bytes)
      .def_property_readonly("free_bytes", &Device::free_bytes)
      .def_property_readonly("index", &Device::index)
      .def_property_readonly("name", &Device::name)
      .def_property_readonly("page_bytes", &Device::vm_page_bytes);  // 0: no virtual memory

  py::class_<SimDevice, Device, std::shared_ptr<SimDevice>>(m, "SimDevice")
      .def(py::init([](py::handle capacity, py::handle page) {
             return std::make_shared<SimDevice>(int_arg(capacity, "capacity_bytes", kMaxSize),
                                                int_arg(page, "page_bytes", kMaxSize));
           }),
           py::arg("capacity_bytes"), py::arg("page_bytes") = SimDevice::kDefaultPageBytes)
      .def("hold_events", &SimDevice::hold_events, py::arg("hold"))
      .def("mapped_bytes", [](SimDevice& d, py::handle addr, py::handle n) {
             return d.vm_mapped_bytes(as_ptr(int_arg(addr, "address", kMaxWord)), int_arg(n, "nbytes", kMaxWord));
           }, py::arg("address"), py::arg("nbytes"))
      // For tests of the invariant walker: change the mapping behind the allocator's back.
      .def("_vm_map", [](SimDevice& d, uint64_t addr, size_t n) { return d.vm_map(as_ptr(addr), n); })
      .def("_vm_unmap", [](SimDevice& d, uint64_t addr, size_t n) { d.vm_unmap(as_ptr(addr), n, true); })
      .def("_vm_set_aside", [](SimDevice& d, uint64_t addr, size_t n) { d.vm_set_aside(as_ptr(addr), n); })
      .def("_vm_trim", &SimDevice::vm_trim)
      .def("_vm_reserve", [](SimDevice& d, size_t n) { return reinterpret_cast<uint64_t>(d.vm_reserve(n)); })
      .def("_vm_release", [](SimDevice& d, uint64_t addr, size_t n) { d.vm_release(as_ptr(addr), n); })
      .def_property_readonly("used_bytes", &SimDevice::used_bytes)
      .def_property_readonly("live_events", &SimDevice::live_events)
      .def_property_readonly("waits", &SimDevice::waits)
      .def_property_readonly("stream_waits", &SimDevice::stream_waits)
      .def_property_readonly("page_calls", [](SimDevice& d) {
        auto c = d.page_calls();
        return py::dict(py::arg("created") = c.created, py::arg("aliased") = c.aliased,
                        py::arg("in_place") = c.in_place, py::arg("unmapped") = c.unmapped);
      });

#ifdef SUPERMEM_WITH_CUDA
  py::class_<CudaDevice, Device, std::shared_ptr<CudaDevice>>(m, "CudaDevice")
      .def(py::init([](py::handle index) {
             return std::make_shared<CudaDevice>(static_cast<int>(int_arg(index, "CUDA device index", INT32_MAX)));
           }),
           py::arg("index") = 0);
  py::class_<PinnedHostDevice, Device, std::shared_ptr<PinnedHostDevice>>(m, "PinnedHostDevice")
      .def(py::init([](py::handle capacity) {
             return std::make_shared<PinnedHostDevice>(int_arg(capacity, "capacity_bytes", kMaxSize));
           }),
           py::arg("capacity_bytes"));
  m.def("cuda_device_count", &cuda_device_count);
  m.attr("has_cuda") = true;
#else
  m.def("cuda_device_count", []() { return 0; });
  m.attr("has_cuda") = false;
#endif
  bind_kernels(m);  // relu compression kernels (csrc/kernels/)

  using CA = CachingAllocator;
  py::class_<CA, std::shared_ptr<CA>>(m, "CachingAllocator")
      .def(py::init([](py::handle device, py::handle limit, py::handle passthrough, py::handle debug,
                       py::handle trace_capacity, py::handle segment_bytes, py::handle expandable) {
             // None would become a null device and crash at the first malloc.
             if (device.is_none() || !py::isinstance<Device>(device))
               throw py::type_error("supermem: device must be a supermem device (SimulatedDevice, CudaDevice, "
                                    "PinnedHostDevice), got " + short_repr(device));
             AllocatorOptions o;
             o.limit_bytes = int_arg(limit, "limit_bytes", kMaxSize);
             o.passthrough = bool_arg(passthrough, "passthrough");
             o.debug = static_cast<int>(int_arg(debug, "debug", 2));
             o.trace_capacity = int_arg(trace_capacity, "trace_capacity", kMaxSize);
             o.segment_bytes = int_arg(segment_bytes, "segment_bytes", kMaxSize);
             o.expandable = bool_arg(expandable, "expandable_segments");
             auto dev = device.cast<DevicePtr>();
             try {
               return std::make_shared<CA>(std::move(dev), o);
             } catch (const std::bad_alloc&) {  // only the trace ring is big enough to fail
               raise_trace_ring_memory_error(o.trace_capacity);
             }
           }),
           py::arg("device"), py::arg("limit_bytes") = 0, py::arg("passthrough") = false,
           py::arg("debug") = 0, py::arg("trace_capacity") = 0, py::arg("segment_bytes") = 0,
           py::arg("expandable_segments") = false)
      .def("malloc", [](CA& a, py::handle n, py::handle stream) {
             size_t size = request_size(n);
             Stream s = int_arg(stream, "stream", kMaxWord);
             return without_gil([&] { return reinterpret_cast<uint64_t>(a.malloc(size, s)); });
           }, py::arg("nbytes"), py::arg("stream") = 0)
      .def("free", [](CA& a, py::handle addr) {
             void* p = as_ptr(int_arg(addr, "address", kMaxWord));
             without_gil([&] { a.free(p); });
           }, py::arg("address"))
      .def("record_stream", [](CA& a, py::handle addr, py::handle stream) {
             void* p = as_ptr(int_arg(addr, "address", kMaxWord));
             Stream s = int_arg(stream, "stream", kMaxWord);
             without_gil([&] { a.record_stream(p, s); });
           }, py::arg("address"), py::arg("stream"))
      .def("allocation_size", [](CA& a, py::handle addr) {
             void* p = as_ptr(int_arg(addr, "address", kMaxWord));
             return without_gil([&] { return a.allocation_size(p); });
           }, py::arg("address"))
      .def("empty_cache", nogil(&CA::empty_cache))
      .def("nested_stats", &nested_stats)
      .def_property_readonly("allocated_bytes", [](CA& a) { return a.allocated_now(); })
      .def("set_memory_fraction", nogil(&CA::set_memory_fraction), py::arg("fraction"))
      .def("memory_fraction", nogil(&CA::memory_fraction))
      .def("take_watermark", nogil(&CA::take_watermark))
      .def_property("soft_limit_bytes",
                    [](CA& a) {
                      return without_gil([&] { return a.soft_limit(); });
                    },
                    [](CA& a, py::handle v) {
                      size_t bytes = int_arg(v, "soft_limit_bytes", kMaxSize);
                      without_gil([&] { a.set_soft_limit(bytes); });
                    })
      .def("arm_soft_limit", &CA::arm_soft_limit)  // lock-free: no GIL release
      .def_property_readonly("in_soft_limit_call", &CA::in_soft_limit_call)
      .def("reset_peak_stats", nogil(&CA::reset_peak_stats))
      .def("reset_accumulated_stats", nogil(&CA::reset_accumulated_stats))
      .def_property("limit_bytes",
                    [](CA& a) {
                      return without_gil([&] { return a.limit_bytes(); });
                    },
                    [](CA& a, py::handle v) {
                      size_t limit = int_arg(v, "limit_bytes", kMaxSize);
                      without_gil([&] { a.set_limit_bytes(limit); });
                    })
      .def("check", [](CA& a) {
             without_gil([&] {
               try {
                 a.check();
               } catch (const std::logic_error& e) {
                 throw InvariantError(e.what());
               }
             });
           })
      .def("add_pressure_handler", [](CA& a, py::function fn) {
             PressureHandler h = pressure_handler_from_py(std::move(fn));
             return without_gil([&] { return a.add_pressure_handler(std::move(h)); });
           }, py::arg("handler"))
      .def("add_oom_observer", [](CA& a, py::function fn) {
             OomObserver o = oom_observer_from_py(std::move(fn));
             without_gil([&] { a.add_oom_observer(std::move(o)); });
           }, py::arg("observer"))
      .def("remove_pressure_handler", nogil(&CA::remove_pressure_handler), py::arg("handler_id"))
      .def("begin_allocate_to_pool", [](CA& a, PoolId id, std::vector<uint64_t> streams) {
             without_gil([&] {
               a.begin_allocate_to_pool(id, [streams](Stream s) {
                 return std::find(streams.begin(), streams.end(), s) != streams.end();
               });
             });
           }, py::arg("pool_id"), py::arg("streams"))
      .def("end_allocate_to_pool", nogil(&CA::end_allocate_to_pool), py::arg("pool_id"))
      .def("release_pool", nogil(&CA::release_pool), py::arg("pool_id"))
      .def("snapshot", [](CA& a) {
             std::vector<SegmentInfo> segs;
             {
               without_gil([&] { segs = a.snapshot(); });
             }
             py::list out;
             for (auto& s : segs) {
               py::list blocks;
               for (auto& b : s.blocks)
                 blocks.append(py::dict(py::arg("address") = b.addr, py::arg("size") = b.size,
                                        py::arg("requested_size") = b.requested,
                                        py::arg("state") = state_name(b.state)));
               out.append(py::dict(py::arg("address") = s.addr, py::arg("total_size") = s.size,
                                   py::arg("stream") = s.stream,
                                   py::arg("segment_type") = s.small ? "small" : "large",
                                   py::arg("segment_pool_id") = py::make_tuple(s.pool.first, s.pool.second),
                                   py::arg("is_expandable") = s.expandable, py::arg("blocks") = blocks));
             }
             return out;
           })
      .def("drain_trace", [](CA& a) {
             std::vector<TraceEvent> evs;
             {
               without_gil([&] { evs = a.trace().drain(); });
             }
             py::list out(evs.size());
             for (size_t i = 0; i < evs.size(); ++i) {
               auto& e = evs[i];
               out[i] = py::make_tuple(e.time_ns, kTraceNames[size_t(e.kind)], e.addr, e.size, e.stream, e.tag);
             }
             return out;
           })
      .def("push_trace", [](CA& a, const std::string& kind, py::handle addr, py::handle size, py::handle stream,
                            py::handle tag) {
             void* p = as_ptr(int_arg(addr, "address", kMaxWord));
             uint64_t n = int_arg(size, "size", kMaxWord), s = int_arg(stream, "stream", kMaxWord);
             uint64_t t = int_arg(tag, "tag", kMaxWord);
             for (size_t k = 0; k < size_t(TraceKind::count_); ++k)
               if (kind == kTraceNames[k]) return a.trace().push(TraceKind(k), p, n, s, t);
             throw UsageError("supermem: unknown trace event kind '" + kind + "'");
           }, py::arg("kind"), py::arg("address") = 0, py::arg("size") = 0, py::arg("stream") = 0,
           py::arg("tag") = 0)
      .def_property("trace_capacity", [](CA& a) { return a.trace().capacity(); },
                    [](CA& a, py::handle n) {
                      set_trace_capacity(a.trace(), int_arg(n, "trace_capacity", kMaxSize));
                    })
      .def_property_readonly("trace_dropped", [](CA& a) { return a.trace().dropped(); })
      .def_property_readonly("device", &CA::device)
      .def_property_readonly("passthrough", [](CA& a) { return a.options().passthrough; })
      .def_property_readonly("expandable_segments", [](CA& a) { return a.options().expandable; });

  m.def("format_size", [](py::handle n) { return format_size(int_arg(n, "nbytes", kMaxWord)); }, py::arg("nbytes"),
        "A size as PyTorch's OOM messages write it (\"1.50 GiB\").");
  m.attr("trace_kinds") = py::cast(std::vector<std::string>(std::begin(kTraceNames), std::end(kTraceNames)));
  register_plugin(m);
  // atexit runs on the thread that then finalizes, before finalization begins. The terminate handler
  // goes back on there too: a library loaded after supermem may have set its own (an abort at exit
  // in 2 of 200 GPU runs said only "terminate called without an active exception", no stack).
  py::module_::import("atexit").attr("register")(py::cpp_function([]() {
    finalizing_thread.store(PyThread_get_thread_ident());
    if (std::get_terminate() != terminate_with_stack)
      previous_terminate = std::set_terminate(terminate_with_stack);
  }));
}
