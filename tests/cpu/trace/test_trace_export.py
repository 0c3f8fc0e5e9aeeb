"""Export to PyTorch's snapshot pickle, checked with torch.cuda._memory_viz's own helpers, and import of
PyTorch snapshots."""

import base64
import copy
import json
import pickle
import pickletools
import re
import subprocess
import sys

import numpy as np
import pytest
import torch.cuda._memory_viz as mv
from trace_workload import Workload, make_allocator

import supermem
from supermem.trace.analysis import analyze
from supermem.trace.loader import load
from supermem.trace.replay import replay
from supermem.trace.timeline import lifetimes, series
from supermem.trace.torch_snapshot import from_torch_snapshot, to_torch_snapshot, write_torch_snapshot

# The opcodes MemoryViz.js's own unpickler handles (torch/utils/viz/MemoryViz.js, function unpickle);
# any other opcode makes pytorch.org/memory_viz fail to open the file.
MEMORY_VIZ_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "DICT", "LIST", "TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "NONE", "NEWTRUE", "NEWFALSE",
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "MEMOIZE",
    "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    alloc = make_allocator()
    w = Workload(alloc, layers=9)
    stream_block = None
    with supermem.trace(tmp / "run.smtrace", allocators=[alloc], model=w.model, optimizer=w.opt):
        w.run(2)
        stream_block = alloc.malloc(5 << 20, 7)  # a block on another stream, used by stream 9 too
        alloc.record_stream(stream_block, 9)
        alloc.free(stream_block)  # free_requested now, free_completed at the next malloc
        alloc.free(alloc.malloc(4096))
    tr = load(tmp / "run.smtrace")
    snap = to_torch_snapshot(tr)
    pk = tmp / "run.pickle"
    write_torch_snapshot(tr, pk)
    return {"w": w, "alloc": alloc, "trace": tr, "snap": snap, "pickle": pk, "tmp": tmp}


def test_pickle_uses_only_opcodes_memory_viz_reads(run):
    ops = {op.name for op, _, _ in pickletools.genops(run["pickle"].read_bytes())}
    assert ops <= MEMORY_VIZ_OPCODES, ops - MEMORY_VIZ_OPCODES


def test_segsum_accounts_for_every_byte(run):
    snap = pickle.loads(run["pickle"].read_bytes())
    text = mv.segsum(snap)  # raises if blocks do not tile their segments
    stats = run["alloc"].stats()
    assert f"total_reserved: {mv.Bytes(stats['reserved_bytes'])}" in text
    assert f"segments: {stats['segments']}" in text


def test_memory_viz_trace_lists_every_event(run):
    snap = run["snap"]
    text = mv.trace(snap)
    n = len(snap["device_traces"][0])
    assert f"{n} entries" in text
    tr = run["trace"]
    assert text.count("cudaMalloc(") == int((tr.cols["action"] == tr.actions.index("segment_alloc")).sum())
    assert text.count("raise OutOfMemoryError") == 0
    assert "'action': 'offload'" in text  # pool events are listed as they are


def test_flamegraphs_see_the_live_blocks(run):
    snap = run["snap"]
    lines = mv.memory(snap, format_flamegraph=lambda s: s)
    allocated = sum(int(x.rsplit(" ", 1)[1]) for x in lines.splitlines() if ";active_allocated;" in x)
    live = run["w"].live
    assert allocated == sum(run["alloc"].allocation_size(a) for a in live)  # requested == size here
    seg_lines = mv.segments(snap, format_flamegraph=lambda s: s)
    assert seg_lines.count("\n") >= len(live)


def test_trace_plot_embeds_a_loadable_snapshot(run):
    html = mv.trace_plot(copy.deepcopy(run["snap"]))
    files = json.loads(re.search(r"const local_files = (\[.*?\])\n", html).group(1))
    back = pickle.loads(base64.b64decode(files[0]["base64"]))
    assert back["device_traces"] == run["snap"]["device_traces"]
    filtered = mv.filter_alloc_free_pairs(copy.deepcopy(run["snap"]))
    allocs_left = [e for e in filtered["device_traces"][0] if e["action"] == "alloc"]
    tr = run["trace"]
    lt = lifetimes(tr, 0)
    still_live_in_window = int(((lt.start >= 0) & (lt.end < 0)).sum())
    assert len(allocs_left) == still_live_in_window


