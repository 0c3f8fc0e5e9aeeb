"""`supermem demo`: the main job on an embedded default.

Trains a small GPT for a few steps in one process: plainly (no saved-tensor hooks at all: a
process-wide pool's are taken off), with per-block torch.utils.checkpoint (what a user does by hand),
with supermem's tensor pool at 60% of the plain peak, and with the pool at checkpoint's own peak (the
same memory); prints step time, peak memory and what the pool moved and rebuilt over the steps after
the warm-up (and, where higher, what a pool's warm-up steps peaked at). On a GPU supermem's allocator
serves the runs (installed first: it keeps the pool's budget as a soft limit), peak memory is
torch.cuda.max_memory_allocated and the pool offloads to pinned host memory; on CPU there is no device
to spare, so the figure is the saved-activation bytes held in memory (what a GPU would hold, counted
for the runs without a pool in one more, untimed step) and "offload" copies into the host pool. On CPU
every run must produce the plain run's losses bit for bit; on a GPU, within 1% (fused attention kernels
differ slightly from run to run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import config
from . import torch_private as tp
from .cli_args import positive_int
from .errors import UsageError
from .policies import live_names
from .tensor_pool import Pool
from .units import format_bytes


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, vocab: int, ctx: int):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.checkpoint = False  # per-block torch.utils.checkpoint

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
        return self.head(self.ln(x))


# Steps before the timed ones, in every run: a planned pool finds its regions in the first, records
# the second, and runs its plan from the third. Then more, up to MAX_WARMUP, until the last STEADY
# steps' times are within STEADY_SPREAD of each other: a process's first run pays first-time costs
# (a GPU's first row took 1592 ms a step, 29.9 ms when run again) for longer than 3 steps.
WARMUP = 3
MAX_WARMUP = 10
STEADY = 3
STEADY_SPREAD = 0.1

SIZES = {  # layers, d, heads, vocab, seq, batch
    "cuda": (12, 768, 12, 8192, 1024, 8),
    "cpu": (4, 128, 4, 1024, 128, 4),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=positive_int, default=6, help="timed training steps per run (default 6)")
    p.add_argument("--budget", default=None, help="pool budget (default: 60%% of the plain run's peak)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--policy", choices=live_names(), default="planned", help="pool policy (default planned)")


def steady(times_s: list[float], warmup: int = WARMUP) -> bool:
    """Warm enough to time: at least `warmup` steps, and the last STEADY within STEADY_SPREAD of their
    fastest (or MAX_WARMUP steps run)."""
    if len(times_s) >= MAX_WARMUP:
        return True
    last = times_s[-STEADY:]
    return len(times_s) >= warmup and len(last) == STEADY and max(last) <= (1 + STEADY_SPREAD) * min(last)


def train(device: torch.device, steps: int, pool: Pool | None, ckpt: bool = False) -> dict:
    """`steps` timed steps after a warm-up until steady(), under `pool`; without one, with no
    saved-tensor hooks at all (a process-wide pool's, a caller's) besides checkpoint's own. On CPU such
    a run's peak is counted in one more step, untimed and after the compared ones, by a pool without a
    budget. "losses" has every step's, warm-up's too (runs compare the steps they all ran); "ms" is the
    timed steps' median, "ms_range" their fastest and slowest."""
    layers, d, heads, vocab, seq, batch = SIZES[device.type]
    torch.manual_seed(0)
    model = GPT(layers, d, heads, vocab, seq).to(device)
    model.checkpoint = ckpt
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randint(0, vocab, (batch, seq + 1), device=device)
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    hooks = pool if pool is not None else _NoSavedTensorHooks()

    losses: list[float] = []

    def step(hooks: Any) -> float:
        """One step's seconds (loss.item() waits for the GPU)."""
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with hooks, amp:
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
        return time.perf_counter() - t0

    warm: list[float] = []
    while not steady(warm):  # kernels, caches, host pool chunks; a planned pool's recorded steps
        warm.append(step(hooks))
    if device.type == "cuda":
        torch.cuda.synchronize()
        warm_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        warm_peak = pool.stats()["peak_resident_bytes"] if pool is not None else 0
    if pool is not None:
        pool.reset_stats()
    times_s = [step(hooks) for _ in range(steps)]
    if pool is not None:
        pool.synchronize()
    s = pool.stats() if pool is not None else None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    elif s is not None:  # (a pool)
        peak = s["peak_resident_bytes"]
    else:
        counter = Pool(budget=None, device=device)  # counts saved activations, moves nothing
        step(counter)
        losses.pop()  # (not a compared step)
        peak = counter.stats()["peak_resident_bytes"]
    return {
        "ms": statistics.median(times_s) * 1e3,
        "ms_range": (min(times_s) * 1e3, max(times_s) * 1e3),
        "warmup_steps": len(warm),
        "peak": peak,
        "warm_peak": warm_peak or peak,
        "losses": losses,
        "pool": s,
    }


