"""Where a training step's time goes, per phase (forward with the loss, backward, optimizer): the host's
issue time and, on a GPU, the time until the GPU reached the phase's end (CUDA events). Native, the
planned pool at each budget (a fraction of native's peak), checkpointing the first blocks by hand,
native again: all in one process, so the rows share the host's speed of the moment. A phase whose host
time is about its GPU time is host-bound: the host's work there is the step's.

    python3 tools/diag/step_phases.py gpt 0.75 0.6     # GPU: GPT-24; gpt-quick or resnet-quick on a CPU

What it found on an H100 (session 8): a planned GPT-24 step's forward is host-bound (native: host 11 ms,
GPU 21; keeping everything: host 28; at 75%: host 42), its backward GPU-bound.
"""

import sys
import time

import torch

import supermem
from supermem.bench.models import PRESETS, Trainer
from supermem.tensor_pool import Pool

STEPS = 8  # timed steps a row; the fastest is printed, with the median


def step_phases(tr: Trainer, ctx) -> tuple[float, list[float], list[float] | None]:
    """One step (Trainer.step, marked at its start and after the loss, backward and the optimizer): its
    wall ms, host ms per phase, and on a GPU the ms until the GPU finished each phase (None on a CPU)."""
    cuda = tr.device.type == "cuda"
    marks, events = [], []

    def mark() -> None:
        marks.append(time.perf_counter())
        if cuda:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()

    wall_s = tr.step(ctx, mark=mark)
    host = [(marks[i + 1] - marks[i]) * 1e3 for i in range(3)]
    gpu = [events[i].elapsed_time(events[i + 1]) for i in range(3)] if cuda else None
    return wall_s * 1e3, host, gpu


def row(label: str, tr: Trainer, ctx=None) -> float:
    """Prints the fastest of STEPS steps (and the median wall), the peak and, for a pool, what it did."""
    cuda = tr.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    steps = sorted((step_phases(tr, ctx) for _ in range(STEPS)), key=lambda r: r[0])
    wall, host, gpu = steps[0]
    line = f"{label:16s} wall {wall:7.1f} (median {steps[len(steps) // 2][0]:7.1f})"
    line += f" | host fwd {host[0]:6.1f} bwd {host[1]:6.1f} opt {host[2]:5.1f}"
    if cuda:
        line += f" | gpu fwd {gpu[0]:6.1f} bwd {gpu[1]:6.1f} opt {gpu[2]:5.1f}"
        line += f" | peak {torch.cuda.max_memory_allocated() / 2**30:5.2f} GiB"
    print(line, flush=True)
    if hasattr(ctx, "stats"):
        s = ctx.stats()
        counters = ("light_calls", "bypassed_calls", "lean_calls", "lean_drops", "plan_misses", "replays")
        did = {k: s.get(k) for k in (*counters, "offloads")}
        plan = s.get("plan") and {k: s["plan"][k] for k in ("offload", "recompute", "compress", "keep")}
        print(f"{'':16s} per {STEPS} steps {did}, plan {plan}")
    return wall


def main() -> None:
    name, fractions = sys.argv[1], [float(f) for f in sys.argv[2:]] or [0.75]
    cuda = torch.cuda.is_available()
    if cuda:
        supermem.install()
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    tr = Trainer.of(name, torch.device("cuda" if cuda else "cpu"))
    for _ in range(3):
        tr.step()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        tr.step()
        peak = torch.cuda.max_memory_allocated()
    else:
        probe = Pool(budget=None, min_bytes=0)  # (not supermem.pool's: that one is kept for its options)
        tr.step(probe)
        peak = probe.stats()["peak_resident_bytes"]
        del probe  # (its region hooks would run in every later step)
    print(f"{PRESETS[name].label} on {tr.device}: native peak {peak / 2**20:.1f} MiB (ms below)")
    native = row("native", tr)
    for f in fractions:
        pool = Pool(budget=int(peak * f), policy="planned")  # (gone after its row, with its hooks)
        for _ in range(4):  # find the regions, record a step, plan, run the plan once
            tr.step(pool)
        pool.reset_stats()
        ms = row(f"planned {f:g}", tr, pool)
        print(f"{'':16s} {ms / native:.2f}x native")
        del pool
    blocks = len(tr.model.blocks) if hasattr(tr.model, "blocks") else 0
    for n in sorted({blocks // 4, blocks // 2} - {0}):
        tr.model.checkpoint_blocks = n
        row(f"ckpt first {n}", tr)
    tr.model.checkpoint_blocks = False
    row("native again", tr)


if __name__ == "__main__":
    main()
