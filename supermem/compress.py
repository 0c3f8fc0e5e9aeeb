"""Lossless ReLU compression: a tensor that is mostly zeros (a ReLU's output) kept as a bitmap of its
nonzero elements, per-block offsets and the nonzeros themselves.

    packed = relu_pack(x)           # packed.nbytes: bitmap + offsets + values
    y = relu_unpack(packed)         # bitwise equal to x: -0.0, NaN payloads and inf included

CUDA tensors go through the kernels in csrc/kernels/relu_pack.cu (one pass: bitmap, block offsets
by a single-pass scan across blocks, and the nonzeros); CPU tensors through the
vectorised torch code below, which is also the reference that the GPU tests compare the kernels
with byte for byte. Elements are compared as 16/32-bit words: "nonzero" means "bits != 0", so only
+0.0 is dropped. fp32, fp16 and bf16 only.

Layout kept: a tensor whose elements are dense in memory in some dimension order (contiguous,
channels_last, a transpose) is packed in memory order without a copy and unpacks with the same
strides; any other (a slice with gaps, an expanded view) is made contiguous first (a copy) and
unpacks contiguous.

The packed size depends on the data, so on CUDA `relu_pack(x)` runs the kernel twice: first for the
bitmap and offsets, then (after reading the nonzero count back: one host sync) for the values into a
buffer of their exact size; it reads x twice. `relu_pack(x, exact=False)` runs it once and never
syncs: it allocates room for every element, and `packed.compact()` trims it later (one sync, when
the caller chooses).

The mask-only form keeps 1 bit per element, set where the element is > 0 (NaN and -0.0 are not):
the mask ReLU's backward reads. `relu_mask_unpack` gives it back as a bool tensor.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass

import torch

from .errors import DeviceError, UsageError

BLOCK_ELEMS = 2048  # elements per offsets entry; kBlockElems in csrc/kernels/relu_pack.h

# dtype -> (integer dtype of the same size, the bits of +inf: elements whose bits are 1..this are > 0)
_FORMATS = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
}


@dataclass(frozen=True, eq=False, repr=False)
class Packed:
    """A tensor as bitmap + offsets + values (the format in csrc/kernels/relu_pack.h)."""

    bitmap: torch.Tensor  # uint8, 4 * ceil(n / 32) bytes: element i is bit i % 8 of byte i // 8
    offsets: torch.Tensor  # int64, ceil(n / BLOCK_ELEMS) + 1: nonzeros before each block; the last is nnz
    values: torch.Tensor  # the nonzeros in memory order (room for all n of them after exact=False)
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]  # of the tensor relu_unpack makes
    # nnz as the host learned it when packing (a CPU pack, or exact=True on CUDA); None: not known there
    # (exact=False), and then values must have room for every element
    host_nnz: int | None = None

    @property
    def device(self) -> torch.device:
        return self.bitmap.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: bitmap + values + offsets."""
        return self.bitmap.nbytes + self.values.nbytes + self.offsets.nbytes

    @property
    def nnz(self) -> int:
        """Nonzero elements (reads one number from the device: a host sync on CUDA)."""
        return int(self.offsets[-1])

    def __repr__(self) -> str:
        return f"Packed({_describe(self.dtype, self.shape, self.device)}, nbytes={self.nbytes})"

    def compact(self) -> Packed:
        """This, with the values buffer trimmed to nnz elements (after relu_pack(exact=False)); reads
        nnz from the device (trimmed() takes it from an asynchronous copy instead)."""
        return self if self.values.numel() == self.host_nnz else trimmed(self, self.nnz)


@dataclass(frozen=True, eq=False, repr=False)
class PackedMask:
    """The bitmap of a tensor's elements > 0: 1 bit per element, as in Packed.bitmap."""

    bitmap: torch.Tensor
    shape: torch.Size
    stride: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        return self.bitmap.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.bitmap.nbytes

    def __repr__(self) -> str:
        return f"PackedMask({_describe(torch.bool, self.shape, self.device)}, nbytes={self.nbytes})"


