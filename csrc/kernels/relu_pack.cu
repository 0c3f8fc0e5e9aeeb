// ReLU bitmap compression kernels (format and contracts: relu_pack.h).
//
// Pack is three passes, each a single sweep: (1) one warp per block of kBlockElems elements reads
// 16-byte vectors, builds the block's bitmap words with shuffles and counts its nonzeros; (2) CUB's
// device-wide exclusive scan turns the counts into offsets; (3) the same warps read their block
// again (back to front, so the first reads hit what pass 1 left in L2) and write the nonzeros at
// offsets[block] + their rank, staged through shared memory so the global writes are contiguous. Unpack is one pass: each warp loads its block's 64 bitmap words
// once, ranks each lane's elements with a warp prefix sum of popcounts, loads its values and
// writes 16-byte vectors. All indices are int64: tensors past 2^31 elements work.
#include <cub/device/device_scan.cuh>

#include <climits>
#include <string>

#include "core/types.h"
#include "kernels/relu_pack.h"

namespace supermem::kernels {

namespace {

constexpr int kWarpsPerCta = 8;
constexpr int kThreads = 32 * kWarpsPerCta;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kUnroll = 4;  // vectors loaded before the first is used: 64 bytes in flight per thread
constexpr uint32_t kNonzero = 0xffffffffu;  // predicate limit: every word but 0 (see relu_pack.h)
static_assert(kBlockElems == 64 * 32, "unpack keeps a block's bitmap words in two registers per lane");

// How a warp walks a block for a W-bit element: each lane holds one 16-byte vector per step.
template <typename W>
struct Layout {
  static constexpr int kVec = 16 / sizeof(W);          // elements per vector: 4 (fp32) or 8 (16-bit)
  static constexpr int kLanesPerWord = 32 / kVec;      // lanes whose vectors make one bitmap word
  static constexpr int kChunk = 32 * kVec;             // elements per warp step (kVec bitmap words)
  static constexpr int kSteps = kBlockElems / kChunk;  // steps per block: 16 or 8
  static_assert(kSteps % kUnroll == 0, "steps come in groups of kUnroll");
};

template <typename W>
struct Vec {
  W w[16 / sizeof(W)];
};

// A vector's elements <-> the four 32-bit words of a 16-byte access (little-endian: element 0 is
// the low half of word 0). Built field by field, so the compiler emits one 16-byte load or store.
template <typename W>
__device__ __forceinline__ Vec<W> from_uint4(uint4 u) {
  const uint32_t words[4] = {u.x, u.y, u.z, u.w};
  Vec<W> v;
#pragma unroll
  for (int j = 0; j < Layout<W>::kVec; ++j) {
    if constexpr (sizeof(W) == 4)
      v.w[j] = words[j];
    else
      v.w[j] = W(words[j / 2] >> (16 * (j % 2)));
  }
  return v;
}

template <typename W>
__device__ __forceinline__ uint4 to_uint4(const Vec<W>& v) {
  if constexpr (sizeof(W) == 4) {
    return make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]);
  } else {
    uint32_t words[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) words[k] = uint32_t(v.w[2 * k]) | (uint32_t(v.w[2 * k + 1]) << 16);
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// Elements i .. i+kVec-1; those at or past n read as 0 (so they never set a bit).
template <typename W, bool kAligned>
__device__ __forceinline__ Vec<W> load_vec(const W* __restrict__ src, int64_t i, int64_t n) {
  constexpr int V = Layout<W>::kVec;
  if (kAligned && i + V <= n) return from_uint4<W>(*reinterpret_cast<const uint4*>(src + i));
  Vec<W> v;
#pragma unroll
  for (int j = 0; j < V; ++j) v.w[j] = (i + j < n) ? src[i + j] : W(0);
  return v;
}

// Stores elements i .. i+kVec-1, skipping those at or past n.
template <typename W, bool kAligned>
__device__ __forceinline__ void store_vec(W* __restrict__ dst, int64_t i, int64_t n, const Vec<W>& v) {
  constexpr int V = Layout<W>::kVec;
  if (kAligned && i + V <= n) {
    __stwb(reinterpret_cast<uint4*>(dst + i), to_uint4(v));  // a plain store got split into four
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (i + j < n) dst[i + j] = v.w[j];
  }
}

// Bit j set iff 1 <= element j's word <= limit (unsigned): a zero word wraps to UINT32_MAX.
template <typename W>
__device__ __forceinline__ uint32_t mask_of(const Vec<W>& v, uint32_t limit) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < Layout<W>::kVec; ++j) m |= uint32_t(uint32_t(v.w[j]) - 1u < limit) << j;
  return m;
}

