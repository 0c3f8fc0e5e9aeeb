// ReLU bitmap compression kernels (format and contracts: relu_pack.h).
//
// Pack is one pass (a single-pass scan, Merrill & Garland's decoupled look-back, as CUB's
// DeviceSelect): each CTA takes a tile of 64 KiB of input (kWarpsPerCta warps, each taking 16 steps
// of one 16-byte vector a lane: one 2048-element block of fp32, two of a 16-bit type) in the order
// of an atomic ticket. The tile goes to shared memory by asynchronous copies; step by step, each
// warp writes the bitmap words (built with shuffles), counts the nonzeros and compacts them in
// place. The CTA publishes its tile's count, looks back over its predecessors' status words for the
// nonzeros before it, publishes its own inclusive prefix, writes its blocks' offsets, and each warp
// writes its run of nonzeros from shared memory as 16-byte vectors. Unpack is one pass too: each
// warp loads its block's 64 bitmap words once, scans their popcounts once (so every lane finds its
// first value of a step with two shuffles, not a scan a step), loads the values of a few steps into
// shared memory as 16-byte vectors, and writes 16-byte vectors. All indices are int64: tensors past
// 2^31 elements work.
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

// Elements i .. i+kVec-1 as one 16-byte word; those at or past n read as 0 (so they never set a bit).
template <typename W, bool kAligned>
__device__ __forceinline__ uint4 load_raw(const W* __restrict__ src, int64_t i, int64_t n) {
  constexpr int V = Layout<W>::kVec;
  if (kAligned && i + V <= n) return *reinterpret_cast<const uint4*>(src + i);
  Vec<W> v;
#pragma unroll
  for (int j = 0; j < V; ++j) v.w[j] = (i + j < n) ? src[i + j] : W(0);
  return to_uint4(v);
}

template <typename W, bool kAligned>
__device__ __forceinline__ Vec<W> load_vec(const W* __restrict__ src, int64_t i, int64_t n) {
  return from_uint4<W>(load_raw<W, kAligned>(src, i, n));
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

// Warp sum, every lane gets it.
template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// The bitmap of the elements whose word is in 1..limit (relu_mask_pack), one warp per block.
template <typename W, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    mask_kernel(const W* __restrict__ src, int64_t n, uint32_t limit, uint32_t* __restrict__ bitmap,
                int64_t nblocks) {
  using L = Layout<W>;
  const int lane = threadIdx.x % 32;
  const int64_t block = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (block >= nblocks) return;  // the whole warp leaves together
  const int64_t first = block * kBlockElems;
  const int64_t nwords = (n + 31) / 32;
  for (int s0 = 0; s0 < L::kSteps; s0 += kUnroll) {
    Vec<W> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      v[u] = load_vec<W, kAligned>(src, first + (s0 + u) * L::kChunk + lane * L::kVec, n);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t word = bitmap_word<W>(mask_of(v[u], limit), lane);
      const int64_t w = (first + (s0 + u) * L::kChunk) / 32 + lane / L::kLanesPerWord;
      if (lane % L::kLanesPerWord == 0 && w < nwords) bitmap[w] = word;
    }
  }
}

// Tile status words of the single-pass pack, one per tile (PackTiling): the flag in the top two
// bits, the call's epoch below it, the value in the low 40. A word is this call's once it carries
// this call's epoch and a flag: the tile's own count (kAggregate), then the nonzeros up to and
// including it (kPrefix). Anything else (0 from a memset, or an earlier call's word on a workspace
// kept across calls) is not ready. A word holds everything a reader needs and is written by one
// 64-bit store, so a reader sees either nothing or a whole (flag, epoch, value): no other data
// travels with it, so no fence is needed.
constexpr uint64_t kAggregate = 1ull << 62;
constexpr uint64_t kPrefix = 2ull << 62;
constexpr int kEpochShift = 40;
constexpr uint64_t kValueMask = (1ull << kEpochShift) - 1;
static_assert(relu_pack_max_epoch < (1u << (62 - kEpochShift)), "the epoch fits between value and flag");

