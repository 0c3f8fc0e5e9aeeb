// The CUDA device's virtual memory, for expandable segments: cuMemAddressReserve once per segment,
// then per page cuMemCreate + cuMemMap (+ cuMemSetAccess for the range mapped), cuMemUnmap to give a
// page back. One physical allocation per page, as PyTorch's ExpandableSegment does: the driver cannot
// unmap part of an allocation, and a page is what the allocator gives back.
//
// A page moved to another address (vm_set_aside, then vm_map) keeps its memory and stays mapped where it
// was, unused: a stale view. When the allocator moves it back there, the page is taken as it is, with no
// driver call; elsewhere the memory is mapped once more (cuMemMap + cuMemSetAccess, about half a new
// page's cost, docs/allocator.md). The memory is freed with its last view.
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
#include <unordered_map>
#include <unordered_set>
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
  std::mutex mu;  // guards what follows; never held across a driver call that waits for the device
  ForkRegistration fork{&mu, ForkLevel::device};
  size_t page = 0;  // 0: no virtual memory management on this device or driver
  CUmemAllocationProp prop{};
  struct Page {
    bool mapped = false;
    CUmemGenericAllocationHandle h = 0;  // the memory this address maps (unused: a stale view); 0: none
  };
  std::map<CUdeviceptr, std::vector<Page>> ranges;  // reserved ranges, by page
  std::unordered_map<CUmemGenericAllocationHandle, std::vector<CUdeviceptr>> views;  // memory -> its addresses
  std::vector<CUmemGenericAllocationHandle> aside;  // memory set aside for the next vm_map

  // The range holding [p, p + n) and its first page; DeviceError for anything else (an allocator bug).
  std::pair<std::vector<Page>*, size_t> find(CUdeviceptr p, size_t n, const char* what) {
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
  // find(), where every page must be mapped.
  std::pair<std::vector<Page>*, size_t> find_mapped(CUdeviceptr p, size_t n, const char* what) {
    auto found = find(p, n, what);
    for (size_t i = found.second; i < found.second + n / page; ++i)
      if (!(*found.first)[i].mapped) throw DeviceError(std::string("supermem: ") + what + " of a page not mapped");
    return found;
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
  v.ranges[p].assign(nbytes / v.page, Vm::Page{});
  return reinterpret_cast<void*>(p);
}

void CudaDevice::vm_release(void* base, size_t nbytes) {
  Vm& v = vm();
  CUdeviceptr p = reinterpret_cast<CUdeviceptr>(base);
  DeviceGuard g(index_);
  {
    std::lock_guard<std::mutex> l(v.mu);
    auto it = v.ranges.find(p);
    if (it == v.ranges.end() || it->second.size() * v.page != nbytes)
      throw DeviceError("supermem: vm_release of a range that was not reserved");
    for (const Vm::Page& page : it->second)
      if (page.mapped) throw DeviceError("supermem: vm_release of a range with pages still mapped");
    for (size_t i = 0; i < it->second.size(); ++i)  // stale views: their memory lives on elsewhere
      if (it->second[i].h) drop_view(it->second[i].h, p + i * v.page);
    v.ranges.erase(it);
  }
  check_cu(driver().address_free(p, nbytes), "cuMemAddressFree");
}

// (With the lock) `va`, a page mapping h that is not in use, is unmapped.
void CudaDevice::drop_view(CUmemGenericAllocationHandle h, CUdeviceptr va) {
  Vm& v = *vm_;
  check_cu(driver().unmap(va, v.page), "cuMemUnmap");
  auto& views = v.views[h];
  views.erase(std::find(views.begin(), views.end(), va));
  if (views.empty()) v.views.erase(h);
}

// (With the lock) every address mapping h unmapped, and its memory freed.
void CudaDevice::free_page(CUmemGenericAllocationHandle h) {
  Vm& v = *vm_;
  auto it = v.views.find(h);
  if (it != v.views.end()) {
    for (CUdeviceptr va : it->second) {
      check_cu(driver().unmap(va, v.page), "cuMemUnmap");
      auto [pages, i] = v.find(va, v.page, "vm_unmap");
      (*pages)[i].h = 0;
    }
    v.views.erase(it);
  }
  check_cu(driver().release(h), "cuMemRelease");
}

bool CudaDevice::vm_map(void* addr, size_t nbytes) {
  Vm& v = vm();
  const Driver& d = driver();
  CUdeviceptr p = reinterpret_cast<CUdeviceptr>(addr);
  size_t n = nbytes / v.page;
  DeviceGuard g(index_);
  RelaxedCapture relaxed;
  std::lock_guard<std::mutex> l(v.mu);  // (no call below waits for the device)
  auto [pages, first] = v.find(p, nbytes, "vm_map");
  Vm::Page* at = pages->data() + first;
  for (size_t k = 0; k < n; ++k)
    if (at[k].mapped) throw DeviceError("supermem: vm_map of a page already mapped");
  std::vector<char> how(n, 0);  // 1: set-aside memory still mapped here; 2: set-aside memory; 3: new
  std::unordered_set<CUmemGenericAllocationHandle> aside(v.aside.begin(), v.aside.end());
  for (size_t k = 0; k < n; ++k)
    if (at[k].h && aside.erase(at[k].h)) how[k] = 1;
  auto taken = [&](CUmemGenericAllocationHandle h) { return !aside.count(h); };
  v.aside.erase(std::remove_if(v.aside.begin(), v.aside.end(), taken), v.aside.end());
  // Pages [0, upto) of the second pass go back; every page taken in place goes back to the aside list.
  auto undo = [&](size_t upto) {  // nothing has used these pages yet: no need to wait for the device
    for (size_t k = 0; k < n; ++k) {
      if (how[k] == 1) v.aside.push_back(at[k].h);
      if (k >= upto || how[k] < 2) continue;
      drop_view(at[k].h, p + k * v.page);
      if (how[k] == 2) v.aside.push_back(at[k].h);
      else d.release(at[k].h);
      at[k].h = 0;
    }
  };
  for (size_t k = 0; k < n; ++k) {
    if (how[k] == 1) continue;
    CUdeviceptr va = p + k * v.page;
    CUresult r = CUDA_SUCCESS;
    if (at[k].h) {  // a stale view of memory in use elsewhere
      drop_view(at[k].h, va);
      at[k].h = 0;
    }
    CUmemGenericAllocationHandle h = 0;
    if (!v.aside.empty()) {
      h = v.aside.back();
      v.aside.pop_back();
      how[k] = 2;
    } else {
      r = d.create(&h, v.page, &v.prop, 0);
      how[k] = 3;
    }
    if (r == CUDA_SUCCESS && (r = d.map(va, v.page, 0, h, 0)) != CUDA_SUCCESS && how[k] == 3) d.release(h);
    if (r != CUDA_SUCCESS) {
      if (how[k] == 2) v.aside.push_back(h);
      how[k] = 0;
      undo(k);
      if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
      check_cu(r, "cuMemCreate/cuMemMap");
    }
    at[k].h = h;
    v.views[h].push_back(va);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = index_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (size_t k = 0; k < n;) {  // each run of newly mapped pages (a stale view kept its access)
    size_t e = k;
    while (e < n && how[e] >= 2) ++e;
    if (e == k) {
      ++k;
      continue;
    }
    CUresult r = d.set_access(p + k * v.page, (e - k) * v.page, &access, 1);
    if (r != CUDA_SUCCESS) {
      undo(n);
      if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
      check_cu(r, "cuMemSetAccess");
    }
    k = e;
  }
  for (size_t k = 0; k < n; ++k) at[k].mapped = true;
  return true;
}

void CudaDevice::vm_unmap(void* addr, size_t nbytes, bool wait) {
  Vm& v = vm();
  CUdeviceptr p = reinterpret_cast<CUdeviceptr>(addr);
  size_t n = nbytes / v.page;
  {
    std::lock_guard<std::mutex> l(v.mu);
    v.find_mapped(p, nbytes, "vm_unmap");
  }
  DeviceGuard g(index_);
  // Unlike cudaFree, cuMemUnmap does not wait for kernels still using the pages (PyTorch found the
  // same): a block freed on its own stream may still be read by work queued there.
  if (wait) check(cudaDeviceSynchronize(), "cudaDeviceSynchronize before cuMemUnmap");
  std::lock_guard<std::mutex> l(v.mu);
  auto [pages, first] = v.find(p, nbytes, "vm_unmap");
  for (size_t i = first; i < first + n; ++i) {
    (*pages)[i].mapped = false;
    free_page((*pages)[i].h);  // (every view of it, this one included)
  }
}

void CudaDevice::vm_set_aside(void* addr, size_t nbytes) {
  Vm& v = vm();
  std::lock_guard<std::mutex> l(v.mu);
  auto [pages, first] = v.find_mapped(reinterpret_cast<CUdeviceptr>(addr), nbytes, "vm_set_aside");
  for (size_t i = first; i < first + nbytes / v.page; ++i) {
    (*pages)[i].mapped = false;
    v.aside.push_back((*pages)[i].h);
  }
}

void CudaDevice::vm_trim() {
  Vm& v = vm();
  std::lock_guard<std::mutex> l(v.mu);
  if (v.aside.empty()) return;
  DeviceGuard g(index_);
  for (CUmemGenericAllocationHandle h : v.aside) free_page(h);
  v.aside.clear();
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
      if (pages[i].mapped) total += page_end - q;
      q = page_end;
    }
  }
  return total;
}

}  // namespace supermem
