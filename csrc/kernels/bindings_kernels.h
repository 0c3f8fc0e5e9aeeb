// Registers the kernels' Python bindings on supermem._C (called from bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace supermem {

// Adds relu_* functions and has_relu_kernels (false when built without nvcc).
void bind_kernels(pybind11::module_& m);

}  // namespace supermem