def test_categories_reach_the_viewer_and_unknown_is_among_them(run):
    entries = run["snap"]["device_traces"][0]
    cats = {e["category"] for e in entries if "category" in e}
    assert {"gradient", "optimizer_state", "activation", "unknown"} <= cats
    # MemoryViz.js crashes when categories are present without "unknown" (it misspells the fix-up)
    assert entries[-1] == {**entries[-1], "action": "snapshot", "category": "unknown"}


def test_stream_use_shows_as_pending_then_completed(run):
    entries = run["snap"]["device_traces"][0]
    acts = [(e["action"], e["time_us"]) for e in entries if e["size"] == 5 << 20 and e["action"] != "offload"]
    assert [a for a, _ in acts] == ["alloc", "free_requested", "free_completed"]
    assert acts[1][1] <= acts[2][1]  # requested, then completed (at the next malloc)


def test_every_free_is_requested_then_completed_as_pytorch_logs_it(run):
    entries = run["snap"]["device_traces"][0]
    open_requests = set()
    for e in entries:
        if e["action"] == "free_requested":
            open_requests.add(e["addr"])
        elif e["action"] == "free_completed":
            assert e["addr"] in open_requests
            open_requests.remove(e["addr"])


def test_command_line_memory_viz_opens_the_export(run):
    out = run["tmp"] / "plot.html"
    r = subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(run["pickle"]), "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "snapshot.pickle" in out.read_text()
    r = subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(run["pickle"])],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "total_reserved" in r.stdout, r.stderr


def test_round_trip_through_pytorch_format_keeps_memory_and_categories(run):
    tr = run["trace"]
    back = from_torch_snapshot(pickle.loads(run["pickle"].read_bytes()))
    for t in (tr, back):
        t.lt = lifetimes(t, 0)
        t.s = series(t, 0, t.lt)
    assert int(back.s.active.max()) == int(tr.s.active.max())
    assert int(back.s.reserved[-1]) == int(tr.s.reserved[-1])

    # the export adds free_requested before each lone free_completed (as PyTorch logs them): the same
    # memory curve, with repeated values where those were inserted
    def changes(a):
        return a[np.r_[True, a[1:] != a[:-1]]]

    np.testing.assert_array_equal(changes(back.s.active), changes(tr.s.active))
    cat = [tr.categories[c] for c in tr.lt.category]
    cat_back = [back.categories[c] for c in back.lt.category]
    # parameters live since before the trace have no alloc entry: their category travels on the blocks
    assert cat == cat_back


def pytorch_style_snapshot():
    """A snapshot shaped like torch.cuda.memory._snapshot() output, written from its documented schema:
    legacy 'history' blocks, expandable-segment map/unmap, frames, no time_us."""
    base = 0x7F0000000000
    frames = [{"filename": "train.py", "line": 42, "name": "forward"}]
    history = [{"real_size": 8 << 20, "frames": frames}]
    seg = {
        "device": 0, "address": base, "total_size": 20 << 20, "stream": 0, "segment_type": "large",
        "segment_pool_id": (0, 0), "allocated_size": 8 << 20, "active_size": 8 << 20,
        "blocks": [
            {"size": 8 << 20, "state": "active_allocated", "history": history},
            {"size": 12 << 20, "state": "inactive", "history": []},
        ],
    }  # fmt: skip

    def entry(action, addr, size, f=frames):
        return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": f}

    second = base + (8 << 20)
    tr = [
        entry("segment_map", base, 20 << 20, []),
        entry("alloc", base, 8 << 20),
        entry("alloc", second, 10 << 20),
        entry("free_requested", second, 10 << 20),
        entry("free_completed", second, 10 << 20),
        {"action": "oom", "size": 64 << 20, "stream": 0, "device_free": 1 << 20, "frames": []},
    ]
    return {"segments": [seg], "device_traces": [tr]}


def test_reads_pytorch_snapshots(tmp_path):
    p = tmp_path / "torch.pickle"
    p.write_bytes(pickle.dumps(pytorch_style_snapshot()))
    tr = load(p)
    assert tr.meta["time_is_index"]
    rep = analyze(tr)
    d = rep.devices[0]
    assert d.peak_bytes == 18 << 20
    assert d.peak_reserved_bytes == 20 << 20
    assert len(d.ooms) == 1 and d.ooms[0]["requested_bytes"] == 64 << 20
    assert ("train.py", 42, "forward") in tr.frames
    r = replay(tr, 32 << 20)
    assert r.num_ooms == 0 and r.peak_allocated_bytes == 18 << 20
    assert replay(tr, 12 << 20).num_ooms == 1  # the 18 MiB peak cannot fit in 12 MiB
