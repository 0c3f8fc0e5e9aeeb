// The PyTorch plug-in: extern "C" entry points that torch.cuda.memory.CUDAPluggableAllocator loads
// from this very .so, over one CachingAllocator per CUDA device. Built only with CUDA and torch.
#pragma once

#include <pybind11/pybind11.h>

namespace supermem {
void register_plugin(pybind11::module_& m);  // adds _C.plugin_* functions (no-op without CUDA)
}
