"""`supermem bench trace`: what recording a trace costs a training step, and the trace itself.

One fresh process with supermem's allocator trains GPT-24 (or ResNet-152) in rounds, each of steps
without a recording (the baseline) and steps inside `supermem.trace(...)`, the order alternating
(`interleaved`, which tests/gpu/test_trace_owners_gpu.py measures its models with too). Overhead is what
a step of a long recording costs (`steady_cost`): each traced step's ratio to its round's median untraced
step, the steps that record module calls (one in 8 in a long run) and the others each by their median,
weighted as a long run has them. Each round's first two steps, whose backwards a recording's saved-tensor
hook observes to check how activations are named (trace/context.py), run untimed: a run pays them once.
The last recording is written to --out (run.smtrace, and with --report the HTML and PNG report beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..cli_args import positive_int
from . import runner


def interleaved(
    timed: Callable[[], float], recording: Callable[[bool], Any], rounds: int, steps: int, warm: int
) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """Rounds of `steps` timed steps untraced and inside `recording(last round)`, the order alternating,
    each after `warm` untimed ones: the untraced rounds' times, the traced ones', and each round's ratio
    of its median steps (steady_cost weighs the steps: the host's pace drifts between rounds more than
    tracing costs)."""
    plain: list[list[float]] = []
    traced: list[list[float]] = []
    ratios = []
    for r in range(rounds):
        for times in (plain, traced)[:: 1 if r % 2 == 0 else -1]:
            with recording(r == rounds - 1) if times is traced else contextlib.nullcontext():
                for _ in range(warm):
                    timed()
                times.append([timed() for _ in range(steps)])
        ratios.append(statistics.median(traced[-1]) / statistics.median(plain[-1]))
    return plain, traced, ratios


def steady_cost(plain: list[list[float]], traced: list[list[float]], warm: int) -> tuple[float, dict]:
    """What tracing costs a step of a long recording, from `interleaved`'s rounds run after `warm` untimed
    steps: each traced step's ratio to its round's median untraced step, split by whether that step of
    its recording records module calls (context.records_calls: the first 3, then one in CALLS_EVERY);
    the median of each kind, weighted by the share it has in a long run. Returns (cost, {kind: median
    ratio}) for the kinds timed; with one kind only, its median is the cost."""
    from ..trace.context import CALLS_EVERY, records_calls

    kinds: dict[str, list[float]] = {}
    for p, t in zip(plain, traced, strict=True):
        base = statistics.median(p)
        for i, x in enumerate(t):
            kinds.setdefault("calls" if records_calls(warm + i) else "no calls", []).append(x / base)
    medians = {k: statistics.median(v) for k, v in kinds.items()}
    if len(medians) == 1:
        return next(iter(medians.values())) - 1, medians
    share = 1 / CALLS_EVERY
    return share * medians["calls"] + (1 - share) * medians["no calls"] - 1, medians


def measure(spec: dict) -> dict:
    import torch

    import supermem

    from ..trace import recorder
    from .models import PRESETS, loss_fn
    from .train_worker import _timed

    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    preset = PRESETS[spec["preset"]]
    torch.manual_seed(0)
    with device:
        model = preset.build()
    x, y = preset.batch(device, torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=preset.bf16 and cuda):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    recordings = []

    def recording(last: bool) -> Any:
        recordings.append(
            supermem.trace.record(  # (what supermem.trace(...) calls; only the last round's is written)
                str(out / "run.smtrace") if last else None,
                model=model,
                optimizer=opt,
                report=spec["report"] and last,
            )
        )
        return recordings[-1]

    warm = recorder.ACTIVATION_HOOK_BACKWARDS
    plain, traced, _ = interleaved(lambda: _timed(step, cuda), recording, spec["rounds"], spec["steps"], warm)
    cost, by_kind = steady_cost(plain, traced, warm)
    events = recordings[-1].status()["drained_events"]
    base = statistics.median(t for round_ in plain for t in round_)
    with_trace = statistics.median(t for round_ in traced for t in round_)
    return {
        "preset": preset.label,
        "plain_ms": round(base, 2),
        "traced_ms": round(with_trace, 2),
        "overhead": cost,
        "by_kind": by_kind,  # the median ratio of the steps that record module calls, and of the others
        "events": events,
        "files": sorted(p.name for p in out.iterdir()),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("gpt", "resnet"), default="gpt")
    p.add_argument(
        "--rounds", type=positive_int, default=3, help="interleaved plain/traced rounds (default 3)"
    )
    p.add_argument("--steps", type=positive_int, default=8, help="timed steps per round and mode (default 8)")
    p.add_argument("--out", type=Path, default=Path("trace-bench"), help="where run.smtrace goes")
    p.add_argument("--report", action="store_true", help="also write the HTML/PNG report of the last round")


def run(args: argparse.Namespace) -> dict:
    preset = f"{args.model}-quick" if args.quick else args.model
    spec = {
        "bench": "trace",
        "allocator": "supermem" if args.device == "cuda" else "native",
        "device": args.device,
        "preset": preset,
        "rounds": args.rounds,
        "steps": args.steps,
        "out": str(args.out.resolve()),
        "report": args.report,
    }
    row = runner.run(spec, args.timeout, f"trace {preset}")
    if "error" in row:
        print(f"trace bench failed: {row['error']}")
        return {"rows": [row]}
    print(f"\ntrace overhead: {row['preset']}, {args.device} (baseline: untraced steps, same process)")
    print(
        f"untraced {row['plain_ms']:.2f} ms/step, traced {row['traced_ms']:.2f} ms/step: "
        f"{100 * row['overhead']:+.2f}% (target <= 5%)"
    )
    kinds = ", ".join(f"{k} {100 * (v - 1):+.2f}%" for k, v in row["by_kind"].items())
    print(f"steps that record module calls (one in 8 of a long recording) and the others: {kinds}")
    print(f"files in {args.out}: {', '.join(row['files'])}")
    return {"rows": [row]}
