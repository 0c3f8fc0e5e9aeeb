"""The ReLU compression kernels (csrc/kernels/relu_pack.cu) on a GPU, held byte for byte to the CPU
reference in supermem.compress: bitmap, offsets and values, the unpacked tensor, the mask form; the
unaligned paths, writes staying inside their buffers, the caller's stream, no host sync with
exact=False, and tensors past 2^31 elements. Runs in this process (no allocator swap needed)."""

import math

import pytest
import torch
from compress_cases import (
    CORRUPT_PARTS,
    DENSITIES,
    DTYPES,
    INT,
    SIZES,
    SPECIAL_BITS,
    bitwise_equal,
    from_bits,
    sparse,
)

from supermem import _C
from supermem.compress import relu_mask_pack, relu_mask_unpack, relu_pack, relu_unpack
from supermem.errors import UsageError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def kernels_built():
    # A GPU machine must have built them: skipping here would hide a broken build.
    assert _C.has_relu_kernels, "supermem._C was built without the CUDA kernels (no nvcc at build time?)"
    yield
    torch.cuda.synchronize()  # a kernel fault surfaces in the test that caused it


def assert_same_pack(gpu, ref):
    """A CUDA Packed equals the CPU reference's, byte for byte."""
    assert gpu.device.type == "cuda" and gpu.dtype == ref.dtype and gpu.shape == ref.shape
    assert torch.equal(gpu.bitmap.cpu(), ref.bitmap)
    assert torch.equal(gpu.offsets.cpu(), ref.offsets)
    assert bitwise_equal(gpu.values[: ref.nnz], ref.values)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "worst_case"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES + [(1 << 20) + 3])
@pytest.mark.parametrize("density", DENSITIES)
def test_kernels_equal_reference(density, n, dtype, exact):
    x = sparse(n, density, dtype, seed=n)
    ref = relu_pack(x)
    packed = relu_pack(x.cuda(), exact=exact)
    assert_same_pack(packed, ref)
    if exact:
        assert packed.nbytes == ref.nbytes
    else:  # room for every element until compacted
        assert packed.values.numel() == n and packed.compact().nbytes == ref.nbytes
    y = relu_unpack(packed)
    assert y.is_cuda and bitwise_equal(y, x)
    assert bitwise_equal(relu_unpack(packed.compact()), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(dtype):
    special = from_bits(SPECIAL_BITS[dtype], dtype)
    order = torch.randperm(1000 * special.numel(), generator=torch.Generator().manual_seed(2))
    x = special.repeat(1000)[order]
    packed = relu_pack(x.cuda())
    assert_same_pack(packed, relu_pack(x))
    assert bitwise_equal(relu_unpack(packed), x)
    mask = relu_mask_pack(x.cuda())
    assert torch.equal(mask.bitmap.cpu(), relu_mask_pack(x).bitmap)
    assert torch.equal(relu_mask_unpack(mask).cpu(), x > 0)


def views(base):
    return {
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "transpose": base.reshape(64, -1).t(),
        "offset_1": base.reshape(-1)[1:],  # 2- or 4-byte aligned: the scalar load path
        "offset_3": base.reshape(-1)[3:-2],
        "gaps": base[:, ::3, 1:],
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(views(torch.zeros(4, 16, 17, 19))))
def test_layouts_and_unaligned_input(name, dtype):
    base = sparse(4 * 16 * 17 * 19, 0.5, dtype, seed=3).reshape(4, 16, 17, 19)
    view, gpu_view = views(base)[name], views(base.cuda())[name]
    packed = relu_pack(gpu_view)
    assert_same_pack(packed, relu_pack(view))
    y = relu_unpack(packed)
    assert bitwise_equal(y, view)
    assert y.stride() == relu_unpack(relu_pack(view)).stride()
    mask = relu_mask_unpack(relu_mask_pack(gpu_view - 0.5))
    assert torch.equal(mask.cpu(), (view - 0.5) > 0)
    mask = relu_mask_pack(gpu_view)  # offset_*: the mask's scalar load path
    assert torch.equal(mask.bitmap.cpu(), relu_mask_pack(view).bitmap)
    assert torch.equal(relu_mask_unpack(mask).cpu(), view > 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 17, 31, 33, 2047, 2049, 100_003])
