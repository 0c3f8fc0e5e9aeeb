"""Expandable segments on a GPU (SUPERMEM_CONF=expandable_segments:true): pages mapped with the driver's
virtual memory API, given back to the driver by empty_cache, never unmapped under queued work, CUDA
graphs and torch.compile(mode="reduce-overhead") in private pools, the tensor pool's offload beside
them, a limit, PyTorch's memory tools, and CUDA IPC refused with an error rather than a crash.

Checks that need supermem's allocator skip in the native dry run (SUPERMEM_TEST_NATIVE=1); the rest
hold for native's allocator too."""

import gc

import torch
import torch.nn.functional as F
from gpu_child import GiB, MiB, Skip, assert_cookie, cookie, device_allocator, isolated, used_bytes
from gpu_harness import check_tests, needs_cuda

pytestmark = needs_cuda

CONF = "expandable_segments:true"


def _alloc():
    a = device_allocator()  # Skip in a native dry run
    assert a.expandable_segments, "expandable_segments:true did not reach the allocator"
    return a


def _page() -> int:
    page = _alloc().device.page_bytes
    assert page >= 2 * MiB and page % (2 * MiB) == 0, f"the driver's page is {page} B"
    return page


def _release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def check_pages_are_mapped_on_demand():
    page = _page()
    _release()
    res0 = torch.cuda.memory_reserved()
    t = cookie(torch.empty(3 * MiB, dtype=torch.uint8, device="cuda"), 7)
    grown = torch.cuda.memory_reserved() - res0  # a plain segment: 20 MiB
    assert 0 < grown <= -(-3 * MiB // page) * page, f"reserved grew by {grown} B for 3 MiB (page {page} B)"
    assert_cookie(t, 7, "a tensor across a page boundary")
    segs = [
        s
        for s in torch.cuda.memory_snapshot()
        if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]
    ]
    assert len(segs) == 1 and segs[0]["is_expandable"] is True, segs
    _alloc().check()
    return {"page_mib": page / MiB}


def check_a_larger_tensor_extends_the_segment_end():
    page = _page()
    _release()
    res0 = torch.cuda.memory_reserved()
    a = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
    ptr = a.data_ptr()
    del a
    b = cookie(torch.empty(14 * MiB, dtype=torch.uint8, device="cuda"), 3)
    assert b.data_ptr() == ptr, "the 14 MiB tensor went elsewhere instead of growing the free 12 MiB"
    assert_cookie(b, 3)
    grown = torch.cuda.memory_reserved() - res0
    assert grown <= 14 * MiB + page, f"reserved grew by {grown} B (plain segments: 12 + 14 MiB)"
    del b


def check_empty_cache_gives_pages_back_to_the_driver():
    _alloc()
    _release()
    used0, res0 = used_bytes(), torch.cuda.memory_reserved()
    xs = [cookie(torch.empty(256 * MiB, dtype=torch.uint8, device="cuda"), i) for i in range(3)]
    hole = xs[1].data_ptr()
    del xs[1]
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() - res0 == 512 * MiB, torch.cuda.memory_reserved() - res0
    assert used_bytes() <= used0 + 512 * MiB + 64 * MiB, "the driver still counts the unmapped hole"
    assert_cookie(xs[0], 0)
    assert_cookie(xs[1], 2)
    y = cookie(torch.empty(256 * MiB, dtype=torch.uint8, device="cuda"), 5)
    assert y.data_ptr() == hole, "the hole was not mapped again at the lowest address"
    assert_cookie(y, 5)
    del xs, y
    _release()
    assert torch.cuda.memory_reserved() == res0 and used_bytes() <= used0 + 64 * MiB


def check_unmapping_waits_for_queued_kernels():
    """Free a tensor a queued kernel still writes, then empty_cache at once: the unmap must wait, or the
    kernel faults (an illegal address, sticky for the whole process)."""
    _alloc()
    w = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            x = torch.tanh(x @ w)  # seconds of queued work on the current stream
        del x
        torch.cuda.empty_cache()
    side = torch.cuda.Stream()
    t = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        for _ in range(50):
            t.add_(1)
    t.record_stream(side)
    del t
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    _alloc().check()


def _chain(x: torch.Tensor, w: torch.Tensor, depth: int = 8) -> torch.Tensor:
    h = x
    for _ in range(depth):
        h = torch.tanh(h @ w)
    return h.sum(0)


def check_cuda_graphs_capture_replay_and_release():
    _alloc()
    x = torch.randn(4096, 4096, device="cuda")
    w = torch.randn(4096, 4096, device="cuda") / 64
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _chain(x, w)
    torch.cuda.current_stream().wait_stream(side)
    _release()
    res0 = torch.cuda.memory_reserved()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = _chain(x, w)
    pool_segments = [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0)]
    assert pool_segments and all(s["is_expandable"] for s in pool_segments), pool_segments
    for i in range(4):
        new = torch.randn(4096, 4096, device="cuda")
        x.copy_(new)
        junk = [torch.full((n,), 255, dtype=torch.uint8, device="cuda") for n in (MiB, 32 * MiB)]
        g.replay()
        torch.testing.assert_close(y, _chain(new, w), rtol=1e-4, atol=1e-4)
        assert all(bool((t == 255).all()) for t in junk), f"replay {i} overwrote an eager tensor"
    del g, y, junk, new
    _release()
    left = torch.cuda.memory_reserved() - res0
    assert left <= 4 * MiB, f"{left} B of the deleted graph's pool is still mapped"
    _alloc().check()