// Joins the lanes' kVec-bit masks into the step's bitmap words: afterwards every lane of the
// aligned group g (lanes g*kLanesPerWord ..) holds word g. The bits are disjoint, so OR them.
template <typename W>
__device__ __forceinline__ uint32_t bitmap_word(uint32_t m, int lane) {
  using L = Layout<W>;
  uint32_t word = m << ((lane % L::kLanesPerWord) * L::kVec);
#pragma unroll
  for (int off = L::kLanesPerWord / 2; off > 0; off >>= 1) word |= __shfl_xor_sync(kFullMask, word, off);
  return word;
}

// Inclusive prefix sum over the warp's lanes.
__device__ __forceinline__ int warp_inclusive_sum(int x, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(kFullMask, x, off);
    if (lane >= off) x += y;
  }
  return x;
}

// Pass 1: the bitmap under predicate `limit`, and (when counts is set) each block's set bits,
// plus counts[nblocks] = 0 so that the exclusive scan's last entry is the total.
template <typename W, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    bitmap_kernel(const W* __restrict__ src, int64_t n, uint32_t limit, uint32_t* __restrict__ bitmap,
                  int64_t* __restrict__ counts, int64_t nblocks) {
  using L = Layout<W>;
  const int lane = threadIdx.x % 32;
  const int64_t block = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (block >= nblocks) return;  // the whole warp leaves together
  const int64_t first = block * kBlockElems;
  const int64_t nwords = (n + 31) / 32;
  int count = 0;
  for (int s0 = 0; s0 < L::kSteps; s0 += kUnroll) {
    Vec<W> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      v[u] = load_vec<W, kAligned>(src, first + (s0 + u) * L::kChunk + lane * L::kVec, n);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t m = mask_of(v[u], limit);
      count += __popc(m);
      const uint32_t word = bitmap_word<W>(m, lane);
      const int64_t w = (first + (s0 + u) * L::kChunk) / 32 + lane / L::kLanesPerWord;
      if (lane % L::kLanesPerWord == 0 && w < nwords) bitmap[w] = word;
    }
  }
  if (counts == nullptr) return;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) count += __shfl_xor_sync(kFullMask, count, off);
  if (lane == 0) {
    counts[block] = count;
    if (block == 0) counts[nblocks] = 0;
  }
}

// Pass 3: each block's nonzeros to values[offsets[block] ..], in element order.
template <typename W, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    scatter_kernel(const W* __restrict__ src, int64_t n, const int64_t* __restrict__ offsets,
                   W* __restrict__ values, int64_t nblocks) {
  using L = Layout<W>;
  __shared__ W stage[kWarpsPerCta][L::kChunk];
  const int lane = threadIdx.x % 32;
  // CTAs take their blocks back to front: pass 1 has just read the input front to back, so the
  // first blocks read here are the ones still in L2.
  const int64_t cta = int64_t(gridDim.x) - 1 - blockIdx.x;
  const int64_t block = cta * kWarpsPerCta + threadIdx.x / 32;
  if (block >= nblocks) return;
  W* mine = stage[threadIdx.x / 32];
  const int64_t first = block * kBlockElems;
  int64_t out = offsets[block];
  for (int s0 = 0; s0 < L::kSteps; s0 += kUnroll) {
    Vec<W> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      v[u] = load_vec<W, kAligned>(src, first + (s0 + u) * L::kChunk + lane * L::kVec, n);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t m = mask_of(v[u], kNonzero);
      const int c = __popc(m);
      const int incl = warp_inclusive_sum(c, lane);
      const int total = __shfl_sync(kFullMask, incl, 31);
      int pos = incl - c;  // this lane's first slot among the step's nonzeros
#pragma unroll
      for (int j = 0; j < L::kVec; ++j)
        if ((m >> j) & 1u) mine[pos++] = v[u].w[j];
      __syncwarp();
      for (int k = lane; k < total; k += 32) values[out + k] = mine[k];
      __syncwarp();  // the stage is rewritten next step
      out += total;
    }
  }
}