class _NoSavedTensorHooks:
    """This thread's default saved-tensor hooks taken off (popped, every one) and put back after:
    the plain rows run as PyTorch alone would, even under SUPERMEM_CONF=pool (process-wide hooks)."""

    def __enter__(self) -> None:
        self.taken = []
        while (top := tp.saved_hooks_in_force()) is not None:
            tp.pop_saved_hooks()
            self.taken.append(top)

    def __exit__(self, *exc: object) -> None:
        for pack, unpack in reversed(self.taken):
            tp.push_saved_hooks(pack, unpack)


def recomputed(s: dict | None, steps: int) -> str:
    """What a pool run rebuilt in backward, per step: block calls a plan ran light (they saved
    nothing; backward runs each again), saves its lean calls dropped, and bytes dropped by the
    reactive recompute treatment. "-" without a pool."""
    if s is None:
        return "-"
    parts = []
    if s["light_calls"]:
        parts.append(f"{s['light_calls'] / steps:.3g} calls")
    if s["lean_drops"]:
        parts.append(f"{s['lean_drops'] / steps:.3g} saves")
    if s["dropped_bytes"] or not parts:
        parts.append(format_bytes(s["dropped_bytes"] / steps))
    return " + ".join(parts)


def main(args: argparse.Namespace) -> int:
    if config.current().stream != "off":  # it would stream the first model: the plain row's
        raise UsageError(
            "the demo compares supermem with plain PyTorch in one process; run it without stream in "
            "SUPERMEM_CONF (the process's first model, the plain run's, would be streamed)"
        )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layers, d, heads, vocab, seq, batch = SIZES[device.type]
    if device.type == "cuda":
        _install_allocator()  # before anything asks CUDA for memory (or for the device's name)
    what = (
        f"{torch.cuda.get_device_name()}, supermem's allocator"
        if device.type == "cuda"
        else "CPU (no GPU: memory is saved activations)"
    )
    print(f"supermem demo: GPT {layers}x{d}, batch {batch}x{seq}, {args.steps} steps, on {what}\n")
    min_bytes = 0 if device.type == "cpu" else None

    def pooled(budget: int | str) -> dict:
        return train(device, args.steps, Pool(budget, args.policy, device=device, min_bytes=min_bytes))

    plain = train(device, args.steps, None)
    ckpt = train(device, args.steps, None, ckpt=True)
    budget = args.budget if args.budget is not None else int(0.6 * plain["peak"])
    shown = format_bytes(budget) if isinstance(budget, int) else budget
    pool_run = pooled(budget)
    runs = [
        ("plain PyTorch", plain),
        ("checkpoint per block (by hand)", ckpt),
        (f"supermem pool ({args.policy}, {shown})", pool_run),
        (f"supermem pool at checkpoint's peak ({format_bytes(ckpt['peak'])})", pooled(ckpt["peak"])),
    ]

    print(HEADER)
    for name, r in runs:
        print(row(name, r, args.steps))
    fewest, most = min(r["warmup_steps"] for _, r in runs), max(r["warmup_steps"] for _, r in runs)
    print(
        f"(step: the median of {args.steps} timed steps, spread: their fastest and slowest, after "
        f"{fewest if fewest == most else f'{fewest}-{most}'} warm-up steps, until\n"
        f" {STEADY} steps in a row were within {100 * STEADY_SPREAD:.0f}%; a step's offloaded bytes; "
        "recomputed: block calls run light,\n which save nothing and run again in backward, and saves "
        "dropped to be rebuilt; the first two rows run\n without any pool)"
    )
    warm = [format_bytes(r["warm_peak"]) for _, r in runs[2:] if r["warm_peak"] > 1.01 * r["peak"]]
    if warm:  # the steps a planned pool records before its plan run under its reactive fallback
        print(f"(the pool runs' warm-up steps, before a plan, peaked at {' and '.join(warm)})")
    print()
    for label, r in (("supermem pool", pool_run), ("checkpoint per block", ckpt)):
        saved, ratio = 1 - r["peak"] / plain["peak"], r["ms"] / plain["ms"]
        print(f"{label + ':':<22} memory saved: {100 * saved:.0f}%   time: {ratio:.2f}x")
    others = [r for _, r in runs[1:]]
    common = min(len(r["losses"]) for _, r in runs)  # the steps every run took (warm-ups differ)
    if device.type == "cpu":
        same = all(r["losses"][:common] == plain["losses"][:common] for r in others)
        verdict = f"losses identical: {same} ({common} steps)"
    else:  # fused attention kernels are not bitwise deterministic from one run to the next
        pairs = [(a, b) for r in others for a, b in zip(plain["losses"][:common], r["losses"][:common])]
        rel = max(abs(a - b) / abs(a) for a, b in pairs)
        same = rel < 1e-2
        verdict = f"losses match: {same} (largest relative difference {rel:.1e}; GPU kernels vary run to run)"
    print(verdict)
    return 0 if same else 1


