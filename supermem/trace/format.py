"""The .smtrace file: a versioned, checksummed header, then zlib-compressed sections.

Layout (little-endian), format 2:
    0   8 bytes   magic b"\\x89SMTRACE" (the high byte catches 7-bit and text-mode damage)
    8   u16       format major version (a reader refuses a newer major)
    10  u16       format minor version (additions a reader may ignore)
    12  u32       header length H
    16  u64       data length D (bytes after the header; the file is exactly 28+H+D bytes)
    24  u32       crc32 of bytes 0..24, the header and the data: any damage after writing is caught
                  before anything is parsed
    28  H bytes   header: UTF-8 JSON {meta, actions, categories, devices, num_events, sections}
    28+H D bytes  sections, each zlib of its bytes; the header gives each one's offset, compressed
                  length, raw length, crc32 of the raw bytes, dtype and encoding.
Format 1 (supermem 0.1) is the same without the u32 at 24: it is still read, with every check but the
file checksum.

Sections: one per event column (time_ns stored as deltas: they compress ~5x better), and JSON for
strings, frames, stacks and the per-device segment snapshots. 10^6 events write in about a second
and take ~10-20 bytes each on disk.

Reading never allocates more than the file can hold: each section's raw length is checked against
zlib's largest expansion (1032:1) before it is inflated, and inflating stops at that length; JSON
sections may expand at most 64:1 (the writer stores a section uncompressed rather than exceed that),
because their Python objects take ~20 times their text. Everything read is then checked
(validate.check_trace), so a damaged or crafted file gives one TraceFormatError naming the file.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from . import validate
from .output import atomic_output
from .table import ALLOCATOR_ACTIONS, COLUMNS, Trace
from .validate import TraceFormatError  # noqa: F401  (supermem.trace.format.TraceFormatError)

MAGIC = b"\x89SMTRACE"
MAJOR, MINOR = 2, 0
_PREFIX = struct.Struct("<8sHHIQ")  # both formats start so
_CRC = struct.Struct("<I")
_PICKLE_PROTOCOL_BYTE = 0x80
DEFLATE_MAX_RATIO = 1032  # zlib cannot expand more: ~1032:1 plus a few bytes
JSON_MAX_RATIO = 64
_JSON_SECTIONS = ("strings", "frames", "stacks", "segments")


def _pack(name: str, raw: bytes) -> tuple[bytes, int, int]:
    packed = zlib.compress(raw, 1)
    if name in _JSON_SECTIONS and len(raw) > JSON_MAX_RATIO * len(packed):
        packed = zlib.compress(raw, 0)  # stored: a reader would refuse the expansion
    return packed, len(raw), zlib.crc32(raw)


def write(trace: Trace, path: str | os.PathLike) -> int:
    """Writes `trace` to `path` atomically (a temporary file, then rename). Returns bytes written."""
    sections: list[tuple[str, bytes, dict[str, Any]]] = []
    for name, dtype in COLUMNS.items():
        col: np.ndarray = np.ascontiguousarray(trace.cols[name], dtype=dtype)
        encoding = "raw"
        if name == "time_ns" and len(col):
            col = np.diff(col, prepend=np.int64(0))  # first value absolute, then deltas
            encoding = "delta"
        sections.append((name, col.tobytes(), {"dtype": np.dtype(dtype).str, "encoding": encoding}))
    devices = [{k: x for k, x in d.items() if k != "segments"} for d in trace.devices]
    blobs = {
        "strings": trace.strings,
        "frames": [list(f) for f in trace.frames],
        "stacks": [list(s) for s in trace.stacks],
        "segments": [d.get("segments", []) for d in trace.devices],
    }
    for name, obj in blobs.items():
        sections.append((name, json.dumps(obj, separators=(",", ":")).encode(), {"encoding": "json"}))

    body: list[bytes] = []
    table = []
    offset = 0
    for name, raw, info in sections:
        packed, raw_len, crc = _pack(name, raw)
        entry = {"name": name, "offset": offset, "length": len(packed), "raw_length": raw_len, "crc32": crc}
        table.append({**entry, **info})
        body.append(packed)
        offset += len(packed)
    header = json.dumps(
        {
            "format": "supermem-trace",
            "meta": trace.meta,
            "actions": trace.actions,
            "categories": trace.categories,
            "devices": devices,
            "num_events": len(trace),
            "sections": table,
        },
        separators=(",", ":"),
        default=_json_default,
    ).encode()
    prefix = _PREFIX.pack(MAGIC, MAJOR, MINOR, len(header), offset)
    crc = zlib.crc32(header, zlib.crc32(prefix))
    for b in body:
        crc = zlib.crc32(b, crc)
    with atomic_output(path) as f:
        f.write(prefix + _CRC.pack(crc))
        f.write(header)
        for b in body:
            f.write(b)
    return _PREFIX.size + _CRC.size + len(header) + offset


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, (tuple, set)):
        return list(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def read_input(path: str | os.PathLike) -> bytes:
    """The bytes of a trace file. Only regular files: a device or pipe (/dev/zero) may never end.
    Raises FileNotFoundError, or TraceFormatError naming the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise TraceFormatError(f"{path}: not a regular file (a device, pipe or socket)")
            return f.read(st.st_size)  # what it held when opened: a growing file cannot run on
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise TraceFormatError(f"{path} is a directory, not a trace file") from None
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot be read ({e.strerror or e})") from None


