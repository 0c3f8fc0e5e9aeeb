"""Where `report --budget` and a live pool at that budget part (issue 40's what-if targets), on one corpus
model at real size on a GPU: traces the model as a user does (`supermem trace -- python train.py`, the
training script of tests/gpu/test_trace_owners_gpu.py), plans from the trace, then trains under
supermem.pool at that budget and prints the live plan (its counts, predicted and measured peaks, its
profile's untreated peak and entry cost) beside the trace's.

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
sys.path.insert(0, str(TESTS / "gpu"))

# After the test's script: the live pool's plan and the profile it planned from
EPILOGUE = """
pool = pool if pool is not None else globals().get("use")  # (the run at a budget keeps it in `use`)
if pool is not None:
    s, prof = pool.stats(), list(pool.plans.profiles.values())[-1]
    regions = set(prof.unit_start)
    print("@@POOL " + json.dumps({
        "plan": s.get("plan"), "sync_restores": s["sync_restores"], "regions": len(regions),
        "other_units": len(set(prof.unit_cost_s) - regions), "entry_us": prof.entry_s * 1e6,
        "saves": len(prof.saved), "saved_gib": sum(x.nbytes for x in prof.saved) / 2**30,
        "untreated_peak_gib": max(map(sum, zip(prof.base_bytes, prof.transient_bytes))) / 2**30,
    }))
"""


def run(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SUPERMEM": "1"})
    if out.returncode:
        print(out.stdout[-3000:], out.stderr[-3000:])
        raise SystemExit(out.returncode)
    found = {}
    for line in out.stdout.splitlines():
        for tag in ("@@RESULT ", "@@POOL "):
            if line.startswith(tag):
                found[tag.strip("@ ")] = json.loads(line[len(tag) :])
    return found


def main() -> None:
    from test_trace_owners_gpu import TRAIN

    from supermem.trace.loader import load
    from supermem.trace.step_profile import step_profile
    from supermem.trace.whatif import summary, what_if

    name = sys.argv[1]
    share = float(sys.argv[2]) if len(sys.argv) > 2 else 0.75
    steps = sys.argv[3] if len(sys.argv) > 3 else "12"
    tmp = Path(tempfile.mkdtemp())
    script = tmp / "train.py"
    script.write_text(TRAIN.format(tests=str(TESTS)) + EPILOGUE)
    out = tmp / "run.smtrace"
    trace_cmd = [sys.executable, "-m", "supermem", "trace", "-o", str(out), "--"]
    traced = run([*trace_cmd, "python", str(script), name, steps, "0"])["RESULT"]
    budget = int(share * traced["peak"])
    trace = load(out)
    w = what_if(trace, budget)
    print(f"##### {name}: traced peak {traced['peak'] / 2**30:.3f} GiB, budget {budget / 2**30:.3f} GiB")
    print(summary(w))
    made = step_profile(trace, w.device)
    p = made.profile
    print(
        f"trace profile: {len(p.saved)} saves, {sum(s.nbytes for s in p.saved) / 2**30:.3f} GiB, "
        f"{len(made.unit_calls)} region units, {len(made.op_calls)} op units, step peak "
        f"{made.step_peak / 2**30:.3f} GiB, untreated peak "
        f"{max(map(sum, zip(p.base_bytes, p.transient_bytes))) / 2**30:.3f} GiB, step {p.step_s * 1e3:.1f} ms"
    )
    pooled = [str(script), name, "4", str(budget), "4"]  # 4 steps to plan, 4 rounds of 4 each way
    if os.environ.get("KEEP"):  # a directory: both runs' traces go there (the pooled run traced too)
        keep = Path(os.environ["KEEP"])
        (keep / f"{name}.smtrace").write_bytes(out.read_bytes())
        pooled = [*trace_cmd[:4], "-o", str(keep / f"{name}-pooled.smtrace"), "--", "python", *pooled]
    else:
        pooled = [sys.executable, *pooled]
    for k, v in run(pooled).items():
        print(k, json.dumps(v))


if __name__ == "__main__":
    main()
