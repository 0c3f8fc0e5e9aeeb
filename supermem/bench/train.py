"""`supermem bench train`: training steps of GPT-24, ResNet-152 and (--model hf-llama) Hugging Face's Llama
(models.PRESETS), one row per mode.

Two tables per model, each with the native row of this run as its baseline:
- allocator: native vs supermem's allocator. Step ms (median of timed steps, CUDA events), ratio,
  peak allocated/reserved GiB and fragmentation = peak reserved / peak allocated.
  Targets: step <= 1.01x native, fragmentation <= native's.
- savers: what a user can do to use less memory: checkpoint every block, checkpoint the first half of
  the blocks, save_on_cpu (pure PyTorch, native allocator), and supermem's tensor pool at budgets of
  native's peak, under the `lru` policy ("pool N%"), the `cost_aware` one ("cost_aware N%") and, on
  ResNet, cost_aware with ReLU compression as a third treatment ("cost_aware+compress N%"). Step
  ms, ratio, peak allocated, bytes offloaded, recomputed and compressed, copy GB/s, % copy hidden.
  Targets: each cost_aware row beats the lru row of its budget in step time and peak, and its peak is
  within 5% of its budget.
- hf-llama: its savers are HF's own `gradient_checkpointing_enable()`, non-reentrant ("hf checkpoint") and
  reentrant ("hf checkpoint reentrant"), in place of checkpointing model.blocks; with --sweep the pool
  runs at 75% and 50% of native's peak and at each of those rows' peaks. Target: no pool row slower
  than an HF checkpointing row at an equal (within 1%) or lower peak.

A new row is a `Mode`; a new way to save memory is an entry in `SAVERS` (worker side).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..cli_args import check_names, comma_list, nonnegative_int, positive_float, positive_int
from . import runner, table

GiB = 1 << 30
BLOCK_MODELS = ("gpt", "resnet")  # the bench's own models: model.blocks, checkpointed by torch's checkpoint
HF_MODELS = ("hf-llama",)  # transformers' models: checkpointed by gradient_checkpointing_enable()
MODELS = BLOCK_MODELS + HF_MODELS
STEP_TARGET = 1.01
# docs/design.md#baselines, H200, torch 2.11 (the anchors script): step ms, peak allocated GiB. Not this run.
REFERENCE = {
    "gpt": {"native": (61.1, 15.93), "checkpoint": (78.9, 9.36), "save_on_cpu": (516.8, 8.47)},
    "resnet": {"native": (69.1, 11.25), "checkpoint": (113.7, 4.47), "save_on_cpu": (747.9, 1.65)},
}


@dataclass(frozen=True)
class Mode:
    name: str  # the row's label
    allocator: str  # "native" | "supermem"
    saver: str  # a key of SAVERS
    budget: float | None = None  # pool: the fraction of the native row's peak allocated bytes
    table: str = "savers"  # "allocator" | "savers"
    options: dict = field(default_factory=dict)  # extra spec keys for the saver, e.g. {"policy": "lru"}
    models: tuple[str, ...] = ()  # the models it runs for ("gpt", "resnet"); empty: all
    budget_of: str = "native"  # the row (run earlier) whose peak allocated bytes `budget` is a fraction of


def runs_on(m: Mode, model: str) -> bool:
    return not m.models or model in m.models


def modes(device: str, budgets: list[float]) -> list[Mode]:
    """The rows this machine can run, native first (the pool's budgets are fractions of its peak)."""
    import supermem

    cuda = device == "cuda"
    out = [Mode("native", "native", "none", table="allocator")]
    if cuda:
        out.append(Mode("supermem", "supermem", "none", table="allocator"))
    out.append(Mode("checkpoint", "native", "checkpoint", models=BLOCK_MODELS))
    out.append(Mode("checkpoint first half", "native", "checkpoint_half", models=BLOCK_MODELS))
    out += hf_checkpoint_modes()
    if cuda:
        out.append(Mode("save_on_cpu", "native", "save_on_cpu"))
    if cuda and hasattr(supermem, "pool"):
        for b in budgets:
            out.append(Mode(f"lru {b:.0%}", "supermem", "pool", budget=b, options={"policy": "lru"}))
            out.append(
                Mode(f"cost_aware {b:.0%}", "supermem", "pool", budget=b, options={"policy": "cost_aware"})
            )
            # ReLU compression as a third treatment; ResNet only (GPT has no ReLU: the same as cost_aware)
            compress = {"policy": "cost_aware", "treatments": ["offload", "recompute", "compress"]}
            out.append(
                Mode(
                    f"cost_aware+compress {b:.0%}",
                    "supermem",
                    "pool",
                    b,
                    options=compress,
                    models=("resnet",),
                )
            )
            out.append(Mode(f"planned {b:.0%}", "supermem", "pool", budget=b, options={"policy": "planned"}))
    return out


def hf_checkpoint_modes() -> list[Mode]:
    """HF's own checkpointing of every decoder layer, as its users turn it on: non-reentrant (HF's default)
    and reentrant."""
    return [
        Mode(name, "native", "hf_checkpoint", options={"reentrant": reentrant}, models=HF_MODELS)
        for name, reentrant in (("hf checkpoint", False), ("hf checkpoint reentrant", True))
    ]


SWEEP_BUDGETS = (0.9, 0.75, 0.6, 0.5)
HF_SWEEP_BUDGETS = (0.75, 0.5)  # and each HF checkpointing row's peak: the sweep in ~4 minutes on an H200
# --sweep's warm-up: a planned pool records its first steps, then may record and plan again a few times
# (PlanRunner: MAX_REPLANS) before its plan holds; the rows time the steps after (an H100 sweep with 3
# warm-up steps timed GPT-24's planned 75% at 183.7 ms a step, its plan's own steps at 95.3)
SWEEP_WARMUP = 10
COMPILE_BUDGETS = (1.0, 0.5, 0.2)  # torch._functorch.config.activation_memory_budget


def sweep_modes(device: str) -> list[Mode]:
    """--sweep: every baseline, then cost_aware and planned at fractions of native's peak and at
    checkpoint's own peak (an HF model: at HF_SWEEP_BUDGETS and each HF checkpointing row's peak). On
    CPU one torch.compile row only: inductor's build takes ~15 s a row; none for an HF model."""
    cuda = device == "cuda"
    out = [Mode("native", "native", "none", table="allocator")]
    out.append(Mode("checkpoint", "native", "checkpoint", models=BLOCK_MODELS))
    reentrant = {"reentrant": True}
    out.append(Mode("checkpoint reentrant", "native", "checkpoint", options=reentrant, models=BLOCK_MODELS))
    for name, f in (("quarter", 0.25), ("half", 0.5), ("three quarters", 0.75)):
        opts = {"fraction": f}
        out.append(
            Mode(f"checkpoint first {name}", "native", "checkpoint_first", options=opts, models=BLOCK_MODELS)
        )
    out += hf_checkpoint_modes()
    if cuda:
        out.append(Mode("save_on_cpu", "native", "save_on_cpu"))
    # supermem.linear_cross_entropy in place of the head and its loss (GPT only: its loss is the spike)
    out.append(Mode("chunked loss", "native", "none", options={"loss": "chunked"}, models=("gpt",)))
    import torch

    if hasattr(torch.nn, "LinearCrossEntropyOptions"):  # torch's own (2.13), its chunked path, beside it
        torchs = {"loss": "torch_chunked"}
        out.append(Mode("torch chunked loss", "native", "none", options=torchs, models=("gpt",)))
    for b in COMPILE_BUDGETS if cuda else COMPILE_BUDGETS[1:2]:
        opts = {"memory_budget": b}
        out.append(Mode(f"compile budget {b}", "native", "compile", options=opts, models=BLOCK_MODELS))
    for policy in ("cost_aware", "planned"):
        opts = {"policy": policy}
        for b in SWEEP_BUDGETS:
            ms = () if b in HF_SWEEP_BUDGETS else BLOCK_MODELS
            out.append(Mode(f"{policy} {b:.0%}", "supermem", "pool", budget=b, options=opts, models=ms))
        name = f"{policy} ckpt peak"
        out.append(
            Mode(name, "supermem", "pool", 1.0, options=opts, models=BLOCK_MODELS, budget_of="checkpoint")
        )
        for ck in hf_checkpoint_modes():  # "cost_aware hf ckpt peak", "... hf ckpt reentrant peak"
            name = f"{policy} {ck.name.replace('checkpoint', 'ckpt')} peak"
            out.append(Mode(name, "supermem", "pool", 1.0, options=opts, models=HF_MODELS, budget_of=ck.name))
    # ReLU compression offered to the plan (packs that wait for nothing: Compress(room="full")); ResNet
    # only (GPT has no ReLU)
    opts = {"policy": "planned", "treatments": ["offload", "recompute", "compress:full"]}
    for label, b, of in (("75%", 0.75, "native"), ("50%", 0.5, "native"), ("ckpt peak", 1.0, "checkpoint")):
        name = f"planned+compress {label}"
        out.append(Mode(name, "supermem", "pool", b, options=opts, models=("resnet",), budget_of=of))
    # The plan over a step without the loss's spike (GPT only), at the same budgets as the rows above
    opts = {"policy": "planned", "loss": "chunked"}
    budgets = [(f"{b:.0%}", b, "native") for b in SWEEP_BUDGETS] + [("ckpt peak", 1.0, "checkpoint")]
    for label, b, of in budgets:
        name = f"planned+chunked loss {label}"
        out.append(Mode(name, "supermem", "pool", b, options=opts, models=("gpt",), budget_of=of))
    return out


# ---- worker side ---------------------------------------------------------------------------------


def _no_saver(spec: dict) -> Callable[[], contextlib.AbstractContextManager]:
    return contextlib.nullcontext


def _save_on_cpu(spec: dict) -> Callable[[], contextlib.AbstractContextManager]:
    import torch

    return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)


