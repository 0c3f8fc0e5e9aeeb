"""`supermem bench frag`: memory reserved but never allocated, with and without expandable segments.

Workloads (--pattern): two synthetic allocation patterns of a decoder's training step (12 layers, d1024,
vocab 32k, bf16-sized): `varlen`, sequence lengths drawn from 128..2048 each step; `ramp`, a batch that
grows 1..16 over the run. And real training steps on CUDA (the models of `supermem bench train`, built by
train_worker.build): `gpt` (GPT-24) and `resnet` (ResNet-152) at their bench batch, `llama-varlen` (HF
Llama, batch 4, the sequence lengths of `varlen`), `llama-ramp` (HF Llama, the batches of `ramp` at
sequence 1024). Rows: native, native `expandable_segments:True`, supermem, supermem
`expandable_segments:true`, each in a fresh process on a GPU, --repeats processes a row, round robin over
the rows (a step time moves 10-20% between processes). Reported: reserved / allocated at the peak, the
median step time of the row's processes and their spread, and the smallest limit, as a multiple of the
allocated peak, under which the run completes (LIMIT_FACTORS; each its own process; native caps by
set_per_process_memory_fraction, supermem by its `limit:` option).

On a machine without CUDA the synthetic rows of supermem run on the simulated device: the same mallocs
and frees on a CachingAllocator (no tensors, no kernels, no step time), in this process. Native rows and
the model workloads need a GPU (--quick skips the model workloads with a note).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ..cli_args import positive_int
from . import runner, table

H = TypeVar("H")  # what alloc returns and free takes: an address, a tensor's key
LIMIT_FACTORS = (1.00, 1.02, 1.05, 1.10, 1.25, 1.50)
PATTERNS = ("varlen", "ramp")  # synthetic: run on the simulated device without CUDA
# workload -> (its models.PRESETS entry, the lengths() pattern of its (batch, sequence) per step; None:
# the preset's own batch every step)
MODEL_WORKLOADS = {
    "gpt": ("gpt", None),
    "resnet": ("resnet", None),
    "llama-varlen": ("hf-llama", "varlen"),
    "llama-ramp": ("hf-llama", "ramp"),
}
# gpt and resnet repeat one shape: after the first steps nothing new is allocated, 200 would only cost time
FIXED_SHAPE_STEPS = 20
ROWS = (  # name, allocator, its option text
    ("native", "native", None),
    ("native expandable", "native", "expandable_segments:True"),
    ("supermem", "supermem", None),
    ("supermem expandable", "supermem", "expandable_segments:true"),
)


@dataclass(frozen=True)
class Decoder:
    """The tensors a decoder step allocates, in bytes, as functions of batch and sequence length."""

    layers: int = 12
    d_model: int = 1024
    heads: int = 16
    vocab: int = 32000
    elem: int = 2  # bf16

    def params_bytes(self) -> list[int]:
        return [12 * self.d_model * self.d_model * 4] * self.layers + [self.vocab * self.d_model * 4]


def lengths(pattern: str, steps: int, seed: int = 0) -> Iterator[tuple[int, int]]:
    """(batch, sequence length) of each step."""
    rng = random.Random(seed)
    for i in range(steps):
        if pattern == "varlen":
            yield 4, rng.randint(128, 2048)
        else:  # ramp
            yield 1 + (15 * i) // max(1, steps - 1), 1024


def step(alloc: Callable[[int], H], free: Callable[[H], None], m: Decoder, batch: int, seq: int) -> None:
    """One forward and backward: activations saved per layer, attention scores and the loss's logits
    as temporaries, gradients of each layer's size in backward."""
    act = batch * seq * m.d_model * m.elem
    saved: list[list[H]] = []
    for _ in range(m.layers):
        scores = alloc(batch * m.heads * seq * seq * m.elem)
        saved.append([alloc(3 * act), alloc(act), alloc(4 * act), alloc(4 * act)])
        free(scores)
    logits = alloc(batch * seq * m.vocab * 4)  # fp32 log_softmax
    grad = alloc(batch * seq * m.vocab * 4)
    free(logits)
    free(grad)
    for layer in reversed(saved):
        g = alloc(4 * act)
        for t in reversed(layer):
            free(t)
        free(g)


def run_pattern(alloc: Callable[[int], H], free: Callable[[H], None], pattern: str, steps: int) -> int:
    """The whole run; returns the steps completed (all of them, or an OOM propagates)."""
    m = Decoder()
    params = [alloc(n) for n in m.params_bytes()]
    done = 0
    for batch, seq in lengths(pattern, steps):
        step(alloc, free, m, batch, seq)
        done += 1
    for p in params:
        free(p)
    return done


