"""Recording a training-like run on a simulated device: events, categories, stacks, bounds, discovery."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from trace_workload import EXPECTED_CATEGORY, Workload, make_allocator, sim_tensor

import supermem
from supermem import events
from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.errors import UsageError
from supermem.trace import recorder
from supermem.trace.analysis import analyze
from supermem.trace.loader import load
from supermem.trace.table import ALLOC
from supermem.trace.timeline import lifetimes, series
from supermem.trace.torch_snapshot import to_torch_snapshot


@pytest.fixture
def traced(tmp_path):
    """A 3-step workload recorded with model and optimizer given, loaded back from its file."""
    alloc = make_allocator()
    path = tmp_path / "run.smtrace"
    # the model exists before recording: its parameters' allocs precede the trace
    w = Workload(alloc, layers=9)
    with supermem.trace(path, allocators=[alloc], model=w.model, optimizer=w.opt):
        w.run(3)
    return w, alloc, load(path)


def test_peak_and_final_state_match_an_independent_ledger(traced):
    w, alloc, tr = traced
    lt = lifetimes(tr, 0)
    s = series(tr, 0, lt)
    assert int(s.active.max()) == w.ledger.peak_live_bytes
    live_end = {a: v[0] for a, v in w.live.items()}  # what the workload still holds
    assert int(s.active[-1]) == sum(live_end.values())
    ends = lt.end < 0
    assert dict(zip(lt.address[ends].tolist(), lt.size[ends].tolist(), strict=True)) == live_end
    assert int(s.reserved[-1]) == alloc.stats()["reserved_bytes"]
    assert int(s.reserved.max()) == alloc.stats()["reserved_bytes_peak"]


def test_every_block_gets_the_category_of_its_role(traced):
    w, _, tr = traced
    lt = lifetimes(tr, 0)
    # parameters were allocated before the recording: no alloc event, they are live at its start
    pre = lt.start < 0
    params = {a for a, _, role in w.ledger.allocations if role == "parameter"}
    assert set(lt.address[pre].tolist()) == params
    assert {tr.categories[c] for c in lt.category[pre]} == {"parameter"}
    # the rest, in allocation order, line up one to one with the ledger
    started = np.flatnonzero(~pre)
    started = started[np.argsort(lt.start[started])]
    got = [(int(lt.address[i]), int(lt.size[i]), tr.categories[lt.category[i]]) for i in started]
    want = [(a, s, EXPECTED_CATEGORY[r]) for a, s, r in w.ledger.allocations if r != "parameter"]
    assert got == want


def test_pool_events_are_recorded_with_their_categories(traced):
    w, _, tr = traced
    offload = tr.actions.index("offload")
    prefetch = tr.actions.index("prefetch")
    n_off = int((tr.cols["action"] == offload).sum())
    n_pre = int((tr.cols["action"] == prefetch).sum())
    assert n_off + n_pre == w.ledger.pool_events + w.ledger.pushed_events
    from_events = (tr.cols["action"] == prefetch) | (
        (tr.cols["action"] == offload) & (tr.cols["detail"] >= 0)
    )
    assert int(from_events.sum()) == w.ledger.pool_events
    assert {tr.strings[d] for d in tr.cols["detail"][from_events]} == {"d2h", "h2d"}
    assert np.all(np.diff(tr.cols["time_ns"]) >= 0)  # ring and pool events merged on one clock


def test_gc_finds_models_and_optimizers_when_none_are_given(tmp_path):
    alloc = make_allocator()
    w = Workload(alloc, layers=6)
    with supermem.trace(tmp_path / "gc.smtrace", allocators=[alloc]):
        w.run(2)
    tr = load(tmp_path / "gc.smtrace")
    lt = lifetimes(tr, 0)
    cats = {tr.categories[c] for c in lt.category}
    assert {"parameter", "gradient", "optimizer_state", "activation"} <= cats


def test_ring_overflow_keeps_the_newest_events_and_rebuilds_the_start(tmp_path):
    alloc = make_allocator()
    w = Workload(alloc, layers=9)
    with supermem.trace(tmp_path / "small.smtrace", allocators=[alloc], capacity_events=100):
        w.run(4)
    tr = load(tmp_path / "small.smtrace")
    dropped = tr.meta["dropped_events"]["0"]
    assert dropped > 0
    from_ring = tr.cols["detail"] < 0  # pool events from supermem.events carry a detail here
    assert int(from_ring.sum()) <= 100
    assert tr.cols["time_ns"][~from_ring].min() >= tr.cols["time_ns"][from_ring].min()
    lt = lifetimes(tr, 0)
    s = series(tr, 0, lt)
    # Memory at the end is exact even though the start is gone, and never negative in between.
    assert int(s.active[-1]) == sum(v[0] for v in w.live.values())
    assert int(s.active.min()) >= 0 and int(s.reserved.min()) >= 0
    # Blocks freed in the window but allocated before it are known (from their free events).
    assert int((lt.start < 0).sum()) > len(w.model.weights)


def test_one_recording_at_a_time_and_rings_restored(tmp_path):
    alloc = make_allocator()
    assert alloc.trace_capacity == 0
    with supermem.trace(tmp_path / "a.smtrace", allocators=[alloc], capacity_events=1000):
        assert alloc.trace_capacity == 1000
        assert recorder.active() is not None
        with pytest.raises(UsageError, match="already recording"):
            supermem.trace(tmp_path / "b.smtrace", allocators=[alloc]).start()
    assert alloc.trace_capacity == 0 and recorder.active() is None


def test_the_trace_is_written_when_the_block_raises(tmp_path):
    alloc = make_allocator(limit="64MiB")
    path = tmp_path / "oom.smtrace"
    with pytest.raises(torch.OutOfMemoryError), supermem.trace(path, allocators=[alloc]):
        alloc.malloc(32 << 20)
        alloc.malloc(40 << 20)
    tr = load(path)
    assert int((tr.cols["action"] == tr.actions.index("oom")).sum()) == 1
    assert recorder.active() is None


def test_discovery_registry_and_device_allocator_hook(monkeypatch, tmp_path):
    a0, a1 = make_allocator(), make_allocator()
    monkeypatch.setattr(supermem, "has_cuda_build", True, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # supermem.device_allocator does not exist in this build: discovery must work without it
    assert not hasattr(supermem, "device_allocator") or True
    monkeypatch.delattr(supermem, "device_allocator", raising=False)
    assert recorder.discover_allocators() == []
    monkeypatch.setattr(supermem, "device_allocator", lambda i: a1 if i == 1 else None, raising=False)
    recorder.register_allocator(a0, device=0)
    try:
        assert recorder.discover_allocators() == [(0, a0), (1, a1)]
        with supermem.trace(tmp_path / "d.smtrace"):  # no allocators given: discovered
            a0.free(a0.malloc(1000))
            a1.free(a1.malloc(3000))
            late = make_allocator()
            recorder.register_allocator(late, device=0)  # filed under the next free index
            late.malloc(5000)
        tr = load(tmp_path / "d.smtrace")
        assert tr.device_indices() == [0, 1, 2]
        sizes = {
            d: set(tr.cols["size"][(tr.cols["device"] == d) & (tr.cols["action"] == ALLOC)].tolist())
            for d in (0, 1, 2)
        }
        assert sizes == {0: {1024}, 1: {3072}, 2: {5120}}
        rep = analyze(tr)
        assert [(d.device, d.peak_bytes) for d in rep.devices] == [(0, 1024), (1, 3072), (2, 5120)]
        snap = to_torch_snapshot(tr)
        assert len(snap["device_traces"]) == 3 and {s["device"] for s in snap["segments"]} == {0, 1, 2}
    finally:
        recorder.unregister_allocator(a0)
        recorder.unregister_allocator(late)


def test_stacks_name_the_python_line_that_made_a_tensor(tmp_path):
    alloc = make_allocator()
    x = torch.ones(256)
    with supermem.trace(tmp_path / "s.smtrace", allocators=[alloc], stacks=True, model=[], optimizer=[]):
        out, addr = sim_tensor(alloc, 256)  # a block of the simulated device...
        torch.add(x, x, out=out)  # ...written by an op: the op's output is that block
        line = __import__("inspect").currentframe().f_lineno - 1
        t2 = torch.mul(x, 3)  # an ordinary CPU tensor: not a block of the allocator, not attributed
        del t2
    tr = load(tmp_path / "s.smtrace")
    lt = lifetimes(tr, 0)
    i = int(np.flatnonzero(lt.address == addr)[0])
    frames = tr.stack_frames(int(lt.stack[i]))
    assert frames[0] == ("<op>", 0, "aten.add.out")
    assert (__file__, line, "test_stacks_name_the_python_line_that_made_a_tensor") in frames
    assert not any("supermem/trace" in f[0] or "/torch/" in f[0] for f in frames[1:])


def test_events_subscription_is_removed_after_the_recording(tmp_path):
    alloc = make_allocator()
    with supermem.trace(tmp_path / "x.smtrace", allocators=[alloc]):
        assert events.enabled()
    assert not events.enabled()


def test_importing_supermem_does_not_load_the_trace_tool():
    code = (
        "import sys, supermem;"
        "assert 'supermem.trace' not in sys.modules and 'supermem.control' not in sys.modules;"
        "r = supermem.trace('x.smtrace'); assert type(r).__name__ == 'Recorder' and r.path == 'x.smtrace';"
        "print(callable(supermem.trace), supermem.trace.record is not None)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True"], r.stderr


def test_a_recording_without_events_still_lists_the_live_blocks(tmp_path):
    """Parameters allocated before the recording and no event during it: the trace is the final
    state, with the parameters attributed."""
    alloc = make_allocator()
    w = Workload(alloc, layers=3)
    with supermem.trace(tmp_path / "quiet.smtrace", allocators=[alloc], model=w.model, optimizer=w.opt):
        pass
    lt = lifetimes(load(tmp_path / "quiet.smtrace"), 0)
    params = {p.untyped_storage().data_ptr() for p in w.model.parameters()}
    assert params <= set(lt.address.tolist())


def test_discovered_allocators_are_attached_once(tmp_path, monkeypatch):
    """The same allocator found twice (two wrappers of one C++ object) is one source, not two."""
    alloc = CachingAllocator(SimulatedDevice("64MiB"))
    twin = CachingAllocator.wrap(alloc._impl)
    monkeypatch.setattr(supermem.trace.recorder, "discover_allocators", lambda: [(0, alloc), (0, twin)])
    rec = supermem.trace(tmp_path / "once.smtrace", model=[], optimizer=[])
    with rec:
        alloc.free(alloc.malloc(4096))
    assert rec.status()["devices"] == [0]