__device__ __forceinline__ bool ready(uint64_t word, uint64_t tag) {
  return (word >> 62) != 0 && ((word >> kEpochShift) & uint64_t(relu_pack_max_epoch)) == tag;
}

__device__ __forceinline__ void publish(uint64_t* status, uint64_t word) {
  *reinterpret_cast<volatile unsigned long long*>(status) = word;
}

// A lane's nonzeros of one step (mask m over the vector raw) to stage[pos], stage[pos + 1], ...
template <typename W>
__device__ __forceinline__ void stage_nonzeros(W* stage, int pos, uint32_t m, uint4 raw) {
  const Vec<W> v = from_uint4<W>(raw);
#pragma unroll
  for (int j = 0; j < Layout<W>::kVec; ++j)
    if ((m >> j) & 1u) stage[pos++] = v.w[j];
}

// The nonzeros before `tile` (> 0), by warp 0 of its CTA: lane l reads the status of tile
// window - l, waits until all 32 are ready, then sums the aggregates back to the nearest inclusive
// prefix (a window with none moves back 32 tiles). Tickets make this safe: every tile before this
// one took its ticket earlier, so its CTA is running or done, and it publishes its aggregate
// before it waits on anything.
__device__ int64_t look_back(const uint64_t* status, int64_t tile, int lane, uint64_t tag) {
  int64_t exclusive = 0;
  for (int64_t window = tile - 1;; window -= 32) {
    const int64_t t = window - lane;
    uint64_t word;
    for (;;) {
      // Before tile 0 there is nothing: a prefix of 0.
      word = t >= 0 ? *reinterpret_cast<const volatile unsigned long long*>(status + t)
                    : kPrefix | (tag << kEpochShift);
      if (!__any_sync(kFullMask, !ready(word, tag))) break;
      __nanosleep(64);
    }
    const unsigned prefixes = __ballot_sync(kFullMask, (word >> 62) == 2);
    const int last = prefixes ? __ffs(prefixes) - 1 : 31;  // the nearest prefix ends the sum
    exclusive += warp_sum<int64_t>(lane <= last ? int64_t(word & kValueMask) : 0);
    if (prefixes) return exclusive;
  }
}

// How the pack splits a tile: every warp takes 16 steps (8 KiB), whatever the element size, so a
// 16-bit warp takes two blocks. Measured on an H100 (bench relu), per-tile costs (the look-back)
// dominated with 32 KiB bf16 tiles: 0.73x copy at 1 GiB, against 0.77x with 64 KiB.
template <typename W>
struct PackTiling {
  static constexpr int kBlocksPerWarp = 4 / sizeof(W);
  static constexpr int kStepsPerBlock = Layout<W>::kSteps;
  static constexpr int kSteps = kStepsPerBlock * kBlocksPerWarp;  // steps a warp takes: 16
  static constexpr int kBlocksPerTile = kWarpsPerCta * kBlocksPerWarp;
  static constexpr int kGroupSteps = 4;  // steps whose copies land together (one cp.async group)
  static_assert(kSteps % kGroupSteps == 0 && kGroupSteps % 2 == 0, "groups of step pairs");
  static_assert(kBlocksPerTile * kBlockElems == relu_pack_tile_elems(sizeof(W)), "relu_pack.h says so");
};

int64_t num_tiles(int64_t nblocks, int elem_bytes) {
  const int64_t per = elem_bytes == 4 ? PackTiling<uint32_t>::kBlocksPerTile : PackTiling<uint16_t>::kBlocksPerTile;
  return (nblocks + per - 1) / per;
}

// Copies 16 bytes from global to shared memory without a register (sm_80+); the issuing thread's
// wait_copies<N>() waits until at most N of its commit groups are in flight.
__device__ __forceinline__ void copy_async16(uint4* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
#else
  *dst = *static_cast<const uint4*>(src);
#endif
}

__device__ __forceinline__ void commit_copies() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wait_copies() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Bytes of a pack CTA's tile in shared memory: each warp's kSteps x 32 16-byte vectors, and one
// more that write_run may read past the last warp's.
template <typename W>
constexpr size_t pack_shared_bytes() {
  return (size_t(kWarpsPerCta) * PackTiling<W>::kSteps * 32 + 1) * 16;
}