def test_writes_stay_in_their_buffers_and_unaligned_outputs_work(dtype, n):
    """The kernels called directly with guard bytes around every output, and outputs one element
    (unpack) or three bytes (mask) off 16-byte alignment."""
    stream = torch.cuda.current_stream().cuda_stream
    x = sparse(n, 0.5, dtype, seed=n).cuda()
    ref = relu_pack(x.cpu())
    size = x.element_size()
    guard = 64

    def guarded(nbytes):
        return torch.full((nbytes + 2 * guard,), 0xA5, dtype=torch.uint8, device="cuda")

    def inside(buf):
        return buf[guard:-guard]

    def guards_intact(buf):
        return bool((buf[:guard] == 0xA5).all() and (buf[-guard:] == 0xA5).all())

    nwords, nblocks = math.ceil(n / 32), math.ceil(n / 2048)
    bitmap, offsets, values = guarded(4 * nwords), guarded(8 * (nblocks + 1)), guarded(size * ref.nnz)
    workspace = guarded(_C.relu_pack_workspace_bytes(n))
    ptr = lambda buf: inside(buf).data_ptr()  # noqa: E731
    for values_ptr in (0, ptr(values)):  # bitmap and offsets only (exact mode's first call), then all three
        _C.relu_pack(x.data_ptr(), n, size, ptr(bitmap), ptr(offsets), values_ptr, ref.nnz, ptr(workspace),
                     inside(workspace).numel(), 0, 0, stream)  # fmt: skip
        assert all(guards_intact(b) for b in (bitmap, offsets, values, workspace))
        assert torch.equal(inside(bitmap).cpu(), ref.bitmap)
        assert torch.equal(inside(offsets).cpu().view(torch.int64), ref.offsets)
        if not values_ptr:
            assert bool((inside(values) == 0xA5).all())  # nothing written
    assert torch.equal(inside(values).cpu(), ref.values.view(torch.uint8))
    # A values buffer sized by a guess too small: the first `short` values, nothing past them, and
    # whole bitmap and offsets (nnz among them: how the caller learns it did not fit).
    short = ref.nnz // 2
    few, offsets2 = guarded(size * short), guarded(8 * (nblocks + 1))
    _C.relu_pack(x.data_ptr(), n, size, ptr(bitmap), ptr(offsets2), ptr(few), short, ptr(workspace),
                 inside(workspace).numel(), 0, 0, stream)  # fmt: skip
    assert guards_intact(few) and guards_intact(offsets2)
    assert torch.equal(inside(offsets2).cpu().view(torch.int64), ref.offsets)
    assert torch.equal(inside(few).cpu(), ref.values.view(torch.uint8)[: size * short])
    # Values one element off 16-byte alignment (each run goes out as shifted 16-byte stores): the same bytes.
    odd = guarded(size * (ref.nnz + 1))
    _C.relu_pack(x.data_ptr(), n, size, ptr(bitmap), ptr(offsets2), inside(odd)[size:].data_ptr(), ref.nnz,
                 ptr(workspace), inside(workspace).numel(), 0, 0, stream)  # fmt: skip
    assert guards_intact(odd) and torch.equal(inside(odd)[size:].cpu(), ref.values.view(torch.uint8))

    dense = guarded(size * (n + 1))  # the output starts one element past a 16-byte boundary
    out = inside(dense)[size:]
    _C.relu_unpack(ptr(bitmap), ptr(offsets), ptr(values), n, size, out.data_ptr(), stream)
    assert guards_intact(dense) and bitwise_equal(out.view(dtype), x)

    limit = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80}[dtype]
    signed = x - 1.0  # about half of the nonzeros turn negative
    mask_bits = guarded(4 * nwords)
    _C.relu_mask_pack(signed.data_ptr(), n, size, limit, ptr(mask_bits), stream)
    bools = guarded(n + 3)
    _C.relu_mask_unpack(ptr(mask_bits), n, inside(bools)[3:].data_ptr(), stream)
    assert guards_intact(mask_bits) and guards_intact(bools)
    assert torch.equal(inside(bools)[3:].view(torch.bool), signed > 0)


