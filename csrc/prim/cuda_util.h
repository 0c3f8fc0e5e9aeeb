// What the CUDA device's files share (cuda.cpp, cuda_vm.cpp): error checks and a device guard.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../core/types.h"

namespace supermem {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it so it does not surface in an unrelated PyTorch call
    throw DeviceError(std::string("supermem: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

// Makes `index` the current device for the guard's lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != index) check(cudaSetDevice(index), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
};

}  // namespace supermem