// Bytes [16 - sh, 32 - sh) of a followed by b (0 < sh < 16, the same in every lane).
template <int Q>
__device__ __forceinline__ uint4 shifted_at(const uint32_t (&c)[8], int r) {
  return make_uint4(__funnelshift_r(c[Q], c[Q + 1], 8 * r), __funnelshift_r(c[Q + 1], c[Q + 2], 8 * r),
                    __funnelshift_r(c[Q + 2], c[Q + 3], 8 * r), __funnelshift_r(c[Q + 3], c[Q + 4], 8 * r));
}

__device__ __forceinline__ uint4 shifted(uint4 a, uint4 b, int sh) {
  const uint32_t c[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  const int o = 16 - sh, r = o % 4;
  switch (o / 4) {
    case 0: return shifted_at<0>(c, r);
    case 1: return shifted_at<1>(c, r);
    case 2: return shifted_at<2>(c, r);
    default: return shifted_at<3>(c, r);
  }
}

// A warp's run of `end` values (run, in shared memory: 16-byte vectors) to values[out ..]. The run
// starts anywhere in a 16-byte vector of values (pad elements in), so each whole vector of values
// is two of the run's, shifted; the partial first and last ones go element by element (the rest of
// their vector belongs to the runs beside this one).
template <typename W>
__device__ __forceinline__ void write_run(W* values, int64_t out, const uint4* run, int end, int lane) {
  constexpr int V = Layout<W>::kVec;
  const int pad = int(reinterpret_cast<uintptr_t>(values + out) % 16 / sizeof(W));
  W* dst = values + out - pad;  // 16-byte aligned: element d of dst is run element d - pad
  const W* elems = reinterpret_cast<const W*>(run);
  const int nvec = (pad + end + V - 1) / V;
  for (int q = lane; q < nvec; q += 32) {
    const int d = q * V;
    if (d >= pad && d + V <= pad + end) {
      const uint4 v = pad == 0 ? run[q] : shifted(run[q - 1], run[q], pad * int(sizeof(W)));
      *reinterpret_cast<uint4*>(dst + d) = v;
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (d + j >= pad && d + j < pad + end) dst[d + j] = elems[d + j - pad];
    }
  }
}

// Single-pass pack: bitmap, offsets and (values != nullptr) the nonzeros, reading src once.
// `workspace`: word 0 is the ticket counter (`ticket_base` tickets were taken before this call),
// words 1.. the tile statuses (tagged with `epoch`, see ready()).
// The tile goes to shared memory by asynchronous copies (no registers held while they fly), and
// each warp compacts its nonzeros there in place, step by step: a step's nonzeros go before the
// step's own place, which its lanes have read. So a warp holds no tile in registers while it waits
// for its offset (the look-back), and 3 CTAs fit an SM, not 2 (with the tile in registers, the
// values pass cost twice the time of its writes: bench relu on an H200).
template <typename W, bool kAligned>
__global__ void __launch_bounds__(kThreads, 3)
    pack_kernel(const W* __restrict__ src, int64_t n, uint32_t* __restrict__ bitmap, int64_t* __restrict__ offsets,
                W* __restrict__ values, int64_t capacity, uint64_t* workspace, int64_t nblocks, uint64_t ticket_base,
                uint32_t epoch) {
  using L = Layout<W>;
  using T = PackTiling<W>;
  constexpr int kGroups = T::kSteps / T::kGroupSteps;
  extern __shared__ __align__(16) uint4 tile_shared_vectors[];
  __shared__ int64_t tile_shared;
  __shared__ int warp_count[kWarpsPerCta];
  __shared__ int first_block_count[kWarpsPerCta];  // of the warp's first block (two-block warps)
  __shared__ int64_t warp_offset[kWarpsPerCta];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  // The tile comes from a ticket, not blockIdx: a CTA never waits on one that has not started.
  if (threadIdx.x == 0)
    tile_shared = atomicAdd(reinterpret_cast<unsigned long long*>(workspace), 1ull) - ticket_base;
  __syncthreads();
  const int64_t tile = tile_shared;
  const uint64_t tag = epoch, tagged = tag << kEpochShift;
  uint64_t* status = workspace + 1;
  const int64_t ntiles = (nblocks + T::kBlocksPerTile - 1) / T::kBlocksPerTile;
  const int64_t tile_block = tile * T::kBlocksPerTile;
  const int64_t first = (tile_block + warp * T::kBlocksPerWarp) * kBlockElems;  // past n: all loads read 0
  const int64_t nwords = (n + 31) / 32;
  uint4* vectors = tile_shared_vectors + warp * T::kSteps * 32;  // the warp's: step s, lane l at s * 32 + l
  W* run = reinterpret_cast<W*>(vectors);                        // its nonzeros, compacted in place

#pragma unroll
  for (int s = 0; s < T::kSteps; ++s) {
    const int64_t i = first + s * L::kChunk + lane * L::kVec;
    if (kAligned && i + L::kVec <= n)
      copy_async16(&vectors[s * 32 + lane], src + i);
    else
      vectors[s * 32 + lane] = load_raw<W, kAligned>(src, i, n);
    if (s % T::kGroupSteps == T::kGroupSteps - 1) commit_copies();
  }

  // Step by step: the bitmap word, the count, the nonzeros to run[total ..]. A pair of steps shares
  // a scan: their counts (<= 256 a warp) in 16-bit halves.
  int total = 0, first_count = 0;
  static_assert(kGroups == 4, "one wait a group below");
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    if (g == 0) wait_copies<3>();  // group g has landed (this lane's copies: it reads only its own)
    if (g == 1) wait_copies<2>();
    if (g == 2) wait_copies<1>();
    if (g == 3) wait_copies<0>();
#pragma unroll
    for (int s = g * T::kGroupSteps; s < (g + 1) * T::kGroupSteps; s += 2) {
      const uint4 raw0 = vectors[s * 32 + lane], raw1 = vectors[(s + 1) * 32 + lane];
      const uint32_t m0 = mask_of(from_uint4<W>(raw0), kNonzero), m1 = mask_of(from_uint4<W>(raw1), kNonzero);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const uint32_t word = bitmap_word<W>(k ? m1 : m0, lane);
        const int64_t w = (first + (s + k) * L::kChunk) / 32 + lane / L::kLanesPerWord;
        if (lane % L::kLanesPerWord == 0 && w < nwords) bitmap[w] = word;
      }
      const int c0 = __popc(m0), c1 = __popc(m1);
      const int incl = warp_inclusive_sum(c0 | (c1 << 16), lane);
      const int both = __shfl_sync(kFullMask, incl, 31);
      const int total0 = total + (both & 0xffff);
      __syncwarp();  // every lane has read both steps before any writes over them
      if (values != nullptr) {
        stage_nonzeros<W>(run, total + (incl & 0xffff) - c0, m0, raw0);
        stage_nonzeros<W>(run, total0 + (incl >> 16) - c1, m1, raw1);
      }
      total = total0 + (both >> 16);
      if (s + 1 == T::kStepsPerBlock - 1) first_count = total;
    }
  }
  if (lane == 0) warp_count[warp] = total, first_block_count[warp] = first_count;
  __syncthreads();

  if (warp == 0) {
    const int c = lane < kWarpsPerCta ? warp_count[lane] : 0;
    const int incl = warp_inclusive_sum(c, lane);
    const int64_t aggregate = __shfl_sync(kFullMask, incl, 31);
    if (lane == 0) publish(status + tile, (tile == 0 ? kPrefix : kAggregate) | tagged | uint64_t(aggregate));
    const int64_t exclusive = tile == 0 ? 0 : look_back(status, tile, lane, tag);
    if (lane == 0 && tile > 0) publish(status + tile, kPrefix | tagged | uint64_t(exclusive + aggregate));
    if (lane < kWarpsPerCta) {
      const int64_t offset = exclusive + (incl - c);
      warp_offset[lane] = offset;
      const int64_t b = tile_block + lane * T::kBlocksPerWarp;
      if (b < nblocks) offsets[b] = offset;
      if (T::kBlocksPerWarp > 1 && b + 1 < nblocks) offsets[b + 1] = offset + first_block_count[lane];
    }
    if (lane == 0 && tile == ntiles - 1) offsets[nblocks] = exclusive + aggregate;
  }
  __syncthreads();
  if (values == nullptr) return;
  const int64_t out = warp_offset[warp];
  const int64_t room = capacity - out;  // values past the capacity are left out (< 0: all of them)
  if (room > 0) write_run<W>(values, out, vectors, room < total ? int(room) : total, lane);
}