def kind_of(head: bytes) -> str:
    """ "smtrace", "pickle" or "unknown", from a file's first bytes."""
    if head[: len(MAGIC)] == MAGIC:
        return "smtrace"
    if head[:1] == bytes([_PICKLE_PROTOCOL_BYTE]):
        return "pickle"
    return "unknown"


def read(path: str | os.PathLike) -> Trace:
    """Loads a .smtrace file. Raises TraceFormatError with what is wrong and what to do."""
    return parse(read_input(path), str(path))


def parse(data: bytes, name: str = "trace") -> Trace:
    """A Trace from the bytes of a .smtrace file; `name` (the file) starts every error message."""
    try:
        return _parse(data)
    except TraceFormatError as e:
        raise TraceFormatError(f"{name}: {e}") from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as e:
        # validate.py should have caught it first: still one line naming the file, not a traceback
        raise TraceFormatError(f"{name}: corrupt ({type(e).__name__}: {e})") from None


def _parse(data: bytes) -> Trace:
    if len(data) < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
        pickle = data[:1] == b"\x80"
        kind = (
            "empty"
            if not data
            else "a pickle (a PyTorch memory snapshot?)"
            if pickle
            else "not a supermem trace"
        )
        raise TraceFormatError(
            f"{kind}: a .smtrace file starts with {MAGIC!r}, this one with {data[:8]!r}"
            + (" (supermem replay/report read PyTorch snapshot pickles too)" if pickle else "")
        )
    if len(data) < _PREFIX.size:
        raise TraceFormatError(f"truncated: {len(data)} bytes, not even the fixed header")
    _, major, minor, header_len, data_len = _PREFIX.unpack_from(data)
    if major > MAJOR:
        raise TraceFormatError(
            f"written by a newer supermem (trace format {major}.{minor}); this one reads formats 1 to "
            f"{MAJOR}: upgrade supermem"
        )
    if major not in (1, 2):
        raise TraceFormatError(f"corrupt: unknown trace format {major}.{minor}")
    base = _PREFIX.size + (_CRC.size if major >= 2 else 0)
    want = base + header_len + data_len
    if len(data) < want:
        raise TraceFormatError(
            f"truncated: the header promises {want} bytes, the file has {len(data)} "
            "(was the writer killed or the copy cut short?)"
        )
    if len(data) > want:
        raise TraceFormatError(f"corrupt: {len(data) - want} bytes after the end the header gives")
    if major >= 2:
        (crc,) = _CRC.unpack_from(data, _PREFIX.size)
        if zlib.crc32(memoryview(data)[base:], zlib.crc32(memoryview(data)[: _PREFIX.size])) != crc:
            raise TraceFormatError("corrupt: checksum mismatch (the file changed after it was written)")
    try:
        header = json.loads(data[base : base + header_len])
    except (ValueError, RecursionError) as e:
        raise TraceFormatError(f"corrupt header ({type(e).__name__}: {e})") from None
    validate.need(type(header) is dict and header.get("format") == "supermem-trace", "corrupt header")
    n = validate.int_field(header, "num_events", "header", 0)
    sections = _section_table(header.get("sections"), data_len)
    body = memoryview(data)[base + header_len :]

    def section(name: str) -> bytes:
        s = sections.get(name)
        validate.need(s is not None, f"section {name!r} is missing")
        assert s is not None
        return _inflate(name, body[s["offset"] : s["offset"] + s["length"]], s)

    cols = {}
    for name, dtype in COLUMNS.items():
        s = sections.get(name)
        validate.need(s is not None, f"column {name!r} is missing")
        assert s is not None
        dt = np.dtype(dtype)
        validate.need(
            s.get("dtype") == dt.str, f"column {name!r}: dtype {s.get('dtype')!r}, expected {dt.str!r}"
        )
        validate.need(s["raw_length"] == n * dt.itemsize, f"column {name!r} does not hold {n} events")
        col = np.frombuffer(section(name), dtype=dt).copy()
        encoding = s.get("encoding")
        validate.need(encoding in ("raw", "delta"), f"column {name!r}: unknown encoding {encoding!r}")
        if encoding == "delta":
            validate.need(n == 0 or bool(np.all(col[1:] >= 0)), "event times are not in order")
            col = np.cumsum(col, dtype=np.int64)  # a wrapped sum would show as times out of order
        cols[name] = col
    blobs = {}
    for name in _JSON_SECTIONS:
        validate.need(sections.get(name, {}).get("encoding") == "json", f"section {name!r} is not JSON")
        try:
            blobs[name] = json.loads(section(name))
        except (ValueError, RecursionError) as e:
            raise TraceFormatError(f"section {name!r} is corrupt ({type(e).__name__})") from None
    trace = Trace(cols=cols)
    trace.actions = validate.names(header.get("actions"), "actions")
    trace.categories = validate.names(header.get("categories"), "categories")
    trace.strings = validate.strings(blobs["strings"])
    trace.frames = validate.frames(blobs["frames"])
    trace.stacks = validate.stacks(blobs["stacks"], len(trace.frames))
    trace.meta = validate.meta(header.get("meta", {}))
    devices, segments = header.get("devices"), blobs["segments"]
    validate.need(
        type(devices) is list and type(segments) is list and len(devices) == len(segments),
        "devices and their segments do not match",
    )
    trace.devices = [validate.device(d, segs, trace) for d, segs in zip(devices, segments, strict=True)]
    validate.check_trace(trace)
    _canonicalise_actions(trace)
    return trace