def relu_pack(t: torch.Tensor, *, exact: bool = True, capacity: int | None = None) -> Packed:
    """Packs `t` (fp32/fp16/bf16, CPU or CUDA) losslessly. On CUDA, exact=True costs one host sync
    (the values buffer gets its exact size); exact=False costs none and holds room for every element
    (on CPU too, as on CUDA: trimmed() or compact() sizes it).

    capacity: room for this many nonzeros (a guess: the same tensor's count last step, say), no host
    sync on either device; nonzeros past it are left out. The result is whole only if its nnz fits:
    `fitted(packed, nnz)` says so (and makes it unpackable) once the caller has read nnz, e.g. from an
    asynchronous copy of `packed.offsets[-1]`; until then relu_unpack refuses it on CUDA.

    A `t` whose elements are not dense in memory (a slice with gaps, an expanded view) is copied
    contiguous first: relu_unpack gives its values back as a contiguous tensor, not its strides."""
    flat, stride = _flat(_check_tensor(t, "relu_pack"))
    if capacity is not None:
        capacity = max(0, min(int(capacity), flat.numel()))
    if flat.is_cuda:
        bitmap, offsets, values = _pack_cuda(flat, exact, capacity)
    else:
        bitmap, offsets, values = _pack_reference(flat)
        if capacity is None and not exact:
            capacity = flat.numel()
        if capacity is not None:  # as the kernel leaves it: `capacity` slots, the first nonzeros in them
            room = values.new_zeros(capacity)
            room[: min(capacity, values.numel())] = values[:capacity]
            values = room
    exact_size = capacity is None and exact
    known = values.numel() if exact_size else None  # exact sizes: values hold nnz
    return Packed(bitmap, offsets, values, t.dtype, t.shape, stride, known)


def fitted(packed: Packed, nnz: int) -> Packed | None:
    """`packed` (made with a capacity) as a whole pack when `nnz`, its nonzero count as read from
    `packed.offsets[-1]`, fit its values buffer; else None (values were left out: pack again). The
    buffer keeps its room (trimming it would copy the values). Costs no host sync."""
    if nnz > packed.values.numel():
        return None
    return dataclasses.replace(packed, host_nnz=nnz)


def trimmed(packed: Packed, nnz: int) -> Packed:
    """`packed` with its values in a buffer of their exact size, `nnz` as read from `packed.offsets[-1]`
    (an asynchronous copy, say): a device copy of the nonzeros, no host sync. The old buffer goes when
    its last use is done (stream order)."""
    if not 0 <= nnz <= packed.values.numel():
        raise UsageError(f"trimmed: nnz {nnz} outside the pack's values (0..{packed.values.numel()})")
    values = packed.values if packed.values.numel() == nnz else packed.values[:nnz].clone()
    return dataclasses.replace(packed, values=values, host_nnz=nnz)


def relu_unpack(packed: Packed) -> torch.Tensor:
    """The tensor `packed` was made from, bitwise, on packed.device, with its strides where its elements
    were dense in memory (contiguous, channels_last, a transpose); from a slice with gaps or an expanded
    view, a new contiguous tensor of its values (an expanded view's repeats each their own element)."""
    _check_packed(packed)
    out = torch.empty_strided(packed.shape, packed.stride, dtype=packed.dtype, device=packed.device)
    flat, _ = _flat(out)
    if out.is_cuda:
        _unpack_cuda(packed, flat)
    else:
        flat.copy_(_unpack_reference(packed))
    return out


def relu_mask_pack(t: torch.Tensor) -> PackedMask:
    """The mask `t > 0` of a fp32/fp16/bf16 tensor, 1 bit per element (NaN and -0.0 give 0)."""
    flat, stride = _flat(_check_tensor(t, "relu_mask_pack"))
    int_dtype, inf_bits = _FORMATS[t.dtype]
    n = flat.numel()
    if flat.is_cuda:
        _C = _kernels()
        with torch.cuda.device(flat.device):
            bitmap = torch.empty(_bitmap_bytes(n), dtype=torch.uint8, device=flat.device)
            stream = torch.cuda.current_stream(flat.device).cuda_stream
            _C.relu_mask_pack(flat.data_ptr(), n, flat.element_size(), inf_bits, bitmap.data_ptr(), stream)
    else:
        bits = flat.view(int_dtype)
        bitmap = _bits_to_bytes((bits > 0) & (bits <= inf_bits))
    return PackedMask(bitmap, t.shape, stride)


