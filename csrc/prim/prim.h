// The primitive layer: the only code that talks to a device. Two implementations:
//   CudaDevice (cuda.cpp): cudaMalloc/cudaFree, events and stream capture queries on one GPU;
//   SimDevice  (sim.cpp):  a fixed-capacity device backed by host memory, so everything above runs
//                          and is tested on machines without a GPU.
// Contracts are written above each function. Implementations are thread-safe.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "../core/types.h"

namespace supermem {

class Device {
 public:
  virtual ~Device() = default;

  // Returns nbytes (> 0) of device memory aligned to >= 512 bytes, or nullptr when the device
  // has no room. Throws DeviceError on any other failure. Safe while `stream` is being captured
  // into a CUDA graph (the call is made in relaxed capture mode).
  virtual void* segment_alloc(size_t nbytes, Stream stream) = 0;

  // Returns a segment obtained from segment_alloc. Must not be called during a graph capture.
  virtual void segment_free(void* ptr, size_t nbytes) = 0;

  // Records a new event on `stream`; it completes once all work queued before it has run.
  virtual Event event_record(Stream stream) = 0;
  // True once the event has completed. Never blocks.
  virtual bool event_done(Event e) = 0;
  // Blocks the calling thread until the event has completed.
  virtual void event_wait(Event e) = 0;
  // Gives the event back (to a pool of reusable events).
  virtual void event_release(Event e) = 0;

  // Virtual memory, for expandable segments: address space reserved once, memory mapped into it and
  // unmapped from it in pages. A device without it keeps these defaults (vm_page_bytes() == 0).
  //
  // The page size: every size and offset below is a multiple of it. 0: no virtual memory.
  virtual size_t vm_page_bytes() { return 0; }
  // Reserves `nbytes` of address space with nothing mapped. nullptr when the address space is
  // exhausted; throws DeviceError on any other failure.
  virtual void* vm_reserve(size_t nbytes) { return nullptr; }
  // Gives a reserved range back. Precondition: none of its pages is mapped.
  virtual void vm_release(void* base, size_t nbytes) {}
  // Backs the unmapped pages [addr, addr + nbytes) of a reserved range with new memory, readable and
  // writable by the device. false when the device has no room (then none of them is mapped); throws
  // DeviceError on any other failure (a page already mapped, a range not reserved). Legal while a
  // stream is being captured into a CUDA graph.
  virtual bool vm_map(void* addr, size_t nbytes) { return false; }
  // Unmaps the mapped pages [addr, addr + nbytes) and frees their memory, after waiting for the work
  // queued on the device if `wait` (a kernel queued on the allocation stream may still use them; false:
  // the caller waited since they were last used). Throws DeviceError for a page not mapped. Must not be
  // called during a graph capture.
  virtual void vm_unmap(void* addr, size_t nbytes, bool wait) {}
  // The mapped pages [addr, addr + nbytes) are unmapped for the caller (as after vm_unmap(..., false):
  // no queued work uses them), but their memory is kept aside for the next vm_map, which takes it before
  // any new memory: for a page that still names one of them (its old address), with no driver call at
  // all; else mapped there too. The old address may stay mapped, unused (CUDA: a stray write there lands
  // in the memory wherever it went, as a write to a freed block does in any caching allocator; the
  // simulated device makes it inaccessible). vm_trim frees what no vm_map took. Pages move between
  // addresses and back without new memory.
  virtual void vm_set_aside(void* addr, size_t nbytes) { vm_unmap(addr, nbytes, false); }
  virtual void vm_trim() {}
  // Bytes of [addr, addr + nbytes) that are mapped, as the device itself counts them (the walker
  // compares them with the allocator's blocks).
  virtual size_t vm_mapped_bytes(void* addr, size_t nbytes) { return 0; }

  virtual size_t total_bytes() = 0;  // capacity of the device
  virtual size_t free_bytes() = 0;   // what segment_alloc could still hand out, roughly
  virtual int index() const = 0;     // device ordinal (0 for the simulated device)
  virtual std::string name() const = 0;
};

using DevicePtr = std::shared_ptr<Device>;

// A simulated device of `capacity` bytes. Memory is real host memory (mmap'd per segment,
// pages committed only when touched). Events complete immediately unless the test holds them:
// hold_events(true) keeps every event recorded from then on outstanding until hold_events(false).
// Virtual memory in pages of `page_bytes` (a multiple of the host's page size; 0: none): a reserved range is
// inaccessible host address space, a mapped page fresh zeroed memory, an unmapped page inaccessible
// again (a stray access faults, as on a GPU). Mapped pages count as used, reserved ranges do not.
class SimDevice : public Device {
 public:
  static constexpr size_t kDefaultPageBytes = 2 << 20;  // CUDA's granularity on current GPUs
  explicit SimDevice(size_t capacity, size_t page_bytes = kDefaultPageBytes);
  ~SimDevice() override;
  void* segment_alloc(size_t nbytes, Stream stream) override;
  void segment_free(void* ptr, size_t nbytes) override;
  Event event_record(Stream stream) override;
  bool event_done(Event e) override;
  void event_wait(Event e) override;
  void event_release(Event e) override;
  size_t vm_page_bytes() override { return page_bytes_; }
  void* vm_reserve(size_t nbytes) override;
  void vm_release(void* base, size_t nbytes) override;
  bool vm_map(void* addr, size_t nbytes) override;
  void vm_unmap(void* addr, size_t nbytes, bool wait) override;
  void vm_set_aside(void* addr, size_t nbytes) override;
  void vm_trim() override;
  size_t vm_mapped_bytes(void* addr, size_t nbytes) override;
  size_t total_bytes() override { return capacity_; }
  size_t free_bytes() override;
  int index() const override { return 0; }
  std::string name() const override { return "sim"; }

