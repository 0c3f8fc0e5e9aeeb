"""The .smtrace file: a versioned header, then zlib-compressed sections.

Layout (little-endian):
    0   8 bytes   magic b"\\x89SMTRACE" (the high byte catches 7-bit and text-mode damage)
    8   u16       format major version (a reader refuses a newer major)
    10  u16       format minor version (additions a reader may ignore)
    12  u32       header length H
    16  u64       data length D (bytes after the header; a shorter file is truncated)
    24  H bytes   header: UTF-8 JSON {meta, actions, categories, devices, num_events, sections}
    24+H D bytes  sections, each zlib(level 1) of its bytes; the header gives each one's
                  offset, compressed length, raw length, crc32 of the raw bytes, dtype and encoding.

Sections: one per event column (time_ns stored as deltas: they compress ~5x better), and JSON for
strings, frames, stacks and the per-device segment snapshots. 10^6 events write in about a second
and take ~10-20 bytes each on disk.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .output import atomic_output
from .table import ALLOCATOR_ACTIONS, COLUMNS, Trace

MAGIC = b"\x89SMTRACE"
MAJOR, MINOR = 1, 0
_FIXED = struct.Struct("<8sHHIQ")
_PICKLE_PROTOCOL_BYTE = 0x80


class TraceFormatError(ValueError):
    """A file that is not a readable .smtrace (foreign, truncated, corrupt or too new)."""


def _pack(raw: bytes) -> tuple[bytes, int, int]:
    return zlib.compress(raw, 1), len(raw), zlib.crc32(raw)


def write(trace: Trace, path: str | os.PathLike) -> int:
    """Writes `trace` to `path` atomically (a temporary file, then rename). Returns bytes written."""
    sections: list[tuple[str, bytes, dict[str, Any]]] = []
    for name, dtype in COLUMNS.items():
        col = np.ascontiguousarray(trace.cols[name], dtype=dtype)
        encoding = "raw"
        if name == "time_ns" and len(col):
            col = np.diff(col, prepend=np.int64(0))  # first value absolute, then deltas
            encoding = "delta"
        sections.append((name, col.tobytes(), {"dtype": np.dtype(dtype).str, "encoding": encoding}))
    devices = [{k: v for k, v in d.items() if k != "segments"} for d in trace.devices]
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
        packed, raw_len, crc = _pack(raw)
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
    with atomic_output(path) as f:
        f.write(_FIXED.pack(MAGIC, MAJOR, MINOR, len(header), offset))
        f.write(header)
        for b in body:
            f.write(b)
    return _FIXED.size + len(header) + offset


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, (tuple, set)):
        return list(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def sniff(path: str | os.PathLike) -> str:
    """ "smtrace", "pickle" or "unknown", from the first bytes."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if head == MAGIC:
        return "smtrace"
    if head[:1] == bytes([_PICKLE_PROTOCOL_BYTE]):
        return "pickle"
    return "unknown"


def read(path: str | os.PathLike) -> Trace:
    """Loads a .smtrace file. Raises TraceFormatError with what is wrong and what to do."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < _FIXED.size or data[: len(MAGIC)] != MAGIC:
        kind = "a pickle (a PyTorch memory snapshot?)" if data[:1] == b"\x80" else "not a supermem trace"
        if not data:
            kind = "empty"
        raise TraceFormatError(
            f"{path}: {kind}: a .smtrace file starts with {MAGIC!r}, this one with {data[:8]!r}"
            + (" (supermem replay/report read PyTorch snapshot pickles too)" if data[:1] == b"\x80" else "")
        )
    _, major, minor, header_len, data_len = _FIXED.unpack_from(data)
    if major > MAJOR:
        raise TraceFormatError(
            f"{path}: written by a newer supermem (trace format {major}.{minor}); this one reads format "
            f"{MAJOR}.x: upgrade supermem"
        )
    want = _FIXED.size + header_len + data_len
    if len(data) < want:
        raise TraceFormatError(
            f"{path}: truncated: the header promises {want} bytes, the file has {len(data)} "
            "(was the writer killed or the copy cut short?)"
        )
    try:
        header = json.loads(data[_FIXED.size : _FIXED.size + header_len])
    except ValueError as e:
        raise TraceFormatError(f"{path}: corrupt header ({e})") from None
    base = _FIXED.size + header_len
    sections = {s["name"]: s for s in header["sections"]}

    def section(name: str) -> bytes:
        s = sections.get(name)
        if s is None:
            raise TraceFormatError(f"{path}: section {name!r} is missing")
        start = base + s["offset"]
        try:
            raw = zlib.decompress(data[start : start + s["length"]])
        except zlib.error as e:
            raise TraceFormatError(f"{path}: section {name!r} is corrupt ({e})") from None
        if len(raw) != s["raw_length"] or zlib.crc32(raw) != s["crc32"]:
            raise TraceFormatError(f"{path}: section {name!r} is corrupt (checksum mismatch)")
        return raw

    n = header["num_events"]
    cols = {}
    for name, dtype in COLUMNS.items():
        s = sections.get(name)
        if s is None:  # a column added by a later minor version is absent from older files
            raise TraceFormatError(f"{path}: column {name!r} is missing")
        col = np.frombuffer(section(name), dtype=np.dtype(s["dtype"])).astype(dtype, copy=True)
        if len(col) != n:
            raise TraceFormatError(f"{path}: column {name!r} has {len(col)} rows, expected {n}")
        if s.get("encoding") == "delta":
            col = np.cumsum(col, dtype=np.int64)
        cols[name] = col
    blobs = {name: json.loads(section(name)) for name in ("strings", "frames", "stacks", "segments")}
    devices = header["devices"]
    for d, segs in zip(devices, blobs["segments"], strict=False):
        d["segments"] = segs
    trace = Trace(
        cols=cols,
        actions=list(header["actions"]),
        categories=list(header["categories"]),
        strings=blobs["strings"],
        frames=[(f[0], int(f[1]), f[2]) for f in blobs["frames"]],
        stacks=[tuple(s) for s in blobs["stacks"]],
        devices=devices,
        meta=header.get("meta", {}),
    )
    _canonicalise_actions(trace)
    return trace


def _canonicalise_actions(trace: Trace) -> None:
    """Maps the file's action names onto this version's order, so code can use the fixed ids."""
    if trace.actions[: len(ALLOCATOR_ACTIONS)] == list(ALLOCATOR_ACTIONS):
        return
    names = list(ALLOCATOR_ACTIONS) + [a for a in trace.actions if a not in ALLOCATOR_ACTIONS]
    remap = np.array([names.index(a) for a in trace.actions], dtype=np.uint8)
    trace.cols["action"] = remap[trace.cols["action"]]
    trace.actions = names
