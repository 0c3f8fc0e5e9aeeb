"""Tiny crafted files must not make the trace tools allocate much: a zlib bomb inside a .smtrace, JSON
that inflates into millions of objects, a pickle memo index of 2**26, a snapshot naming device 2**23,
and a never-ending file (/dev/zero). Each is loaded (and, if accepted, reported, exported and replayed)
in a child process whose peak RSS is measured (os.wait4) against a child that loads a good file."""

import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
from trace_workload import Workload, make_allocator

import supermem
from supermem.trace.loader import load
from supermem.trace.validate import TraceFormatError

CHILD = textwrap.dedent(
    """
    import sys
    from supermem.trace.analysis import analyze
    from supermem.trace.loader import load
    from supermem.trace.replay import replay
    from supermem.trace.report_html import render
    from supermem.trace.torch_snapshot import to_torch_snapshot
    from supermem.trace.validate import TraceFormatError

    def hwm_kb():  # this process's peak RSS (ru_maxrss would count the parent's, from before exec)
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    before = hwm_kb()
    try:
        t = load(sys.argv[1])
    except TraceFormatError as e:
        out = f"error: {e}"
    else:
        render(analyze(t)); to_torch_snapshot(t)  # the report at the CLI's default width
        if t.device_indices():
            replay(t, 1 << 34)
        out = "ok"
    print(hwm_kb() - before, out)
    """
)
ALLOWED_GROWTH_KB = 64 << 10


def measure(path, timeout_s=60):
    """(stdout, peak RSS growth in KiB) of a child that loads `path` (and uses it, if it loads)."""
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=timeout_s
    )
    assert r.returncode == 0, r.stderr[-3000:]
    growth, out = r.stdout.split(" ", 1)
    return out, int(growth)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds")
    alloc = make_allocator()
    w = Workload(alloc, layers=3, seed=2)
    with supermem.trace(tmp / "good.smtrace", allocators=[alloc], model=w.model, optimizer=w.opt):
        w.run(1)
    out, growth = measure(tmp / "good.smtrace")
    assert out.strip() == "ok" and growth < ALLOWED_GROWTH_KB, (out, growth)
    return {"path": tmp / "good.smtrace", "tmp": tmp}


def split(b: bytes):
    """(major, header dict, data) of a .smtrace file's bytes."""
    major, hl = struct.unpack_from("<H", b, 8)[0], struct.unpack_from("<I", b, 12)[0]
    base = 28 if major >= 2 else 24
    return major, json.loads(b[base : base + hl]), b[base + hl :]


def join(major: int, header: dict, data: bytes) -> bytes:
    """A file with a correct checksum: what someone crafting a file would write."""
    h = json.dumps(header).encode()
    prefix = b"\x89SMTRACE" + struct.pack("<HHIQ", major, 0, len(h), len(data))
    if major == 1:
        return prefix + h + data
    crc = zlib.crc32(data, zlib.crc32(h, zlib.crc32(prefix)))
    return prefix + struct.pack("<I", crc) + h + data