// Unpack: dst gets the values where the bitmap is set and 0 elsewhere. Everything a lane needs to
// find its values is in registers (the bitmap words) or one load (the block's offset), so the
// value loads of kUnroll steps are all in flight before the first store.
template <typename W, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    unpack_kernel(const uint32_t* __restrict__ bitmap, const int64_t* __restrict__ offsets,
                  const W* __restrict__ values, int64_t n, W* __restrict__ dst, int64_t nblocks) {
  using L = Layout<W>;
  const int lane = threadIdx.x % 32;
  const int64_t block = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (block >= nblocks) return;
  const int64_t first = block * kBlockElems;
  const int64_t nwords = (n + 31) / 32;
  // The block's 64 bitmap words, loaded once: word k is register k / 32 of lane k % 32. Words past
  // the bitmap read as 0, so steps past n load nothing and store nothing.
  const int64_t w0 = first / 32;
  const uint32_t lo = (w0 + lane < nwords) ? bitmap[w0 + lane] : 0u;
  const uint32_t hi = (w0 + 32 + lane < nwords) ? bitmap[w0 + 32 + lane] : 0u;
  int64_t in = offsets[block];  // values before this step
  for (int s0 = 0; s0 < L::kSteps; s0 += kUnroll) {
    Vec<W> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // Step s covers block words s*kVec .. s*kVec+kVec-1: never straddling a register (32 % kVec == 0).
      const int s = s0 + u;
      const int k = s * L::kVec + lane / L::kLanesPerWord;
      const uint32_t word = __shfl_sync(kFullMask, s * L::kVec < 32 ? lo : hi, k % 32);
      const uint32_t m = (word >> ((lane % L::kLanesPerWord) * L::kVec)) & ((1u << L::kVec) - 1u);
      const int c = __popc(m);
      const int incl = warp_inclusive_sum(c, lane);
      const W* mine = values + in + (incl - c);  // this lane's first value
      int r = 0;
#pragma unroll
      for (int j = 0; j < L::kVec; ++j) {
        const bool set = (m >> j) & 1u;
        v[u].w[j] = set ? mine[r] : W(0);
        r += set;
      }
      in += __shfl_sync(kFullMask, incl, 31);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      store_vec<W, kAligned>(dst, first + (s0 + u) * L::kChunk + lane * L::kVec, n, v[u]);
  }
}

// Spreads 4 bits to the low bit of 4 bytes.
__device__ __forceinline__ uint32_t bits_to_bytes(uint32_t x) {
  return (x & 1u) | ((x & 2u) << 7) | ((x & 4u) << 14) | ((x & 8u) << 21);
}

// Thread t writes bools 16t .. 16t+15 from half a bitmap word.
__global__ void __launch_bounds__(kThreads)
    mask_unpack_kernel(const uint32_t* __restrict__ bitmap, int64_t n, uint8_t* __restrict__ dst, bool aligned) {
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t i = t * 16;
  if (i >= n) return;
  const uint32_t bits = (bitmap[t / 2] >> ((t % 2) * 16)) & 0xffffu;
  if (aligned && i + 16 <= n) {
    const uint4 out = {bits_to_bytes(bits), bits_to_bytes(bits >> 4), bits_to_bytes(bits >> 8),
                       bits_to_bytes(bits >> 12)};
    *reinterpret_cast<uint4*>(dst + i) = out;
  } else {
    for (int j = 0; j < 16 && i + j < n; ++j) dst[i + j] = (bits >> j) & 1u;
  }
}

