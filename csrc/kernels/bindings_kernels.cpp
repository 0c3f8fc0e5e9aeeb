// Python face of the ReLU compression kernels (relu_pack.h). Pointers and the stream arrive as
// integers (tensor.data_ptr(), torch.cuda.current_stream().cuda_stream); supermem/compress.py
// allocates every buffer with torch and checks dtypes and sizes, so these stay thin.
#include "kernels/bindings_kernels.h"

#ifdef SUPERMEM_WITH_KERNELS
#include "kernels/relu_pack.h"
#endif

namespace supermem {

#ifdef SUPERMEM_WITH_KERNELS
namespace {

template <typename T>
T* ptr(uint64_t address) {
  return reinterpret_cast<T*>(address);
}

cudaStream_t stream_of(uint64_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

}  // namespace

void bind_kernels(pybind11::module_& m) {
  using namespace kernels;
  m.attr("has_relu_kernels") = true;
  m.attr("relu_block_elems") = kBlockElems;
  m.def("relu_pack_workspace_bytes", &relu_pack_workspace_bytes, pybind11::arg("n"));
  m.def("relu_pack_tile_elems", &relu_pack_tile_elems, pybind11::arg("elem_bytes"),
        "Elements of one tile of the one-pass pack (one CTA, one look-back status word)");
  m.def("relu_pack_tiles", &relu_pack_tiles, pybind11::arg("n"), pybind11::arg("elem_bytes"),
        "Tiles (workspace tickets) of one pack");
  m.attr("relu_pack_max_epoch") = relu_pack_max_epoch;
  m.def(
      "relu_pack",
      [](uint64_t src, int64_t n, int elem_bytes, uint64_t bitmap, uint64_t offsets, uint64_t values,
         int64_t values_capacity, uint64_t workspace, size_t workspace_bytes, uint64_t ticket_base, uint32_t epoch,
         uint64_t stream) {
        relu_pack(ptr<const void>(src), n, elem_bytes, ptr<uint32_t>(bitmap), ptr<int64_t>(offsets),
                  ptr<void>(values), values_capacity, ptr<void>(workspace), workspace_bytes, ticket_base, epoch,
                  stream_of(stream));
      },
      "One pass: bitmap, offsets and (values != 0) the first values_capacity nonzeros; see relu_pack.h");
  m.def(
      "relu_unpack",
      [](uint64_t bitmap, uint64_t offsets, uint64_t values, int64_t n, int elem_bytes, uint64_t dst,
         uint64_t stream) {
        relu_unpack(ptr<const uint32_t>(bitmap), ptr<const int64_t>(offsets), ptr<const void>(values), n,
                    elem_bytes, ptr<void>(dst), stream_of(stream));
      },
      "Bitmap + offsets + values back to the dense elements");
  m.def(
      "relu_mask_pack",
      [](uint64_t src, int64_t n, int elem_bytes, uint32_t positive_limit, uint64_t bitmap, uint64_t stream) {
        relu_mask_pack(ptr<const void>(src), n, elem_bytes, positive_limit, ptr<uint32_t>(bitmap),
                       stream_of(stream));
      },
      "The bitmap of elements whose bits are in 1..positive_limit (element > 0)");
  m.def(
      "relu_mask_unpack",
      [](uint64_t bitmap, int64_t n, uint64_t dst, uint64_t stream) {
        relu_mask_unpack(ptr<const uint32_t>(bitmap), n, ptr<bool>(dst), stream_of(stream));
      },
      "The bitmap to n bools");
}

#else

void bind_kernels(pybind11::module_& m) { m.attr("has_relu_kernels") = false; }

#endif

}  // namespace supermem
