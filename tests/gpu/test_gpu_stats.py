"""While supermem serves PyTorch, torch.cuda.memory_* report supermem's real numbers, and empty_cache,
set_per_process_memory_fraction and the snapshot APIs act.

"Real" is checked against what does not come from supermem's books: tensor sizes, the driver's
cudaMemGetInfo and the block each live tensor sits in. Each check_* runs in a swapped child process.
"""

import gc
import pickle
import tempfile
from pathlib import Path

import torch
from gpu_child import GiB, MiB, assert_cookie, cookie, device_allocator, isolated, used_bytes
from gpu_harness import check_tests, needs_cuda

pytestmark = needs_cuda


def _settle() -> None:
    gc.collect()
    torch.cuda.synchronize()


def _empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def check_backend_is_supermem():
    torch.cuda.init()
    alloc = device_allocator(0)
    assert torch.cuda.get_allocator_backend() == "pluggable"
    return {"allocator": repr(alloc)}


def check_allocated_tracks_each_tensor():
    _settle()
    before = torch.cuda.memory_allocated()
    for nbytes in (3 * MiB, 12345, 64 * MiB + 17, 1):
        x = _empty(nbytes)
        delta = torch.cuda.memory_allocated() - before
        block = device_allocator().allocation_size(x.data_ptr())
        assert nbytes <= delta == block, f"{nbytes} B tensor: allocated grew by {delta}, its block is {block}"
        assert delta <= nbytes + max(4096, nbytes // 8), f"{nbytes} B tensor costs {delta} B"
        assert torch.cuda.memory.memory_allocated() == torch.cuda.memory_allocated()  # both spellings
        del x
        assert torch.cuda.memory_allocated() == before, "allocated did not come back after del"


def check_torch_stats_equal_supermem_stats():
    keep = [_empty(n) for n in (5 * MiB, 300 * 1024, 77)]
    s = device_allocator().stats()
    ms = torch.cuda.memory_stats()
    pairs = {
        "memory_allocated": (torch.cuda.memory_allocated(), s["allocated_bytes"]),
        "max_memory_allocated": (torch.cuda.max_memory_allocated(), s["allocated_bytes_peak"]),
        "memory_reserved": (torch.cuda.memory_reserved(), s["reserved_bytes"]),
        "max_memory_reserved": (torch.cuda.max_memory_reserved(), s["reserved_bytes_peak"]),
        "memory_stats allocated": (ms["allocated_bytes.all.current"], s["allocated_bytes"]),
        "memory_stats reserved peak": (ms["reserved_bytes.all.peak"], s["reserved_bytes_peak"]),
        "memory_stats num_ooms": (ms["num_ooms"], s["num_ooms"]),
    }
    wrong = {k: v for k, v in pairs.items() if v[0] != v[1]}
    assert not wrong, f"torch vs supermem: {wrong}"
    del keep
    return {"stats": {k: v[0] for k, v in pairs.items()}}


def check_peak_and_reset():
    _settle()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    assert torch.cuda.max_memory_allocated() == base
    x = _empty(256 * MiB)
    del x
    assert torch.cuda.max_memory_allocated() >= base + 256 * MiB
    assert torch.cuda.max_memory_reserved() >= base + 256 * MiB
    assert torch.cuda.memory_allocated() == base
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == base
    assert torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved()


def check_reserved_is_real_device_memory():
    _settle()
    torch.cuda.empty_cache()
    used0, res0 = used_bytes(), torch.cuda.memory_reserved()
    x = _empty(GiB)
    used1, res1 = used_bytes(), torch.cuda.memory_reserved()
    assert res1 - res0 >= GiB, f"reserved grew by {res1 - res0} B for a 1 GiB tensor"
    drift = abs((used1 - used0) - (res1 - res0))
    assert drift <= 64 * MiB, f"driver saw {used1 - used0} B more in use, reserved grew {res1 - res0} B"
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    assert torch.cuda.memory_reserved() <= used_bytes(), "more reserved than the driver says is in use"
    del x


def check_empty_cache_returns_memory():
    _settle()
    torch.cuda.empty_cache()
    used0, res0 = used_bytes(), torch.cuda.memory_reserved()
    x = _empty(512 * MiB)
    del x
    _settle()
    assert torch.cuda.memory_reserved() >= res0 + 512 * MiB, (
        "a freed block should stay cached until empty_cache"
    )
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == res0
    assert used_bytes() <= used0 + 64 * MiB, f"the driver still sees {used_bytes() - used0} B more in use"


def check_memory_fraction_limits():
    _settle()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 2 * GiB) / total)
    try:
        keep = cookie(_empty(GiB), 7)
        try:
            _empty(2 * GiB)
            raise AssertionError("3 GiB in use under a cap of 2 GiB more did not raise")
        except torch.OutOfMemoryError as e:
            assert "CUDA out of memory." in str(e)
        assert_cookie(keep, 7, "a tensor allocated before the OOM")
        small = _empty(512 * MiB)
        del small
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    big = _empty(4 * GiB)  # the cap is lifted
    del big, keep


def check_memory_summary():
    x = _empty(100 * MiB)
    text = torch.cuda.memory_summary()
    assert isinstance(text, str) and "alloc" in text.lower(), text[:500]
    del x
    return {"summary_head": text[:300]}


def _segments_of_device_0(segments: list[dict]) -> list[dict]:
    return [s for s in segments if s.get("device", 0) == 0]


def check_memory_snapshot_matches_stats():
    _settle()
    xs = [_empty(n) for n in (MiB, 7 * MiB + 3, 100 * MiB)]
    segments = _segments_of_device_0(torch.cuda.memory_snapshot())
    assert segments, "an empty snapshot while tensors are live"
    reserved = sum(s["total_size"] for s in segments)
    active = sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated")
    assert reserved == torch.cuda.memory_reserved(), (reserved, torch.cuda.memory_reserved())
    assert active == torch.cuda.memory_allocated(), (active, torch.cuda.memory_allocated())
    for s in segments:
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"], f"blocks do not tile segment {s}"
    live = {
        b["address"]: b["size"]
        for s in segments
        for b in s["blocks"]
        if b["state"] == "active_allocated" and "address" in b
    }
    for x in xs:
        assert live.get(x.data_ptr(), -1) >= x.numel(), (
            f"no live block at {x.data_ptr():#x} for {x.numel()} B"
        )
    del xs


def check_snapshot_loads_in_memory_viz():
    from torch.cuda import _memory_viz

    x = _empty(33 * MiB)
    snap = torch.cuda.memory._snapshot()
    assert "segments" in snap and "device_traces" in snap, list(snap)
    text = _memory_viz.segsum(snap)  # raises on accounting errors (allocated + free != reserved)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "snap.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        with open(path, "rb") as f:
            loaded = pickle.load(f)
    assert loaded["segments"], "the dumped snapshot has no segments"
    del x
    return {"segsum_tail": text.strip().splitlines()[-4:]}


@isolated(conf="trace:100000")
def check_trace_ring_sees_tensors():
    alloc = device_allocator()
    assert alloc.trace_capacity >= 100000
    alloc.drain_trace()
    x = _empty(3 * MiB)
    ptr = x.data_ptr()
    del x
    events = [e for e in alloc.drain_trace() if e.address == ptr]
    assert len({e.action for e in events}) >= 2, f"expected an alloc and a free event at {ptr:#x}: {events}"
    return {"actions": sorted({e.action for e in events})}


def check_invariants_hold():
    device_allocator().check()


test_stats = check_tests(__name__)