def _pool(spec: dict) -> Callable[[], contextlib.AbstractContextManager]:
    import supermem

    # Treatments by name: supermem.pool reuses one Pool for the same names on every step.
    kw = {"treatments": tuple(spec["treatments"])} if spec.get("treatments") else {}
    return lambda: supermem.pool(budget=spec["budget_bytes"], policy=spec.get("policy", "lru"), **kw)


# saver name -> (spec -> a context-manager factory entered around forward+backward). "checkpoint",
# "checkpoint_half" and "checkpoint_first" also set model.checkpoint_blocks (all blocks, the first half,
# the first spec["fraction"]); "hf_checkpoint" calls an HF model's gradient_checkpointing_enable();
# "compile" runs torch.compile(model) under spec["memory_budget"] (_prepare does these). When
# the `as` value has stats() (the pool: cumulative counters), they are read over the timed steps
# (reset_stats() before, synchronize() after, when it has them).
SAVERS = {
    "none": _no_saver,
    "checkpoint": _no_saver,
    "checkpoint_half": _no_saver,
    "checkpoint_first": _no_saver,
    "hf_checkpoint": _no_saver,
    "compile": _no_saver,
    "save_on_cpu": _save_on_cpu,
    "pool": _pool,
}


def measure(spec: dict) -> dict:
    """Worker side: build the model, run warm-up then timed steps; step ms, peaks, pool stats."""
    import torch
    import torch.nn.functional as F

    from ..losses import linear_cross_entropy
    from .models import PRESETS

    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    if cuda:  # as the anchors were measured
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = False
    preset = PRESETS[spec["preset"]]
    torch.manual_seed(0)
    with device:
        model = preset.build()
    forward = _prepare(model, spec)
    x, y = preset.batch(device, torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    saver = SAVERS[spec["saver"]](spec)
    chunked_loss = spec.get("loss") == "chunked"
    torch_chunked_loss = spec.get("loss") == "torch_chunked"
    amp = preset.bf16 and cuda
    entered: list = []  # the saver's `as` value, when it keeps stats (the pool)
    # CPU has no allocator watermark: --sweep counts the bytes saved for backward (what the pool budgets)
    saved = _SavedBytes(model) if spec.get("saved_peak") and not cuda and spec["saver"] != "pool" else None

    def step() -> torch.Tensor:
        with saver() as ctx, saved or contextlib.nullcontext():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                if chunked_loss:  # the head and its loss a chunk of rows at a time: no full logits
                    loss = linear_cross_entropy(model.hidden(x), model.head.weight, y)
                elif torch_chunked_loss:  # torch's own, chunked as its options pick; (N, d) rows only
                    h, options = model.hidden(x).flatten(0, -2), torch.nn.LinearCrossEntropyOptions()
                    loss = F.linear_cross_entropy(h, model.head.weight, y.flatten(), options=options)
                else:
                    loss = preset.loss(forward, x, y)
            loss.backward()
        if hasattr(ctx, "stats") and not entered:
            entered.append(ctx)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()  # allocates gradients and optimizer state
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    warmup_peaks = []  # each warm-up step's peak: a planned pool's recorded steps may rise higher
    for _ in range(spec["warmup"] - 1):
        step()
        if cuda:
            sync()
            warmup_peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
    warmup_plans = {}  # how often the pool planned (and planned again, lower) before the timed steps
    for ctx in entered:  # count the timed steps only
        if hasattr(ctx, "synchronize"):
            ctx.synchronize()
        if hasattr(ctx, "stats"):
            warmup_plans = {k: ctx.stats().get(k, 0) for k in ("plans", "replans")}
        if hasattr(ctx, "reset_stats"):
            ctx.reset_stats()
    times_ms = []
    for _ in range(spec["steps"]):
        times_ms.append(_timed(step, cuda))
    row = {
        "preset": preset.label,
        "step_ms": round(statistics.median(times_ms), 2),
        "step_ms_all": [round(t, 2) for t in times_ms],
    }
    if cuda:
        alloc, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        row.update(peak_alloc_bytes=alloc, peak_reserved_bytes=reserved, frag=reserved / alloc)
        row["warmup_peak_alloc_bytes"] = max(warmup_peaks, default=None)
        row["warmup_step_peak_bytes"] = warmup_peaks
    row["warmup_plans"] = warmup_plans
    row["pool"] = _saver_stats(entered, spec["steps"])
    if saved is not None:
        row["peak_alloc_bytes"] = saved.peak_bytes
    elif spec.get("saved_peak") and not cuda and row["pool"]:
        row["peak_alloc_bytes"] = row["pool"]["peak_resident_bytes"]
    row["loss"] = float(step())
    return row


def _prepare(model, spec: dict):
    """Sets the model up for spec's saver (checkpointing, compile); returns what the step calls."""
    saver = spec["saver"]
    reentrant = spec.get("reentrant", False)
    if saver == "hf_checkpoint":
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ValueError(f"hf_checkpoint needs a Hugging Face model, not {type(model).__name__}")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model
    if hasattr(model, "blocks"):
        n = len(model.blocks)
        first = int(spec.get("fraction", 0) * n)
        model.checkpoint_blocks = {
            "checkpoint": True,
            "checkpoint_half": n // 2,
            "checkpoint_first": first,
        }.get(saver, False)
        model.checkpoint_reentrant = reentrant
    elif saver.startswith("checkpoint"):  # an HF model: its own checkpointing is hf_checkpoint
        raise ValueError(f"{saver} checkpoints model.blocks; {type(model).__name__} has none")
    if saver == "compile":
        import torch

        from .. import torch_private as tp

        tp.set_compile_memory_budget(spec["memory_budget"])  # read when the backward graph is partitioned
        return torch.compile(model)
    return model


def _saver_stats(entered: list, steps: int) -> dict | None:
    """The pool's stats over the timed steps (its counters are cumulative; bytes become per step)."""
    if not entered:
        return None
    ctx = entered[0]
    if hasattr(ctx, "synchronize"):
        ctx.synchronize()
    all_stats = ctx.stats()
    stats = {k: v for k, v in all_stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if all_stats.get("plan"):  # the planned policy: predictions beside the last step's measurements
        stats["plan"] = all_stats["plan"]
    for key in ("offloaded_bytes", "prefetched_bytes", "dropped_bytes", "compressed_bytes"):
        if key in stats:
            stats[key + "_per_step"] = stats[key] / steps
    return stats


class _SavedBytes:
    """Saved-tensor hooks that count the bytes autograd holds for backward (parameters excluded, each
    storage once) and their peak since the first step. Checkpointed blocks' own hooks win inside them."""

    def __init__(self, model) -> None:
        import torch

        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.held: dict[int, list] = {}  # storage data_ptr -> [holders alive, bytes]
        self.live_bytes = self.peak_bytes = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.t)

    def __enter__(self):
        return self.hooks.__enter__()

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)

    def _pack(self, t) -> _Held:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params:
            return _Held(t)
        held = self.held.setdefault(ptr, [0, storage.nbytes()])
        if held[0] == 0:
            self.live_bytes += held[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        held[0] += 1
        return _Held(t, lambda: self._release(ptr))

    def _release(self, ptr: int) -> None:
        held = self.held[ptr]
        held[0] -= 1
        if held[0] == 0:
            self.live_bytes -= held[1]
            del self.held[ptr]


class _Held:
    """A saved tensor; autograd frees it with the graph after backward, and then it is released."""

    def __init__(self, t, release: Callable[[], None] | None = None) -> None:
        self.t, self.release = t, release

    def __del__(self) -> None:
        if self.release is not None:
            self.release()


def _timed(step: Callable[[], object], cuda: bool) -> float:
    if not cuda:
        t = time.perf_counter()
        step()
        return (time.perf_counter() - t) * 1e3
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


# ---- parent side ---------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        choices=(*MODELS, "all"),
        default="all",
        help="all: gpt and resnet; hf-llama needs transformers (default all)",
    )
    p.add_argument(
        "--modes",
        type=comma_list(str),
        default=[],
        help="rows or savers to run, e.g. supermem,pool (default: all)",
    )
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per process (default 10)")
    p.add_argument(
        "--warmup",
        type=nonnegative_int,
        default=3,
        help="steps before timing, the first included (default 3)",
    )
    p.add_argument(
        "--budgets",
        type=comma_list(positive_float),
        default=[1.0, 0.75, 0.6, 0.5],
        help="pool budgets, fractions of native's peak allocated (default 1.0,0.75,0.6,0.5)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="every baseline and the pool (cost_aware, planned) at 90/75/60/50%% of native's peak and at"
        " checkpoint's: one table sorted by peak, a Pareto line per pool row",
    )
    p.add_argument(
        "--ddp",
        type=positive_int,
        default=None,
        metavar="N",
        help="GPT under DDP on N ranks (see bench/ddp.py)",
    )


