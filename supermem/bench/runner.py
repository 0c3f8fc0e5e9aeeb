"""Runs one benchmark configuration in a fresh process (see worker.py) and returns its row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROW = "@@ROW "


def run(spec: dict, timeout_s: float, label: str = "") -> dict:
    """The worker's row for `spec`, plus "wall_s"; a row with "error" when the process failed."""
    env = child_env()
    env["PYTHONUNBUFFERED"] = "1"
    print(f"  running {label or spec} ...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "supermem.bench.worker", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        row = parse_row(r.stdout)
        if row is None:
            tail = " | ".join(r.stderr.strip().splitlines()[-3:])
            row = {"error": f"worker exited rc={r.returncode} without a row: {tail[-400:]}"}
    except subprocess.TimeoutExpired:
        row = {"error": f"timed out after {timeout_s:.0f} s"}
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    status = "OOM" if row.get("oom") else ("error" if "error" in row else "ok")
    if "step_ms" in row:  # the numbers now, not only in the closing table: a run cut short keeps them
        peak = row.get("peak_alloc_bytes", row.get("allocated_bytes_peak", 0))  # (train's, frag's)
        status += f": {row['step_ms']:.1f} ms, peak {peak / 2**30:.2f} GiB"
    print(f" {status} ({row['wall_s']} s)", file=sys.stderr, flush=True)
    return row


def child_env() -> dict[str, str]:
    """The caller's environment without SUPERMEM*: the allocator of a trial is chosen by its spec, never by
    the caller's environment (SUPERMEM=1 would swap it)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}


def parse_row(stdout: str) -> dict | None:
    """The last `@@ROW {json}` line of a trial's output, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(ROW):
            return json.loads(line[len(ROW) :])
    return None
