"""`supermem demo`: the main job on an embedded default.

Trains a small GPT for a few steps twice, in one process: plainly, then with supermem's tensor pool
under a budget, and prints step time, peak memory and what the pool moved. On a GPU, peak memory is
torch.cuda.max_memory_allocated and the pool offloads to pinned host memory; on CPU there is no
device to spare, so the figure is the saved-activation bytes held in memory (what a GPU would hold)
and "offload" copies into the host pool. On CPU both runs must produce the same losses bit for bit;
on a GPU, within 1% (fused attention kernels differ slightly from run to run even without supermem).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cli_args import positive_int
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

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


SIZES = {  # layers, d, heads, vocab, seq, batch
    "cuda": (12, 768, 12, 8192, 1024, 8),
    "cpu": (4, 128, 4, 1024, 128, 4),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=positive_int, default=6, help="timed training steps per run (default 6)")
    p.add_argument("--budget", default=None, help="pool budget (default: 60%% of the plain run's peak)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument(
        "--policy", choices=live_names(), default="cost_aware", help="pool policy (default cost_aware)"
    )


def train(device: torch.device, steps: int, pool: Pool | None) -> dict:
    layers, d, heads, vocab, seq, batch = SIZES[device.type]
    torch.manual_seed(0)
    model = GPT(layers, d, heads, vocab, seq).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randint(0, vocab, (batch, seq + 1), device=device)
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    tracker = pool if pool is not None else Pool(budget=None, device=device)  # counts activations only

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with tracker, amp:
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
        loss.backward()
        opt.step()
        return loss.item()

    step()  # warm-up: kernels, caches, host pool chunks
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracker.reset_stats()
    losses, t0 = [], time.perf_counter()
    for _ in range(steps):
        losses.append(step())
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    tracker.synchronize()
    s = tracker.stats()
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else s["peak_resident_bytes"]
    return {"ms": seconds * 1e3, "peak": peak, "losses": losses, "pool": s}


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layers, d, heads, vocab, seq, batch = SIZES[device.type]
    what = (
        torch.cuda.get_device_name() if device.type == "cuda" else "CPU (no GPU: memory is saved activations)"
    )
    print(f"supermem demo: GPT {layers}x{d}, batch {batch}x{seq}, {args.steps} steps, on {what}\n")
    plain = train(device, args.steps, None)
    budget = args.budget if args.budget is not None else int(0.6 * plain["peak"])
    min_bytes = 0 if device.type == "cpu" else None
    pooled = train(device, args.steps, Pool(budget, args.policy, device=device, min_bytes=min_bytes))

    print(
        f"{'run':<40}{'step':>10}{'peak memory':>14}{'offloaded':>12}{'recomputed':>12}"
        f"{'copy GB/s':>11}{'hidden':>8}"
    )
    for name, r in (
        ("plain PyTorch", plain),
        (f"supermem pool ({args.policy}, {format_bytes(pooled['pool']['budget_bytes'])})", pooled),
    ):
        s = r["pool"]
        moved, dropped = s["offloaded_bytes"] / args.steps, s["dropped_bytes"] / args.steps
        rate = max(s["d2h_gbps"], s["h2d_gbps"])
        print(
            f"{name:<40}{r['ms']:>8.1f}ms{format_bytes(r['peak']):>14}{format_bytes(moved):>12}"
            f"{format_bytes(dropped):>12}{rate:>11.1f}{100 * s['hidden_fraction']:>7.0f}%"
        )
    saved = 1 - pooled["peak"] / plain["peak"]
    ratio = pooled["ms"] / plain["ms"]
    if device.type == "cpu":
        same = plain["losses"] == pooled["losses"]
        verdict = f"losses identical: {same}"
    else:  # fused attention kernels are not bitwise deterministic from one run to the next
        rel = max(abs(a - b) / abs(a) for a, b in zip(plain["losses"], pooled["losses"]))
        same = rel < 1e-2
        verdict = f"losses match: {same} (largest relative difference {rel:.1e}; GPU kernels vary run to run)"
    print(f"\nmemory saved: {100 * saved:.0f}%   time: {ratio:.2f}x   {verdict}")
    return 0 if same else 1