// Unpack: dst gets the values where the bitmap is set and 0 elsewhere. A warp takes `warp_steps`
// steps of a block (all kSteps, or kUnroll when the tensor is too small to fill the GPU with one
// warp per block). Everything a lane needs to find its values is in registers (the bitmap words)
// or one load (the block's offset). kStaged (values 16-byte aligned): the warp loads the run of
// values of kUnroll steps into shared memory as 16-byte vectors, and each lane takes its values
// from there, not by one 2- or 4-byte global load each (per byte, twice as many for 16-bit types).
template <typename W, bool kAligned, bool kStaged>
__global__ void __launch_bounds__(kThreads)
    unpack_kernel(const uint32_t* __restrict__ bitmap, const int64_t* __restrict__ offsets,
                  const W* __restrict__ values, int64_t n, W* __restrict__ dst, int64_t nwarps, int warp_steps) {
  using L = Layout<W>;
  constexpr int V = L::kVec;
  __shared__ __align__(16) W stage[kStaged ? kWarpsPerCta : 1][kStaged ? kUnroll * L::kChunk + V : 1];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t gwarp = int64_t(blockIdx.x) * kWarpsPerCta + warp;
  if (gwarp >= nwarps) return;
  const int parts = L::kSteps / warp_steps;
  const int64_t block = gwarp / parts;
  const int s_begin = int(gwarp % parts) * warp_steps;
  const int64_t first = block * kBlockElems;
  const int64_t nwords = (n + 31) / 32;
  // The block's 64 bitmap words, loaded once: word k is register k / 32 of lane k % 32. Words past
  // the bitmap read as 0, so steps past n load nothing and store nothing.
  const int64_t w0 = first / 32;
  const uint32_t lo = (w0 + lane < nwords) ? bitmap[w0 + lane] : 0u;
  const uint32_t hi = (w0 + 32 + lane < nwords) ? bitmap[w0 + 32 + lane] : 0u;
  // The values before each word in the block, by one scan of the words' counts (both registers'
  // in the 16-bit halves of one sum: a block has <= 2048): word k's in lane k % 32 of lo_before /
  // hi_before. A lane's first value in a step is then two shuffles away, not a scan away.
  const int64_t base = offsets[block];
  const int c_lo = __popc(lo), c_hi = __popc(hi);
  const int incl = warp_inclusive_sum(c_lo | (c_hi << 16), lane);
  const int total = __shfl_sync(kFullMask, incl, 31);  // both halves' sums over the block
  const int lo_before = (incl & 0xffff) - c_lo;
  const int hi_before = (total & 0xffff) + (incl >> 16) - c_hi;
  const int block_count = (total & 0xffff) + (total >> 16);
  // Values in the block before its word k (0 .. 64), the same k in every lane.
  auto before_word = [&](int k) {
    return k == 64 ? block_count : __shfl_sync(kFullMask, k < 32 ? lo_before : hi_before, k % 32);
  };
  W* mine = stage[kStaged ? warp : 0];
  for (int s0 = s_begin; s0 < s_begin + warp_steps; s0 += kUnroll) {
    int64_t run = base;  // kStaged: the value at mine[0]
    if (kStaged) {
      // The values of steps s0 .. s0+kUnroll-1, from the 16-byte boundary at or before the first.
      const int64_t begin = base + before_word(s0 * V), end = base + before_word((s0 + kUnroll) * V);
      run = begin - begin % V;
      const int nvec = int((end - run + V - 1) / V);
      for (int k = lane; k < nvec; k += 32) {
        const int64_t i = run + int64_t(k) * V;
        uint4 x;
        if (i + V <= end) {
          x = *reinterpret_cast<const uint4*>(values + i);
        } else {  // the last vector: nothing read past the run (nor so past the buffer)
          Vec<W> part;
#pragma unroll
          for (int j = 0; j < V; ++j) part.w[j] = i + j < end ? values[i + j] : W(0);
          x = to_uint4(part);
        }
        *reinterpret_cast<uint4*>(mine + k * V) = x;
      }
      __syncwarp();
    }
    Vec<W> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // Step s covers block words s*kVec .. s*kVec+kVec-1: never straddling a register (32 % kVec == 0).
      const int s = s0 + u;
      const int k = s * V + lane / L::kLanesPerWord;
      const bool low = s * V < 32;
      const uint32_t word = __shfl_sync(kFullMask, low ? lo : hi, k % 32);
      const int word_before = __shfl_sync(kFullMask, low ? lo_before : hi_before, k % 32);
      const int bit = (lane % L::kLanesPerWord) * V;
      const uint32_t m = (word >> bit) & ((1u << V) - 1u);
      const int at = word_before + __popc(word & ((1u << bit) - 1u));  // the lane's first, in the block
      const W* src = kStaged ? mine + int(base + at - run) : values + base + at;
      int r = 0;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const bool set = (m >> j) & 1u;
        v[u].w[j] = set ? src[r] : W(0);
        r += set;
      }
    }
    if (kStaged) __syncwarp();  // the stage is rewritten next round
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

