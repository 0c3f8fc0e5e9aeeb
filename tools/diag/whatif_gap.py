"""Where `report --budget` and a live pool at that budget part (issue 40's what-if targets), on one corpus
model at real size on a GPU: traces the model as a user does (`supermem trace -- python train.py`), plans
from the trace, then trains under supermem.pool at that budget and prints, step by step, the live plan's
counts, predicted and measured peaks beside the trace's.

    python3 tools/diag/whatif_gap.py llama [share=0.75] [steps=12]
    KEEP=dir python3 tools/diag/whatif_gap.py llama    # keeps both traces, the pooled run's traced too
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
TRAIN = """
import json, sys, time
sys.path.insert(0, {tests!r})
import torch
import supermem
from corpus import CASES
name, steps, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model, batch, loss_of = CASES[name]("real")
model = model.cuda().train()
inputs = batch(torch.Generator().manual_seed(1))
inputs = inputs.cuda() if isinstance(inputs, torch.Tensor) else tuple(x.cuda() for x in inputs)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
pool = supermem.pool(budget=budget) if budget else None
times, rows = [], []
for i in range(steps):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", torch.bfloat16):
        if pool is not None:
            with pool:
                loss = loss_of(model, inputs)
                loss.backward()
        else:
            loss = loss_of(model, inputs)
            loss.backward()
    opt.step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    row = {{"step": i, "ms": times[-1] * 1e3, "peak": torch.cuda.max_memory_allocated()}}
    if pool is not None:
        s = pool.stats()
        p = s.get("plan") or {{}}
        row.update({{k: p.get(k) for k in ("offload", "recompute", "compress", "keep", "predicted_peak_bytes",
                    "measured_peak_bytes", "predicted_step_s", "budget_bytes")}})
        row.update({{k: s.get(k) for k in ("replans", "plans", "sync_restores", "regions", "margin_bytes")}})
        row["away"] = s.get("away_bytes_by_treatment")
    rows.append(row)
if pool is not None:
    prof = list(pool.plans.profiles.values())[-1]
    regions = set(prof.unit_start)
    rows.append({{"entry_us": prof.entry_s * 1e6, "step_ms": prof.step_s * 1e3, "saves": len(prof.saved),
                 "saved_gib": sum(s.nbytes for s in prof.saved) / 2**30,
                 "untreated_peak_gib": max(map(sum, zip(prof.base_bytes, prof.transient_bytes))) / 2**30,
                 "base_max_gib": max(prof.base_bytes) / 2**30, "regions": len(regions),
                 "other_units": len(set(prof.unit_cost_s) - regions),
                 "recomputed_in_regions": sum(1 for s in prof.saved if s.unit in regions
                                              and pool.plans.plan.treatment.get(s.ordinal) == "recompute")}})
print("@@ROWS " + json.dumps(rows))
"""


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SUPERMEM": "1"})
    if out.returncode:
        print(out.stdout[-3000:], out.stderr[-3000:])
        raise SystemExit(out.returncode)
    line = [x for x in out.stdout.splitlines() if x.startswith("@@ROWS ")][-1]
    return json.loads(line[len("@@ROWS ") :])


def main():
    from supermem.trace.loader import load
    from supermem.trace.step_profile import step_profile
    from supermem.trace.whatif import summary, what_if

    name = sys.argv[1]
    share = float(sys.argv[2]) if len(sys.argv) > 2 else 0.75
    steps = sys.argv[3] if len(sys.argv) > 3 else "12"
    tmp = Path(tempfile.mkdtemp())
    script = tmp / "train.py"
    script.write_text(TRAIN.format(tests=str(TESTS)))
    out = tmp / "run.smtrace"
    trace_cmd = [sys.executable, "-m", "supermem", "trace", "-o", str(out), "--"]
    rows = run([*trace_cmd, "python", str(script), name, steps, "0"])
    peak = max(r["peak"] for r in rows[2:])
    budget = int(share * peak)
    trace = load(out)
    w = what_if(trace, budget)
    print(f"##### {name}: traced peak {peak / 2**30:.3f} GiB, budget {budget / 2**30:.3f} GiB")
    print(summary(w))
    made = step_profile(trace, w.device)
    p = made.profile
    print(
        f"trace profile: {len(p.saved)} saves, {sum(s.nbytes for s in p.saved) / 2**30:.3f} GiB, "
        f"{len(made.unit_calls)} units, base max {max(p.base_bytes) / 2**30:.3f} GiB, "
        f"step peak {made.step_peak / 2**30:.3f} GiB, step {p.step_s * 1e3:.1f} ms"
    )
    print("units:", sorted({x.module for x in made.unit_calls.values()})[:12], len(made.op_calls), "op units")
    pooled = [str(script), name, steps, str(budget)]
    if os.environ.get("KEEP"):  # a directory: both runs' traces go there (the pooled run traced too)
        keep = Path(os.environ["KEEP"])
        (keep / f"{name}.smtrace").write_bytes(out.read_bytes())
        pooled = [*trace_cmd[:4], "-o", str(keep / f"{name}-pooled.smtrace"), "--", "python", *pooled]
    else:
        pooled = [sys.executable, *pooled]
    for r in run(pooled):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