def simulated(pattern: str, steps: int, expandable: bool, limit_bytes: int | None = None) -> dict:
    """The run on a simulated device (64 GiB, nothing touched): peaks, or oom=True."""
    from ..allocator import CachingAllocator, SimulatedDevice
    from ..errors import OutOfMemoryError

    a = CachingAllocator(SimulatedDevice(64 << 30), limit_bytes, expandable_segments=expandable)
    row: dict = {"oom": False}
    t = time.perf_counter()
    try:
        row["steps"] = run_pattern(a.malloc, a.free, pattern, steps)
    except OutOfMemoryError:
        row["oom"] = True
    row["wall_s"] = round(time.perf_counter() - t, 3)
    s = a.stats()
    row.update({k: s[k] for k in ("allocated_bytes_peak", "reserved_bytes_peak", "peak_reserved_ratio")})
    row.update(_moves([s]))
    return row


def _moves(stats: list) -> dict:
    """Summed over supermem's allocators' stats: the holes whose pages moved to a request, the host's
    waits before such moves and the bytes moved; the misses another stream's settled free block served;
    and of reserved - allocated at the peak, the freed blocks awaiting another stream (copies in
    flight). None where 0 (or no allocator of supermem's)."""
    keys = {
        "reclaims": "num_reclaims",
        "reclaim_waits": "num_reclaim_waits",
        "reclaimed_bytes": "reclaimed_bytes",
        "borrows": "num_borrows",
        "pending_at_peak": "pending_at_reserved_peak",
    }
    return {row: sum(s[key] for s in stats) or None for row, key in keys.items()}


def measure(spec: dict) -> dict:
    """Worker side (a GPU): the pattern with torch.empty tensors, or the model workload's training steps;
    peaks and the median milliseconds per step."""
    import torch

    if spec.get("limit_bytes"):  # native's cap (supermem's is its limit: option, in spec["conf"])
        torch.cuda.set_per_process_memory_fraction(
            spec["limit_bytes"] / torch.cuda.get_device_properties(0).total_memory
        )
    from .train_worker import _timed

    step = _model_steps(spec) if spec["pattern"] in MODEL_WORKLOADS else _pattern_steps(spec)
    times_ms = [_timed(run_step, cuda=True) for run_step in step]  # (the train bench's step timer)
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    from .. import registry

    return {
        "steps": len(times_ms),
        "step_ms": statistics.median(times_ms),
        "allocated_bytes_peak": allocated,
        "reserved_bytes_peak": reserved,
        "peak_reserved_ratio": reserved / allocated if allocated else 1.0,
        **_moves([a.stats() for _, a in registry.allocators()]),
    }


def _pattern_steps(spec: dict) -> Iterator[Callable[[], None]]:
    """The synthetic pattern's steps, torch.empty tensors for its allocations."""
    import torch

    live: dict[int, torch.Tensor] = {}

    def alloc(n: int) -> int:
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        live[id(x)] = x
        return id(x)

    def free(h: int) -> None:
        del live[h]

    m = Decoder()
    params = [alloc(n) for n in m.params_bytes()]
    for batch, seq in lengths(spec["pattern"], spec["steps"]):
        yield lambda: step(alloc, free, m, batch, seq)  # noqa: B023  (called before the next is made)
    for p in params:
        free(p)


def _model_steps(spec: dict) -> Iterator[Callable[[], None]]:
    """Training steps of the workload's model: forward under its autocast, backward, SGD. spec["shapes"]:
    (batch, sequence) of each step's tokens, or null for the preset's own batch every step. spec["loss"]
    "chunked": GPT's head and loss through supermem.linear_cross_entropy (no full logits)."""
    import torch

    from ..losses import linear_cross_entropy
    from . import train_worker

    device = torch.device(spec["device"])  # cuda; cpu in the tests
    preset, model, opt = train_worker.build(spec)
    gen = torch.Generator().manual_seed(0)
    shapes = spec.get("shapes")
    fixed = None if shapes else preset.batch(device, gen)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=preset.bf16 and device.type == "cuda"):
            if spec.get("loss") == "chunked":
                loss = linear_cross_entropy(model.hidden(x), model.head.weight, y)
            else:
                loss = preset.loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for shape in shapes or [None] * spec["steps"]:
        if fixed is not None:
            x, y = fixed
        else:  # a causal LM's tokens: its labels are its input_ids (the HF model shifts them)
            x = y = torch.randint(0, model.config.vocab_size, tuple(shape), generator=gen).to(device)
        yield lambda: train_step(x, y)  # noqa: B023  (called before the next is made)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pattern",
        choices=PATTERNS + tuple(MODEL_WORKLOADS),
        action="append",
        help="a workload, again for more (default: all on CUDA; varlen and ramp elsewhere)",
    )
    p.add_argument("--steps", type=positive_int, default=200, help="steps per run (default 200)")
    p.add_argument(
        "--allocator",
        choices=("native", "supermem"),
        action="append",
        help="the rows of one allocator only, again for both (default: both)",
    )
    p.add_argument(
        "--loss",
        choices=("plain", "chunked"),
        default="plain",
        help="gpt's loss: its full logits, or supermem.linear_cross_entropy a chunk of rows at a time",
    )
    p.add_argument(
        "--no-limits",
        action="store_true",
        help="skip the search for the smallest limit each row completes under (a process per factor)",
    )


