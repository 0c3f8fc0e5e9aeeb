// The CUDA device's virtual memory, for expandable segments: cuMemAddressReserve once per segment,
// then per page cuMemCreate + cuMemMap (+ cuMemSetAccess for the range mapped), cuMemUnmap to give a
// page back. One physical allocation per page, as PyTorch's ExpandableSegment does: the driver cannot
// unmap part of an allocation, and a page is what the allocator gives back.
//
// The driver API is reached through cudaGetDriverEntryPointByVersion, not by linking libcuda: the
// module must import on machines with no driver (cudart itself only dlopens libcuda when first used).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/fork.h"
#include "cuda_util.h"
#include "prim.h"

namespace supermem {

namespace {

constexpr size_t kMinPageBytes = 2 << 20;
constexpr unsigned kDriverApiVersion = 12000;  // the entry points' ABI asked for (CUDA 12.0 and later)

struct Driver {
  PFN_cuDeviceGetAttribute_v2000 get_attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuGetErrorString_v6000 error_string = nullptr;
  std::string missing;  // the first entry point not found: no virtual memory then
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    auto get = [&](const char* name, auto& fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult found{};
      if (cudaGetDriverEntryPointByVersion(name, &p, kDriverApiVersion, cudaEnableDefault, &found) != cudaSuccess ||
          found != cudaDriverEntryPointSuccess || !p) {
        cudaGetLastError();
        if (d.missing.empty()) d.missing = name;
        return;
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    get("cuDeviceGetAttribute", d.get_attribute);
    get("cuMemGetAllocationGranularity", d.granularity);
    get("cuMemAddressReserve", d.reserve);
    get("cuMemAddressFree", d.address_free);
    get("cuMemCreate", d.create);
    get("cuMemRelease", d.release);
    get("cuMemMap", d.map);
    get("cuMemUnmap", d.unmap);
    get("cuMemSetAccess", d.set_access);
    get("cuGetErrorString", d.error_string);
    return d;
  }();
  return d;
}

void check_cu(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  if (driver().error_string) driver().error_string(r, &msg);
  throw DeviceError(std::string("supermem: ") + what + " failed: " + (msg ? msg : "CUresult " + std::to_string(r)));
}

// cuMemCreate and cuMemMap while another thread captures a graph in global mode: allowed in relaxed
// mode, as segment_alloc's cudaMalloc is.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace

struct CudaDevice::Vm {
  std::mutex mu;  // guards `ranges`; never held across a driver call that waits for the device
  ForkRegistration fork{&mu, ForkLevel::device};
  size_t page = 0;  // 0: no virtual memory management on this device or driver
  CUmemAllocationProp prop{};
  std::map<CUdeviceptr, std::vector<bool>> ranges;  // reserved ranges: which of their pages are mapped

