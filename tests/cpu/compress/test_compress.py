"""ReLU compression on CPU (supermem.compress's torch reference, which the GPU tests hold the kernels
to): lossless round trips, and a format checked against independent numpy computations."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from compress_cases import (
    CORRUPT_CONTENTS,
    CORRUPT_PARTS,
    DENSITIES,
    DTYPES,
    SIZES,
    SPECIAL_BITS,
    bitwise_equal,
    from_bits,
    sparse,
    words,
)

from supermem import _C
from supermem.compress import (
    BLOCK_ELEMS,
    Packed,
    fitted,
    packed_nbytes,
    relu_mask_pack,
    relu_mask_unpack,
    relu_pack,
    relu_unpack,
    trimmed,
)
from supermem.errors import UsageError


def memory_order(t):
    """t's elements in the order they sit in memory (t dense)."""
    order = sorted(range(t.dim()), key=t.stride, reverse=True)
    return t.permute(order).reshape(-1)


def check_format(packed, x):
    """Packed's buffers against numpy: packbits for the bitmap, per-block sums for the offsets."""
    w = words(memory_order(x) if x.numel() else x.reshape(-1))
    n = w.size
    nonzero = w != 0
    nwords = math.ceil(n / 32)
    expect_bitmap = np.packbits(np.pad(nonzero, (0, nwords * 32 - n)), bitorder="little")
    assert np.array_equal(packed.bitmap.numpy(), expect_bitmap)
    nblocks = math.ceil(n / BLOCK_ELEMS)
    counts = [int(nonzero[b * BLOCK_ELEMS : (b + 1) * BLOCK_ELEMS].sum()) for b in range(nblocks)]
    assert packed.offsets.tolist() == [0] + list(np.cumsum(counts, dtype=np.int64))
    assert np.array_equal(words(packed.values), w[nonzero])
    nnz = int(nonzero.sum())
    assert packed.nnz == nnz
    assert packed.nbytes == 4 * nwords + nnz * x.element_size() + 8 * (nblocks + 1)
    assert packed_nbytes(n, nnz, x.element_size()) == packed.nbytes  # the size a planner predicts


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("density", DENSITIES)
def test_round_trip_and_format(dtype, n, density):
    x = sparse(n, density, dtype, seed=n)
    packed = relu_pack(x)
    check_format(packed, x)
    y = relu_unpack(packed)
    assert bitwise_equal(y, x) and y.device == x.device and y.stride() == x.stride()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_round_trip_bitwise(dtype):
    special = from_bits(SPECIAL_BITS[dtype], dtype)
    x = special.repeat(300)[torch.randperm(300 * special.numel(), generator=torch.Generator().manual_seed(1))]
    packed = relu_pack(x)
    check_format(packed, x)
    # Only +0.0 is dropped: -0.0, NaNs, infinities and subnormals are kept as they are.
    assert packed.nnz == (x.numel() // special.numel()) * (special.numel() - 1)
    assert bitwise_equal(relu_unpack(packed), x)


@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (2, 3, 4, 5), (64, 1, 33), (0, 4), (1, 1, 1)])
def test_shapes(shape):
    x = sparse(math.prod(shape), 0.5, torch.float32, seed=3).reshape(shape)
    packed = relu_pack(x)
    assert packed.shape == x.shape and packed.dtype == x.dtype and packed.device == x.device
    assert repr(packed) == f"Packed(float32{list(shape)} on cpu, nbytes={packed.nbytes})"
    y = relu_unpack(packed)
    assert y.shape == x.shape and bitwise_equal(y, x)


def layouts(dtype):
    """name -> (a view of a 2x8x9x10 tensor, whether its elements are dense in memory)."""
    base = sparse(2 * 8 * 9 * 10, 0.4, dtype, seed=4).reshape(2, 8, 9, 10)
    return {
        "transpose": (base.reshape(16, 90).t(), True),
        "channels_last": (base.contiguous(memory_format=torch.channels_last), True),
        "storage_offset": (base.reshape(-1)[3:], True),  # dense but not 16-byte aligned
        "permuted": (base.permute(3, 1, 0, 2), True),
        "gaps": (base[:, ::2, :, 1:], False),
        "expanded": (base[0, 0, 0].expand(7, 10), False),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(layouts(torch.float32)))
def test_non_contiguous_input(name, dtype):
    x, dense = layouts(dtype)[name]
    packed = relu_pack(x)
    y = relu_unpack(packed)
    assert bitwise_equal(y, x)
    if dense:  # packed in memory order, no copy; unpacked with the same strides
        assert y.stride() == x.stride()
        check_format(packed, x)
    else:  # copied contiguous first
        assert y.is_contiguous()
        check_format(packed, x.contiguous())


