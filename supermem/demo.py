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
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import config
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


# Steps before the timed ones, in every run (the losses compare step by step): a planned pool finds
# its regions in the first, records the second, and runs its plan from the third.
WARMUP = 3

SIZES = {  # layers, d, heads, vocab, seq, batch
    "cuda": (12, 768, 12, 8192, 1024, 8),
    "cpu": (4, 128, 4, 1024, 128, 4),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=positive_int, default=6, help="timed training steps per run (default 6)")
    p.add_argument("--budget", default=None, help="pool budget (default: 60%% of the plain run's peak)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--policy", choices=live_names(), default="planned", help="pool policy (default planned)")


def train(device: torch.device, steps: int, pool: Pool | None, ckpt: bool = False) -> dict:
    """`steps` timed steps after WARMUP ones, under `pool`; without one, with no saved-tensor hooks at
    all (a process-wide pool's, a caller's) besides checkpoint's own. On CPU such a run's peak is
    counted in one more step, untimed and after the compared ones, by a pool without a budget."""
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

    def step(hooks: Any) -> float:
        opt.zero_grad(set_to_none=True)
        with hooks, amp:
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(WARMUP):  # kernels, caches, host pool chunks; a planned pool's recorded steps
        step(hooks)
    if device.type == "cuda":
        torch.cuda.synchronize()
        warm_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        warm_peak = pool.stats()["peak_resident_bytes"] if pool is not None else 0
    if pool is not None:
        pool.reset_stats()
    losses, t0 = [], time.perf_counter()
    for _ in range(steps):
        losses.append(step(hooks))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    if pool is not None:
        pool.synchronize()
    s = pool.stats() if pool is not None else None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    elif pool is not None:
        peak = s["peak_resident_bytes"]
    else:
        counter = Pool(budget=None, device=device)  # counts saved activations, moves nothing
        step(counter)
        peak = counter.stats()["peak_resident_bytes"]
    return {"ms": seconds * 1e3, "peak": peak, "warm_peak": warm_peak or peak, "losses": losses, "pool": s}


class _NoSavedTensorHooks:
    """This thread's default saved-tensor hooks taken off (popped, every one) and put back after:
    the plain rows run as PyTorch alone would, even under SUPERMEM_CONF=pool (process-wide hooks)."""

    def __enter__(self) -> None:
        self.taken = []
        while (top := torch._C._autograd._top_saved_tensors_default_hooks(False)) is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.taken.append(top)

    def __exit__(self, *exc: object) -> None:
        for pack, unpack in reversed(self.taken):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


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

    print(
        f"{'run':<52}{'step':>10}{'peak memory':>14}{'offloaded':>12}{'recomputed':>20}"
        f"{'copy GB/s':>11}{'hidden':>8}"
    )
    for name, r in runs:
        print(row(name, r, args.steps))
    print(
        "(a step's offloaded bytes; recomputed: block calls run light, which save nothing and run again\n"
        " in backward, and saves dropped to be rebuilt; the first two rows run without any pool)"
    )
    warm = [format_bytes(r["warm_peak"]) for _, r in runs[2:] if r["warm_peak"] > 1.01 * r["peak"]]
    if warm:  # the steps a planned pool records before its plan run under its reactive fallback
        print(f"(the pool runs' first {WARMUP} steps, before a plan, peaked at {' and '.join(warm)})")
    print()
    for label, r in (("supermem pool", pool_run), ("checkpoint per block", ckpt)):
        saved, ratio = 1 - r["peak"] / plain["peak"], r["ms"] / plain["ms"]
        print(f"{label + ':':<22} memory saved: {100 * saved:.0f}%   time: {ratio:.2f}x")
    others = [r for _, r in runs[1:]]
    if device.type == "cpu":
        same = all(r["losses"] == plain["losses"] for r in others)
        verdict = f"losses identical: {same}"
    else:  # fused attention kernels are not bitwise deterministic from one run to the next
        rel = max(abs(a - b) / abs(a) for r in others for a, b in zip(plain["losses"], r["losses"]))
        same = rel < 1e-2
        verdict = f"losses match: {same} (largest relative difference {rel:.1e}; GPU kernels vary run to run)"
    print(verdict)
    return 0 if same else 1


def row(name: str, r: dict, steps: int) -> str:
    """One run's line of the table: its step time, peak, and what its pool moved and rebuilt a step."""
    s = r["pool"]
    head = f"{name:<52}{r['ms']:>8.1f}ms{format_bytes(r['peak']):>14}"
    if s is None:
        return f"{head}{'-':>12}{'-':>20}{'-':>11}{'-':>8}"
    rate = max(s["d2h_gbps"], s["h2d_gbps"])
    return (
        f"{head}{format_bytes(s['offloaded_bytes'] / steps):>12}{recomputed(s, steps):>20}"
        f"{rate:>11.1f}{100 * s['hidden_fraction']:>7.0f}%"
    )


def _install_allocator() -> None:
    """supermem's allocator, so the pool's budget is also its soft limit (too late once CUDA holds
    memory: then the pool runs over PyTorch's allocator, and says so)."""
    import supermem

    from .errors import ActivationError

    try:
        supermem.install()
    except ActivationError as e:
        print(f"note: supermem's allocator is not installed ({e}); the pool runs over PyTorch's\n")