def test_runs_on_the_callers_stream():
    """Queued behind a long kernel on a side stream, the pack must still see the side stream's writes."""
    n = 1 << 22
    x = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # tens of ms: a launch on another stream would run first
        x.fill_(2.0)
        packed = relu_pack(x, exact=False)
        y = relu_unpack(packed)
        mask = relu_mask_unpack(relu_mask_pack(x))
    side.synchronize()
    assert packed.nnz == n and bool((y == 2.0).all()) and bool(mask.all())


def test_worst_case_mode_never_syncs_and_exact_mode_syncs_once():
    x = sparse(1 << 20, 0.5, torch.bfloat16).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = relu_pack(x, exact=False)
        relu_unpack(packed)
        relu_mask_unpack(relu_mask_pack(x))
        with pytest.raises(RuntimeError, match="synchroniz"):
            relu_pack(x)  # reads the nonzero count back to size the values buffer
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_past_2_to_the_31_elements():
    n = (1 << 31) + 4099  # int32 indices would wrap
    if torch.cuda.mem_get_info()[0] < 24 * (1 << 30):
        pytest.skip("needs 24 GiB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(n, device="cuda", generator=g, dtype=torch.bfloat16) - 0.5
    x = torch.relu_(x)
    nnz = int(torch.count_nonzero(x.view(torch.int16)))
    packed = relu_pack(x)
    assert packed.nnz == nnz and packed.values.numel() == nnz
    y = relu_unpack(packed)
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))
    tail = x[-5000:]  # elements past index 2^31, whose values sit past byte 2^31 of the values
    assert torch.equal(packed.values[-int(torch.count_nonzero(tail)) :].view(INT[x.dtype]),
                       tail[tail.view(torch.int16) != 0].view(torch.int16))  # fmt: skip


def tile_elems(dtype):
    """Elements per tile of the one-pass pack (one CTA, one look-back status): 64 KiB of input."""
    return _C.relu_pack_tile_elems(torch.empty((), dtype=dtype).element_size())