@isolated(CONF)
def check_compile_reduce_overhead():
    _alloc()

    def fn(x, w):
        return F.gelu(x @ w).sum(dim=0)

    x, w = torch.randn(256, 512, device="cuda"), torch.randn(512, 512, device="cuda")
    expected = fn(x, w)
    compiled = torch.compile(fn, mode="reduce-overhead")
    for _ in range(5):
        y = compiled(x, w)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected, rtol=1e-3, atol=1e-3)
    torch._dynamo.reset()
    _alloc().check()


@isolated(CONF + ",limit:1GiB")
def check_a_fragmented_cache_serves_a_large_tensor_under_the_limit():
    """Holes of 90 MiB between live tensors, 450 MiB free in all, then 400 MiB at once: plain segments
    need a new 400 MiB segment over the limit; expandable ones move the holes' pages."""
    _alloc()
    xs = [torch.empty(90 * MiB, dtype=torch.uint8, device="cuda") for _ in range(10)]
    for i in range(0, 10, 2):
        xs[i] = None
    big = cookie(torch.empty(400 * MiB, dtype=torch.uint8, device="cuda"), 9)
    assert torch.cuda.max_memory_reserved() <= GiB
    assert_cookie(big, 9)
    del xs, big
    _alloc().check()


def check_growth_past_the_peak_moves_the_pages_of_holes_first():
    """Without a limit: 1 GiB holes between live tensors, their last kernels still queued, then 3 GiB
    at once. Instead of 3 GiB more memory the holes' pages move to it, unmapped once those kernels ran
    (else they fault); every live tensor keeps its bytes."""
    a = _alloc()
    _release()
    xs = [cookie(torch.empty(GiB, dtype=torch.uint8, device="cuda"), i) for i in range(10)]
    reserved, reclaims = torch.cuda.memory_reserved(), a.stats()["num_reclaims"]
    for i in range(0, 8, 2):
        xs[i].add_(1)  # queued work on what becomes a hole
        xs[i] = None
    big = cookie(torch.empty(3 * GiB, dtype=torch.uint8, device="cuda"), 99)
    grew = torch.cuda.memory_reserved() - reserved
    assert a.stats()["num_reclaims"] >= reclaims + 3 and grew <= 2 * _page(), (
        grew,
        a.stats()["num_reclaims"],
    )
    for i in range(1, 10, 2):
        assert_cookie(xs[i], i, f"live tensor {i}")
    assert_cookie(big, 99)
    del xs, big
    a.check()
    return {"reserved_growth_mib": grew / MiB}


def check_tensor_pool_offload_beside_expandable_segments():
    import supermem

    _alloc()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU()) for _ in range(6)]
    )
    model = model.cuda()
    x = torch.randn(512, 2048, device="cuda")
    model(x).square().mean().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with supermem.pool(budget=0, policy="lru") as pool:  # everything it can move goes to the host pool
        model(x).square().mean().backward()
    pool.check()
    for p, r in zip(model.parameters(), ref, strict=True):
        assert torch.equal(p.grad, r), "gradients differ under the pool with expandable segments"
    _alloc().check()


def check_stats_snapshot_and_oom_message():
    a = _alloc()
    t = torch.empty(10 * MiB, dtype=torch.uint8, device="cuda")
    s, own = torch.cuda.memory_stats(), a.stats()
    assert s["reserved_bytes.all.current"] == own["reserved_bytes"]
    assert own["address_space_bytes"] >= torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        raise AssertionError("a 1 PiB tensor was allocated")
    except torch.OutOfMemoryError as e:
        assert "Expandable segments map" in str(e), str(e)
    del t


def check_ipc_sharing_is_refused_not_crashed():
    """supermem's pages carry no shareable handle: torch.multiprocessing cannot share them. Its
    reducer must raise (as it does for any pluggable allocator), and the process carry on."""
    from torch.multiprocessing.reductions import reduce_tensor

    _alloc()
    t = torch.ones(MiB, device="cuda")
    try:
        reduce_tensor(t)
    except RuntimeError as e:
        outcome = str(e).splitlines()[0][:200]
    else:
        raise Skip("this PyTorch shared the tensor: check it in a child process before relying on it")
    torch.cuda.synchronize()
    assert float(t.sum()) == MiB
    _alloc().check()
    return {"refused": outcome}


def check_cross_device_copies():
    """Pages are mapped for their own device only (no peer mappings, unlike native's enablePeerAccess):
    a copy between GPUs must still be right, through peer access or staged."""
    if torch.cuda.device_count() < 2:
        raise Skip("needs two GPUs")
    _alloc()
    x = torch.arange(16 * MiB, dtype=torch.int32, device="cuda:0")
    y = x.to("cuda:1")
    z = (y + 1).to("cuda:0")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert torch.equal(z, x + 1)


def check_invariants_hold():
    _alloc().check()


test_expandable = check_tests(__name__, conf=CONF, timeout=300)
