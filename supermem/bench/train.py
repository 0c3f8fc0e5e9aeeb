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
- --sweep: one table sorted by peak. Every baseline (checkpointing, save_on_cpu, torch.compile at
  activation_memory_budget 1.0/0.5/0.2 and, where this torch has it, the partitioner's own CPU offload)
  and the pool (cost_aware, planned, and planned around the compiled model: "compiled planned") at
  90/75/60/50% of native's peak and at checkpoint's; on GPT each checkpointing, compile and pool row again
  with supermem.linear_cross_entropy ("... + chunked loss"; its pool rows at the chunked checkpoint's
  peak). Each row runs --repeats times (default 3), round robin over the rows: step ms and peak are the
  medians, min-max the spread. A Pareto line per pool row names the baselines with the same loss and
  the same compile mode (eager or compiled) that are faster at no higher peak.
- hf-llama: its savers are HF's own `gradient_checkpointing_enable()`, non-reentrant ("hf checkpoint") and
  reentrant ("hf checkpoint reentrant"), in place of checkpointing model.blocks; with --sweep the pool
  runs at 75% and 50% of native's peak and at each of those rows' peaks. Target: no pool row slower
  than an HF checkpointing row at an equal (within 1%) or lower peak.

A new row is a `Mode` (train_modes.py); a new way to save memory is an entry in `SAVERS` (train_worker.py,
the worker side); the tables are printed by train_tables.py.
"""

from __future__ import annotations

import argparse
import statistics

from ..cli_args import check_names, comma_list, nonnegative_int, positive_float, positive_int
from . import runner
from .train_modes import BLOCK_MODELS as BLOCK_MODELS
from .train_modes import COMPILED_POOL_WARMUP
from .train_modes import HF_MODELS as HF_MODELS
from .train_modes import MODELS as MODELS
from .train_modes import SWEEP_WARMUP as SWEEP_WARMUP
from .train_modes import Mode as Mode
from .train_modes import modes as modes
from .train_modes import runs_on as runs_on
from .train_modes import sweep_modes as sweep_modes
from .train_tables import print_sweep, print_tables
from .train_worker import SAVERS as SAVERS
from .train_worker import _prepare as _prepare
from .train_worker import measure as measure


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
        help="every baseline and the pool (cost_aware, planned, compiled planned) at 90/75/60/50%% of"
        " native's peak and at checkpoint's, on GPT also with the chunked loss; every row --repeats times"
        " (default 3), interleaved: one table of medians sorted by peak, a Pareto line per pool row against"
        " the baselines of its loss and compile mode",
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
        (print_sweep if sweep else print_tables)(model, rows, args)
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
    sweep = getattr(args, "sweep", False)
    if sweep:
        base["saved_peak"] = True  # a peak on CPU too: the sweep's budgets are fractions of it

    def spec(m: Mode) -> dict:
        conf = args.conf if m.allocator == "supermem" else None
        out = {**base, **m.options, "allocator": m.allocator, "conf": conf, "saver": m.saver}
        if m.saver == "pool" and m.compiled and not args.quick:  # its recompiles, before the timed steps
            out["warmup"] = max(out["warmup"], COMPILED_POOL_WARMUP)
        return out

    # --sweep: every row `repeats` times, round robin, each row its median. Else the allocator rows, which
    # are compared to 1%, interleaved `repeats` times, each its best; the others once.
    repeated = chosen if sweep else [m for m in chosen if m.table == "allocator"]
    runs: dict[str, list[dict]] = {m.name: [] for m in chosen}
    budgets: dict[str, int] = {}  # a row's budget bytes, from its reference's first run with a peak
    for i in range(args.repeats):
        for m in repeated:
            runs[m.name].append(_run(model, m, spec(m), runs, budgets, args, (i, args.repeats)))
    for m in chosen:
        if m not in repeated:
            runs[m.name].append(_run(model, m, spec(m), runs, budgets, args))
    out = []
    for m in chosen:
        rs = runs[m.name]
        row = _median(rs) if sweep else _best(rs) if m in repeated else rs[0]
        row.update(config=m.name, allocator=m.allocator, table=m.table, budget=m.budget)
        row.update(loss_kind=m.loss_kind, compiled=m.compiled)  # the Pareto line's groups
        out.append(row)
    return out


def _run(
    model: str,
    m: Mode,
    s: dict,
    runs: dict[str, list[dict]],
    budgets: dict[str, int],
    args: argparse.Namespace,
    round_: tuple[int, int] = (0, 1),
) -> dict:
    """One process of row `m`; a row with a budget takes it from its reference row's runs so far."""
    if m.budget is not None:
        if m.name not in budgets:
            peaks = (r.get("peak_alloc_bytes") for r in runs.get(m.budget_of, []))
            ref_peak = next((p for p in peaks if p), None)
            if ref_peak is None:
                return {"error": f"no {m.budget_of} peak to take the budget from", "budget_bytes": None}
            budgets[m.name] = int(m.budget * ref_peak)
        s["budget_bytes"] = budgets[m.name]
    i, n = round_
    row = runner.run(s, args.timeout, f"{model} {m.name}" + (f" ({i + 1}/{n})" if n > 1 else ""))
    row["budget_bytes"] = s.get("budget_bytes")
    return row


def _best(rs: list[dict]) -> dict:
    ok = [r for r in rs if "step_ms" in r]
    best = dict(min(ok, key=lambda r: r["step_ms"]) if ok else rs[-1])
    best["step_ms_runs"] = [r.get("step_ms") for r in rs]
    return best


def _median(rs: list[dict]) -> dict:
    """A row run several times: the median run's row (its pool stats, plan) with the median step ms and
    peak allocated bytes over the runs that measured, the spread (step_ms_min, step_ms_max), and how many
    runs failed (runs_failed: the first one's error under "error" when none measured)."""
    ok = [r for r in rs if "step_ms" in r]
    if not ok:
        return dict(rs[0], runs=len(rs), runs_failed=len(rs))
    times = [r["step_ms"] for r in ok]
    row = dict(sorted(ok, key=lambda r: r["step_ms"])[(len(ok) - 1) // 2])
    row.update(step_ms=statistics.median(times), step_ms_min=min(times), step_ms_max=max(times))
    row.update(step_ms_runs=[r.get("step_ms") for r in rs], runs=len(rs), runs_failed=len(rs) - len(ok))
    peaks = [r["peak_alloc_bytes"] for r in ok if r.get("peak_alloc_bytes") is not None]
    if peaks:
        row.update(peak_alloc_bytes=int(statistics.median(peaks)), peak_alloc_bytes_runs=peaks)
    if len(ok) < len(rs):
        row["failed_error"] = next(r.get("error") for r in rs if "step_ms" not in r)
    return row
