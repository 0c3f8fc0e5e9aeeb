"""`supermem bench train`'s tables (parent side): the allocator and savers tables, or --sweep's table
sorted by peak with a Pareto line per pool row, and the target lines."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from . import table

GiB = 1 << 30
STEP_TARGET = 1.01
# docs/design.md#baselines, H200, torch 2.11 (the anchors script): step ms, peak allocated GiB. Not this run.
REFERENCE = {
    "gpt": {"native": (61.1, 15.93), "checkpoint": (78.9, 9.36), "save_on_cpu": (516.8, 8.47)},
    "resnet": {"native": (69.1, 11.25), "checkpoint": (113.7, 4.47), "save_on_cpu": (747.9, 1.65)},
}


def _gib(key: str) -> Callable[[dict], float]:
    return lambda r: r[key] / GiB


def print_tables(model: str, rows: list[dict], args: argparse.Namespace) -> None:
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


def print_sweep(model: str, rows: list[dict], args: argparse.Namespace) -> None:
    """One table sorted by peak (rows without one last), then a Pareto line per pool row. On CPU the
    peaks are bytes saved for backward (eager rows: each storage once; pool rows: the pool's count)."""
    unit, size = ("MiB", 1 << 20) if args.quick else ("GiB", GiB)
    native = next(r for r in rows if r["config"] == "native")
    for r in rows:
        r["step_x"] = table.ratio(r.get("step_ms"), native.get("step_ms"))
    label = native.get("preset", model)
    peak_of = lambda r: r.get("peak_alloc_bytes") or float("inf")  # noqa: E731
    runs = f"medians of {args.repeats} runs a row, interleaved" if args.repeats > 1 else "one run a row"
    print(f"\n{label}: sweep (baseline: native, this run; {runs}; sorted by peak)")
    columns = [
        ("config", lambda r: r["config"], ""),
        ("step ms", lambda r: r["step_ms"], ".1f"),
        ("min-max ms", lambda r: f"{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}", ""),
        ("x native", lambda r: r["step_x"], ".2f"),
        (f"budget {unit}", lambda r: r["budget_bytes"] / size, ".2f"),
        (f"peak alloc {unit}", lambda r: r["peak_alloc_bytes"] / size, ".2f"),
        ("note", _note, ""),
    ]
    print(table.render(columns, sorted(rows, key=peak_of)))
    mem = lambda b: f"{b / size:.2f}{unit}"  # noqa: E731
    # PyTorch's own ways to the same memory, beside each pool row: the rows of the same loss and the same
    # compile mode only (a chunked loss or a compiled model is another step, faster or smaller by itself)
    for r in rows:
        if r["allocator"] == "native":
            continue
        x, peak = r.get("step_x"), r.get("peak_alloc_bytes")
        line = f"pareto {label} {r['config']}: {_fmt(x, '.2f')}x {mem(peak) if peak else '-'}"
        group = f"{'compiled' if r['compiled'] else 'eager'}, {r['loss_kind']} loss"
        peers = [e for e in rows if e["allocator"] == "native" and _same_step(e, r)]
        if None in (x, peak):
            line += ", NO DATA"
        elif not peers:
            line += f", no baseline of its kind ({group}) ran"
        else:
            dom = [
                e
                for e in peers
                if e.get("peak_alloc_bytes") is not None
                and e.get("step_x") is not None
                and e["peak_alloc_bytes"] <= peak
                and e["step_x"] < x
            ]
            names = ", ".join(f"{e['config']} ({e['step_x']:.2f}x {mem(e['peak_alloc_bytes'])})" for e in dom)
            line += f", dominated by {names}" if dom else f", no baseline ({group}) dominates it"
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


def _same_step(a: dict, b: dict) -> bool:
    """The same loss and the same compile mode (eager or compiled): rows the Pareto line compares."""
    return (a["loss_kind"], a["compiled"]) == (b["loss_kind"], b["compiled"])


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
    if r.get("runs_failed") and r.get("error") is None:
        return f"{r['runs_failed']} of {r['runs']} runs failed: {r.get('failed_error')}"
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
        ok = (
            x is not None
            and lx is not None
            and peak is not None
            and lpeak is not None
            and x < lx
            and peak <= 1.01 * lpeak
        )
        print(
            f"target {label} {r['config']}: {_fmt(x, '.2f')}x {_fmt(_peak_gib(r), '.2f')}GiB vs lru "
            f"{_fmt(lx, '.2f')}x {_fmt(_peak_gib(lru), '.2f')}GiB (faster, peak no higher): {_met(ok, x)}"
        )
        budget = r.get("budget_bytes")
        ok = peak is not None and budget is not None and peak <= 1.05 * budget
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