def run(args: argparse.Namespace) -> dict:
    if args.ddp is not None:
        from . import ddp

        return ddp.run(args)
    if args.quick:
        args.steps, args.warmup = 3, 2
    wanted = set(args.modes)
    sweep = getattr(args, "sweep", False)
    if sweep and not args.quick:
        args.warmup = max(args.warmup, SWEEP_WARMUP)
    all_modes = sweep_modes(args.device) if sweep else modes(args.device, args.budgets)
    every = sweep_modes("cuda") if sweep else modes("cuda", args.budgets)  # the names --modes may give
    check_names("--modes", args.modes, _names(every), here=_names(all_modes))
    models = BLOCK_MODELS if args.model == "all" else (args.model,)
    _check_models(models, args.modes, every)
    chosen = [m for m in all_modes if _selected(m, wanted)]
    out = {"bench": "train", "device": args.device, "models": {}}
    for model in models:
        rows = _run_model(model, [m for m in chosen if runs_on(m, model)], args)
        out["models"][model] = rows
        out.setdefault("env", rows[0].get("env"))
        (_print_sweep if sweep else _print_tables)(model, rows, args)
    return out


def _check_models(models: tuple[str, ...], names: list[str], every: list[Mode]) -> None:
    """UsageError, before anything runs: a --modes name that runs for none of the models (an HF row for
    gpt, checkpointing model.blocks for hf-llama), or an HF model without transformers."""
    import importlib.util

    from ..errors import UsageError

    for name in names:
        for_models = {x for m in every if name in (m.name, m.saver) for x in (m.models or MODELS)}
        if not for_models & set(models):
            raise UsageError(
                f"--modes: {name!r} runs only for --model {'/'.join(sorted(for_models))},"
                f" not {'/'.join(models)}"
            )
    if set(models) & set(HF_MODELS) and importlib.util.find_spec("transformers") is None:
        raise UsageError(f"--model {'/'.join(models)} needs transformers (pip install transformers)")