  // The range holding [p, p + n) and its first page; DeviceError for anything else (an allocator bug).
  std::pair<std::vector<bool>*, size_t> find(CUdeviceptr p, size_t n, const char* what) {
    auto it = ranges.upper_bound(p);
    if (it != ranges.begin()) {
      --it;
      size_t off = p - it->first, size = it->second.size() * page;
      if (p >= it->first && off % page == 0 && n % page == 0 && n <= size - std::min(off, size))
        return {&it->second, off / page};
    }
    throw DeviceError(std::string("supermem: ") + what + " of " + std::to_string(n) +
                      " bytes that are not whole pages of a reserved range");
  }
};

CudaDevice::Vm& CudaDevice::vm() {
  std::call_once(vm_once_, [this] {
    auto* v = new Vm;  // leaked with the device, as its spare events are (exit may unload CUDA first)
    DeviceGuard g(index_);  // also initialises the runtime, and with it the driver
    const Driver& d = driver();
    int supported = 0;
    if (d.missing.empty() &&
        d.get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, index_) == CUDA_SUCCESS &&
        supported) {
      v->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      v->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      v->prop.location.id = index_;
      v->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;  // no IPC export (see docs/allocator.md)
      size_t gran = 0;
      if (d.granularity(&gran, &v->prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == CUDA_SUCCESS && gran)
        v->page = (std::max(kMinPageBytes, gran) + gran - 1) / gran * gran;
    }
    vm_ = v;
  });
  return *vm_;
}

size_t CudaDevice::vm_page_bytes() { return vm().page; }

void* CudaDevice::vm_reserve(size_t nbytes) {
  Vm& v = vm();
  if (!v.page || nbytes % v.page) throw DeviceError("supermem: vm_reserve of a partial page, or no virtual memory");
  DeviceGuard g(index_);
  CUdeviceptr p = 0;
  CUresult r = driver().reserve(&p, nbytes, v.page, 0, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return nullptr;
  check_cu(r, "cuMemAddressReserve");
  std::lock_guard<std::mutex> l(v.mu);
  v.ranges[p].assign(nbytes / v.page, false);
  return reinterpret_cast<void*>(p);
}

void CudaDevice::vm_release(void* base, size_t nbytes) {
  Vm& v = vm();
  CUdeviceptr p = reinterpret_cast<CUdeviceptr>(base);
  {
    std::lock_guard<std::mutex> l(v.mu);
    auto it = v.ranges.find(p);
    if (it == v.ranges.end() || it->second.size() * v.page != nbytes)
      throw DeviceError("supermem: vm_release of a range that was not reserved");
    if (std::find(it->second.begin(), it->second.end(), true) != it->second.end())
      throw DeviceError("supermem: vm_release of a range with pages still mapped");
    v.ranges.erase(it);
  }
  DeviceGuard g(index_);
  check_cu(driver().address_free(p, nbytes), "cuMemAddressFree");
}

bool CudaDevice::vm_map(void* addr, size_t nbytes) {
  Vm& v = vm();
  const Driver& d = driver();
  CUdeviceptr p = reinterpret_cast<CUdeviceptr>(addr);
  size_t first = 0, n = nbytes / v.page;
  {
    std::lock_guard<std::mutex> l(v.mu);
    auto [pages, at] = v.find(p, nbytes, "vm_map");
    first = at;
    for (size_t i = first; i < first + n; ++i)
      if ((*pages)[i]) throw DeviceError("supermem: vm_map of a page already mapped");
  }
  DeviceGuard g(index_);
  RelaxedCapture relaxed;
  size_t mapped = 0;
  auto undo = [&] {  // nothing has used these pages yet: no need to wait for the device
    for (size_t i = 0; i < mapped; ++i) d.unmap(p + i * v.page, v.page);
  };
  for (; mapped < n; ++mapped) {
    CUmemGenericAllocationHandle h = 0;
    CUresult r = d.create(&h, v.page, &v.prop, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      undo();
      return false;
    }
    if (r == CUDA_SUCCESS) {
      r = d.map(p + mapped * v.page, v.page, 0, h, 0);
      d.release(h);  // the mapping keeps the memory until it is unmapped
    }
    if (r != CUDA_SUCCESS) {
      undo();
      check_cu(r, "cuMemCreate/cuMemMap");
    }
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = index_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult r = d.set_access(p, nbytes, &access, 1);
  if (r != CUDA_SUCCESS) {
    undo();
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
    check_cu(r, "cuMemSetAccess");
  }
  std::lock_guard<std::mutex> l(v.mu);
  auto [pages, at] = v.find(p, nbytes, "vm_map");
  std::fill(pages->begin() + at, pages->begin() + at + n, true);
  return true;
}

void CudaDevice::vm_unmap(void* addr, size_t nbytes, bool wait) {
  Vm& v = vm();
  CUdeviceptr p = reinterpret_cast<CUdeviceptr>(addr);
  size_t n = nbytes / v.page;
  {
    std::lock_guard<std::mutex> l(v.mu);
    auto [pages, first] = v.find(p, nbytes, "vm_unmap");
    for (size_t i = first; i < first + n; ++i)
      if (!(*pages)[i]) throw DeviceError("supermem: vm_unmap of a page not mapped");
  }
  DeviceGuard g(index_);
  // Unlike cudaFree, cuMemUnmap does not wait for kernels still using the pages (PyTorch found the
  // same): a block freed on its own stream may still be read by work queued there.
  if (wait) check(cudaDeviceSynchronize(), "cudaDeviceSynchronize before cuMemUnmap");
  for (size_t i = 0; i < n; ++i) check_cu(driver().unmap(p + i * v.page, v.page), "cuMemUnmap");
  std::lock_guard<std::mutex> l(v.mu);
  auto [pages, first] = v.find(p, nbytes, "vm_unmap");
  std::fill(pages->begin() + first, pages->begin() + first + n, false);
}

size_t CudaDevice::vm_mapped_bytes(void* addr, size_t nbytes) {
  Vm& v = vm();
  std::lock_guard<std::mutex> l(v.mu);
  CUdeviceptr lo = reinterpret_cast<CUdeviceptr>(addr), hi = lo + nbytes;
  size_t total = 0;
  for (auto& [base, pages] : v.ranges) {
    CUdeviceptr b = std::max(lo, base), e = std::min(hi, base + pages.size() * v.page);
    for (CUdeviceptr q = b; q < e;) {
      size_t i = (q - base) / v.page;
      CUdeviceptr page_end = std::min(e, base + (i + 1) * v.page);
      if (pages[i]) total += page_end - q;
      q = page_end;
    }
  }
  return total;
}

}  // namespace supermem
