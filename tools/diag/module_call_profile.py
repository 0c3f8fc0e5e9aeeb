#!/usr/bin/env python3
"""Where a recording's module calls spend their time on a corpus model's step: the recording's module
call (trace/context.py, Context._module_call) timed around the module's own forward, its own time
summed a step (the module's forward and the calls nested in it excluded), by module class; beside it
the same timing around a call that does nothing but pass through (what the timing itself costs).

    SUPERMEM=1 python3 tools/diag/module_call_profile.py [model] [--steps 10] [--size real] [--calls on]

--calls on/off: the recording's forward records its module calls (Context.record_calls, what `report
--budget` plans from) in every timed step, or in none (default: as a recording does, some steps only).
"""

import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from trace_gpu_overhead import corpus_parser, corpus_training, passthrough  # noqa: E402

import supermem  # noqa: E402
from supermem import torch_private as tp  # noqa: E402
from supermem.trace import context  # noqa: E402

clock = time.perf_counter
own: collections.Counter = collections.Counter()  # module class -> own seconds
count: collections.Counter = collections.Counter()


def timed(make):
    """make(orig, on) -> call, its own time per call counted by the module's class."""

    def timed_make(orig, on):
        inside: list[float] = []

        def orig_timed(*args, **kwargs):
            t = clock()
            try:
                return orig(*args, **kwargs)
            finally:
                inside[-1] += clock() - t

        call = make(orig_timed, on)

        def outer(module, *args, **kwargs):
            inside.append(0.0)
            t = clock()
            try:
                return call(module, *args, **kwargs)
            finally:
                name = type(module).__name__
                own[name] += clock() - t - inside.pop()
                count[name] += 1

        return outer

    return timed_make


def main() -> int:
    p = corpus_parser("gpt2", 10)
    p.add_argument("--calls", choices=("auto", "on", "off"), default="auto")
    args = p.parse_args()
    dev, sync, model, inputs, loss_of, opt = corpus_training(args.model, args.size)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, torch.bfloat16, enabled=dev == "cuda"):
            loss_of(model, inputs).backward()
        opt.step()
        sync()

    for _ in range(3):
        step()
    real = context.Context._module_call
    results = {}
    for label in ("pass-through", "recording", "pass-through", "recording"):
        own.clear()
        count.clear()
        if label == "recording":
            context.Context._module_call = lambda self, orig, on: timed(real.__get__(self))(orig, on)
            rec = supermem.trace(f"{tempfile.mkdtemp()}/run.smtrace")
            rec.__enter__()
            undo = None
        else:
            undo, rec = tp.patch_module_call(timed(passthrough)), None
        for _ in range(3):
            step()
        own.clear()
        count.clear()
        for _ in range(args.steps):
            if rec is not None and args.calls != "auto":
                rec.context.record_calls = args.calls == "on"
            step()
        if rec is not None:
            rec.__exit__(None, None, None)
            context.Context._module_call = real
        if undo is not None:
            undo()
        results.setdefault(label, []).append((dict(own), dict(count)))
    n = args.steps
    for label, runs in results.items():
        per_step = statistics.median(sum(o.values()) for o, _ in runs) / n * 1e3
        calls = sum(runs[-1][1].values()) / n
        each = per_step / calls * 1e3
        print(f"{label}: {per_step:.3f} ms a step in {calls:.0f} module calls ({each:.2f} us a call)")
    o, c = results["recording"][-1]
    base, _ = results["pass-through"][-1]
    print("recording, by module class: own us a call (pass-through's), calls a step")
    for name, s in sorted(o.items(), key=lambda kv: -kv[1])[:15]:
        mine, theirs = s / c[name] * 1e6, base.get(name, 0) / c[name] * 1e6
        print(f"  {name:28s} {mine:7.2f} ({theirs:5.2f})  {c[name] / n:5.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