def test_the_docstrings_say_which_inputs_come_back_contiguous():
    # what test_non_contiguous_input checks, said where a caller reads it
    for fn in (relu_pack, relu_unpack):
        assert "expanded view" in fn.__doc__ and "contiguous" in fn.__doc__, fn.__name__


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 33, 1000, 4097])
def test_mask_is_greater_than_zero(dtype, n):
    special = from_bits(SPECIAL_BITS[dtype], dtype)
    x = torch.cat([sparse(n, 0.5, dtype, seed=n) * torch.where(torch.rand(n) < 0.5, 1.0, -1.0).to(dtype),
                   special])  # fmt: skip
    packed = relu_mask_pack(x)
    assert packed.nbytes == 4 * math.ceil(x.numel() / 32)
    expect = np.packbits(np.pad((x > 0).numpy(), (0, packed.nbytes * 8 - x.numel())), bitorder="little")
    assert np.array_equal(packed.bitmap.numpy(), expect)
    mask = relu_mask_unpack(packed)
    assert mask.dtype == torch.bool and torch.equal(mask, x > 0)


def test_mask_keeps_layout():
    x = sparse(4 * 6 * 5 * 7, 0.5, torch.bfloat16, seed=5).reshape(4, 6, 5, 7) - 0.5
    x = x.contiguous(memory_format=torch.channels_last)
    mask = relu_mask_unpack(relu_mask_pack(x))
    assert mask.stride() == x.stride() and torch.equal(mask, x > 0)


def test_packed_size_tracks_density():
    n = 1 << 16
    sizes = [relu_pack(sparse(n, d, torch.bfloat16)).nbytes for d in (0.0, 0.3, 1.0)]
    assert sizes[0] == n // 8 + 8 * (n // BLOCK_ELEMS + 1)  # bitmap + offsets only
    assert sizes[0] < sizes[1] < sizes[2]
    assert sizes[2] > 2 * n  # all values kept, plus the bitmap


def test_requires_grad_input_and_exact_flag_on_cpu():
    x = sparse(100, 0.5, torch.float32).requires_grad_()
    packed = relu_pack(x, exact=False)  # room for every element, as on CUDA
    assert packed.values.numel() == 100 and packed.host_nnz is None and packed.nnz < 100
    whole = packed.compact()
    assert whole.values.numel() == whole.nnz == whole.host_nnz and whole.compact() is whole
    for p in (packed, whole, trimmed(packed, packed.nnz)):
        y = relu_unpack(p)
        assert not y.requires_grad and bitwise_equal(y, x)
    with pytest.raises(UsageError, match="outside"):
        trimmed(whole, whole.nnz + 1)


BAD_INPUTS = {
    "float64": torch.ones(4, dtype=torch.float64),
    "int32": torch.ones(4, dtype=torch.int32),
    "bool": torch.ones(4, dtype=torch.bool),
    "complex64": torch.ones(4, dtype=torch.complex64),
    "sparse": torch.ones(4).to_sparse(),
    "list": [1.0, 0.0],
    "None": None,
}
CLEAR_ERROR = "float32, float16 and bfloat16|dense CPU and CUDA|takes a torch"


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_a_clear_error(name):
    for fn in (relu_pack, relu_mask_pack):
        with pytest.raises(UsageError, match=CLEAR_ERROR):
            fn(BAD_INPUTS[name])


def test_unpack_rejects_other_objects_and_corrupt_packs():
    with pytest.raises(UsageError, match="what relu_pack returned"):
        relu_unpack(torch.zeros(3))
    with pytest.raises(UsageError, match="what relu_mask_pack returned"):
        relu_mask_unpack(relu_pack(torch.zeros(3)))
    packed = relu_pack(sparse(5000, 0.5, torch.float32))
    bad = Packed(packed.bitmap, packed.offsets, packed.values[:-1], packed.dtype, packed.shape, packed.stride)
    with pytest.raises(UsageError, match="inconsistent"):
        relu_unpack(bad)


@pytest.mark.parametrize("corrupt", [*CORRUPT_PARTS, *CORRUPT_CONTENTS])
def test_unpack_refuses_a_corrupt_pack(corrupt):
    """The checks relu_unpack makes before either path (CPU reference, CUDA kernel) reads a buffer."""
    packed = relu_pack(sparse(5000, 0.5, torch.float32))
    assert bitwise_equal(relu_unpack(packed), sparse(5000, 0.5, torch.float32))  # the good one unpacks
    bad = {**CORRUPT_PARTS, **CORRUPT_CONTENTS}[corrupt](packed)
    with pytest.raises(UsageError, match="relu_unpack: inconsistent Packed"):
        relu_unpack(bad)


