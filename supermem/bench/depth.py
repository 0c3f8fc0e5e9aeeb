"""`supermem bench depth`: the deepest bottleneck ResNet [3, 8, n, 3] (batch 16, 224px, fp32) that trains
one SGD-momentum step under a device cap, for native PyTorch, checkpoint per block, save_on_cpu, and
supermem (weight streaming + binomial checkpointing over the blocks, whose repeats replay CUDA graphs, +
the pool); and the step time per layer at each one's deepest depth, against native's per layer at its
own deepest depth.

Every trial is a fresh process (`python -m supermem.bench.depth TRIAL_JSON`): its steps (the last is
timed: the second, or for supermem the fourth, once the pool's plan runs: its first step profiles
regions, its second is recorded with a device sync at each save, its third times its tail), exit
status and one `@@ROW {json}` line. The search on n gallops from a starting guess and then
bisects, with a probe budget per configuration; the searches of the configurations run side by side
(--jobs; each trial is capped, so they cannot starve each other of device memory); a deepest depth whose
trial had company is timed again, alone. A layer is a weighted layer: 3 per bottleneck block, plus the
stem and the classifier.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..cli_args import check_names, comma_list, nonnegative_int, positive_int, size_bytes
from .runner import ROW, child_env, parse_row
from .table import render

CONFIGS = ("native", "checkpoint", "save_on_cpu", "supermem")
# Where each search starts, in blocks of stage 3 (an H200 under 12 GiB, docs/design.md#baselines: native
# 716 layers, checkpoint 1,868, save_on_cpu about 2,540; supermem's target 10,000).
START_N = {"native": 224, "checkpoint": 608, "save_on_cpu": 832, "supermem": 3319}
PROBES = {"native": 7, "checkpoint": 7, "save_on_cpu": 6, "supermem": 3}


def layers(n: int) -> int:
    return 3 * (3 + 8 + n + 3) + 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cap", type=size_bytes, default="12GiB", help="device memory cap per trial (default 12GiB)"
    )
    p.add_argument(
        "--configs",
        type=comma_list(str),
        default=list(CONFIGS),
        help=f"comma-separated, of {', '.join(CONFIGS)}",
    )
    p.add_argument(
        "--max-layers", type=positive_int, default=None, help="stop searching at this depth (default 15,000)"
    )
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=None,
        help="searches run side by side (default 4 on cuda, 1 on cpu)",
    )
    p.add_argument(
        "--checkpoints",
        type=nonnegative_int,
        default=512,
        help="binomial checkpoints for supermem (default 512)",
    )


# ---------------------------------------------------------------- one trial (in a fresh process)


def trial(spec: dict) -> dict:
    import torch

    import supermem

    cuda = spec["device"] == "cuda"
    config = spec["config"]
    cap = spec.get("cap_bytes")
    if spec.get("threads"):  # searches side by side share the cores: 4 x 16 OpenMP threads thrash 16 cores
        torch.set_num_threads(spec["threads"])
    phase_s: dict[str, float] = {}
    t_phase = time.perf_counter()

    def phase(name: str) -> None:  # where a trial's wall time goes (the row carries it)
        nonlocal t_phase
        sync()
        now = time.perf_counter()
        phase_s[name] = round(phase_s.get(name, 0.0) + now - t_phase, 3)
        t_phase = now

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda and config == "supermem":
        supermem.install({"limit": cap} if cap else None)
    device = torch.device(spec["device"])
    if cuda and cap and config != "supermem":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    torch.manual_seed(0)
    model = _model(spec)
    phase("build")
    if config == "supermem":
        # "host" by default: "overlap" (each unit stepped in a worker thread during backward) took 17.2 s
        # against host's 14.3 s at 10,001 layers on an H100 (one run each, the overlap one slower in
        # set-up too; its worker contends for the GIL with backward's thread, the bottleneck)
        how = spec.get("optimizer_step", "host")
        streamer = supermem.stream(model, device, unit_bytes=spec["unit_bytes"], optimizer_step=how)
        model.mode = ("binomial", spec["checkpoints"])
        model.graphs = spec.get("graphs", True)
        budget = max(cap - (2 << 30), 1 << 30) if cap else 1 << 30
        pool = supermem.pool(budget=budget if cuda else None, device=device)
    else:
        streamer, pool = None, None
        model.to(device)
        model.mode = ("checkpoint", 0) if config == "checkpoint" else ("plain", 0)
    phase("place")  # streaming set up, or the model moved to the device
    # fused: one kernel over all tensors, each read once (on the host, where supermem's streamed
    # parameters step, 1.7x faster than foreach, which makes three passes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    g = torch.Generator().manual_seed(0)
    b, px, classes = spec["batch"], spec["px"], spec["classes"]
    x = torch.randn(b, 3, px, px, generator=g).to(device)
    y = torch.randint(0, classes, (b,), generator=g).to(device)
    times, losses = [], []
    steps = spec.get("steps", 4 if config == "supermem" else 2)
    for i in range(steps):
        sync()
        t0 = time.perf_counter()
        t_phase = t0
        last = i == steps - 1  # phases of the timed step; the first is "build" .. "place"
        if config == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=cuda):
                loss = torch.nn.functional.cross_entropy(model(x), y)
        elif pool is not None:
            with pool:  # the held boundaries go through the pool; the rebuilds in backward need not
                loss = torch.nn.functional.cross_entropy(model(x), y)
        else:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        phase("forward" if last else "step1")
        loss.backward()
        phase("backward" if last else "step1")
        opt.step()
        opt.zero_grad(set_to_none=True)
        phase("optimizer" if last else "step1")
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    values = [float(x) for x in losses]
    row = {"n": spec["n"], "layers": layers(spec["n"]), "step_s": times[-1], "loss": values[-1]}
    row["losses"] = values
    row["phase_s"] = phase_s
    row["threads"] = torch.get_num_threads()
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["gpu"] = torch.cuda.get_device_name(0)
    if streamer is not None:
        s = streamer.stats()
        row.update(h2d_gb=s["h2d_bytes"] / 1e9, d2h_gb=s["d2h_bytes"] / 1e9, prefetch_hits=s["prefetch_hits"])
    return row


def _model(spec: dict) -> Any:
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from supermem.checkpoint import binomial

    from .models import ResNet

    class DeepResNet(ResNet):
        """The benchmark's ResNet, whose chain of blocks runs plain, checkpointed per block, or through
        supermem.checkpoint.binomial (one forward call per step, so the streamer sees steps start)."""

        mode: tuple[str, int] = ("plain", 0)
        graphs = False  # binomial's CUDA graphs for its repeated blocks

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            how, k = self.mode
            if how == "binomial":
                x = binomial(self.blocks, x, checkpoints=k, graphs=self.graphs)
            else:
                for b in self.blocks:
                    x = checkpoint(b, x, use_reentrant=False) if how == "checkpoint" else b(x)
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    shape = dict(depths=(3, 8, spec["n"], 3), width=spec["width"], classes=spec["classes"])
    if spec["device"] != "cuda":
        return DeepResNet(**shape)
    if spec["config"] != "supermem":
        with torch.device("cuda"):  # initialised on the card: seconds, not a minute of CPU at depth
            return DeepResNet(**shape)
    with torch.device("meta"):  # larger than the cap: initialised module by module on the card
        model = DeepResNet(**shape)
    return materialize_on_host(model, "cuda")


def materialize_on_host(model: Any, init_device: str, chunk_bytes: int = 256 << 20) -> Any:
    """A model built on the meta device, initialised one module at a time on `init_device` (as its
    reset_parameters does, in module order: the values of a model built there directly), its parameters
    kept in host memory and its buffers on `init_device` (where they are used).

    Initialised tensors come to the host about `chunk_bytes` at a time, in one copy: one copy (and
    synchronisation) per tensor took seconds per thousand blocks on CUDA. The parameters view those
    chunks (supermem.stream copies them into its own blocks)."""
    import torch

    pending: list[tuple[Any, str, torch.Tensor]] = []  # (module, name, initialised parameter)
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        sizes = [-(-t.nbytes // 64) * 64 for _, _, t in pending]  # 64-byte aligned views
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=init_device)
        offset = 0
        for (_, _, t), size in zip(pending, sizes):
            flat[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            offset += size
        flat = flat.cpu()
        offset = 0
        for (m, name, t), size in zip(pending, sizes):
            view = flat[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            m._parameters[name] = torch.nn.Parameter(view, m._parameters[name].requires_grad)
            offset += size
        pending, pending_bytes = [], 0

    for m in model.modules():
        if not m._parameters and not m._buffers:
            continue
        # torch.empty, not to_empty: empty_like of a meta tensor goes through Python reference code
        for name, p in m._parameters.items():
            if p is not None:
                new = torch.empty(p.shape, dtype=p.dtype, device=init_device)
                m._parameters[name] = torch.nn.Parameter(new, p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=init_device)
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
        for name, p in m._parameters.items():
            if p is not None:
                pending.append((m, name, p.detach()))  # detached: the copy into the chunk is no graph
                pending_bytes += p.nbytes
        if pending_bytes >= chunk_bytes:
            flush()
    flush()
    return model


def _trial_main(argv: list[str]) -> int:
    import torch

    spec = json.loads(argv[0])
    try:
        row = trial(spec)
    except torch.OutOfMemoryError as e:
        row = {"oom": True, "error": "OOM: " + str(e).strip().splitlines()[0][:200]}
    except Exception as e:  # noqa: BLE001  (the parent reports it)
        row = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    print(ROW + json.dumps(row), flush=True)
    sys.stderr.flush()
    # no interpreter teardown: a deep supermem trial holds tens of GB of pinned and pageable host memory,
    # freed block by block at exit (seconds of a trial's wall time); the process's end returns it at once
    os._exit(0)


# ---------------------------------------------------------------- the search (parent process)


class _Crowd:
    """The trials running now: a trial's time counts only if no other trial ran beside it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: list[dict] = []

    def enter(self, mark: dict) -> None:
        with self.lock:
            mark["crowded"] = bool(self.running)
            for other in self.running:
                other["crowded"] = True
            self.running.append(mark)

    def leave(self, mark: dict) -> None:
        with self.lock:
            self.running.remove(mark)


