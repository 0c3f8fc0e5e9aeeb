// The CUDA device. cudart is linked statically (see CMakeLists.txt): it talks to the driver's
// primary context, which PyTorch's own cudart shares, so streams, events and pointers interoperate.
#include <cuda_runtime_api.h>

#include <mutex>
#include <vector>

#include "../core/fork.h"
#include "cuda_util.h"
#include "prim.h"

namespace supermem {

namespace {

// Reusable events: creating one costs a driver call, recording a spare one does not.
struct EventPool {
  std::mutex mu;
  ForkRegistration fork{&mu, ForkLevel::device};
  std::vector<cudaEvent_t> spare;

  Event record(Stream stream) {
    cudaEvent_t e = nullptr;
    {
      std::lock_guard<std::mutex> l(mu);
      if (!spare.empty()) {
        e = spare.back();
        spare.pop_back();
      }
    }
    if (!e) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventRecord(e, reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord");
    return e;
  }
  void release(Event e) {
    std::lock_guard<std::mutex> l(mu);
    spare.push_back(static_cast<cudaEvent_t>(e));
  }
};

bool query_event(Event e) {
  cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(e));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery");
  return true;
}

void wait_event(Event e) { check(cudaEventSynchronize(static_cast<cudaEvent_t>(e)), "cudaEventSynchronize"); }

}  // namespace

struct CudaDevice::State {
  EventPool events;
};

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

CudaDevice::CudaDevice(int index) : st_(new State), index_(index) {
  int n = cuda_device_count();
  if (index < 0 || index >= n)
    throw UsageError("supermem: CUDA device " + std::to_string(index) + " does not exist (" +
                     std::to_string(n) + " visible)");
}

CudaDevice::~CudaDevice() {
  // Deliberately leak spare events: the destructor may run while CUDA is unloading at exit.
}

void* CudaDevice::segment_alloc(size_t nbytes, Stream) {
  DeviceGuard g(index_);
  // Relaxed mode makes cudaMalloc legal while some stream captures a graph in global mode.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  check(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, nbytes);
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return nullptr;
  }
  check(err, "cudaMalloc");
  return p;
}

void CudaDevice::segment_free(void* ptr, size_t) {
  DeviceGuard g(index_);
  check(cudaFree(ptr), "cudaFree");
}

Event CudaDevice::event_record(Stream stream) {
  DeviceGuard g(index_);
  return st_->events.record(stream);
}

bool CudaDevice::event_done(Event e) { return query_event(e); }
void CudaDevice::event_wait(Event e) { wait_event(e); }
void CudaDevice::event_release(Event e) { st_->events.release(e); }

size_t CudaDevice::total_bytes() {
  DeviceGuard g(index_);
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return total;
}

size_t CudaDevice::free_bytes() {
  DeviceGuard g(index_);
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

struct PinnedHostDevice::State {
  EventPool events;
  std::mutex mu;
  ForkRegistration fork{&mu, ForkLevel::device};
  size_t used = 0;
};

PinnedHostDevice::PinnedHostDevice(size_t capacity) : st_(new State), capacity_(capacity) {}

PinnedHostDevice::~PinnedHostDevice() {}

void* PinnedHostDevice::segment_alloc(size_t nbytes, Stream) {
  {
    std::lock_guard<std::mutex> l(st_->mu);
    if (nbytes > capacity_ - st_->used) return nullptr;
    st_->used += nbytes;
  }
  void* p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, nbytes, cudaHostAllocDefault);
  if (err != cudaSuccess) {
    cudaGetLastError();
    std::lock_guard<std::mutex> l(st_->mu);
    st_->used -= nbytes;
    if (err == cudaErrorMemoryAllocation) return nullptr;
    check(err, "cudaHostAlloc");
  }
  return p;
}

void PinnedHostDevice::segment_free(void* ptr, size_t nbytes) {
  check(cudaFreeHost(ptr), "cudaFreeHost");
  std::lock_guard<std::mutex> l(st_->mu);
  st_->used -= nbytes;
}

Event PinnedHostDevice::event_record(Stream stream) { return st_->events.record(stream); }
bool PinnedHostDevice::event_done(Event e) { return query_event(e); }
void PinnedHostDevice::event_wait(Event e) { wait_event(e); }
void PinnedHostDevice::event_release(Event e) { st_->events.release(e); }

size_t PinnedHostDevice::free_bytes() {
  std::lock_guard<std::mutex> l(st_->mu);
  return capacity_ - st_->used;
}

std::string CudaDevice::name() const {
  cudaDeviceProp p;
  check(cudaGetDeviceProperties(&p, index_), "cudaGetDeviceProperties");
  return p.name;
}

}  // namespace supermem
