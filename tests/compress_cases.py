"""Test cases for the ReLU compression tests (tests/cpu/compress/test_compress.py,
tests/gpu/test_compress_gpu.py): sizes, densities, special values, and bitwise comparison helpers."""

import numpy as np
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SIZES = [0, 1, 7, 31, 32, 33, 1023, 2047, 2048, 2049, 4097, 3 * 2048 * 8 + 5]
DENSITIES = [0.0, 1e-6, 0.3, 0.5, 1.0]
# Bits of special values: +0, -0, +inf, -inf, quiet NaN, NaN with a payload, negative NaN, the smallest
# subnormal, its negative, 1.0, the largest finite value.
SPECIAL_BITS = {
    torch.float32: [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00123, 1, 0x80000001,
                    0x3F800000, 0x7F7FFFFF],
    torch.float16: [0, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE12, 1, 0x8001, 0x3C00, 0x7BFF],
    torch.bfloat16: [0, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC3, 1, 0x8001, 0x3F80, 0x7F7F],
}  # fmt: skip


def sparse(n, density, dtype, seed=0):
    """n positive values (>= 0.5) of which about (1 - density) are set to +0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).abs() + 0.5
    return torch.where(torch.rand(n, generator=g) < density, x, 0.0).to(dtype)


def from_bits(bits, dtype):
    """A tensor of `dtype` whose elements have these bit patterns (unsigned ints)."""
    width = torch.finfo(dtype).bits
    signed = [b - (1 << width) if b >= 1 << (width - 1) else b for b in bits]
    return torch.tensor(signed, dtype=INT[dtype]).view(dtype)


def words(t):
    """The elements as unsigned integers (numpy), for bitwise comparisons."""
    a = t.detach().cpu().contiguous().view(INT[t.dtype]).numpy()
    return a.astype(np.uint32 if a.dtype == np.int32 else np.uint16)


def bitwise_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(words(a), words(b))


def _replace(packed, **parts):
    from dataclasses import replace

    return replace(packed, **parts)


# Ways a Packed can be corrupt, each a function of a good Packed of 5000 elements (3 blocks) holding some
# nonzeros. relu_unpack must refuse every one with a UsageError on CPU and on CUDA, before any kernel reads
# a buffer: the checks on the parts themselves (what the CUDA kernel would read out of bounds).
CORRUPT_PARTS = {
    "too few values": lambda p: _replace(p, values=p.values[:-1]),
    "values of another dtype": lambda p: _replace(p, values=p.values.half()),
    "values not contiguous": lambda p: _replace(p, values=torch.stack([p.values, p.values], 1)[:, 0]),
    "values on another device": lambda p: _replace(
        p, values=p.values.cpu() if p.values.is_cuda else p.values.to("meta")
    ),
    "offsets of another dtype": lambda p: _replace(p, offsets=p.offsets.int()),
    "one offset missing": lambda p: _replace(p, offsets=p.offsets[:-1]),
    "bitmap one word short": lambda p: _replace(p, bitmap=p.bitmap[:-4]),
    "bitmap of another dtype": lambda p: _replace(p, bitmap=p.bitmap.to(torch.int16)),
    "stride of another rank": lambda p: _replace(p, stride=(1, 1)),
    "stride with gaps": lambda p: _replace(p, stride=(2,)),
}
# Corrupt contents: offsets that disagree with the bitmap. Checked where reading them is free (CPU); on
# CUDA that would cost the host sync relu_unpack never makes, so there the contents are trusted.
CORRUPT_CONTENTS = {
    "an inner offset off by one": lambda p: _replace(p, offsets=p.offsets + torch.tensor([0, 1, 0, 0])),
    "a bit set past the end": lambda p: _replace(
        p, bitmap=p.bitmap.clone().index_fill_(0, torch.tensor([-1]), 128)
    ),
    # the word padding's bit counted by the offsets and given a value: every count agrees, the bitmap's
    # elements past n do not exist
    "a padding bit set, offsets and values counting it": lambda p: _replace(
        p,
        bitmap=p.bitmap.clone().index_fill_(0, torch.tensor([-1]), 128),
        offsets=p.offsets + torch.tensor([0, 0, 0, 1]),
        values=torch.cat([p.values, p.values[:1]]),
    ),
}
