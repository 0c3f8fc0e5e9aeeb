// The PyTorch plug-in (plugin.cpp): built only against a CUDA build of torch.
#pragma once

#include <pybind11/pybind11.h>

namespace supermem {
void register_plugin(pybind11::module_& m);  // adds _C.plugin_* functions (none without CUDA torch)
}
