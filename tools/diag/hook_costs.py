"""The pool's own host work inside planned steps, piece by piece: each piece (a region's pre- and
post-hook, a light call's node, state and parameters, the output handed to the pool, a save's pack) is
wrapped by a timer (about 1 us each) for a few steps; per piece its calls a step, the median and mean
microseconds a call, and its milliseconds a step. Nested pieces count in their callers too. Native's
and the unwrapped planned pool's steps are printed beside, host time per phase.

    python3 tools/diag/hook_costs.py resnet 4.48GiB      # GPU: ResNet-152 at checkpoint's peak
    python3 tools/diag/hook_costs.py resnet-quick 0.3    # a CPU: a share of the pool's untreated peak

On an H100 (session 17, before 86ce636; ResNet-152 at 4.48 GiB, 46 light calls a step), median us a
call: pre-hook 60 (CallState 35), post-hook 175 (the node 80, the parameters 22, LightGraphs.note 18,
the output handed to the pool 19): ~11 ms of a forward whose host took 49 ms, native's 31. Each piece
ran 2-3x slower inside the step than alone on that host.
"""

import importlib
import statistics
import sys
import time

import torch

import supermem
from supermem.bench.models import PRESETS, Trainer
from supermem.errors import ConfigError
from supermem.tensor_pool import Pool

STEPS = 10
PIECES = (  # (module, class or None, attribute)
    ("regions", "Regions", "_pre_call"),
    ("regions", "Regions", "_post_call"),
    ("regions", "Regions", "_light"),
    ("light", "_Light", "attach"),
    ("light", None, "_light_apply"),
    ("light", None, "_params"),
    ("regions", None, "_pool_hooks"),  # (where it is called: regions.py imports it from light.py)
    ("light", "_Alive", "__init__"),
    ("call_state", "CallState", "__init__"),
    ("light_graphs", "LightGraphs", "note"),
    ("pool", "Pool", "pack"),
    ("plan_run", "PlanRunner", "unseen_call"),
    ("plan_run", "PlanRunner", "unseen_outputs"),
    ("step", "StepClock", "region_start"),
)

on = False
samples: dict[str, list[int]] = {}


def _timed(f, name):
    def timed(*args, **kwargs):
        if not on:
            return f(*args, **kwargs)
        t = time.perf_counter_ns()
        try:
            return f(*args, **kwargs)
        finally:
            samples.setdefault(name, []).append(time.perf_counter_ns() - t)

    return timed


def wrap() -> None:
    for mod, cls, attr in PIECES:
        owner = importlib.import_module(f"supermem.tensor_pool.{mod}")
        owner = getattr(owner, cls) if cls else owner
        setattr(owner, attr, _timed(getattr(owner, attr), f"{cls}.{attr}" if cls else attr))


def phases(tr: Trainer, ctx) -> list[float]:
    """Median ms over STEPS steps: host forward (with the loss), backward, optimizer; the step."""
    rows, marks = [], []
    for _ in range(STEPS):
        marks.clear()
        wall = tr.step(ctx, mark=lambda: marks.append(time.perf_counter()))
        rows.append([b - a for a, b in zip(marks, marks[1:])] + [wall])
    return [statistics.median(r[i] for r in rows) * 1e3 for i in range(4)]


def main() -> None:
    global on
    if len(sys.argv) != 3 or sys.argv[1] not in PRESETS:
        names = ", ".join(PRESETS)
        sys.exit(f"usage: hook_costs.py PRESET BUDGET (PRESET one of {names}; BUDGET a size or a share)")
    preset, budget = sys.argv[1], sys.argv[2]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    supermem.install()
    wrap()  # before the pool hooks anything: its hooks are bound at registration
    tr = Trainer.of(preset, device)
    for _ in range(3):
        tr.step()
    if budget.replace(".", "", 1).isdigit():  # a share of the untreated peak
        full = Pool(budget="1TiB", policy="planned")
        for _ in range(3):
            tr.step(full)
        budget = int(float(budget) * full.stats()["plan"]["measured_peak_bytes"])
        del full
    pool = Pool(budget=budget, policy="planned")
    for _ in range(8):
        tr.step(pool)
    native, planned = phases(tr, None), phases(tr, pool)
    for name, p in (("native", native), ("planned", planned)):
        print(f"{name:8s} step {p[3]:7.1f} ms; host: forward {p[0]:.1f}, backward {p[1]:.1f}, opt {p[2]:.1f}")
    plan = pool.stats()["plan"]
    print(
        f"the plan: {plan['predicted_step_s'] * 1e3:.1f} ms predicted, untreated "
        f"{plan['untreated_step_s'] * 1e3:.1f}, {plan['measured_step_s'] * 1e3:.1f} measured (a step); "
        f"recompute {plan['recompute']}, offload {plan['offload']}, keep {plan['keep']}"
    )
    before = pool.stats()
    on = True
    phases(tr, pool)
    on = False
    after = pool.stats()
    ran = {k: (after[k] - before[k]) / STEPS for k in ("light_calls", "bypassed_calls", "graph_replays")}
    print("a step: " + ", ".join(f"{k} {v:.0f}" for k, v in ran.items()))
    print(f"{'piece':26s} {'calls':>7s} {'median us':>10s} {'mean us':>8s} {'ms a step':>10s}")
    for name, v in sorted(samples.items(), key=lambda kv: -sum(kv[1])):
        print(
            f"{name:26s} {len(v) / STEPS:7.1f} {statistics.median(v) / 1e3:10.1f} "
            f"{sum(v) / len(v) / 1e3:8.1f} {sum(v) / STEPS / 1e6:10.2f}"
        )


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:  # a bad budget: its message, no traceback
        sys.exit(str(e))
