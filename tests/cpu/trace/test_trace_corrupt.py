"""The corrupt-file lane: every truncation and single-bit flips of a real small .smtrace and of a real
small PyTorch snapshot pickle, each through report (analyze), export and replay.

A .smtrace carries a checksum, so each damaged copy must give a TraceFormatError naming the file, or
(where the damage cannot matter) the very result of the intact file. A snapshot pickle has no checksum:
a flipped digit is a different but well-formed snapshot, so there the rule is a TraceFormatError or a
result computed without any other exception. Memory stays bounded throughout (peak RSS growth).
"""

import copy
import json
import pickle
import random
import struct
import subprocess
import sys
import zlib

import pytest
from trace_workload import Workload, make_allocator

import supermem
from supermem import cli
from supermem.trace.analysis import analyze
from supermem.trace.loader import parse
from supermem.trace.replay import replay
from supermem.trace.report_html import render
from supermem.trace.torch_snapshot import to_torch_snapshot
from supermem.trace.validate import TraceFormatError

NAME = "lane-input"
CAPACITY_BYTES = 24 << 20  # below the run's peak: the replay evicts and restores
SEED = 8


def hwm_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def results(trace, html=False):
    rep = analyze(trace, width=50, max_blocks=20, source=NAME)
    out = (rep, to_torch_snapshot(trace), replay(trace, CAPACITY_BYTES, "lru").as_dict())
    return (*out, render(rep)) if html else out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lane")
    alloc = make_allocator()
    w = Workload(alloc, layers=3, seed=SEED)
    with supermem.trace(tmp / "run.smtrace", allocators=[alloc], model=w.model, optimizer=w.opt):
        w.run(2)
    smtrace = (tmp / "run.smtrace").read_bytes()
    snap = pickle.dumps(to_torch_snapshot(parse(smtrace, NAME)), protocol=4)
    (tmp / "run.pickle").write_bytes(snap)
    out = {"tmp": tmp}
    for kind, data in (("smtrace", smtrace), ("pickle", snap), ("pickle-repeated", repeated(snap))):
        out[kind] = (data, results(parse(data, NAME)))
    return out


def repeated(snap: bytes) -> bytes:
    """The snapshot with references repeated within its bound: its first two trace entries again after
    the rest, and one frames list, of three references to one frame dict, in every entry and block
    (what a flipped memo index makes, and more than PyTorch shares)."""
    obj = pickle.loads(snap)
    entries = obj["device_traces"][0]
    entries += [entries[0], entries[1]] * 20
    frames = [{"filename": "lane.py", "line": 7, "name": "step"}] * 3
    for item in [*entries, *(b for s in obj["segments"] for b in s["blocks"])]:
        item["frames"] = frames
    return pickle.dumps(obj, protocol=4)