// One CTA per kWarpsPerCta warps.
unsigned grid_for(int64_t nwarps) {
  const int64_t ctas = (nwarps + kWarpsPerCta - 1) / kWarpsPerCta;
  if (ctas > INT_MAX) throw UsageError("supermem: tensor too large for the relu kernels");
  return static_cast<unsigned>(ctas);
}

// Blocks below which unpack gives each block kSteps / kUnroll warps (per SM: 4 waves of 64 warps):
// with one warp per block a small tensor leaves most of the GPU idle.
int64_t unpack_split_below_blocks() {
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return int64_t(sms) * 4 * 64;
}

template <typename W>
void launch_mask(const void* src, int64_t n, uint32_t limit, uint32_t* bitmap, cudaStream_t stream) {
  const int64_t nblocks = num_blocks(n);
  const auto* s = static_cast<const W*>(src);
  if (aligned16(src))
    mask_kernel<W, true><<<grid_for(nblocks), kThreads, 0, stream>>>(s, n, limit, bitmap, nblocks);
  else
    mask_kernel<W, false><<<grid_for(nblocks), kThreads, 0, stream>>>(s, n, limit, bitmap, nblocks);
  check(cudaGetLastError(), "relu mask kernel launch");
}

template <typename W, bool kAligned>
void launch_pack_as(const W* src, int64_t n, uint32_t* bitmap, int64_t* offsets, W* values, int64_t capacity,
                    uint64_t* workspace, uint64_t ticket_base, uint32_t epoch, cudaStream_t stream) {
  constexpr size_t shared_bytes = pack_shared_bytes<W>();  // past the 48 KiB a kernel gets unasked
  static_assert(shared_bytes <= 96 * 1024, "fits every GPU from sm_80 on");
  check(cudaFuncSetAttribute(pack_kernel<W, kAligned>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)),
        "cudaFuncSetAttribute (relu pack shared memory)");
  const int64_t nblocks = num_blocks(n);
  const unsigned grid = grid_for(num_tiles(nblocks, sizeof(W)) * kWarpsPerCta);  // one CTA a tile
  pack_kernel<W, kAligned><<<grid, kThreads, shared_bytes, stream>>>(src, n, bitmap, offsets, values, capacity,
                                                                     workspace, nblocks, ticket_base, epoch);
  check(cudaGetLastError(), "relu pack kernel launch");
}

