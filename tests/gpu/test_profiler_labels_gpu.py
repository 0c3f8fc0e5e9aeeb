"""The pool's labels on a GPU: with SUPERMEM_NVTX=1 a CUDA pool's step pushes real NVTX ranges named as
its torch.profiler ranges, each popped on the thread that pushed it (backward's unpacks run on
autograd's device thread); under emit_nvtx() the profiler's own ranges are made instead."""

import threading
from collections import defaultdict

import pytest
import torch

from supermem.tensor_pool import Pool, labels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _step(pool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in "abcd"]
    )
    model.cuda()
    x = torch.randn(1024, 1024, device="cuda")
    for _ in range(2):
        with pool:
            model(x).square().mean().backward()
    pool.synchronize()


@pytest.fixture
def nvtx_calls(monkeypatch):
    """The real push and pop, called through and recorded with the calling thread."""
    calls = []
    push, pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop

    def pushed(name):
        calls.append((threading.get_ident(), name))
        return push(name)

    def popped():
        calls.append((threading.get_ident(), None))
        return pop()

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", pushed)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", popped)
    return calls


def test_supermem_nvtx_pushes_balanced_named_ranges_on_a_cuda_pool(monkeypatch, nvtx_calls):
    monkeypatch.setenv(labels.NVTX_ENV, "1")
    pool = Pool(budget=0, policy="lru")  # offloads everything: offload and restore ranges
    assert pool.nvtx
    _step(pool)
    names = {n for _, n in nvtx_calls if n}
    want = {"supermem::pack", "supermem::unpack", "supermem::offload", "supermem::offload.restore"}
    assert want <= names, sorted(names)
    depth = defaultdict(int)
    for thread, name in nvtx_calls:
        depth[thread] += 1 if name else -1
        assert depth[thread] >= 0, "a pop without its push"
    assert set(depth.values()) == {0}, dict(depth)


def test_under_emit_nvtx_the_profilers_ranges_are_made_not_ours(monkeypatch, nvtx_calls):
    monkeypatch.setenv(labels.NVTX_ENV, "1")
    entered = []
    real = labels.record_function
    monkeypatch.setattr(labels, "record_function", lambda name: entered.append(name) or real(name))
    pool = Pool(budget=0, policy="lru")
    with torch.autograd.profiler.emit_nvtx():  # record_function's ranges become NVTX ranges
        _step(pool)
    assert {"supermem::pack", "supermem::offload"} <= set(entered)
    assert not [n for _, n in nvtx_calls if n and n.startswith("supermem::")]
