"""`supermem bench train --ddp N`: GPT training under DistributedDataParallel on N GPUs (or N gloo processes
with --device cpu), native DDP beside supermem's allocator and the pool, all in this run.

Each configuration is one torchrun launch (`python -m torch.distributed.run`) of supermem.bench.ddp_worker;
supermem is switched on the way a user would, through SUPERMEM / SUPERMEM_CONF in the ranks' environment.
Rows: per rank, the peak allocated bytes and the median step time, and each against native DDP's same
rank. Pool budgets are fractions of native DDP's peak on that run's largest rank (--budgets).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1) unless set already.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import UsageError
from ..units import format_bytes

# Model sizes: the reference GPT-24 of docs/design.md#reference-models (GPT-24 d1024 b8 T1024) and, with
# --quick, seconds on a CPU.
FULL = [
    "--layers",
    "24",
    "--dim",
    "1024",
    "--heads",
    "16",
    "--vocab",
    "50304",
    "--batch",
    "8",
    "--seq",
    "1024",
]
QUICK = ["--layers", "2", "--dim", "64", "--heads", "2", "--vocab", "512", "--batch", "2", "--seq", "64"]


def launch(
    nproc: int, worker_args: list[str], env_extra: dict[str, str], timeout_s: float
) -> tuple[list[dict], str]:
    """Runs the worker on `nproc` ranks; returns each rank's result (rank order) and, on failure, why."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env.update(PYTHONUNBUFFERED="1", **env_extra)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with tempfile.TemporaryDirectory(prefix="supermem-ddp-") as out_dir:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "-m",
            "supermem.bench.ddp_worker",
            out_dir,
            *worker_args,
        ]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return [], f"timed out after {timeout_s:.0f} s"
        rows = []
        for rank in range(nproc):
            p = Path(out_dir) / f"rank{rank}.json"
            if p.exists():
                rows.append(json.loads(p.read_text()))
        if r.returncode != 0 or len(rows) != nproc:
            tail = " | ".join(r.stderr.strip().splitlines()[-4:])
            return rows, f"rc={r.returncode}: {tail[-600:]}"
        return rows, ""


def run(args: argparse.Namespace) -> dict:
    nproc = args.ddp
    if nproc < 1:  # the CLI's --ddp is checked by argparse; this guards a direct call
        raise UsageError(f"--ddp takes the number of ranks (>= 1), got {nproc}")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < nproc:
            raise UsageError(
                f"--ddp {nproc} needs {nproc} GPUs, this machine has {torch.cuda.device_count()}"
            )
    sizes = QUICK if args.quick else FULL
    steps = 4 if args.quick else max(args.steps + args.warmup, 5)
    common = [*sizes, "--steps", str(steps), "--warmup", str(2 if args.quick else args.warmup)]
    common += ["--device", args.device]
    budgets = args.budgets
    timeout = args.timeout * 2  # a launch is N processes plus the rendezvous
    out: dict = {"bench": "train-ddp", "nproc": nproc, "device": args.device, "sizes": sizes, "rows": {}}
    print(f"supermem bench train --ddp {nproc}: GPT {' '.join(sizes)} on {args.device}", file=sys.stderr)

    def one(name: str, env: dict[str, str]) -> list[dict]:
        print(f"  running {name} ...", end="", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        rows, error = launch(nproc, common, env, timeout)
        print(f" {'error' if error else 'ok'} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        out["rows"][name] = {"ranks": rows, "error": error, "env": env}
        return rows

    native = one("native DDP", {})
    one("supermem", {"SUPERMEM": "1", **({"SUPERMEM_CONF": args.conf} if args.conf else {})})
    if native and "peak_alloc_bytes" in native[0]:
        top = max(r["peak_alloc_bytes"] for r in native)
        for b in budgets:
            conf = f"pool:cost_aware,budget:{int(top * b)}" + (f",{args.conf}" if args.conf else "")
            one(f"cost_aware {b:g}", {"SUPERMEM_CONF": conf})
    elif native:  # CPU: the pool's budget counts saved bytes; one small budget shows it works
        one("pool 64KiB", {"SUPERMEM_CONF": "pool:lru,budget:64KiB"})
    print(table(out), file=sys.stdout)
    return out


def table(out: dict) -> str:
    rows = out["rows"]
    native = {r["rank"]: r for r in rows.get("native DDP", {}).get("ranks", [])}
    lines = [
        f"\nGPT under DDP, {out['nproc']} ranks on {out['device']} (baseline: native DDP, this run)",
        f"{'config':<14} {'rank':>4} {'peak alloc':>12} {'vs native':>10} {'step ms':>9} {'vs native':>10}"
        f" {'losses = native':>16}",
    ]
    for name, row in rows.items():
        if row["error"]:
            lines.append(f"{name:<14} error: {row['error']}")
            continue
        for r in row["ranks"]:
            base = native.get(r["rank"], {})
            peak, base_peak = r.get("peak_alloc_bytes"), base.get("peak_alloc_bytes")
            peak_text = format_bytes(peak) if peak is not None else "-"
            peak_ratio = f"{peak / base_peak:.2f}x" if peak and base_peak else "-"
            time_ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
            same = str(r["losses"] == base.get("losses")) if base else "-"
            lines.append(
                f"{name:<14} {r['rank']:>4} {peak_text:>12} {peak_ratio:>10} "
                f"{r['step_s'] * 1e3:>9.1f} {time_ratio:>10} {same:>16}"
            )
    return "\n".join(lines)
