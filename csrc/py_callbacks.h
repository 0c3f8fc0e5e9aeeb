// Python callables as allocator callbacks: they take the GIL when called, are kept alive by C++,
// and are released with the GIL held (or leaked at interpreter exit). Errors they raise are reported
// as unraisable and never cross into the allocator, except KeyboardInterrupt and SystemExit: those are
// the user's and reach the caller of malloc.
#pragma once

#include <pybind11/pybind11.h>

#include "alloc/caching.h"

namespace supermem {
PressureHandler pressure_handler_from_py(pybind11::function fn);
OomObserver oom_observer_from_py(pybind11::function fn);
}  // namespace supermem