def relu_mask_unpack(packed: PackedMask) -> torch.Tensor:
    """The mask as a bool tensor of the packed tensor's shape (and strides, as relu_unpack)."""
    if not isinstance(packed, PackedMask):
        raise UsageError(f"relu_mask_unpack takes what relu_mask_pack returned, got {type(packed).__name__}")
    bad = "relu_mask_unpack: inconsistent PackedMask: "
    _check_part(bad, "bitmap", packed.bitmap, torch.uint8, _bitmap_bytes(packed.numel), packed.bitmap)
    _check_layout(bad, packed.shape, packed.stride)
    out = torch.empty_strided(packed.shape, packed.stride, dtype=torch.bool, device=packed.device)
    flat, _ = _flat(out)
    n = flat.numel()
    if out.is_cuda:
        _C = _kernels()
        with torch.cuda.device(out.device):
            stream = torch.cuda.current_stream(out.device).cuda_stream
            _C.relu_mask_unpack(packed.bitmap.data_ptr(), n, flat.data_ptr(), stream)
    else:
        flat.copy_(_bytes_to_bits(packed.bitmap, n))
    return out


def packed_nbytes(numel: int, nnz: int, itemsize: int) -> int:
    """Bytes of an exact Packed: the bitmap in whole 32-bit words + nnz values + the offsets."""
    return _bitmap_bytes(numel) + nnz * itemsize + 8 * (_num_blocks(numel) + 1)


def packed_nbytes_of(t: torch.Tensor) -> int:
    """Bytes an exact relu_pack(t) would hold, without packing: its nonzero words counted (-0.0 and
    NaN are kept, as the pack keeps them). On CUDA, one count kernel and a host sync."""
    bits = _check_tensor(t, "packed_nbytes_of").view(_FORMATS[t.dtype][0])
    return packed_nbytes(t.numel(), int(torch.count_nonzero(bits)), t.element_size())


# ---- layout ------------------------------------------------------------------------------------------


def _check_tensor(t: object, fn: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise UsageError(f"{fn} takes a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FORMATS:
        raise UsageError(f"{fn} supports float32, float16 and bfloat16 tensors, got {t.dtype}")
    if t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
        raise UsageError(f"{fn} supports dense CPU and CUDA tensors, got {t.layout} on {t.device}")
    return t.detach()


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """t's elements as a 1-D view in memory order, and the strides unpack gives back. A tensor whose
    elements are not dense in memory (gaps, overlaps) is copied contiguous first."""
    if t.is_contiguous():
        return t.view(-1), t.stride()
    order = sorted(range(t.dim()), key=t.stride, reverse=True)
    permuted = t.permute(order)
    if permuted.is_contiguous():  # channels_last, a transpose, ...: dense, just not row-major
        return permuted.view(-1), t.stride()
    c = t.contiguous()
    return c.view(-1), c.stride()


def _describe(dtype: torch.dtype, shape: torch.Size, device: torch.device) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)} on {device}"