// ---- host side -----------------------------------------------------------------------------------

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it so it does not surface in an unrelated call
    throw DeviceError(std::string("supermem: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

void check_args(int64_t n, int elem_bytes) {
  if (n < 0) throw UsageError("supermem: element count must be >= 0, got " + std::to_string(n));
  if (elem_bytes != 2 && elem_bytes != 4)
    throw UsageError("supermem: element size must be 2 or 4 bytes, got " + std::to_string(elem_bytes));
}

void check_ptr(const void* p, const char* name) {
  if (p == nullptr) throw UsageError(std::string("supermem: ") + name + " is a null pointer");
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int64_t num_blocks(int64_t n) { return (n + kBlockElems - 1) / kBlockElems; }

// One CTA per kWarpsPerCta blocks.
unsigned grid_for(int64_t nblocks) {
  const int64_t ctas = (nblocks + kWarpsPerCta - 1) / kWarpsPerCta;
  if (ctas > INT_MAX) throw UsageError("supermem: tensor too large for the relu kernels");
  return static_cast<unsigned>(ctas);
}

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

size_t counts_bytes(int64_t nblocks) { return round_up((nblocks + 1) * sizeof(int64_t), 256); }

size_t scan_temp_bytes(int64_t items) {
  size_t bytes = 0;
  check(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int64_t*>(nullptr),
                                      static_cast<int64_t*>(nullptr), items),
        "cub::DeviceScan::ExclusiveSum (workspace size)");
  return bytes;
}

template <typename W>
void launch_bitmap(const void* src, int64_t n, uint32_t limit, uint32_t* bitmap, int64_t* counts,
                   cudaStream_t stream) {
  const int64_t nblocks = num_blocks(n);
  const auto* s = static_cast<const W*>(src);
  if (aligned16(src))
    bitmap_kernel<W, true><<<grid_for(nblocks), kThreads, 0, stream>>>(s, n, limit, bitmap, counts, nblocks);
  else
    bitmap_kernel<W, false><<<grid_for(nblocks), kThreads, 0, stream>>>(s, n, limit, bitmap, counts, nblocks);
  check(cudaGetLastError(), "relu bitmap kernel launch");
}

template <typename W>
void launch_scatter(const void* src, int64_t n, const int64_t* offsets, void* values, cudaStream_t stream) {
  const int64_t nblocks = num_blocks(n);
  const auto* s = static_cast<const W*>(src);
  auto* v = static_cast<W*>(values);
  if (aligned16(src))
    scatter_kernel<W, true><<<grid_for(nblocks), kThreads, 0, stream>>>(s, n, offsets, v, nblocks);
  else
    scatter_kernel<W, false><<<grid_for(nblocks), kThreads, 0, stream>>>(s, n, offsets, v, nblocks);
  check(cudaGetLastError(), "relu scatter kernel launch");
}

template <typename W>
void launch_unpack(const uint32_t* bitmap, const int64_t* offsets, const void* values, int64_t n, void* dst,
                   cudaStream_t stream) {
  const int64_t nblocks = num_blocks(n);
  const auto* v = static_cast<const W*>(values);
  auto* d = static_cast<W*>(dst);
  if (aligned16(dst))
    unpack_kernel<W, true><<<grid_for(nblocks), kThreads, 0, stream>>>(bitmap, offsets, v, n, d, nblocks);
  else
    unpack_kernel<W, false><<<grid_for(nblocks), kThreads, 0, stream>>>(bitmap, offsets, v, n, d, nblocks);
  check(cudaGetLastError(), "relu unpack kernel launch");
}

}  // namespace

size_t relu_pack_workspace_bytes(int64_t n) {
  check_args(n, 4);
  const int64_t nblocks = num_blocks(n);
  return counts_bytes(nblocks) + scan_temp_bytes(nblocks + 1);
}

void relu_pack_offsets(const void* src, int64_t n, int elem_bytes, uint32_t* bitmap, int64_t* offsets,
                       void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  check_args(n, elem_bytes);
  if (n == 0) return;
  check_ptr(src, "src"), check_ptr(bitmap, "bitmap"), check_ptr(offsets, "offsets");
  check_ptr(workspace, "workspace");
  const int64_t nblocks = num_blocks(n);
  size_t temp_bytes = scan_temp_bytes(nblocks + 1);
  if (workspace_bytes < counts_bytes(nblocks) + temp_bytes)
    throw UsageError("supermem: relu_pack workspace of " + std::to_string(workspace_bytes) + " bytes, needs " +
                     std::to_string(counts_bytes(nblocks) + temp_bytes));
  auto* counts = static_cast<int64_t*>(workspace);
  void* temp = static_cast<char*>(workspace) + counts_bytes(nblocks);
  if (elem_bytes == 4)
    launch_bitmap<uint32_t>(src, n, kNonzero, bitmap, counts, stream);
  else
    launch_bitmap<uint16_t>(src, n, kNonzero, bitmap, counts, stream);
  check(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, offsets, nblocks + 1, stream),
        "cub::DeviceScan::ExclusiveSum");
}

