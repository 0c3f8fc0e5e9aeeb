"""Issue 40's targets on a GPU, as a user runs them: `supermem trace -- python train.py` on HF GPT-2, an HF
Llama and timm ResNet-50 (tests/corpus.py, real sizes), then `supermem report`. Each prints its peak table
(pytest -s) for the closing note.

- >= 95% of the peak's bytes in a named category, >= 90% of activation bytes with a module path;
- tracing costs <= 5% of a step of a long recording: in one process under SUPERMEM=1, rounds of steps
  untraced and inside `supermem.trace()` (what `supermem trace` records), interleaved; each traced
  step's ratio to its round's untraced steps, the steps that record module calls (a recording's third,
  one in 8 of a long one) and the others weighted as a long recording has them (bench.trace.steady_cost;
  the first two, whose backwards the saved-tensor hook observes, run untimed: a recording pays them
  once). SUPERMEM_TEST_ROUNDS sets how many rounds: many short ones, as the host's pace drifts (rounds
  of 8 steps of the same untraced step moved 37-52 ms on an H200 host, and a round of 4 steps' ratio
  -27% to +34%: 20 such rounds put the median within a few percent of the cost only). Fresh processes
  are not compared: the same untraced script's step moved 38.6-43.3 ms between processes on one H200
  (docs/measurements.md).
  GPT-24 through `supermem bench trace`;
- `report --budget` (75% of the traced peak) against a real run under supermem.pool at that budget:
  peak within 5%; step time within 15%, as ratios: the predicted step to the traced step it was made
  from, against the median of the run's rounds of pool steps to steps without the pool, interleaved
  (the two are separate processes, and a host's pace drifts within one)."""

import json
import os
import sys
from pathlib import Path

import pytest
from gpu_harness import needs_cuda, run_command

from supermem import cli
from supermem.trace.analysis import analyze
from supermem.trace.loader import load
from supermem.trace.whatif import what_if
from supermem.units import format_bytes

pytestmark = needs_cuda
TESTS = Path(__file__).resolve().parents[1]
MODELS = ["gpt2", "llama", "timm-resnet50"]
ROUNDS = int(os.environ.get("SUPERMEM_TEST_ROUNDS", "120"))  # of 2 steps each way (GPT-24: a quarter, of 8)

TRAIN = """
import contextlib, json, statistics, sys, time
sys.path.insert(0, {tests!r})
import torch
import supermem
from supermem.bench.trace import interleaved, steady_cost
from corpus import CASES
name, steps, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 0
torch.manual_seed(0)
model, batch, loss_of = CASES[name]("real")
model = model.cuda().train()
inputs = batch(torch.Generator().manual_seed(1))
inputs = inputs.cuda() if isinstance(inputs, torch.Tensor) else tuple(x.cuda() for x in inputs)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
pool = supermem.pool(budget=budget) if budget else None
def step():
    torch.cuda.synchronize()
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
    return time.perf_counter() - t0


if pool is None and not rounds:  # traced by `supermem trace`: its step and peak
    times = []
    for i in range(steps):
        times.append(step())
        if i == 1:
            torch.cuda.reset_peak_memory_stats()
    got = {{"step_s": statistics.median(times[3:]), "peak": torch.cuda.max_memory_allocated()}}
elif pool is None:  # tracing's cost: rounds untraced and traced, alternating (supermem bench trace's)
    import tempfile
    from supermem.trace.recorder import ACTIVATION_HOOK_BACKWARDS
    where = tempfile.mkdtemp()
    for _ in range(3):
        step()
    # (untimed steps a round: a recording's first backwards are its saved-tensor hook's check)
    recording = lambda last: supermem.trace(f"{{where}}/run.smtrace" if last else None)  # (written once)
    plain, traced, ratios = interleaved(step, recording, rounds, steps, ACTIVATION_HOOK_BACKWARDS)
    untraced, with_trace = (statistics.median(t for r in v for t in r) for v in (plain, traced))
    cost, by_kind = steady_cost(plain, traced, ACTIVATION_HOOK_BACKWARDS)
    got = {{"ratio": 1 + cost, "by_kind": by_kind, "untraced": untraced, "traced": with_trace}}
else:  # at a budget: after the pool's planning steps, rounds of `steps` steps without the pool and
    use, peaks = pool, []  # inside it, alternating (interleaved); the peak is the pool's steps' alone
    for _ in range(steps):
        step()
    pool = None

    @contextlib.contextmanager
    def inside(last):
        global pool
        pool = use
        torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            pool = None
            peaks.append(torch.cuda.max_memory_allocated())

    plain, pooled, ratios = interleaved(step, inside, rounds, steps, 0)
    pool_s, plain_s = (statistics.median(t for r in v for t in r) for v in (pooled, plain))
    got = {{"ratio": statistics.median(ratios), "step_s": pool_s, "plain_s": plain_s, "peak": max(peaks)}}
if "ratio" in got:
    got["ratios"] = sorted(ratios)
print("@@RESULT " + json.dumps(got))
"""


