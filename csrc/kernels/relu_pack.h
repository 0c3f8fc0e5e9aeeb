// Lossless ReLU compression on the GPU: a dense tensor becomes a nonzero bitmap, per-block offsets
// and the nonzero elements packed in order; unpack restores it bitwise. supermem/compress.py holds
// the format's CPU reference (the tests compare the two byte for byte) and the Python API.
//
// Format for n elements of 2 or 4 bytes (fp16/bf16/fp32, handled as 16/32-bit words, so -0.0,
// NaN payloads and subnormals round-trip bitwise):
//   bitmap   ceil(n / 32) uint32 words; bit i % 32 of word i / 32 is set iff element i's bits != 0
//            (little-endian: byte i / 8, bit i % 8). Bits past n are 0.
//   offsets  nblocks + 1 int64, nblocks = ceil(n / kBlockElems): offsets[b] = nonzeros before block
//            b, so offsets[nblocks] = nnz (an exclusive prefix sum of the per-block counts).
//   values   the nnz nonzero elements, in element order.
//
// Every function launches on `stream` in the current device's context and returns without
// waiting; n == 0 launches nothing. Input and output may have any element alignment: 16-byte
// aligned pointers get 16-byte vector loads and stores, others a scalar path. Errors (a bad
// argument, a failed launch) throw UsageError / DeviceError.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace supermem::kernels {

// Elements per offsets entry, the same for every element size.
constexpr int64_t kBlockElems = 2048;

// Elements of one tile of the pack (one CTA, one status word): 64 KiB of input.
constexpr int64_t relu_pack_tile_elems(int elem_bytes) { return 8 * kBlockElems * (4 / elem_bytes); }

// Device scratch (bytes) that relu_pack needs for n elements of any size: a ticket counter and one
// status word per tile.
size_t relu_pack_workspace_bytes(int64_t n);

// Tiles (tickets taken, status words used) of one relu_pack of n elements of elem_bytes.
int64_t relu_pack_tiles(int64_t n, int elem_bytes);

// The largest epoch relu_pack takes (22 bits of each status word).
constexpr uint32_t relu_pack_max_epoch = (1u << 22) - 1;

// One pass over src: the bitmap, the offsets and, when values is not null, the nonzeros at
// values[offsets[b] + rank within block b], those at index values_capacity and beyond left out:
// bitmap and offsets are always whole, so a caller that sized values by a guess learns from
// offsets[nblocks] (nnz) whether every value fit, without a host sync now. With values null it
// writes only bitmap and offsets (to size values exactly, then call again with it). `workspace`
// holds relu_pack_workspace_bytes(n) bytes, 8-byte aligned.
// epoch 0: the workspace is zeroed first (one memset on the stream). epoch 1..relu_pack_max_epoch:
// a workspace kept across calls on one stream, no memset: zeroed when made, `ticket_base` tickets
// (the tiles of the calls since) taken from it before this call, and `epoch` unlike every call's
// since it was zeroed (the caller zeroes it again before reusing an epoch).
void relu_pack(const void* src, int64_t n, int elem_bytes, uint32_t* bitmap, int64_t* offsets, void* values,
               int64_t values_capacity, void* workspace, size_t workspace_bytes, uint64_t ticket_base,
               uint32_t epoch, cudaStream_t stream);

// The inverse: dst (n elements) gets values where the bitmap is set and 0 elsewhere.
void relu_unpack(const uint32_t* bitmap, const int64_t* offsets, const void* values, int64_t n,
                 int elem_bytes, void* dst, cudaStream_t stream);

// Mask only: bit i is set iff 1 <= bits(element i) <= positive_limit as an unsigned word. With
// positive_limit = the format's +inf bits, that is "element > 0" (NaN and -0.0 excluded), the mask
// ReLU's backward reads.
void relu_mask_pack(const void* src, int64_t n, int elem_bytes, uint32_t positive_limit, uint32_t* bitmap,
                    cudaStream_t stream);

// dst[i] = bit i of the bitmap, as bool bytes (0 or 1).
void relu_mask_unpack(const uint32_t* bitmap, int64_t n, bool* dst, cudaStream_t stream);

}  // namespace supermem::kernels