def run(args: argparse.Namespace) -> dict:
    from ..errors import UsageError

    cuda = args.device == "cuda"
    steps = 20 if args.quick else args.steps
    workloads = args.pattern or list(PATTERNS) + (list(MODEL_WORKLOADS) if cuda else [])
    if not cuda and args.allocator == ["native"]:
        raise UsageError(f"--allocator native: PyTorch's rows need CUDA (device {args.device})")
    models = [w for w in workloads if w in MODEL_WORKLOADS]
    if args.loss == "chunked" and set(workloads) != {"gpt"}:
        raise UsageError("--loss chunked: gpt's head only (--pattern gpt)")
    if models and not cuda:
        if not args.quick:
            need = f"--pattern {'/'.join(models)}: model workloads need CUDA (device {args.device})"
            raise UsageError(need + "; --quick skips them")
        print(f"frag: skipping {', '.join(models)}: model workloads need CUDA (device {args.device})")
        workloads = [w for w in workloads if w not in MODEL_WORKLOADS]
    rows = []
    for workload in workloads:
        chosen = [r for r in ROWS if not args.allocator or r[1] in args.allocator]
        if cuda:
            got = _gpu_rows(args, dict(_spec(workload, steps, args.quick), loss=args.loss), chosen)
        else:
            got = [
                (name, _sim_row(workload, steps, option is not None))
                for name, a, option in chosen
                if a == "supermem"
            ]
        for name, row in got:
            rows.append(dict(row, pattern=workload, config=name + ("" if cuda else " (sim)")))
    print(f"\nfrag: reserved / allocated at the peak, device {args.device} ({steps} steps a run)")
    columns = [
        ("workload", lambda r: r["pattern"], ""),
        ("allocator", lambda r: r["config"], ""),
        ("alloc peak GiB", lambda r: r.get("allocated_bytes_peak", 0) / 2**30, ".2f"),
        ("res. peak GiB", lambda r: r.get("reserved_bytes_peak", 0) / 2**30, ".2f"),
        ("res./alloc", lambda r: r.get("peak_reserved_ratio"), ".3f"),
        ("min limit x", lambda r: r.get("min_limit_x"), ".2f"),
        ("step ms", lambda r: r.get("step_ms"), ".1f"),
        ("min-max ms", _spread, ""),
        ("reclaims", lambda r: r.get("reclaims"), ""),
        ("waits", lambda r: r.get("reclaim_waits"), ""),
        ("moved GiB", lambda r: (r.get("reclaimed_bytes") or 0) / 2**30 or None, ".1f"),
        ("borrows", lambda r: r.get("borrows"), ""),
        ("in flight GiB", lambda r: (r.get("pending_at_peak") or 0) / 2**30 or None, ".2f"),
        ("note", lambda r: r.get("error"), ""),
    ]
    print(table.render(columns, rows))
    if cuda:
        for line in targets(rows):
            print(line)
    return {"bench": "frag", "device": args.device, "rows": rows}


def targets(rows: list[dict]) -> list[str]:
    """The bench's verdicts, for the model workloads run: supermem with expandable segments reserves <=
    1.02x what it allocates at the peak (gpt, resnet, llama-varlen), completes llama-varlen under 1.05x its
    peak where native does not, and steps <= 1.01x as slow as supermem without the option."""
    by = {(r["pattern"], r["config"]): r for r in rows}
    out = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    for w in MODEL_WORKLOADS:
        on, off = by.get((w, "supermem expandable")), by.get((w, "supermem"))
        if on is None or off is None or "error" in on or "error" in off:
            continue
        if w != "llama-ramp":
            ratio = on["peak_reserved_ratio"]
            out.append(f"target frag {w} reserved/allocated <= 1.02: {ratio:.3f}: {verdict(ratio <= 1.02)}")
        x = on["step_ms"] / off["step_ms"]
        n = f"{on.get('runs', 1)} and {off.get('runs', 1)}"
        spread = f"medians of {n} processes: {_spread(on)} against {_spread(off)} ms"
        out.append(f"target frag {w} step <= 1.01x supermem: {x:.3f}x ({spread}): {verdict(x <= 1.01)}")
    on, native = by.get(("llama-varlen", "supermem expandable")), by.get(("llama-varlen", "native"))
    if on and native and "error" not in on and "error" not in native:  # min_limit_x None: not even 1.50
        mine, theirs = on.get("min_limit_x"), native.get("min_limit_x")
        ok = mine is not None and mine <= 1.05 and (theirs is None or theirs > 1.05)
        what = "target frag llama-varlen completes at 1.05x, native not (min limit x)"
        out.append(f"{what}: {mine} vs native {theirs}: {verdict(ok)}")
    return out