def _num_blocks(n: int) -> int:
    return -(-n // BLOCK_ELEMS)


def _bitmap_bytes(n: int) -> int:
    return 4 * -(-n // 32)  # whole 32-bit words, as the kernels write them


# ---- CPU reference -----------------------------------------------------------------------------------


def _bits_to_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A 1-D bool tensor as the bitmap: element i is bit i % 8 of byte i // 8, padded to 32-bit words."""
    padded = torch.zeros(_bitmap_bytes(mask.numel()) * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(1).to(torch.uint8)  # disjoint bits: the sum is an OR


def _bytes_to_bits(bitmap: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    return ((bitmap.view(-1, 1) >> shifts) & 1).view(-1)[:n].bool()


def _pack_reference(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    int_dtype, _ = _FORMATS[flat.dtype]
    n, nblocks = flat.numel(), _num_blocks(flat.numel())
    bits = flat.view(int_dtype)
    nonzero = bits != 0
    per_block = torch.zeros(nblocks * BLOCK_ELEMS, dtype=torch.int64, device=flat.device)
    per_block[:n] = nonzero
    offsets = torch.zeros(nblocks + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(per_block.view(nblocks, BLOCK_ELEMS).sum(1), 0, out=offsets[1:])
    return _bits_to_bytes(nonzero), offsets, bits[nonzero].view(flat.dtype)


def _unpack_reference(packed: Packed) -> torch.Tensor:
    int_dtype, _ = _FORMATS[packed.dtype]
    nonzero = _bytes_to_bits(packed.bitmap, packed.numel)
    bits = torch.zeros(packed.numel, dtype=int_dtype, device=packed.device)
    bits[nonzero] = packed.values[: packed.nnz].view(int_dtype)
    return bits.view(packed.dtype)


# ---- checks on a Packed ------------------------------------------------------------------------------


def _check_packed(packed: object) -> None:
    """UsageError unless `packed` holds what relu_pack makes: the parts' dtypes, sizes, device and layout,
    which both unpack paths read through raw extents (the CUDA kernel through pointers); then, on CPU,
    offsets and values agreeing with the bitmap. On CUDA that last check would cost a host sync, which
    relu_unpack never makes (tests/gpu), so there the contents of well-formed parts are trusted."""
    if not isinstance(packed, Packed):
        raise UsageError(f"relu_unpack takes what relu_pack returned, got {type(packed).__name__}")
    bad = "relu_unpack: inconsistent Packed: "
    if packed.dtype not in _FORMATS:
        raise UsageError(f"{bad}dtype {packed.dtype}")
    n = packed.numel
    _check_part(bad, "bitmap", packed.bitmap, torch.uint8, _bitmap_bytes(n), packed.bitmap)
    _check_part(bad, "offsets", packed.offsets, torch.int64, _num_blocks(n) + 1, packed.bitmap)
    _check_part(bad, "values", packed.values, packed.dtype, None, packed.bitmap)
    _check_layout(bad, packed.shape, packed.stride)
    if packed.device.type != "cpu":  # the values the kernel may read, by what the host knows without a sync
        need = n if packed.host_nnz is None else packed.host_nnz
        if packed.values.numel() < need:
            raise UsageError(f"{bad}{packed.values.numel()} values, the pack made room for {need}")
        return
    per_word = _word_popcounts(packed.bitmap)
    per_word = torch.nn.functional.pad(per_word, (0, _WORDS_PER_BLOCK * _num_blocks(n) - per_word.numel()))
    expected = torch.zeros_like(packed.offsets)
    torch.cumsum(per_word.view(-1, _WORDS_PER_BLOCK).sum(1), 0, out=expected[1:])
    blocks_agree, nnz = torch.equal(packed.offsets, expected), int(expected[-1])
    if not blocks_agree or packed.values.numel() < nnz:
        raise UsageError(
            f"{bad}{nnz} bits set, offsets say {packed.nnz} (per block they "
            f"{'agree' if blocks_agree else 'disagree'}), {packed.values.numel()} values"
        )
    if n % 32 and _bytes_to_bits(packed.bitmap[-4:], 32)[n % 32 :].any():  # the last word's padding
        raise UsageError(f"{bad}bits set past element {n} (the bitmap's last word is padded with 0s)")


def _check_part(
    bad: str, name: str, part: object, dtype: torch.dtype, numel: int | None, first: object
) -> None:
    """A part of a Packed (PackedMask): a contiguous 1-D tensor of `dtype` (and `numel` elements) on the
    device of `first`, the bitmap."""
    device = first.device if isinstance(first, torch.Tensor) else None
    if not (
        isinstance(part, torch.Tensor)
        and (part.dtype, part.dim(), part.device) == (dtype, 1, device)
        and part.is_contiguous()
        and (numel is None or part.numel() == numel)
    ):
        got = f"{part.dtype}{list(part.shape)} on {part.device}" if isinstance(part, torch.Tensor) else part
        size = "" if numel is None else f"{numel} x "
        raise UsageError(f"{bad}{name} must be a contiguous 1-D {size}{dtype} tensor on {device}, got {got}")


def _check_layout(bad: str, shape: torch.Size, stride: tuple[int, ...]) -> None:
    """Unpacking writes through a flat view of torch.empty_strided(shape, stride): it must have one, a
    layout without gaps or overlaps."""
    dims = sorted((p for p in zip(shape, stride) if p[0] != 1), key=lambda p: p[1])
    expected, dense = 1, len(stride) == len(shape)
    for size, step in dims:
        dense = dense and (step == expected or size == 0)
        expected *= size
    if not dense and math.prod(shape) != 0:
        raise UsageError(f"{bad}stride {tuple(stride)} does not lay out shape {list(shape)} densely")


_WORDS_PER_BLOCK = BLOCK_ELEMS // 32


def _word_popcounts(bitmap: torch.Tensor) -> torch.Tensor:
    """Bits set in each 32-bit word of the bitmap (int64), by the usual SWAR steps."""
    x = bitmap.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) & 0xFFFFFFFF) >> 24


# ---- CUDA kernels ------------------------------------------------------------------------------------


def _kernels():
    from . import _C

    if not getattr(_C, "has_relu_kernels", False):
        raise DeviceError(
            "supermem was built without its CUDA kernels (no nvcc at build time): relu compression of "
            "CUDA tensors needs them; rebuild with the CUDA toolkit on PATH"
        )
    return _C


class _Workspace:
    """The one-pass pack's ticket counter and tile statuses, kept across the packs of one stream: a
    pack then needs no memset (a launch: ~2 us of a 16 MiB pack's ~13 on an H100). Zeroed when made;
    each pack takes the next epoch (its status words carry it, so earlier packs' words read as not
    ready) and its tiles' tickets after `tickets` taken before; zeroed again when epochs run out.
    Packs on one stream run in launch order, so the epoch and ticket base a pack is given, under the
    lock, are the counter's and the words' state when its kernel runs."""

    __slots__ = ("tensor", "tickets", "epoch")

    def __init__(self, nbytes: int, device: torch.device):
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.tickets = 0
        self.epoch = 0


_workspaces: dict[tuple[int, int], _Workspace] = {}  # (device index, stream handle) -> its workspace
_workspaces_lock = threading.Lock()


def _launch_pack(
    _C, flat: torch.Tensor, bitmap: torch.Tensor, offsets: torch.Tensor, values_ptr: int, room: int
) -> None:
    """One kernel pack on the current stream, with the stream's kept workspace (a fresh, zeroed one
    under CUDA graph capture: a replay would repeat the captured epoch and ticket base)."""
    n, elem_bytes, device = flat.numel(), flat.element_size(), flat.device
    stream = torch.cuda.current_stream(device).cuda_stream
    need = _C.relu_pack_workspace_bytes(n)
    args = (flat.data_ptr(), n, elem_bytes, bitmap.data_ptr(), offsets.data_ptr(), values_ptr, room)
    if torch.cuda.is_current_stream_capturing():
        workspace = torch.empty(need, dtype=torch.uint8, device=device)
        _C.relu_pack(*args, workspace.data_ptr(), need, 0, 0, stream)  # epoch 0: zeroed first
        return
    with _workspaces_lock:
        key = (device.index, stream)
        ws = _workspaces.get(key)
        if ws is None or ws.tensor.numel() < need:
            ws = _workspaces[key] = _Workspace(max(need, 2 * ws.tensor.numel() if ws else 0), device)
        if ws.epoch == _C.relu_pack_max_epoch:
            ws.tensor.zero_()
            ws.tickets = ws.epoch = 0
        ws.epoch += 1
        base = ws.tickets
        ws.tickets += _C.relu_pack_tiles(n, elem_bytes)
        _C.relu_pack(*args, ws.tensor.data_ptr(), ws.tensor.numel(), base, ws.epoch, stream)


def _pack_cuda(
    flat: torch.Tensor, exact: bool, capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _C = _kernels()
    n, device = flat.numel(), flat.device
    with torch.cuda.device(device):
        bitmap = torch.empty(_bitmap_bytes(n), dtype=torch.uint8, device=device)
        if n == 0:
            return bitmap, torch.zeros(1, dtype=torch.int64, device=device), flat.new_empty(0)
        offsets = torch.empty(_num_blocks(n) + 1, dtype=torch.int64, device=device)

        def pack(values_ptr: int, room: int) -> None:
            _launch_pack(_C, flat, bitmap, offsets, values_ptr, room)

        if capacity is not None:  # a guessed size: no sync; the caller checks nnz against it later
            values = flat.new_empty(capacity)
            pack(values.data_ptr() if capacity else 0, capacity)
        elif exact:
            pack(0, 0)  # bitmap and offsets only
            nnz = int(offsets[-1])  # the one host sync: the values' size is data-dependent
            values = flat.new_empty(nnz)
            if nnz:
                pack(values.data_ptr(), nnz)  # again, with the values (bitmap and offsets come out the same)
        else:
            values = flat.new_empty(n)
            pack(values.data_ptr(), n)
    return bitmap, offsets, values


def _unpack_cuda(packed: Packed, flat: torch.Tensor) -> None:
    """Unpacks into `flat` on the current stream; `packed` passed _check_packed (the kernel reads raw
    pointers)."""
    _C = _kernels()
    with torch.cuda.device(flat.device):
        stream = torch.cuda.current_stream(flat.device).cuda_stream
        _C.relu_unpack(
            packed.bitmap.data_ptr(), packed.offsets.data_ptr(), packed.values.data_ptr(),
            flat.numel(), flat.element_size(), flat.data_ptr(), stream,
        )  # fmt: skip
