"""The .smtrace file: round trips, size, and clear errors on bad, truncated, foreign and newer files."""

import pickle
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supermem import cli
from supermem.allocator import TRACE_ACTIONS
from supermem.events import CATEGORIES
from supermem.trace import format as fmt
from supermem.trace.format import TraceFormatError
from supermem.trace.loader import load
from supermem.trace.table import ALLOCATOR_ACTIONS, COLUMNS, Trace, empty_columns


def random_trace(n: int, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    cols = empty_columns(n)
    cols["time_ns"] = np.sort(rng.integers(0, 10**15, n))
    cols["action"] = rng.integers(0, len(ALLOCATOR_ACTIONS), n).astype(np.uint8)
    cols["device"] = rng.integers(-1, 4, n).astype(np.int16)
    cols["address"] = rng.integers(0, 2**62, n)
    cols["size"] = rng.integers(0, 2**40, n)
    cols["stream"] = rng.integers(0, 2**48, n)
    cols["tag"] = rng.integers(0, 2**62, n)
    cols["category"] = rng.integers(0, len(CATEGORIES), n).astype(np.uint8)
    cols["stack"] = rng.integers(-1, 3, n).astype(np.int32)
    cols["detail"] = rng.integers(-1, 2, n).astype(np.int32)
    t = Trace(cols=cols)
    t.strings = ["d2h 12.5 GB/s", "ünïcode ✓"]
    t.frames = [("train.py", 10, "forward"), ("model.py", 3, "__call__")]
    t.stacks = [(0,), (1, 0), ()]
    seg = {
        "address": 4096,
        "total_size": 2 << 20,
        "stream": 0,
        "segment_type": "small",
        "segment_pool_id": [0, 0],
        "blocks": [
            {
                "address": 4096,
                "size": 2 << 20,
                "requested_size": 7,
                "state": "active_allocated",
                "category": "activation",
            }
        ],
    }
    t.devices = [
        {
            "index": 0,
            "name": "sim",
            "total_bytes": 1 << 34,
            "limit_bytes": 0,
            "segments": [seg],
            "stats": {"num_ooms": 1},
        }
    ]
    t.meta = {"pid": 1, "argv": ["x"], "dropped_events": {"0": 3}}
    return t


def assert_same(a: Trace, b: Trace) -> None:
    for name in COLUMNS:
        np.testing.assert_array_equal(a.cols[name], b.cols[name], err_msg=name)
        assert a.cols[name].dtype == b.cols[name].dtype
    assert a.actions == b.actions
    assert a.categories == b.categories
    assert a.strings == b.strings
    assert a.frames == b.frames
    assert a.stacks == b.stacks
    assert a.devices == b.devices
    assert a.meta == b.meta


def test_allocator_kinds_are_known():
    # The recorder maps the ring's kind names onto this table; a new C++ kind must be added here.
    assert list(TRACE_ACTIONS) == list(ALLOCATOR_ACTIONS)


def test_round_trip(tmp_path):
    t = random_trace(5000, 1)
    p = tmp_path / "r.smtrace"
    fmt.write(t, p)
    assert_same(t, fmt.read(p))
    assert [x.name for x in tmp_path.iterdir()] == ["r.smtrace"]  # the temporary file was renamed away


def test_empty_round_trip(tmp_path):
    t = Trace()
    fmt.write(t, tmp_path / "e.smtrace")
    back = fmt.read(tmp_path / "e.smtrace")
    assert len(back) == 0 and back.devices == []


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**31))
def test_round_trip_property(tmp_path_factory, n, seed):
    p = tmp_path_factory.mktemp("h") / "t.smtrace"
    t = random_trace(n, seed)
    fmt.write(t, p)
    assert_same(t, fmt.read(p))


def test_actions_are_remapped_when_a_file_orders_them_differently(tmp_path):
    t = random_trace(100, 2)
    names = [t.actions[a] for a in t.cols["action"]]
    t.actions = list(reversed(t.actions))  # a file written by a version with another order
    t.cols["action"] = np.array([t.actions.index(n) for n in names], np.uint8)
    fmt.write(t, tmp_path / "o.smtrace")
    back = fmt.read(tmp_path / "o.smtrace")
    assert back.actions[: len(ALLOCATOR_ACTIONS)] == list(ALLOCATOR_ACTIONS)
    assert [back.actions[a] for a in back.cols["action"]] == names


def with_crc(b: bytes) -> bytes:
    """A format-2 file's bytes with their checksum recomputed (what a crafted file would have)."""
    crc = zlib.crc32(b[28:], zlib.crc32(b[:24]))
    return bytes(b[:24]) + struct.pack("<I", crc) + bytes(b[28:])


def as_format_1(b: bytes) -> bytes:
    """The same trace as supermem 0.1 wrote it: major 1, no checksum field."""
    return bytes(b[:8]) + struct.pack("<H", 1) + bytes(b[10:24]) + bytes(b[28:])