template <typename W>
void launch_pack(const void* src, int64_t n, uint32_t* bitmap, int64_t* offsets, void* values, int64_t capacity,
                 uint64_t* workspace, uint64_t ticket_base, uint32_t epoch, cudaStream_t stream) {
  const auto* s = static_cast<const W*>(src);
  auto* v = static_cast<W*>(values);
  if (aligned16(src))
    launch_pack_as<W, true>(s, n, bitmap, offsets, v, capacity, workspace, ticket_base, epoch, stream);
  else
    launch_pack_as<W, false>(s, n, bitmap, offsets, v, capacity, workspace, ticket_base, epoch, stream);
}

template <typename W>
void launch_unpack(const uint32_t* bitmap, const int64_t* offsets, const void* values, int64_t n, void* dst,
                   cudaStream_t stream) {
  using L = Layout<W>;
  const int64_t nblocks = num_blocks(n);
  const int warp_steps = nblocks < unpack_split_below_blocks() ? kUnroll : L::kSteps;
  const int64_t nwarps = nblocks * (L::kSteps / warp_steps);
  const auto* v = static_cast<const W*>(values);
  auto* d = static_cast<W*>(dst);
  const unsigned grid = grid_for(nwarps);
  if (aligned16(dst) && aligned16(values))
    unpack_kernel<W, true, true><<<grid, kThreads, 0, stream>>>(bitmap, offsets, v, n, d, nwarps, warp_steps);
  else if (aligned16(dst))
    unpack_kernel<W, true, false><<<grid, kThreads, 0, stream>>>(bitmap, offsets, v, n, d, nwarps, warp_steps);
  else
    unpack_kernel<W, false, false><<<grid, kThreads, 0, stream>>>(bitmap, offsets, v, n, d, nwarps, warp_steps);
  check(cudaGetLastError(), "relu unpack kernel launch");
}

}  // namespace