def tiled(n, dtype, tile_density, seed=0):
    """n elements whose tile t (of tile_elems) has density tile_density(t): every tile's count differs
    from its neighbours', so a wrong look-back sum shows in offsets and values."""
    x = sparse(n, 1.0, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    keep = torch.zeros(n, dtype=torch.bool)
    tile = tile_elems(dtype)
    for t in range(math.ceil(n / tile)):
        part = keep[t * tile : (t + 1) * tile]
        part.copy_(torch.rand(part.numel(), generator=g) < tile_density(t))
    return torch.where(keep, x, torch.zeros((), dtype=dtype))


PATTERNS = {
    "alternate_0_1": lambda t: t % 2,  # tiles alternately empty and full
    "alternate_1_0": lambda t: 1 - t % 2,
    "ramp": lambda t: (t % 7) / 6,
    "one_full_tile": lambda t: float(t == 40),  # a single nonzero tile past the first look-back window
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("tiles", [1, 2, 31, 32, 33, 65, 300])
@pytest.mark.parametrize("extra", [-1, 0, 1, 2048, 2049])
def test_many_tiles_of_varying_density(dtype, pattern, tiles, extra):
    """The one-pass pack's cross-tile scan: sizes at and around whole tiles (and look-back windows of
    32 tiles), last tiles full, partial or one element long, densities jumping from tile to tile."""
    n = tiles * tile_elems(dtype) + extra
    x = tiled(n, dtype, PATTERNS[pattern], seed=tiles)
    ref = relu_pack(x)
    for exact in (True, False):
        packed = relu_pack(x.cuda(), exact=exact)
        assert_same_pack(packed, ref)
        assert bitwise_equal(relu_unpack(packed), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pattern", ["ramp", "one_far_tile"])
def test_look_back_over_many_windows(dtype, pattern):
    """More tiles than a wave of CTAs holds (2 an SM): a tile walks back over many windows of
    aggregates, and one nonzero tile far back must still be counted by every tile after it."""
    density = {"ramp": PATTERNS["ramp"], "one_far_tile": lambda t: float(t == 300)}[pattern]
    x = tiled(700 * tile_elems(dtype) + 3, dtype, density, seed=7)
    ref = relu_pack(x)
    packed = relu_pack(x.cuda(), exact=False)
    assert_same_pack(packed, ref)
    assert bitwise_equal(relu_unpack(packed), x)


def test_repeated_packs_reuse_the_workspace_cleanly():
    """Back-to-back packs on one stream share its kept workspace (no memset between them): large
    and small, fp32 and bf16, so a pack meets the status words of earlier, larger packs past its own
    tiles and of packs with other tile sizes; and once epochs run out the workspace starts over."""
    from supermem import compress

    tile = tile_elems(torch.float32)
    sizes = [100 * tile + 5, 3 * tile, 100 * tile + 5, 7, 41 * tile + 1]
    xs = [tiled(n, dt, PATTERNS["ramp"], seed=s).cuda() for s, n in enumerate(sizes) for dt in DTYPES]
    packs = [relu_pack(x, exact=False) for x in xs for _ in range(2)]
    key = (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
    compress._workspaces[key].epoch = _C.relu_pack_max_epoch  # the next pack zeroes it and starts over
    packs += [relu_pack(x, exact=False) for x in xs[:4]]
    assert compress._workspaces[key].epoch == 4
    for i, packed in enumerate(packs):
        x = xs[i // 2] if i < 2 * len(xs) else xs[i - 2 * len(xs)]
        assert torch.equal(packed.offsets.cpu(), relu_pack(x.cpu()).offsets)
        assert bitwise_equal(relu_unpack(packed), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_tensor_one_warp_per_block_unpack(dtype):
    """Past sms * 256 blocks unpack gives each block one warp (below, several): check that path and
    the pack of many tiles against the reference computed by torch on the GPU."""
    from supermem.compress import _pack_reference

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    tile = tile_elems(dtype)
    n = sms * 256 * 2048 + 3 * tile + 77
    if torch.cuda.mem_get_info()[0] < 8 * n * 4:
        pytest.skip("not enough free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.rand(n, device="cuda", generator=g)
    tile_density = (torch.arange(math.ceil(n / tile), device="cuda") % 3) / 2  # 0, 0.5, 1, ...
    x = torch.where(x < tile_density.repeat_interleave(tile)[:n], x + 0.5, 0.0).to(dtype)
    bitmap, offsets, values = _pack_reference(x)
    packed = relu_pack(x)
    assert torch.equal(packed.bitmap, bitmap) and torch.equal(packed.offsets, offsets)
    assert torch.equal(packed.values.view(INT[dtype]), values.view(INT[dtype]))
    y = relu_unpack(packed)
    assert torch.equal(y.view(INT[dtype]), x.view(INT[dtype]))


@pytest.mark.parametrize("corrupt", list(CORRUPT_PARTS))
def test_unpack_refuses_a_corrupt_pack_before_the_kernel_reads_it(corrupt):
    """The CPU path's checks on the parts, on CUDA too: values on the host, a short bitmap, ... would
    have the kernel read out of bounds. The autouse fixture's synchronize shows a kernel fault here."""
    x = sparse(5000, 0.5, torch.float32)
    packed = relu_pack(x.cuda())
    assert bitwise_equal(relu_unpack(packed), x)
    with pytest.raises(UsageError, match="relu_unpack: inconsistent Packed"):
        relu_unpack(CORRUPT_PARTS[corrupt](packed))