def _result(run):
    assert run.rc == 0, run.describe()
    line = [x for x in run.stdout.splitlines() if x.startswith("@@RESULT ")][-1]
    return json.loads(line[len("@@RESULT ") :])


@pytest.fixture(scope="module", params=MODELS)
def traced(request, tmp_path_factory):
    name = request.param
    if name.startswith("timm-"):
        pytest.importorskip("timm")
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp(name)
    script = tmp / "train.py"
    script.write_text(TRAIN.format(tests=str(TESTS)))
    out = tmp / "run.smtrace"
    plain = [sys.executable, str(script), name, "12", "0"]
    cmd = [sys.executable, "-m", "supermem", "trace", "-o", str(out), "--", "python", *plain[1:]]
    tr = _result(run_command(cmd, timeout=600))
    return name, tmp, load(out), tr


def test_the_peak_is_named_and_placed(traced):
    name, tmp, trace, _ = traced
    rep = analyze(trace, source=name)
    d = rep.devices[0]
    print(f"\n{name} on {d.name}: peak {format_bytes(d.peak_bytes)}, coverage {d.coverage}")
    for r in d.peak_owners[:20]:
        share = r["bytes"] / d.peak_bytes
        print(f"  {r['category']:16} {r['module']:50} {format_bytes(r['bytes']):>12} {share:6.1%}")
    assert d.coverage["categorised"] >= 0.95
    assert d.coverage["activation_with_module"] >= 0.90
    assert cli.main(["report", str(tmp / "run.smtrace"), "-q"]) == 0
    html = (tmp / "run.html").read_text()
    assert len(html) < 5 << 20 and 'id="owners-0"' in html


def test_tracing_costs_at_most_5_percent_of_a_step(traced):
    name, tmp, _, _ = traced
    cmd = [sys.executable, str(tmp / "train.py"), name, "2", "0", str(ROUNDS)]
    got = _result(run_command(cmd, env={"SUPERMEM": "1"}, timeout=600))
    r = got["ratios"]
    kinds = ", ".join(f"{k} {v - 1:+.1%}" for k, v in got["by_kind"].items())
    print(
        f"\n{name}, {ROUNDS} rounds of 2 steps each way: untraced {got['untraced'] * 1e3:.1f} ms/step, "
        f"traced {got['traced'] * 1e3:.1f} ms/step; a step of a long recording: {got['ratio'] - 1:+.1%} "
        f"(a step's ratio to its round's untraced, median: {kinds}; a round's ratio, quartiles "
        f"{r[len(r) // 4] - 1:+.1%} {r[3 * len(r) // 4] - 1:+.1%}, {sum(x > 1 for x in r)} of {len(r)} "
        "rounds slower traced)"
    )
    assert got["ratio"] <= 1.05


def test_tracing_costs_gpt24_at_most_5_percent_of_a_step(tmp_path):
    out = tmp_path / "rows.json"
    rounds = max(ROUNDS // 4, 3)
    cmd = [sys.executable, *f"-m supermem bench trace --rounds {rounds} --out {tmp_path}".split()]
    run = run_command([*cmd, "--json", str(out)], timeout=600)
    assert run.rc == 0, run.describe()
    (row,) = json.loads(out.read_text())["rows"]
    print(f"\n{row['preset']}: untraced {row['plain_ms']} ms/step, traced {row['traced_ms']} ms/step")
    assert row["overhead"] <= 0.05


def test_what_if_matches_a_run_at_that_budget(traced):
    name, tmp, trace, tr = traced
    budget = int(0.75 * tr["peak"])
    w = what_if(trace, budget)
    script = tmp / "train.py"
    cmd = [sys.executable, str(script), name, "4", str(budget), "8"]
    run = _result(run_command(cmd, env={"SUPERMEM": "1"}, timeout=600))
    # The prediction is the traced step plus what the plan adds. The run is another process, whose host
    # may be faster or slower than the traced one's (the same untraced step: 38.6 and 43.3 ms in two
    # processes) and drifts within it, so the prediction's ratio to the traced step is compared with the
    # run's ratio to its own steps without the pool, interleaved with its pool's.
    predicted = w.predicted_step_s / w.measured_step_s
    print(
        f"\n{name} at {format_bytes(budget)}: predicted peak {format_bytes(w.predicted_peak_bytes)} "
        f"step {w.predicted_step_s * 1e3:.1f} ms from a traced step of {w.measured_step_s * 1e3:.1f} ms "
        f"({predicted:.3f}x; pool's host work {w.pool_host_s * 1e3:.1f} ms; fits: {w.fits}); measured peak "
        f"{format_bytes(run['peak'])}, step {run['step_s'] * 1e3:.1f} ms against {run['plain_s'] * 1e3:.1f} "
        f"ms without the pool: a round's ratio, median {run['ratio']:.3f}x "
        f"(rounds {' '.join(f'{r:.3f}' for r in run['ratios'])})"
    )
    assert abs(w.predicted_peak_bytes - run["peak"]) <= 0.05 * run["peak"]
    assert abs(predicted - run["ratio"]) <= 0.15 * run["ratio"]