_crowd = _Crowd()


def _run_trial(spec: dict, timeout_s: float) -> dict:
    env = child_env()
    mark: dict = {}
    _crowd.enter(mark)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "supermem.bench.depth", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        row = parse_row(r.stdout)
        if row is None and (r.returncode < 0 or "out of memory" in r.stderr.lower()):
            row = {"oom": True, "error": f"killed (rc={r.returncode})"}  # e.g. the host ran out
        elif row is None:
            row = {"error": f"rc={r.returncode}: {' | '.join(r.stderr.strip().splitlines()[-2:])[-300:]}"}
    except subprocess.TimeoutExpired:
        row = {"error": f"timed out after {timeout_s:.0f} s"}
    finally:
        _crowd.leave(mark)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    row["alone"] = not mark["crowded"]
    status = "fits" if "error" not in row else ("OOM" if row.get("oom") else row["error"])
    # where the wall time went: the process's start and imports are what the phases leave out
    split = "".join(f", {k} {v:.1f}" for k, v in row.get("phase_s", {}).items())
    where = f"{spec['config']:<12} n={spec['n']:<5} ({layers(spec['n'])} layers)"
    print(
        f"  {where}: {status} [{row['wall_s']} s{split}]",
        file=sys.stderr,
        flush=True,
    )
    return row