HEADER = (
    f"{'run':<52}{'step':>10}{'spread':>16}{'peak memory':>14}{'offloaded':>12}{'recomputed':>20}"
    f"{'copy GB/s':>11}{'hidden':>11}"
)


def row(name: str, r: dict, steps: int) -> str:
    """One run's line of the table: its median step time and the spread of its steps, peak, and what
    its pool moved and rebuilt a step. A pool that copied nothing says "no copies" (its stats' hidden
    fraction is 1 then: all of nothing)."""
    s = r["pool"]
    fastest, slowest = r["ms_range"]
    spread = f"{fastest:.1f}-{slowest:.1f}ms"
    head = f"{name:<52}{r['ms']:>8.1f}ms{spread:>16}{format_bytes(r['peak']):>14}"
    if s is None:
        return f"{head}{'-':>12}{'-':>20}{'-':>11}{'-':>11}"
    if not s["offloaded_bytes"] and not s["prefetched_bytes"]:
        rate, hidden = "-", "no copies"
    elif not s["copy_seconds"]:  # copies not timed (none finished yet)
        rate, hidden = "-", "-"
    else:
        rate, hidden = f"{max(s['d2h_gbps'], s['h2d_gbps']):.1f}", f"{100 * s['hidden_fraction']:.0f}%"
    moved = f"{format_bytes(s['offloaded_bytes'] / steps):>12}{recomputed(s, steps):>20}"
    return f"{head}{moved}{rate:>11}{hidden:>11}"


def _install_allocator() -> None:
    """supermem's allocator, so the pool's budget is also its soft limit (too late once CUDA holds
    memory: then the pool runs over PyTorch's allocator, and says so)."""
    import supermem

    from .errors import ActivationError

    try:
        supermem.install()
    except ActivationError as e:
        print(f"note: supermem's allocator is not installed ({e}); the pool runs over PyTorch's\n")