def _names(ms: list[Mode]) -> list[str]:
    return [name for m in ms for name in (m.name, m.saver)]


def _selected(m: Mode, wanted: set[str]) -> bool:
    """--modes names rows ("supermem", "pool 75%") or savers ("pool"); native always runs (the baseline)."""
    return not wanted or m.name == "native" or m.name in wanted or m.saver in wanted


def _run_model(model: str, chosen: list[Mode], args: argparse.Namespace) -> list[dict]:
    preset = model + ("-quick" if args.quick else "")
    base = {"bench": "train", "preset": preset, "device": args.device, "steps": args.steps}
    base["warmup"] = args.warmup
    if getattr(args, "sweep", False):
        base["saved_peak"] = True  # a peak on CPU too: the sweep's budgets are fractions of it

    def spec(m: Mode) -> dict:
        conf = args.conf if m.allocator == "supermem" else None
        return {**base, **m.options, "allocator": m.allocator, "conf": conf, "saver": m.saver}

    # Allocator rows are compared to 1%: run them interleaved `repeats` times and keep each one's best.
    alloc_modes = [m for m in chosen if m.table == "allocator"]
    runs: dict[str, list[dict]] = {m.name: [] for m in alloc_modes}
    for _ in range(args.repeats):
        for m in alloc_modes:
            runs[m.name].append(runner.run(spec(m), args.timeout, f"{model} {m.name}"))
    rows = {name: _best(rs) for name, rs in runs.items()}
    for m in chosen:
        if m.name in rows:
            continue
        s = spec(m)
        if m.budget is not None:
            ref_peak = rows.get(m.budget_of, {}).get("peak_alloc_bytes")
            if not ref_peak:
                rows[m.name] = {"error": f"no {m.budget_of} peak to take the budget from"}
                continue
            s["budget_bytes"] = int(m.budget * ref_peak)
        rows[m.name] = runner.run(s, args.timeout, f"{model} {m.name}")
        rows[m.name]["budget_bytes"] = s.get("budget_bytes")
    out = []
    for m in chosen:
        row = rows[m.name]
        row.update(config=m.name, allocator=m.allocator, table=m.table, budget=m.budget)
        out.append(row)
    return out