size_t relu_pack_workspace_bytes(int64_t n) {
  check_args(n, 4);
  return sizeof(uint64_t) * (1 + num_tiles(num_blocks(n), 4));  // fp32 tiles are the smallest
}

int64_t relu_pack_tiles(int64_t n, int elem_bytes) {
  check_args(n, elem_bytes);
  return num_tiles(num_blocks(n), elem_bytes);
}

void relu_pack(const void* src, int64_t n, int elem_bytes, uint32_t* bitmap, int64_t* offsets, void* values,
               int64_t values_capacity, void* workspace, size_t workspace_bytes, uint64_t ticket_base,
               uint32_t epoch, cudaStream_t stream) {
  check_args(n, elem_bytes);
  if (n == 0) return;
  check_ptr(src, "src"), check_ptr(bitmap, "bitmap"), check_ptr(offsets, "offsets");
  check_ptr(workspace, "workspace");
  if (values != nullptr && values_capacity < 0)
    throw UsageError("supermem: relu_pack values capacity must be >= 0, got " + std::to_string(values_capacity));
  const size_t needed = relu_pack_workspace_bytes(n);
  const size_t used = sizeof(uint64_t) * (1 + num_tiles(num_blocks(n), elem_bytes));
  if (workspace_bytes < needed)
    throw UsageError("supermem: relu_pack workspace of " + std::to_string(workspace_bytes) + " bytes, needs " +
                     std::to_string(needed));
  if (reinterpret_cast<uintptr_t>(workspace) % sizeof(uint64_t) != 0)
    throw UsageError("supermem: relu_pack workspace must be 8-byte aligned");
  if (epoch > relu_pack_max_epoch)
    throw UsageError("supermem: relu_pack epoch must be <= " + std::to_string(relu_pack_max_epoch) + ", got " +
                     std::to_string(epoch));
  if (epoch == 0) {  // a fresh workspace: the ticket counter and every tile status start at 0 (not ready)
    check(cudaMemsetAsync(workspace, 0, used, stream), "cudaMemsetAsync (relu pack workspace)");
    ticket_base = 0;
  }
  auto* words = static_cast<uint64_t*>(workspace);
  if (elem_bytes == 4)
    launch_pack<uint32_t>(src, n, bitmap, offsets, values, values_capacity, words, ticket_base, epoch, stream);
  else
    launch_pack<uint16_t>(src, n, bitmap, offsets, values, values_capacity, words, ticket_base, epoch, stream);
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
    launch_mask<uint32_t>(src, n, positive_limit, bitmap, stream);
  else
    launch_mask<uint16_t>(src, n, positive_limit, bitmap, stream);
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
