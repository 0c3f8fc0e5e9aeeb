"""Recording a training-like run on a simulated device: events, categories, stacks, bounds, discovery."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from trace_workload import EXPECTED_CATEGORY, Workload, make_allocator, sim_tensor

import supermem
from supermem import events, registry
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


class SimPlugin:
    """A registry.DeviceSource that behaves like the PyTorch plug-in: a device's allocator is made at
    its first allocation, with the trace ring configured at that moment."""

    def __init__(self):
        self.ring_events = 0
        self.made: dict[int, CachingAllocator] = {}

    def devices(self):
        return sorted(self.made)

    def allocator(self, device):
        a = self.made.get(device)
        return None if a is None else CachingAllocator.wrap(a._impl)  # a new wrapper, as activate's

    def set_new_ring_events(self, n):
        self.ring_events = n

    def malloc(self, device, nbytes):
        if device not in self.made:
            self.made[device] = CachingAllocator(SimulatedDevice("64MiB"), trace_capacity=self.ring_events)
        return self.made[device].malloc(nbytes)

    def free(self, device, address):
        self.made[device].free(address)


@pytest.fixture
def plugin():
    p = SimPlugin()
    registry.set_device_source(p, ring_events=16)  # as with the option trace:16
    yield p
    registry.set_device_source(None)


def alloc_sizes(tr, device):
    return sorted(tr.cols["size"][(tr.cols["device"] == device) & (tr.cols["action"] == ALLOC)].tolist())


def test_discovery_lists_registered_then_device_allocators(plugin):
    assert recorder.discover_allocators() == []
    a0 = make_allocator()
    recorder.register_allocator(a0, device=0)
    try:
        assert recorder.discover_allocators() == [(0, a0)]
        plugin.malloc(1, 512)
        found = recorder.discover_allocators()
        assert [d for d, _ in found] == [0, 1] and found[1][1]._impl is plugin.made[1]._impl
        assert supermem.device_allocator(1) is found[1][1]  # one wrapper per device, every time
        assert supermem.device_allocator(2) is None
    finally:
        recorder.unregister_allocator(a0)
    assert [d for d, _ in recorder.discover_allocators()] == [1]


def test_a_known_device_allocator_is_returned_without_asking_the_plugin(plugin, monkeypatch):
    """The pool's budget check asks for its device's allocator on every saved tensor: once known, no
    call into the plug-in (its device list) is needed. New devices are found by the next allocators()."""
    plugin.malloc(0, 512)
    first = supermem.device_allocator(0)
    asked = []
    monkeypatch.setattr(plugin, "devices", lambda: asked.append(1) or sorted(plugin.made))
    for _ in range(3):
        assert supermem.device_allocator(0) is first
    assert asked == []
    plugin.malloc(1, 512)
    assert supermem.device_allocator(1) is not None and asked  # unknown: the plug-in is asked


def test_device_allocators_made_after_the_recording_starts_are_recorded(plugin, tmp_path):
    """`supermem trace -- python train.py`: the recording starts before the first CUDA tensor, so
    every device allocator is made during it (issue 8.2: they recorded nothing)."""
    plugin.malloc(0, 1000)  # device 0 is in use before; device 1 is first used during the recording
    with supermem.trace(tmp_path / "late.smtrace", model=[], optimizer=[]) as rec:
        for n in range(1, 41):  # more events than the options' ring (16) holds
            plugin.free(0, plugin.malloc(0, 512 * n))
            plugin.free(1, plugin.malloc(1, 512 * n))
        assert rec.status()["devices"] == [0, 1]
    tr = load(tmp_path / "late.smtrace")
    assert alloc_sizes(tr, 0) == [512 * n for n in range(1, 41)]
    assert alloc_sizes(tr, 1) == [512 * n for n in range(1, 41)]
    assert tr.meta["dropped_events"] == {"0": 0, "1": 0}
    # afterwards: rings back to the options' size, and allocators made later get that size too
    assert [plugin.made[d].trace_capacity for d in (0, 1)] == [16, 16]
    plugin.malloc(2, 512)
    assert plugin.made[2].trace_capacity == 16


def test_an_allocator_registered_during_the_recording_joins_it_without_its_past(tmp_path):
    with_past = CachingAllocator(SimulatedDevice("64MiB"), trace_capacity=1000)
    with_past.free(with_past.malloc(1000))  # before the recording: not part of it
    a0 = make_allocator()
    with supermem.trace(tmp_path / "d.smtrace", allocators=None, model=[], optimizer=[]):
        recorder.register_allocator(a0, device=0)
        a0.free(a0.malloc(1000))
        recorder.register_allocator(with_past, device=0)  # filed under the next free index
        with_past.free(with_past.malloc(3000))
        late = make_allocator()  # a ring of 0: sized by the recording when registered
        recorder.register_allocator(late, device=0)
        late.malloc(5000)
    for a in (a0, with_past, late):
        recorder.unregister_allocator(a)
    tr = load(tmp_path / "d.smtrace")
    assert tr.device_indices() == [0, 1, 2]
    assert [alloc_sizes(tr, d) for d in (0, 1, 2)] == [[1024], [3072], [5120]]
    assert with_past.trace_capacity == 1000 and late.trace_capacity == 0
    rep = analyze(tr)
    assert [(d.device, d.peak_bytes) for d in rep.devices] == [(0, 1024), (1, 3072), (2, 5120)]
    snap = to_torch_snapshot(tr)
    assert len(snap["device_traces"]) == 3 and {s["device"] for s in snap["segments"]} == {0, 1, 2}


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
    monkeypatch.setattr(registry, "allocators", lambda: [(0, alloc), (0, twin)])
    rec = supermem.trace(tmp_path / "once.smtrace", model=[], optimizer=[])
    with rec:
        alloc.free(alloc.malloc(4096))
    assert rec.status()["devices"] == [0]


def test_a_pool_for_every_backward_sees_the_recorded_steps_saves(tmp_path):
    """The recorder's activation hook is pushed after the pool's process-wide hooks (SUPERMEM_CONF=pool:
    installs them at import): it must not shadow them, or the first backwards run without the pool."""
    code = f"""
import torch
from supermem import process_hooks
from supermem.trace import recorder
packed = []
class Pool:
    def pack(self, t):
        packed.append(t.shape)
        return t
    def unpack(self, t):
        return t
process_hooks.push(Pool)
rec = recorder.Recorder(capacity_events=1000).start()
lin = torch.nn.Linear(8, 8)
lin(torch.randn(4, 8)).relu().sum().backward()
rec.stop({str(tmp_path / "t.smtrace")!r})
print("packed", len(packed))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "packed 0" not in r.stdout and "packed" in r.stdout, r.stdout