def search(spec: dict, start: int, max_n: int, probes: int, timeout_s: float) -> dict | None:
    """The deepest n that fits, as that trial's row (None when even n=1 does not): gallop from `start`
    by 1.5x, then bisect until the gap is under 2% or the probes run out."""
    fits: dict[int, dict] = {}
    lo, hi = 0, max_n + 1  # lo fits (0: none known), hi does not

    def probe(n: int) -> bool:
        row = _run_trial({**spec, "n": n}, timeout_s)
        if "error" not in row:
            fits[n] = row
            return True
        return False

    n = min(start, max_n)
    while probes > 0:
        probes -= 1
        if probe(n):
            lo = n
        else:
            hi = n
        if hi - lo <= max(1, lo // 50):
            break
        if hi > max_n:  # nothing failed yet: gallop up
            n = min(max(lo * 3 // 2, lo + 1), max_n)
        elif lo == 0:  # nothing fitted yet: gallop down
            n = max(hi * 2 // 3, 1)
        else:
            n = (lo + hi) // 2
    return fits.get(lo)


def run(args: argparse.Namespace) -> dict:
    cuda = args.device == "cuda"
    configs = args.configs
    check_names("--configs", configs, CONFIGS)
    cap_bytes = args.cap if cuda else None
    base: dict[str, Any]
    if args.quick:
        base = {"batch": 2, "px": 32, "width": 8, "classes": 10, "unit_bytes": 1 << 16}  # a unit per block
        start, max_n, probes = dict.fromkeys(CONFIGS, 2), 2, dict.fromkeys(CONFIGS, 1)
    else:
        base = {"batch": 16, "px": 224, "width": 64, "classes": 1000, "unit_bytes": 64 << 20}
        max_layers = args.max_layers or 15_000
        max_n = max(1, (max_layers - 44) // 3)
        start, probes = START_N, PROBES
    base.update(device=args.device, cap_bytes=cap_bytes, checkpoints=args.checkpoints)
    jobs = args.jobs or (4 if cuda else 1)
    cores = len(os.sched_getaffinity(0))
    searching = {**base, "threads": max(1, cores // max(1, jobs))}  # the retime alone keeps them all
    timeout_s = args.timeout
    print(f"searching the deepest ResNet [3, 8, n, 3] per config ({jobs} side by side) ...", file=sys.stderr)

    def one(config: str) -> dict | None:
        return search({**searching, "config": config}, start[config], max_n, probes[config], timeout_s)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        deepest = dict(zip(configs, pool.map(one, configs), strict=True))
    rows = []
    for config in configs:
        found = deepest[config]
        row = {"config": config, "n": None, "layers": None}
        if found is not None:
            # another trial ran beside it, or it had a share of the cores: time the deepest depth again, alone
            if not found.get("alone") or found.get("threads", cores) < cores:
                again = _run_trial({**base, "config": config, "n": found["n"]}, timeout_s)
                found = again if "error" not in again else {**found, "retime_error": again["error"]}
            row.update(found)
            row["at_max"] = found["n"] >= max_n
            row["layer_ms"] = found["step_s"] / found["layers"] * 1e3
        rows.append(row)
    native = next((r for r in rows if r["config"] == "native" and r.get("layer_ms")), None)
    for r in rows:
        r["x_native_layer"] = r["layer_ms"] / native["layer_ms"] if native and r.get("layer_ms") else None
    card = next((r.get("gpu") for r in rows if r.get("gpu")), "cpu")
    print(
        f"\nbench depth: ResNet [3, 8, n, 3], batch {base['batch']}, {base['px']}px, fp32, "
        f"one SGD-momentum step, cap {f'{args.cap / 2**30:g} GiB' if cuda else 'none'}, on {card}"
    )
    columns = [
        ("config", lambda r: r["config"], ""),
        ("layers", lambda r: f"{'>=' if r.get('at_max') else ''}{r['layers']}" if r["layers"] else None, ""),
        ("n", lambda r: r["n"], ""),
        ("step s", lambda r: r["step_s"], ".2f"),
        ("ms/layer", lambda r: r["layer_ms"], ".3f"),
        ("x native/layer", lambda r: r["x_native_layer"], ".2f"),
        ("peak GiB", lambda r: r.get("peak_gib"), ".2f"),
    ]
    print(render(columns, rows))
    if not args.quick:
        print(
            "for reference (docs/design.md#baselines, H200, 12 GiB): native 716 layers, checkpoint 1,868, "
            "save_on_cpu ~2,540"
        )
    sm = next((r for r in rows if r["config"] == "supermem"), None)
    if sm and sm.get("layers") and not args.quick:
        ok_depth = sm["layers"] >= 10_000
        x = sm["x_native_layer"]
        ok_time = x is not None and x <= 2.0
        print(
            f"target >= 10,000 layers: {'met' if ok_depth else 'NOT met'} ({sm['layers']}); "
            f"target <= 2x native per layer: {'met' if ok_time else 'NOT met'} "
            f"({f'{x:.2f}x' if x is not None else 'no native row'})"
        )
    return {"bench": "depth", "card": card, "cap": args.cap, "rows": rows}


if __name__ == "__main__":
    sys.exit(_trial_main(sys.argv[1:]))