def deflate_of(chunk: bytes, total: int) -> bytes:
    z = zlib.compressobj(9)
    out = [z.compress(chunk * (total // len(chunk)))]
    return b"".join(out) + z.flush()


def with_section(good_bytes: bytes, major: int, name: str, packed: bytes, raw_length: int | None) -> bytes:
    _, header, data = split(good_bytes)
    s = next(s for s in header["sections"] if s["name"] == name)
    s.update(offset=len(data), length=len(packed))
    if raw_length is not None:
        s["raw_length"] = raw_length
    return join(major, header, data + packed)


def assert_bounded(path, expect="error:", allowed_kb=ALLOWED_GROWTH_KB):
    out, growth = measure(path)
    assert out.startswith(expect), out
    assert growth < allowed_kb, f"peak RSS grew by {growth} KiB loading {path.name}"


@pytest.mark.parametrize("major", [1, 2])
def test_zlib_bomb_is_not_inflated(good, major):
    # 256 MiB of JSON whitespace in a ~250 KiB section whose header keeps the honest raw length
    bomb = deflate_of(b" " * (1 << 20), 256 << 20)
    p = good["tmp"] / f"bomb{major}.smtrace"
    p.write_bytes(with_section(good["path"].read_bytes(), major, "strings", bomb, None))
    assert p.stat().st_size < 1 << 20
    assert_bounded(p)


@pytest.mark.parametrize("major", [1, 2])
def test_json_that_would_become_millions_of_objects_is_refused(good, major):
    raw = b"[" + b"[]," * (6 << 20) + b"[]]"  # 18 MiB of text, 6M lists: ~400 MiB of Python objects
    packed = zlib.compress(raw, 9)
    p = good["tmp"] / f"lists{major}.smtrace"
    p.write_bytes(with_section(good["path"].read_bytes(), major, "stacks", packed, len(raw)))
    crc_fixed = p.read_bytes()
    _, header, data = split(crc_fixed)
    next(s for s in header["sections"] if s["name"] == "stacks")["crc32"] = zlib.crc32(raw)
    p.write_bytes(join(major, header, data))
    assert_bounded(p)


def test_pickle_memo_index_does_not_size_a_table(good):
    p = good["tmp"] / "memo.pickle"
    p.write_bytes(b"\x80\x04N" + b"r" + struct.pack("<I", 1 << 26) + b".")  # LONG_BINPUT 2**26
    assert_bounded(p)


def test_snapshot_device_index_is_bounded(good):
    snap = {
        "segments": [{"device": 1 << 23, "address": 0, "total_size": 0, "blocks": []}],
        "device_traces": [],
    }
    p = good["tmp"] / "device.pickle"
    p.write_bytes(pickle.dumps(snap))
    assert_bounded(p)


def test_94_byte_pickle_naming_device_10_to_the_9_is_refused_at_load(tmp_path):
    snap = {"segments": [{"device": 10**9, "address": 0, "total_size": 0}], "device_traces": []}
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps(snap))
    assert p.stat().st_size < 120
    with pytest.raises(TraceFormatError, match="device"):
        load(p)


def test_devices_in_smtrace_headers_are_bounded(good, tmp_path):
    _, header, data = split(good["path"].read_bytes())
    header["devices"][0]["index"] = 10**9
    p = tmp_path / "d.smtrace"
    p.write_bytes(join(2, header, data))
    with pytest.raises(TraceFormatError, match="index"):
        load(p)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_a_never_ending_file_is_refused_without_reading_it(good):
    out, _ = measure("/dev/zero", timeout_s=20)
    assert out.startswith("error:") and "regular file" in out, out


def test_sniffing_reads_a_bounded_prefix(tmp_path, monkeypatch):
    p = tmp_path / "big.bin"
    p.write_bytes(b"\x00" * (1 << 20))
    with pytest.raises(TraceFormatError, match=r"big.bin: not a supermem trace"):
        load(p)
    msg = ""
    try:
        load(p)
    except TraceFormatError as e:
        msg = str(e)
    assert len(msg) < 1000  # the message quotes a few bytes, not the file


def test_pickle_loader_stays_plain_data_only(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    p = tmp_path / "evil.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Evil()]]}))
    with pytest.raises(TraceFormatError, match="plain data only"):
        load(p)


def test_many_devices_times_many_categories_stay_small_in_the_report(tmp_path):
    # 128 devices x 255 categories from 32,640 events (~250 KiB): a series per (device, category) of
    # 1000 points made 1.3 GiB of report; at most MAX_SERIES per device (128 x 10 x 1000 points) ~100 MiB.
    from supermem.trace import format as fmt
    from supermem.trace.table import ALLOC, Trace, empty_columns

    t = Trace()
    for i in range(255 - len(t.categories)):
        t.category_id(f"cat{i}")
    n = 128 * 255
    c = empty_columns(n)
    c["time_ns"] = np.arange(n, dtype=np.int64)
    c["action"][:] = ALLOC
    c["device"] = (np.arange(n) // 255).astype(np.int16)
    c["category"] = (np.arange(n) % 255).astype(np.uint8)
    c["address"] = np.arange(n, dtype=np.int64) * 4096 + 4096
    c["size"][:] = 4096
    t.cols = c
    p = tmp_path / "wide.smtrace"
    fmt.write(t, p)
    assert p.stat().st_size < 1 << 20
    assert_bounded(p, expect="ok", allowed_kb=192 << 10)


def test_categories_beyond_the_plotted_ones_are_summed_not_lost():
    from supermem.trace.analysis import MAX_SERIES, OTHER_CATEGORIES, analyze
    from supermem.trace.table import ALLOC, Trace, empty_columns

    t = Trace()
    names = [f"cat{i}" for i in range(3 * MAX_SERIES)]
    n = len(names)
    c = empty_columns(n)
    c["time_ns"] = np.arange(n, dtype=np.int64)
    c["action"][:] = ALLOC
    c["category"] = np.array([t.category_id(x) for x in names], np.uint8)
    c["address"] = np.arange(n, dtype=np.int64) * (1 << 20) + 4096
    c["size"] = (np.arange(n, dtype=np.int64) + 1) * 512  # cat{n-1} is the largest
    t.cols = c
    d = analyze(t, width=20).devices[0]
    assert len(d.by_category) == MAX_SERIES and OTHER_CATEGORIES in d.by_category
    assert f"cat{n - 1}" in d.by_category and "cat0" not in d.by_category
    total = [sum(v[i] for v in d.by_category.values()) for i in range(20)]
    assert total == d.active


def allocs_file(path, sizes):
    from supermem.trace import format as fmt
    from supermem.trace.table import ALLOC, Trace, empty_columns

    c = empty_columns(len(sizes))
    c["time_ns"] = np.arange(len(sizes), dtype=np.int64)
    c["action"][:] = ALLOC
    c["address"] = (np.arange(len(sizes), dtype=np.int64) + 1) << 51
    c["size"] = np.array(sizes, np.int64)
    fmt.write(Trace(cols=c), path)
    return path


def test_sizes_larger_than_any_device_are_refused(tmp_path):
    p = allocs_file(tmp_path / "huge.smtrace", [1 << 62, (1 << 63) - 1])  # their sum wraps int64
    with pytest.raises(TraceFormatError, match="size"):
        load(p)


def test_find_min_never_asks_for_an_impossible_device(tmp_path, capsys):
    from supermem import cli

    p = allocs_file(tmp_path / "wide.smtrace", [1 << 50] * 8192)  # 2**63 bytes live at the end
    assert cli.main(["replay", str(p), "--capacity", "1GiB", "--find-min"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("supermem replay: error:") and "no simulated device" in err, err
    assert cli.main(["replay", str(p), "--capacity", str((1 << 63) - 1)]) == 2
    assert "capacity must be in" in capsys.readouterr().err