def _section_table(table: Any, data_len: int) -> dict[str, dict[str, Any]]:
    validate.need(type(table) is list, "corrupt header: no section table")
    out = {}
    for s in table:
        validate.need(type(s) is dict and type(s.get("name")) is str, "corrupt header: a section has no name")
        what = f"section {s['name']!r}"
        validate.need(s["name"] not in out, f"{what} is listed twice")
        validate.int_field(s, "offset", what, 0, data_len)
        validate.int_field(s, "length", what, 0, data_len - s["offset"])
        validate.int_field(s, "crc32", what, 0, 0xFFFFFFFF)
        limit = (JSON_MAX_RATIO if s["name"] in _JSON_SECTIONS else DEFLATE_MAX_RATIO) * s["length"] + 64
        validate.int_field(s, "raw_length", what, 0, limit)  # checked before anything is inflated
        out[s["name"]] = s
    return out


def _inflate(name: str, packed: memoryview, s: dict[str, Any]) -> bytes:
    """The section's raw bytes; never inflates past the raw length the header gives."""
    raw_length = s["raw_length"]
    d = zlib.decompressobj()
    try:
        raw = d.decompress(packed, raw_length + 1)  # max_length 0 would mean "no limit"
    except zlib.error as e:
        raise TraceFormatError(f"section {name!r} is corrupt ({e})") from None
    if len(raw) != raw_length or not d.eof or d.unused_data or zlib.crc32(raw) != s["crc32"]:
        raise TraceFormatError(f"section {name!r} is corrupt (length or checksum mismatch)")
    return raw


def _canonicalise_actions(trace: Trace) -> None:
    """Maps the file's action names onto this version's order, so code can use the fixed ids."""
    if trace.actions[: len(ALLOCATOR_ACTIONS)] == list(ALLOCATOR_ACTIONS):
        return
    names = list(ALLOCATOR_ACTIONS) + [a for a in trace.actions if a not in ALLOCATOR_ACTIONS]
    validate.need(len(names) <= validate.MAX_NAMES, f"more than {validate.MAX_NAMES} actions")
    remap = np.array([names.index(a) for a in trace.actions], dtype=np.uint8)
    trace.cols["action"] = remap[trace.cols["action"]]
    trace.actions = names