void relu_pack_values(const void* src, int64_t n, int elem_bytes, const int64_t* offsets, void* values,
                      cudaStream_t stream) {
  check_args(n, elem_bytes);
  if (n == 0) return;
  // values may be null when src has no nonzeros (torch's pointer for zero bytes): nothing writes it.
  check_ptr(src, "src"), check_ptr(offsets, "offsets");
  if (elem_bytes == 4)
    launch_scatter<uint32_t>(src, n, offsets, values, stream);
  else
    launch_scatter<uint16_t>(src, n, offsets, values, stream);
}

void relu_unpack(const uint32_t* bitmap, const int64_t* offsets, const void* values, int64_t n, int elem_bytes,
                 void* dst, cudaStream_t stream) {
  check_args(n, elem_bytes);
  if (n == 0) return;
  // values may be empty (an all-zero tensor): torch hands out null for zero bytes, and no lane reads it.
  check_ptr(bitmap, "bitmap"), check_ptr(offsets, "offsets"), check_ptr(dst, "dst");
  if (elem_bytes == 4)
    launch_unpack<uint32_t>(bitmap, offsets, values, n, dst, stream);
  else
    launch_unpack<uint16_t>(bitmap, offsets, values, n, dst, stream);
}

void relu_mask_pack(const void* src, int64_t n, int elem_bytes, uint32_t positive_limit, uint32_t* bitmap,
                    cudaStream_t stream) {
  check_args(n, elem_bytes);
  if (n == 0) return;
  check_ptr(src, "src"), check_ptr(bitmap, "bitmap");
  if (elem_bytes == 4)
    launch_bitmap<uint32_t>(src, n, positive_limit, bitmap, nullptr, stream);
  else
    launch_bitmap<uint16_t>(src, n, positive_limit, bitmap, nullptr, stream);
}

void relu_mask_unpack(const uint32_t* bitmap, int64_t n, bool* dst, cudaStream_t stream) {
  check_args(n, 4);
  if (n == 0) return;
  check_ptr(bitmap, "bitmap"), check_ptr(dst, "dst");
  const int64_t threads = (n + 15) / 16;
  const int64_t ctas = (threads + kThreads - 1) / kThreads;
  if (ctas > INT_MAX) throw UsageError("supermem: tensor too large for the relu kernels");
  mask_unpack_kernel<<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
      bitmap, n, reinterpret_cast<uint8_t*>(dst), aligned16(dst));
  check(cudaGetLastError(), "relu mask unpack kernel launch");
}

}  // namespace supermem::kernels