  void hold_events(bool hold);             // see above
  size_t used_bytes();
  size_t live_events();
  std::pair<size_t, size_t> waits();  // (vm_unmap calls that waited for the device, event_wait calls)
  struct PageCalls {  // what a GPU's driver would have been asked, in pages
    size_t created = 0;   // new memory mapped (cuMemCreate + cuMemMap)
    size_t aliased = 0;   // memory set aside mapped at another address (cuMemMap)
    size_t in_place = 0;  // memory set aside taken back where it was still mapped (nothing)
    size_t unmapped = 0;  // addresses unmapped (cuMemUnmap), stale ones included
  };
  PageCalls page_calls();
  std::map<Stream, size_t> stream_waits();  // event_wait calls by the stream each event was recorded on

 private:
  void drop_view(int64_t phys, char* page);  // (with the lock) `page` no longer maps phys
  void free_phys(int64_t phys);              // (with the lock) every page mapping it unmapped; memory freed
  struct State;
  std::unique_ptr<State> st_;
  size_t capacity_;
  size_t page_bytes_;
};

#ifdef SUPERMEM_WITH_CUDA
// One CUDA device. All calls switch to that device for their duration.
class CudaDevice : public Device {
 public:
  explicit CudaDevice(int index);
  ~CudaDevice() override;
  void* segment_alloc(size_t nbytes, Stream stream) override;
  void segment_free(void* ptr, size_t nbytes) override;
  Event event_record(Stream stream) override;
  bool event_done(Event e) override;
  void event_wait(Event e) override;
  void event_release(Event e) override;
  // Virtual memory through the driver API (cuMemAddressReserve, cuMemCreate + cuMemMap +
  // cuMemSetAccess per page, cuMemUnmap), reached with cudaGetDriverEntryPointByVersion: no link
  // against libcuda. Pages are the driver's recommended granularity, at least 2 MiB; 0 when the
  // device or driver has no virtual memory management. Only this device gets access (no peers).
  size_t vm_page_bytes() override;
  void* vm_reserve(size_t nbytes) override;
  void vm_release(void* base, size_t nbytes) override;
  bool vm_map(void* addr, size_t nbytes) override;
  void vm_unmap(void* addr, size_t nbytes, bool wait) override;
  void vm_set_aside(void* addr, size_t nbytes) override;
  void vm_trim() override;
  size_t vm_mapped_bytes(void* addr, size_t nbytes) override;
  size_t total_bytes() override;
  size_t free_bytes() override;
  int index() const override { return index_; }
  std::string name() const override;

 private:
  struct State;
  struct Vm;  // cuda_vm.cpp: the driver's page size and which reserved pages are mapped
  void drop_view(unsigned long long h, unsigned long long va);  // (cuda_vm.cpp, with Vm's lock)
  void free_page(unsigned long long h);
  Vm& vm();
  std::unique_ptr<State> st_;
  std::once_flag vm_once_;
  Vm* vm_ = nullptr;  // leaked, as the spare events are: the device may outlive CUDA at exit
  int index_;
};

// Pinned (page-locked) host memory as a source, up to `capacity` bytes: cudaHostAlloc'd segments,
// CUDA events (the streams that copy to and from it decide when a block may be reused).
class PinnedHostDevice : public Device {
 public:
  explicit PinnedHostDevice(size_t capacity);
  ~PinnedHostDevice() override;
  void* segment_alloc(size_t nbytes, Stream stream) override;
  void segment_free(void* ptr, size_t nbytes) override;
  Event event_record(Stream stream) override;
  bool event_done(Event e) override;
  void event_wait(Event e) override;
  void event_release(Event e) override;
  size_t total_bytes() override { return capacity_; }
  size_t free_bytes() override;
  int index() const override { return -1; }
  std::string name() const override { return "pinned_host"; }

 private:
  struct State;
  std::unique_ptr<State> st_;
  size_t capacity_;
};

int cuda_device_count();  // 0 when there is no driver or no GPU; never throws
#endif

}  // namespace supermem
