"""`supermem top [PID]`: a live terminal view of a running supermem process, read from its control
socket (see supermem.control): allocated / reserved / limit per device, pool entries by state, bytes
on host, link rates, the trace recording and recent OOMs. `--once` prints one frame and exits."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from . import control
from .cli_args import positive_float, positive_int
from .errors import UsageError
from .units import format_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "pid", nargs="?", type=positive_int, help="process to watch (default: the most recent one)"
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit (for logs and scripts)")
    p.add_argument("--interval", type=positive_float, default=1.0, help="seconds between frames (default 1)")
    p.add_argument("--json", action="store_true", help="print the raw JSON snapshot and exit")


def find_socket(pid: int | None):
    try:
        control.checked_private(control.socket_dir())
    except FileNotFoundError:
        pass  # no process has served yet: said below
    except PermissionError as e:
        raise UsageError(f"{e}; not reading sockets from it") from None
    if pid is not None:
        path = control.socket_path(pid)
        if not path.exists():
            raise UsageError(
                f"no supermem control socket for pid {pid} at {path}: is it a supermem process with the "
                "control server on (option control:true)?"
            )
        return path
    live = control.live_sockets()
    if not live:
        raise UsageError(f"no running supermem process found (no live socket in {control.socket_dir()})")
    return live[0][1]


def _bar(frac: float, width: int = 20) -> str:
    frac = min(max(frac, 0.0), 1.0)
    n = int(round(frac * width))
    return "[" + "#" * n + "." * (width - n) + f"] {frac * 100:3.0f}%"


def render(snap: dict[str, Any]) -> str:
    """One frame of text."""
    prov = snap.get("providers", {})
    proc = prov.get("process", {})
    argv = " ".join(map(str, snap.get("argv", [])))[:70]
    head = f"supermem top - pid {snap.get('pid')}  {argv}"
    if snap.get("world_size", 1) > 1:  # one socket per rank: say which this is
        head = head.replace("  ", f"  rank {snap.get('rank')}/{snap['world_size']}  ", 1)
    if "uptime_s" in proc:
        head += f"  up {proc['uptime_s']:.0f}s"
    if "rss_bytes" in proc:
        head += f"  rss {format_bytes(proc['rss_bytes'])}"
    lines = [head + "  " + time.strftime("%H:%M:%S", time.localtime(snap.get("time_unix_s", time.time())))]
    alloc = prov.get("allocator", {})
    if alloc.get("devices"):
        lines.append(
            f"{'DEVICE':<8}{'ALLOCATED':>12}{'RESERVED':>12}{'LIMIT':>12}{'PEAK RES.':>12}  USE OF LIMIT"
        )
        for d in alloc["devices"]:
            cap = d.get("limit_bytes") or d.get("total_bytes") or 0
            use = _bar(d["reserved_bytes"] / cap) if cap else ""
            lines.append(
                f"{str(d['device']) + ' ' + str(d.get('name', '')):<8}"
                f"{format_bytes(d['allocated_bytes']):>12}"
                f"{format_bytes(d['reserved_bytes']):>12}{format_bytes(cap) if cap else '-':>12}"
                f"{format_bytes(d.get('reserved_bytes_peak', 0)):>12}  {use}"
            )
            if "peak_unallocated_bytes" in d:  # what fragmentation cost at the peak
                frag = (
                    f"{'':<8}unallocated at peak {format_bytes(d['peak_unallocated_bytes'])}"
                    f" (reserved / allocated {d['peak_reserved_ratio']:.3f})"
                )
                if d.get("expandable_segments"):
                    frag += (
                        f"; expandable: {format_bytes(d['reserved_bytes'])} mapped in"
                        f" {format_bytes(d['address_space_bytes'])} of address space"
                    )
                lines.append(frag)
    elif "error" in alloc:
        lines.append(f"allocator: {alloc['error']}")
    else:
        lines.append("allocator: no provider (supermem's allocator is not installed in this process)")
    pool = prov.get("pool")
    if pool:
        states = pool.get("entries_by_state", {})
        nbytes = pool.get("bytes_by_state", {})
        parts = [
            f"{k} {v}" + (f" ({format_bytes(nbytes[k])})" if k in nbytes else "") for k, v in states.items()
        ]
        lines.append("POOL    " + ("  ".join(parts) or "no entries"))
        if "host_bytes" in pool:
            lim = pool.get("host_limit_bytes")
            lines.append(
                f"HOST    {format_bytes(pool['host_bytes'])} on host"
                + (f" of {format_bytes(lim)}" if lim else "")
            )
        for plan in pool.get("plans", []):
            lines.append(
                f"PLAN    keep {plan['keep']}  offload {plan['offload']}  recompute {plan['recompute']}"
                f"  peak {format_bytes(plan['predicted_peak_bytes'])} planned"
                f" / {format_bytes(plan['measured_peak_bytes'])} measured"
                f"  step {plan['predicted_step_s'] * 1e3:.1f} ms planned"
                f" / {plan['measured_step_s'] * 1e3:.1f} ms measured"
                + ("" if plan["feasible"] else "  (over budget: infeasible)")
                + ("  (moves nothing: resting)" if plan.get("resting") else "")
            )
        link = pool.get("link", {})
        if link:
            lines.append(
                "LINKS   "
                + "  ".join(f"{k.replace('_bytes_per_s', '')} {v / 1e9:.1f} GB/s" for k, v in link.items())
            )
    tr = prov.get("trace")
    if tr:
        lines.append(
            f"TRACE   recording {tr.get('recording_s', 0):.0f}s, devices {tr.get('devices')}, "
            f"pool events {tr.get('pool_events', 0)}, dropped {tr.get('dropped_events', 0)}"
        )
    ooms = prov.get("ooms")
    if ooms:
        recent = ooms.get("recent", [])
        line = f"OOMS    {ooms.get('count', len(recent))}"
        if recent:
            last = recent[-1]
            when = time.strftime("%H:%M:%S", time.localtime(last["time_unix_s"]))
            line += f"  last at {when}: device {last['device']} asked {format_bytes(last['requested_bytes'])}"
        lines.append(line)
    else:
        lines.append("OOMS    0")
    for name, value in prov.items():
        if name not in ("process", "allocator", "pool", "trace", "ooms"):
            lines.append(f"{name.upper():<8}{json.dumps(value, default=str)[:200]}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    path = find_socket(args.pid)
    try:
        snap = control.query(path)
    except PermissionError as e:
        raise UsageError(str(e)) from None
    except (ConnectionError, OSError) as e:
        raise UsageError(f"could not read {path}: {e}") from None
    if args.json:
        print(json.dumps(snap, indent=1))
        return 0
    if args.once:
        print(render(snap))
        return 0
    try:
        while True:
            sys.stdout.write("\x1b[H\x1b[2J" + render(snap) + "\n")
            sys.stdout.flush()
            time.sleep(max(args.interval, 0.1))
            try:
                snap = control.query(path)
            except OSError:
                print(f"process {path.stem} is gone")
                return 0
    except KeyboardInterrupt:
        return 0