def test_format_1_files_are_still_read(tmp_path):
    t = random_trace(300, 5)
    fmt.write(t, tmp_path / "t.smtrace")
    old = tmp_path / "old.smtrace"
    old.write_bytes(as_format_1((tmp_path / "t.smtrace").read_bytes()))
    assert_same(t, fmt.read(old))


def write_good(tmp_path):
    p = tmp_path / "good.smtrace"
    fmt.write(random_trace(2000, 3), p)
    return p, p.read_bytes()


@pytest.mark.parametrize(
    "case, expect",
    [
        ("empty", "empty"),
        ("text", "not a supermem trace"),
        ("pickle", "pickle"),
        ("truncated", "truncated"),
        ("corrupt", "corrupt"),
        ("newer", "newer supermem"),
        ("header", "corrupt header"),
        ("checksum", "checksum mismatch"),
        ("trailing", "after the end"),
        ("zero", "unknown trace format 0"),
    ],
)
def test_bad_files_give_clear_errors(tmp_path, case, expect):
    p, good = write_good(tmp_path)
    bad = tmp_path / "bad.smtrace"
    if case == "empty":
        bad.write_bytes(b"")
    elif case == "text":
        bad.write_text("hello, this is a text file\n")
    elif case == "pickle":
        bad.write_bytes(pickle.dumps({"segments": []}))
    elif case == "truncated":
        bad.write_bytes(good[: len(good) - 100])
    elif case == "corrupt":
        b = bytearray(good)
        b[-50] ^= 0xFF  # inside the last section
        bad.write_bytes(bytes(b))
    elif case == "newer":
        b = bytearray(good)
        b[8:10] = struct.pack("<H", fmt.MAJOR + 1)
        bad.write_bytes(bytes(b))
    elif case == "header":  # a crafted file: its checksum is right
        b = bytearray(good)
        b[28] = ord("x")  # the header's opening brace
        bad.write_bytes(with_crc(b))
    elif case == "checksum":
        b = bytearray(good)
        b[40] ^= 0x04  # one bit of the header's JSON
        bad.write_bytes(bytes(b))
    elif case == "trailing":
        bad.write_bytes(good + b"\0")
    elif case == "zero":
        b = bytearray(good)
        b[8:10] = struct.pack("<H", 0)
        bad.write_bytes(bytes(b))
    with pytest.raises(TraceFormatError, match=expect):
        fmt.read(bad)


def test_load_tells_files_apart_by_content(tmp_path):
    p, _ = write_good(tmp_path)
    renamed = tmp_path / "trace.pickle"
    renamed.write_bytes(p.read_bytes())
    assert len(load(renamed)) == 2000
    junk = tmp_path / "junk.smtrace"
    junk.write_bytes(b"\x00\x01garbage")
    with pytest.raises(TraceFormatError, match="not a supermem trace .* or a PyTorch memory snapshot"):
        load(junk)
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.smtrace")
    with pytest.raises(TraceFormatError, match="directory"):
        load(tmp_path)


def test_malicious_pickle_is_refused_without_running_it(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    p = tmp_path / "evil.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Evil()]]}))
    with pytest.raises(TraceFormatError, match="plain data only"):
        load(p)


@pytest.mark.parametrize("content", [b"", b"not a trace at all", None])
def test_cli_reports_bad_files_without_a_traceback(tmp_path, capsys, content):
    p = tmp_path / "bad.smtrace"
    if content is not None:
        p.write_bytes(content)
    for cmd in (["report", str(p)], ["replay", str(p), "--capacity", "1GiB"], ["export", str(p)]):
        assert cli.main(cmd) == 2, cmd  # an exception here would be the traceback users must not see
        err = capsys.readouterr().err
        assert err.startswith(f"supermem {cmd[0]}: error:") and "bad.smtrace" in err, err


def test_cli_error_path_in_a_real_process(tmp_path):
    p = tmp_path / "bad.smtrace"
    p.write_text("text")
    r = subprocess.run([sys.executable, "-m", "supermem", "report", str(p)], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "not a supermem trace" in r.stderr


def test_json_sections_that_compress_too_well_are_stored_and_still_read(tmp_path):
    # The reader refuses JSON that inflates more than JSON_MAX_RATIO:1 (a bomb of Python objects); the
    # writer stores such a section uncompressed, so every file it writes reads back.
    t = random_trace(10, 4)
    t.strings = ["the same long string " * 5] * 20000 + t.strings
    t.frames = [("train.py", 1, "f")] * 20000 + t.frames
    p = tmp_path / "z.smtrace"
    fmt.write(t, p)
    back = fmt.read(p)
    assert back.strings == t.strings and back.frames == t.frames
    assert p.stat().st_size > 20000 * len(t.strings[0]) // fmt.JSON_MAX_RATIO
