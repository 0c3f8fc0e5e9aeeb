"""Out of memory under supermem: the error PyTorch code expects, and an allocator that stays usable.

The checks run swapped with a limit (LIMIT) so that running out is quick and does not depend on the
card. Code that handles OOM (Accelerate's find_executable_batch_size, Lightning's batch-size finder)
catches torch.OutOfMemoryError or matches "CUDA out of memory." in `exception.args[0]`.
"""

import gc
import os
import time
from pathlib import Path

import torch
from gpu_child import GiB, MiB, assert_cookie, cookie, device_allocator, isolated
from gpu_harness import check_tests, needs_cuda

pytestmark = needs_cuda

LIMIT = 6 * GiB
CONF = "limit:6GiB"
PiB = 1 << 50


def _empty(nbytes: int) -> torch.Tensor:
    _native_limit()
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def _native_limit() -> None:
    """In a native dry run (SUPERMEM_TEST_NATIVE=1), PyTorch's memory fraction stands in for LIMIT."""
    import supermem

    if not supermem.installed() and not getattr(_native_limit, "done", False):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(LIMIT / total)
        _native_limit.done = True


def _oom_message(nbytes: int) -> str:
    """The message of the OOM that allocating `nbytes` raises (AssertionError if none)."""
    try:
        _empty(nbytes)
    except torch.OutOfMemoryError as e:
        assert isinstance(e, RuntimeError) and len(e.args) == 1, f"args={e.args!r}"
        return e.args[0]
    raise AssertionError(f"allocating {nbytes} B under a {LIMIT} B limit did not raise")


def _settle() -> None:
    _native_limit()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def check_limit_comes_from_conf():
    assert device_allocator().limit_bytes == LIMIT


def check_oom_type_and_message():
    _settle()
    ooms0 = torch.cuda.memory_stats()["num_ooms"]
    messages = [_oom_message(n) for n in (LIMIT + GiB, PiB)]
    assert torch.cuda.memory_stats()["num_ooms"] == ooms0 + 2
    messages.append(_oom_message(1 << 62))  # more than any card: PyTorch says "more than 1EB"
    for m in messages:
        assert "CUDA out of memory." in m and any(c.isdigit() for c in m), m
    assert torch.ones(1000, device="cuda").sum().item() == 1000  # a kernel still runs
    return {"message": messages[0]}


def check_limit_is_enforced_and_reachable():
    _settle()
    chunk = 512 * MiB
    chunks = []
    try:
        while len(chunks) < 4 * LIMIT // chunk:
            chunks.append(cookie(_empty(chunk), len(chunks)))
    except torch.OutOfMemoryError:
        pass
    held = len(chunks) * chunk
    assert torch.cuda.memory_reserved() <= LIMIT, f"reserved {torch.cuda.memory_reserved()} > limit"
    assert held >= LIMIT - GiB, f"only {held} B fit under a {LIMIT} B limit"
    for i, c in enumerate(chunks):
        assert_cookie(c, i, f"chunk {i} after the OOM")
    chunks.clear()
    big = _empty(LIMIT - GiB)  # needs the cached chunks released: the OOM protocol's first stage
    del big
    return {"held_gib": held / GiB}


def check_retry_after_free():
    _settle()
    a = _empty(LIMIT // 2)
    _oom_message(LIMIT * 6 // 10)
    del a
    b = _empty(LIMIT * 6 // 10)
    del b


def check_record_stream_frees_are_reclaimed_on_oom():
    """PyTorch #19219: a block whose free waits on another stream's work is reclaimed (once that work
    is done) before an OOM is raised."""
    _settle()
    side = torch.cuda.Stream()
    x = _empty(LIMIT * 6 // 10)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        x.add_(1)
    x.record_stream(side)
    del x
    y = _empty(LIMIT * 6 // 10)  # fits only in x's memory, after the side stream's work
    del y


def check_find_executable_batch_size():
    """Accelerate's loop: catch the OOM, halve the batch, retry; then the found batch trains."""
    _settle()
    torch.manual_seed(0)
    width = 4096
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    witness = cookie(_empty(MiB), 11)

    def train_step(batch: int) -> float:
        x = torch.randn(batch, width, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    batch, tried = 1 << 17, []
    while batch:
        oom = False
        try:
            train_step(batch)
            break
        except RuntimeError as e:  # Accelerate's should_reduce_batch_size
            if not (len(e.args) == 1 and "CUDA out of memory." in e.args[0]):
                raise
            oom = True
        if oom:
            tried.append(batch)
            batch //= 2
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
    assert tried, "the first batch fit: the test did not exercise an OOM"
    assert batch > 0, "no batch size fits"
    losses = [train_step(batch) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert_cookie(witness, 11, "a tensor allocated before the OOMs")
    return {"tried": tried, "found": batch}


@isolated(conf=CONF + ",oom_snapshot:{tmp}/oom.pickle")
def check_oom_snapshot_written():
    device_allocator()  # skips in a native dry run
    path = Path(os.environ["SUPERMEM_TEST_TMP"]) / "oom.pickle"
    _oom_message(LIMIT + GiB)
    deadline = time.monotonic() + 10
    while not (path.exists() and path.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert path.exists() and path.stat().st_size > 0, f"no snapshot at {path} after an OOM"
    return {"bytes": path.stat().st_size, "files": sorted(p.name for p in path.parent.iterdir())}


def check_invariants_hold():
    device_allocator().check()


test_oom = check_tests(__name__, conf=CONF)