def damaged(data: bytes, kind: str, flips: int):
    """(description, bytes): every truncation (a dense sample past 6000 bytes), then bit flips (all of
    them for a file under 8000 bytes, else a seeded sample of `flips`)."""
    stride = max(1, len(data) // 6000)
    for n in range(0, len(data), stride):
        yield f"{kind} cut at {n}", data[:n]
    bits = range(len(data) * 8)
    sample = bits if len(data) < 8000 and kind == "smtrace" else random.Random(SEED).sample(bits, flips)
    for bit in sample:
        b = bytearray(data)
        b[bit // 8] ^= 1 << (bit % 8)
        yield f"{kind} bit {bit}", bytes(b)


@pytest.mark.parametrize("kind, flips", [("smtrace", 3000), ("pickle", 4000), ("pickle-repeated", 2000)])
def test_damaged_files_give_a_clear_error_or_the_same_result(files, kind, flips):
    data, want = files[kind]
    start_kb = hwm_kb()
    errors = same = different = 0
    for what, bad in damaged(data, kind, flips):
        try:
            trace = parse(bad, NAME)
        except TraceFormatError as e:
            assert str(e).startswith(f"{NAME}: ") and "\n" not in str(e), (what, str(e))
            errors += 1
            continue
        got = results(trace)  # any exception here fails the test: it would be a traceback for users
        if got == want:
            same += 1
        else:
            assert kind != "smtrace", f"{what}: a damaged .smtrace was read with a different result"
            different += 1
    print(f"{kind}: {errors} clear errors, {same} same results, {different} different results")
    assert errors > 0 and hwm_kb() - start_kb < 256 << 10
    if kind == "smtrace":
        assert different == 0


def shared_entries_pickle(n: int) -> bytes:
    """n trace entries that are references to two dicts: about 2 bytes an entry."""
    frames = [{"filename": "train.py", "line": 1, "name": "step"}]
    a = {"action": "alloc", "addr": 1 << 20, "size": 512, "stream": 0, "time_us": 1, "frames": frames}
    f = {**a, "action": "free_completed", "time_us": 2}
    return pickle.dumps({"segments": [], "device_traces": [[a, f] * (n // 2)]}, protocol=4)


def shared_blocks_pickle(n: int) -> bytes:
    block = {"address": 0, "size": 512, "requested_size": 512, "state": "active_allocated", "frames": []}
    seg = {"address": 0, "total_size": 512 * n, "stream": 0, "blocks": [block] * n}
    return pickle.dumps({"segments": [seg], "device_traces": []}, protocol=4)


def shared_frames_pickle(n: int) -> bytes:
    """Entries of their own, each with a frames list of its own of n references to one frame dict."""
    f = {"filename": "train.py", "line": 1, "name": "step"}
    entries = [
        {"action": "alloc", "addr": i << 10, "size": 512, "stream": 0, "time_us": i, "frames": [f] * n}
        for i in range(8)
    ]
    return pickle.dumps({"segments": [], "device_traces": [entries]}, protocol=4)


@pytest.mark.parametrize(
    "make, words",
    [(shared_entries_pickle, "trace entries and blocks"), (shared_blocks_pickle, "trace entries and blocks")],
)
def test_a_pickle_of_repeated_references_is_refused_by_its_size(make, words, tmp_path, capsys):
    """600,000 events in 1.2 MB: refused before any work in proportion to them (before: ~185 bytes of
    memory to replay for each byte of the file, 1.1 GB for 6 MB)."""
    data = make(600_000)
    assert len(data) < 1_300_000
    start_kb = hwm_kb()
    with pytest.raises(TraceFormatError, match=f"{NAME}: .*{words}.*repeats references"):
        parse(data, NAME)
    p = tmp_path / "repeated.pickle"
    p.write_bytes(data)
    for argv in (
        ["replay", str(p), "--capacity", "1GiB"],
        ["report", str(p), "-o", str(tmp_path / "r.html")],
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "repeats references" in err, err
    assert hwm_kb() - start_kb < 128 << 10


def test_frames_repeated_within_the_bound_are_read_once_each():
    """Frames lists of references to one frame dict (PyTorch shares frame dicts among stacks): each
    list is read (2 bytes a reference in the file), each frame dict once."""
    trace = parse(shared_frames_pickle(100_000), NAME)
    assert len(trace.frames) == 1 and len(trace.stacks) == 1 and len(trace) == 8


def test_damaged_files_through_the_command_line(files, capsys):
    tmp = files["tmp"]
    for kind in ("smtrace", "pickle"):
        data, _ = files[kind]
        cases = {"cut": data[: len(data) // 2], "flip": data[:40] + bytes([data[40] ^ 0x10]) + data[41:]}
        for how, bad in cases.items():
            p = tmp / f"bad-{how}.{kind}"
            p.write_bytes(bad)
            for argv in (
                ["report", p, "-o", tmp / "out.html", "-q"],
                ["export", p, "-o", tmp / "out.pickle"],
                ["replay", p, "--capacity", "1GiB"],
            ):
                rc = cli.main([str(a) for a in argv])
                err = capsys.readouterr().err
                if kind == "pickle" and rc in (0, 1):  # a flip the pickle cannot tell from data
                    continue
                assert rc == 2 and err.startswith(f"supermem {argv[0]}: error: {p}: "), (argv, err)
                assert err.count("\n") == 1, err
    r = subprocess.run(
        [sys.executable, "-m", "supermem", "report", str(tmp / "bad-flip.smtrace")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "checksum" in r.stderr, r.stderr


# ---------------------------------------------------------------- crafted files (checksums right)

ODD_VALUES = [None, -1, 1 << 70, -(1 << 70), 1.5, float("nan"), True, "x", "", [], {}, [[]], {"a": 1}]


def leaves(obj, path=()):
    """Every path into nested dicts/lists (containers included)."""
    yield path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from leaves(v, (*path, k))


def replaced(obj, path, value):
    if not path:
        return value
    out = copy.copy(obj)
    out[path[0]] = replaced(obj[path[0]], path[1:], value)
    return out


def crafted_smtrace(header: dict, data: bytes, name: str | None, obj) -> bytes:
    """A format-2 file with `header` and, when `name` is given, JSON section `name` holding `obj`;
    every checksum and length recomputed, as someone crafting a file would."""
    header = copy.deepcopy(header)
    if name is not None:
        raw = json.dumps(obj).encode()
        packed = zlib.compress(raw)
        s = next(s for s in header["sections"] if s["name"] == name)
        s.update(offset=len(data), length=len(packed), raw_length=len(raw), crc32=zlib.crc32(raw))
        data = data + packed
    h = json.dumps(header).encode()
    prefix = b"\x89SMTRACE" + struct.pack("<HHIQ", 2, 0, len(h), len(data))
    return prefix + struct.pack("<I", zlib.crc32(data, zlib.crc32(h, zlib.crc32(prefix)))) + h + data


def test_crafted_smtrace_headers_and_sections(files):
    data, _ = files["smtrace"]
    hl = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[28 : 28 + hl])
    body = data[28 + hl :]
    trace = parse(data, NAME)
    blobs = {
        "strings": trace.strings,
        "frames": [list(f) for f in trace.frames] or [["f.py", 1, "g"]],
        "stacks": [list(s) for s in trace.stacks] or [[0]],
        "segments": [d["segments"] for d in trace.devices],
    }
    cases = [("header", p, v) for p in leaves(header) for v in ODD_VALUES]
    cases += [(n, p, v) for n, obj in blobs.items() for p in leaves(obj) for v in ODD_VALUES]

    accepted = 0
    for where, path, value in cases:
        if where == "header":
            bad = crafted_smtrace(replaced(header, path, value), body, None, None)
        else:
            bad = crafted_smtrace(header, body, where, replaced(blobs[where], path, value))
        try:
            t = parse(bad, NAME)
        except TraceFormatError as e:
            assert "\n" not in str(e) and str(e).startswith(NAME), (where, path, value, str(e))
            continue
        results(t, html=True)  # any exception here is a traceback a user would see
        accepted += 1
    assert accepted < len(cases)


def test_crafted_snapshots(files):
    data, _ = files["pickle"]
    snap = pickle.loads(data)
    from supermem.trace.torch_snapshot import from_torch_snapshot

    paths = list(leaves(snap))
    sample = random.Random(SEED).sample(paths, min(len(paths), 400))
    for path in sample:
        for value in ODD_VALUES:
            try:
                t = from_torch_snapshot(replaced(snap, path, value))
            except TraceFormatError as e:
                assert "\n" not in str(e), (path, value, str(e))
                continue
            results(t, html=True)