def test_mask_unpack_refuses_a_corrupt_mask():
    mask = relu_mask_pack(sparse(5000, 0.5, torch.float32))
    for bad in (dataclasses.replace(mask, bitmap=mask.bitmap[:-4]), dataclasses.replace(mask, stride=(2,))):
        with pytest.raises(UsageError, match="relu_mask_unpack: inconsistent PackedMask"):
            relu_mask_unpack(bad)


def test_kernel_constants_match():
    """The kernels and this reference share a block size (two languages, one number)."""
    assert isinstance(_C.has_relu_kernels, bool)
    if _C.has_relu_kernels:
        assert _C.relu_block_elems == BLOCK_ELEMS


@pytest.mark.skipif(not _C.has_relu_kernels, reason="built without the CUDA kernels")
def test_pack_workspace_and_its_checks():
    """The one-pass pack's scratch: a ticket counter and one status word per tile of 8 blocks (8 bytes
    each). Its size and alignment are checked before anything reaches the GPU (none needed here)."""
    tile = 8 * BLOCK_ELEMS
    for n, tiles in [(0, 0), (1, 1), (tile, 1), (tile + 1, 2), (100 * tile - 1, 100)]:
        assert _C.relu_pack_workspace_bytes(n) == 8 * (1 + tiles)
    n = 3 * tile
    fake = 1 << 20  # never dereferenced: the checks throw first
    args = (fake, n, 4, fake, fake, fake, n)  # ... values and their capacity
    with pytest.raises(UsageError, match="workspace of 31 bytes, needs 32"):
        _C.relu_pack(*args, fake, 31, 0, 0, 0)
    with pytest.raises(UsageError, match="8-byte aligned"):
        _C.relu_pack(*args, fake + 4, 32, 0, 0, 0)
    with pytest.raises(UsageError, match="null pointer"):
        _C.relu_pack(*args, 0, 32, 0, 0, 0)
    with pytest.raises(UsageError, match="epoch must be <= 4194303"):
        _C.relu_pack(*args, fake, 32, 0, _C.relu_pack_max_epoch + 1, 0)
    assert [_C.relu_pack_tiles(n, size) for size in (4, 2)] == [
        3,
        2,
    ]  # a 16-bit tile holds twice the elements


def test_bench_relu_quick_cpu(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "supermem", "bench", "relu", "--quick", "--device", "cpu", "--sizes", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    r = subprocess.run(cmd + ["--json", str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows[:5]] == ["copy", "pack", "pack+sync", "pack room", "unpack"]
    assert len(rows) == 5 * 2 * 2  # ops x densities x dtypes
    for row in rows:
        assert row["us"] > 0 and row["x_copy"] > 0
        if row["op"] != "copy":  # packed within 1% of n/8 + nnz x itemsize at 1 MiB
            assert row["lossless"] and 1 < row["x_ideal"] < 1.01
    assert "x copy" in r.stdout and "copy" in r.stdout


def test_bench_relu_rejects_bad_sizes():
    cmd = [sys.executable, "-m", "supermem", "bench", "relu", "--device", "cpu", "--sizes", "16,abc"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "'abc' is not an integer" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_pack_into_a_guessed_room_is_whole_only_when_its_count_fits(dtype):
    """relu_pack(capacity=k) keeps the first k nonzeros, whole bitmap and offsets; `fitted` with the
    count read from offsets makes it unpackable when k was enough, and says None when it was not."""
    x = sparse(10_007, 0.5, dtype, seed=3)
    exact = relu_pack(x)
    nnz = exact.nnz
    for room in (nnz, nnz + 100):
        p = relu_pack(x, capacity=room)
        assert p.values.numel() == room and p.host_nnz is None
        assert torch.equal(p.bitmap, exact.bitmap) and torch.equal(p.offsets, exact.offsets)
        whole = fitted(p, int(p.offsets[-1]))
        assert whole is not None and whole.host_nnz == nnz and whole.nbytes == p.nbytes
        assert bitwise_equal(relu_unpack(whole), x)
    short = relu_pack(x, capacity=nnz - 1)
    assert torch.equal(short.values, exact.values[: nnz - 1])
    assert fitted(short, int(short.offsets[-1])) is None
    with pytest.raises(UsageError, match="inconsistent Packed"):
        relu_unpack(short)  # values left out: refused, never half restored
    assert relu_pack(x, capacity=10 * x.numel()).values.numel() == x.numel()  # never more than n