def _best(rs: list[dict]) -> dict:
    ok = [r for r in rs if "step_ms" in r]
    best = dict(min(ok, key=lambda r: r["step_ms"]) if ok else rs[-1])
    best["step_ms_runs"] = [r.get("step_ms") for r in rs]
    return best


def _gib(key: str) -> Callable[[dict], float]:
    return lambda r: r[key] / GiB


def _print_tables(model: str, rows: list[dict], args: argparse.Namespace) -> None:
    native = next(r for r in rows if r["config"] == "native")
    for r in rows:
        r["step_x"] = table.ratio(r.get("step_ms"), native.get("step_ms"))
    label = native.get("preset", model)
    print(f"\n{label}: allocator (baseline: native, this run; best of {args.repeats} processes)")
    columns = [
        ("config", lambda r: r["config"], ""),
        ("step ms", lambda r: r["step_ms"], ".1f"),
        ("x native", lambda r: r["step_x"], ".3f"),
        ("peak alloc GiB", _gib("peak_alloc_bytes"), ".2f"),
        ("peak resv GiB", _gib("peak_reserved_bytes"), ".2f"),
        ("frag", lambda r: r["frag"], ".3f"),
        ("note", _note, ""),
    ]
    print(table.render(columns, [r for r in rows if r["table"] == "allocator"]))
    savers = [native] + [r for r in rows if r["table"] == "savers"]
    if len(savers) > 1:
        print(f"\n{label}: memory savers (baseline: native, this run)")
        columns = [
            ("config", lambda r: r["config"], ""),
            ("allocator", lambda r: r["allocator"], ""),
            ("step ms", lambda r: r["step_ms"], ".1f"),
            ("x native", lambda r: r["step_x"], ".2f"),
            ("budget GiB", _gib("budget_bytes"), ".2f"),
            ("peak alloc GiB", _gib("peak_alloc_bytes"), ".2f"),
            ("offloaded GiB/step", lambda r: r["pool"]["offloaded_bytes_per_step"] / GiB, ".2f"),
            ("recomputed GiB/step", lambda r: r["pool"]["dropped_bytes_per_step"] / GiB, ".2f"),
            ("compressed GiB/step", lambda r: r["pool"]["compressed_bytes_per_step"] / GiB, ".2f"),
            ("copy GB/s d2h/h2d", lambda r: f"{r['pool']['d2h_gbps']:.1f}/{r['pool']['h2d_gbps']:.1f}", ""),
            ("hidden %", lambda r: 100 * r["pool"]["hidden_fraction"], ".0f"),
            ("note", _note, ""),
        ]
        print(table.render(columns, savers))
    ref = REFERENCE.get(model)
    if ref and not args.quick:
        print(
            "reference (docs/design.md#baselines, H200, not this run): "
            + ", ".join(f"{k} {v[0]} ms / {v[1]} GiB" for k, v in ref.items())
        )
    _print_targets(label, native, rows)
    _print_hf_targets(label, rows, "GiB", GiB)
    if len(savers) > 1:  # one line per model for summaries (tools/ci/gpu_check.sh greps "savers ")
        parts = [
            f"{r['config']} {_fmt(r.get('step_x'), '.2f')}x {_fmt(_peak_gib(r), '.2f')}GiB" for r in savers
        ]
        print(f"savers {label}: " + ", ".join(parts))


