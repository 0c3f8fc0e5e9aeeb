"""Sizes, alignment, aliasing and random traffic through torch while supermem serves PyTorch.

Every tensor is filled with a cookie (a byte derived from its id) and checked when freed, so a block
handed out twice, or reused too early, shows up as changed bytes (RMM and mimalloc tests do the same).
"""

import gc
import queue
import random
import threading
import traceback

import torch
from gpu_child import GiB, MiB, assert_cookie, cookie, device_allocator, isolated
from gpu_harness import check_tests, needs_cuda

pytestmark = needs_cuda

ALIGN = 512  # PyTorch's native allocator aligns every block to 512 bytes; kernels may rely on 256


def _empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def fuzz(ops: int, seed: int, max_live_bytes: int = 2 * GiB, max_log2: float = 27) -> dict:
    """Random alloc/free of 1 B .. 2^max_log2 B tensors with cookies; empty_cache now and then."""
    gc.collect()
    base = torch.cuda.memory_allocated()
    rng = random.Random(seed)
    live: dict[int, torch.Tensor] = {}
    live_bytes = peak = 0
    for i in range(ops):
        if live and (rng.random() < 0.45 or live_bytes > max_live_bytes):
            key = rng.choice(list(live))
            t = live.pop(key)
            assert_cookie(t, key, f"op {i}: tensor {key}")
            live_bytes -= t.numel()
            del t
        else:
            n = int(2 ** rng.uniform(0, max_log2))
            live[i] = cookie(_empty(n), i)
            live_bytes += n
            peak = max(peak, live_bytes)
        if i % 500 == 499:
            torch.cuda.empty_cache()
    for key in list(live):  # no loop variable may keep the last tensor alive
        assert_cookie(live.pop(key), key, f"tensor {key} at the end")
    assert torch.cuda.memory_allocated() == base, "allocated did not return to its start after the fuzz"
    return {"ops": ops, "peak_live_gib": round(peak / GiB, 2)}


def check_zero_size_tensors():
    before = torch.cuda.memory_allocated()
    for _ in range(1000):
        x = torch.empty(0, device="cuda")
        y = torch.empty(0, 5, device="cuda")
        del x, y
    z = torch.cat([torch.empty(0, device="cuda"), torch.ones(3, device="cuda")])
    assert z.sum().item() == 3
    del z
    assert torch.cuda.memory_allocated() == before


def check_boundary_sizes_aligned_and_usable():
    sizes = [1, 511, 512, 513, MiB - 1, MiB, MiB + 1, 2 * MiB - 1, 2 * MiB, 2 * MiB + 1, 20 * MiB, GiB]
    live = []
    for i, n in enumerate(sizes):
        t = cookie(_empty(n), i)
        assert t.data_ptr() % ALIGN == 0, f"{n} B at {t.data_ptr():#x} is not {ALIGN}-aligned"
        live.append(t)
    for i, t in enumerate(live):
        assert_cookie(t, i, f"{sizes[i]} B tensor")


def check_live_tensors_never_overlap():
    rng = random.Random(1)
    live = [cookie(_empty(int(2 ** rng.uniform(0, 24))), i) for i in range(2000)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel(), i) for i, t in enumerate(live))
    for (_, end, i), (start, _, j) in zip(spans, spans[1:], strict=False):
        assert end <= start, f"tensors {i} and {j} overlap"
    for i, t in enumerate(live):
        assert_cookie(t, i)


def check_fuzz_with_cookies():
    return fuzz(ops=4000, seed=2)


def check_threads_free_each_others_tensors():
    handoff: queue.Queue = queue.Queue()
    errors: list[str] = []

    def worker(tid: int) -> None:
        try:
            rng = random.Random(tid)
            for i in range(300):
                key = tid * 1000 + i
                handoff.put((key, cookie(_empty(int(2 ** rng.uniform(4, 24))), key)))
                if rng.random() < 0.6:
                    try:
                        other, t = handoff.get_nowait()
                    except queue.Empty:
                        continue
                    assert_cookie(t, other, f"thread {tid} freeing tensor {other}")
                    del t
        except BaseException:  # noqa: BLE001
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    while not handoff.empty():
        key, t = handoff.get()
        assert_cookie(t, key)


def check_caching_allocator_raw_alloc():
    before = torch.cuda.memory_allocated()
    ptr = torch.cuda.caching_allocator_alloc(MiB)
    assert ptr and ptr % ALIGN == 0
    assert torch.cuda.memory_allocated() >= before + MiB
    torch.cuda.caching_allocator_delete(ptr)
    assert torch.cuda.memory_allocated() == before


@isolated(conf="debug:2")
def check_fuzz_under_debug_2():
    """debug:2 walks the allocator's invariants after every call: real traffic must keep them."""
    return fuzz(ops=1500, seed=3, max_log2=24)


@isolated(conf="passthrough:true")
def check_passthrough_caches_nothing():
    torch.cuda.synchronize()
    res0 = torch.cuda.memory_reserved()
    x = _empty(256 * MiB)
    assert torch.cuda.memory_reserved() >= res0 + 256 * MiB
    del x
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() <= res0, "passthrough kept a freed block cached"
    return fuzz(ops=500, seed=4, max_log2=24)


def check_invariants_hold():
    device_allocator().check()


test_basics = check_tests(__name__)