def _spec(workload: str, steps: int, quick: bool) -> dict:
    """What every row of `workload` runs: the same steps, the same (batch, sequence) per step."""
    spec: dict = {"bench": "frag", "device": "cuda", "pattern": workload, "steps": steps}
    if workload in MODEL_WORKLOADS:
        preset, pattern = MODEL_WORKLOADS[workload]
        spec["preset"] = preset + ("-quick" if quick else "")
        if pattern is None:
            spec["steps"] = min(steps, FIXED_SHAPE_STEPS)
        else:
            spec["shapes"] = list(lengths(pattern, steps))
    return spec


def _sim_row(pattern: str, steps: int, expandable: bool) -> dict:
    row = simulated(pattern, steps, expandable)
    row["min_limit_x"] = _min_limit(
        row["allocated_bytes_peak"], lambda limit: not simulated(pattern, steps, expandable, limit)["oom"]
    )
    return row


def _gpu_rows(args: argparse.Namespace, spec: dict, chosen: list) -> list[tuple[str, dict]]:
    """The rows of one workload: each row's run --repeats times, round robin over the rows, its median
    (by step time) kept, with the spread; then each row's runs under a cap at LIMIT_FACTORS of its
    allocated peak until one completes."""
    specs = {name: _row_spec(args, spec, allocator, option) for name, allocator, option in chosen}
    runs: dict[str, list[dict]] = {name: [] for name in specs}
    for i in range(args.repeats):
        tag = f" ({i + 1}/{args.repeats})" if args.repeats > 1 else ""
        for name, allocator, option in chosen:
            label = f"frag {spec['pattern']} {allocator} {option or ''}{tag}"
            runs[name].append(runner.run(specs[name], args.timeout, label))
    out = []
    for name in specs:
        row = _median(runs[name])
        if "allocated_bytes_peak" in row and not args.no_limits:
            row["min_limit_x"] = _min_limit(row["allocated_bytes_peak"], _completes(args, specs[name]))
        out.append((name, row))
    return out


def _row_spec(args: argparse.Namespace, spec: dict, allocator: str, option: str | None) -> dict:
    spec = dict(spec, allocator=allocator)
    if allocator == "supermem":
        spec["conf"] = ",".join(filter(None, [args.conf, option])) or None
    else:
        spec["pytorch_alloc_conf"] = option
    return spec


def _median(runs: list[dict]) -> dict:
    """The run of median step time among those that completed (its own peaks with it), its spread and
    count; the first run where none did."""
    done = sorted((r for r in runs if "step_ms" in r and "error" not in r), key=lambda r: r["step_ms"])
    if not done:
        return dict(runs[0])
    times = [r["step_ms"] for r in done]
    row = dict(done[(len(done) - 1) // 2])
    row.update(step_ms=statistics.median(times), step_ms_min=times[0], step_ms_max=times[-1], runs=len(done))
    return row


def _spread(row: dict) -> str:
    lo, hi = row.get("step_ms_min"), row.get("step_ms_max")
    return f"{lo:.1f}-{hi:.1f}" if lo is not None and hi is not None else ""


def _min_limit(peak: int, completes: Callable[[int], bool]) -> float | None:
    """The smallest of LIMIT_FACTORS x `peak` as a cap under which the run completes, tried in order;
    None: not even the last."""
    return next((f for f in LIMIT_FACTORS if completes(int(peak * f))), None)


def _completes(args: argparse.Namespace, spec: dict) -> Callable[[int], bool]:
    """Whether the row's run completes under a cap of `limit` bytes, in a process of its own (native
    caps by its memory fraction, supermem by its `limit:` option)."""

    def completes(limit: int) -> bool:
        if spec["allocator"] == "supermem":
            trial = dict(spec, conf=",".join(filter(None, [spec["conf"], f"limit:{limit}"])))
        else:
            trial = dict(spec, limit_bytes=limit)
        result = runner.run(trial, args.timeout)
        return not result.get("oom") and "error" not in result

    return completes