def _print_sweep(model: str, rows: list[dict], args: argparse.Namespace) -> None:
    """One table sorted by peak (rows without one last), then a Pareto line per pool row. On CPU the
    peaks are bytes saved for backward (eager rows: each storage once; pool rows: the pool's count)."""
    unit, size = ("MiB", 1 << 20) if args.quick else ("GiB", GiB)
    native = next(r for r in rows if r["config"] == "native")
    for r in rows:
        r["step_x"] = table.ratio(r.get("step_ms"), native.get("step_ms"))
    label = native.get("preset", model)
    peak_of = lambda r: r.get("peak_alloc_bytes") or float("inf")  # noqa: E731
    print(f"\n{label}: sweep (baseline: native, this run; sorted by peak)")
    columns = [
        ("config", lambda r: r["config"], ""),
        ("step ms", lambda r: r["step_ms"], ".1f"),
        ("x native", lambda r: r["step_x"], ".2f"),
        (f"budget {unit}", lambda r: r["budget_bytes"] / size, ".2f"),
        (f"peak alloc {unit}", lambda r: r["peak_alloc_bytes"] / size, ".2f"),
        ("note", _note, ""),
    ]
    print(table.render(columns, sorted(rows, key=peak_of)))
    mem = lambda b: f"{b / size:.2f}{unit}"  # noqa: E731
    # PyTorch's own ways to the same memory (not compile's, not a chunked loss: another loss expression)
    other = ("compile", "chunked", "torch chunked")
    eager = [r for r in rows if r["allocator"] == "native" and not r["config"].startswith(other)]
    for r in rows:
        if r["allocator"] == "native":
            continue
        x, peak = r.get("step_x"), r.get("peak_alloc_bytes")
        line = f"pareto {label} {r['config']}: {_fmt(x, '.2f')}x {mem(peak) if peak else '-'}"
        if None in (x, peak):
            line += ", NO DATA"
        else:
            dom = [
                e
                for e in eager
                if e.get("peak_alloc_bytes") is not None
                and e.get("step_x") is not None
                and e["peak_alloc_bytes"] <= peak
                and e["step_x"] < x
            ]
            names = ", ".join(f"{e['config']} ({e['step_x']:.2f}x {mem(e['peak_alloc_bytes'])})" for e in dom)
            line += f", dominated by {names}" if dom else ", no eager baseline dominates it"
        pool = r.get("pool") or {}
        plan = pool.get("plan")
        warm = r.get("warmup_plans") or {}
        if warm.get("replans"):  # a planned step rose over the budget: the shape was planned again, lower
            peaks = " ".join(f"{b / size:.2f}" for b in r.get("warmup_step_peak_bytes") or [])
            line += f"; warm-up: {warm['plans']} plan(s), {warm['replans']} replan(s), step peaks {peaks}"
        if pool.get("plans"):  # a step recorded and planned again inside the timed ones
            line += f"; {pool['plans']} plan(s) made in the timed steps"
        ran = [(k, pool.get(k)) for k in RAN_COUNTERS]
        if any(v for _, v in ran):
            line += "; " + ", ".join(f"{k} {v}" for k, v in ran if v)
        if plan:
            # measured: the row's median step (the plan's last step alone is one sample, and the step
            # a sweep closes its timing on)
            step_ms = r.get("step_ms") or plan["measured_step_s"] * 1e3
            off = plan["predicted_step_s"] * 1e3 / step_ms - 1
            line += (
                f"; plan peak {mem(plan['predicted_peak_bytes'])} predicted /"
                f" {mem(plan['measured_peak_bytes'])} measured, step {plan['predicted_step_s'] * 1e3:.1f}"
                f" predicted / {step_ms:.1f} measured ms ({off:+.0%})"
            )
        print(line)
    _print_hf_targets(label, rows, unit, size)


# How a pool row's timed steps ran: blocks the pool did not see (under checkpoint, bypassed, lean), its
# own op replays, and where it left its plan: the allocator's soft limit called it, a tensor came back
# with the host waiting (an H100 sweep's planned+compress ResNet-152 row took 3.05x native with 122 of
# those a step; its other rows, 1-2)
RAN_COUNTERS = (
    "light_calls",
    "graph_replays",
    "bypassed_calls",
    "lean_calls",
    "lean_drops",
    "replays",
    "pressure_calls",
    "sync_restores",
)


def _peak_gib(r: dict) -> float | None:
    peak = r.get("peak_alloc_bytes")
    return None if peak is None else peak / GiB


def _note(r: dict) -> str | None:
    if r.get("oom"):
        return "OOM"
    warm, peak = r.get("warmup_peak_alloc_bytes"), r.get("peak_alloc_bytes")
    if r.get("error") is None and warm and peak and warm > 1.01 * peak:
        return f"warm-up peak {warm / GiB:.2f} GiB"
    return r.get("error")


def _print_targets(label: str, native: dict, rows: list[dict]) -> None:
    by_name = {r["config"]: r for r in rows}
    for r in rows:
        if not r["config"].startswith("cost_aware "):
            continue
        lru = by_name.get("lru " + r["config"].split(" ", 1)[1], {})
        x, lx, peak, lpeak = (
            r.get("step_x"),
            lru.get("step_x"),
            r.get("peak_alloc_bytes"),
            lru.get("peak_alloc_bytes"),
        )
        # Both hold the budget (the allocator's soft limit), so "lower" means no higher: within 1%.
        ok = None not in (x, lx, peak, lpeak) and x < lx and peak <= 1.01 * lpeak
        print(
            f"target {label} {r['config']}: {_fmt(x, '.2f')}x {_fmt(_peak_gib(r), '.2f')}GiB vs lru "
            f"{_fmt(lx, '.2f')}x {_fmt(_peak_gib(lru), '.2f')}GiB (faster, peak no higher): {_met(ok, x)}"
        )
        budget = r.get("budget_bytes")
        ok = None not in (peak, budget) and peak <= 1.05 * budget
        print(f"target {label} {r['config']} peak within 5% of budget: {_met(ok, peak)}")
    for r in rows:
        if r["config"] != "supermem":
            continue
        x = r.get("step_x")
        ok = x is not None and x <= STEP_TARGET
        print(f"target {label} step: supermem {_fmt(x, '.3f')}x native (<= {STEP_TARGET}x): {_met(ok, x)}")
        f, nf = r.get("frag"), native.get("frag")
        ok = f is not None and nf is not None and f <= nf
        print(
            f"target {label} frag: supermem {_fmt(f, '.3f')} vs native {_fmt(nf, '.3f')} (<=): {_met(ok, f)}"
        )


HF_PEAK_SLACK = 1.01  # an HF checkpointing row within 1% of a pool row's peak is at its peak


def _print_hf_targets(label: str, rows: list[dict], unit: str, size: int) -> None:
    """One line per pool row beside HF's checkpointing rows: no slower than any of them whose peak is
    equal (within 1%) or lower. Nothing when the run has no HF checkpointing row."""
    ckpts = [r for r in rows if r["config"].startswith("hf checkpoint")]
    if not ckpts:
        return

    def show(r: dict) -> str:
        peak = r.get("peak_alloc_bytes")
        return f"{_fmt(r.get('step_x'), '.2f')}x {'-' if peak is None else f'{peak / size:.2f}'}{unit}"

    measured = lambda r: None not in (r.get("step_x"), r.get("peak_alloc_bytes"))  # noqa: E731
    for r in rows:
        if r["allocator"] != "supermem" or r.get("budget") is None:  # the pool's rows
            continue
        if not all(map(measured, [r, *ckpts])):
            verdict, against = "NO DATA", ckpts
        else:
            against = [c for c in ckpts if c["peak_alloc_bytes"] <= HF_PEAK_SLACK * r["peak_alloc_bytes"]]
            verdict = "met" if all(r["step_x"] <= c["step_x"] for c in against) else "MISSED"
        vs = (
            ", ".join(f"{c['config']} {show(c)}" for c in against)
            or "no HF checkpointing row at its peak or lower"
        )
        print(
            f"target {label} {r['config']}: {show(r)} vs {vs}"
            f" (no slower than HF checkpointing at an equal or lower peak): {verdict}"
        )


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _met(ok: bool, value: float | None) -> str:
    if value is None:
        return "NO DATA"
    return "met" if ok else "MISSED"
