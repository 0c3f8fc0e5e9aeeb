"""Smoke test of the benchmark harness on CPU: `supermem bench ... --quick --device cpu` runs every
configuration in a subprocess, prints its tables and writes JSON rows that make sense."""

import json
import math
import os
import subprocess
import sys

import pytest


def _bench(tmp_path, *args, timeout=300):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    r = subprocess.run(
        [sys.executable, "-m", "supermem", "bench", *args, "--quick", "--device", "cpu", "--repeats", "1"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,  # the quick train rows take ~60 s alone, ~110 s on a busy 2-core machine
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, json.loads(out.read_text())


TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "diag")


def _tool(name, *args, env=None):
    """tools/<name> run with this Python; it must exit 0. Its stdout."""
    cmd = [sys.executable, os.path.join(TOOLS, name), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_bench_train_quick_cpu(tmp_path):
    stdout, result = _bench(tmp_path, "train", "--model", "all")
    assert set(result["models"]) == {"gpt", "resnet"}
    for model, rows in result["models"].items():
        by_name = {r["config"]: r for r in rows}
        assert set(by_name) == {"native", "checkpoint", "checkpoint first half"}, f"{model}: CPU rows"
        for name, row in by_name.items():
            assert "error" not in row, f"{model} {name}: {row['error']}"
            assert row["step_ms"] > 0 and len(row["step_ms_all"]) == 3
            assert math.isfinite(row["loss"])
        # checkpointing recomputes the same forward: the same loss from the same seed and batch
        assert math.isclose(by_name["native"]["loss"], by_name["checkpoint"]["loss"], rel_tol=1e-4)
        assert math.isclose(by_name["native"]["loss"], by_name["checkpoint first half"]["loss"], rel_tol=1e-4)
        assert "x native" in stdout and by_name["native"]["preset"] in stdout


def test_bench_alloc_quick_cpu(tmp_path):
    stdout, result = _bench(tmp_path, "alloc")
    (row,) = result["rows"]
    assert row["config"] == "native" and "error" not in row
    assert 0 < row["pair_us"] < 1e4 and 0 < row["burst500_us"] < 1e4
    assert "pair us" in stdout


def test_bench_trace_quick_cpu(tmp_path):
    """Rounds of untraced and traced steps in one process: the overhead is what a step of a long
    recording costs (steady_cost), the last recording written where asked."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "supermem", "bench", "trace", "--quick", "--device", "cpu"]
    cmd += ["--rounds", "3", "--steps", "2", "--out", str(tmp_path / "t"), "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["plain_ms"] > 0 and row["traced_ms"] > 0 and -1 < row["overhead"] < 10
    assert row["files"] == ["run.smtrace"] and row["events"] == 0  # (CPU tensors: no allocator events)
    assert f"{100 * row['overhead']:+.2f}%" in r.stdout
    assert set(row["by_kind"]) == {"calls", "no calls"}  # (timed steps 2 and 3: step 2 records calls)


def test_the_trace_cost_weighs_the_steps_that_record_calls_as_a_long_recording_has_them():
    """steady_cost: each traced step against its round's median untraced step, the kinds of step by
    their medians, weighted one step with module calls in CALLS_EVERY; a single kind is its own cost."""
    from supermem.bench.trace import steady_cost
    from supermem.trace.context import CALLS_EVERY, records_calls

    assert [s for s in range(30) if records_calls(s)] == [0, 1, 2, 10, 18, 26]
    plain = [[1.0, 3.0], [2.0, 2.0], [1.0, 1.0]]  # round medians 2, 2, 1
    traced = [[2.8, 2.04], [3.0, 2.1], [1.2, 1.02]]  # after 2 warm: step 2 records calls, step 3 not
    cost, kinds = steady_cost(plain, traced, warm=2)
    assert kinds == pytest.approx({"calls": 1.4, "no calls": 1.02})
    assert cost == pytest.approx(0.4 / CALLS_EVERY + 0.02 * (CALLS_EVERY - 1) / CALLS_EVERY)
    cost, kinds = steady_cost([[1.0, 1.0]], [[1.1, 1.3]], warm=3)  # steps 3 and 4: none records calls
    assert kinds == pytest.approx({"no calls": 1.2}) and cost == pytest.approx(0.2)


def test_bench_train_sweep_quick_cpu(tmp_path):
    # ~330 s on an idle 2-core machine: 49 rows, 8 of them compiled (inductor builds ~20 s a row)
    stdout, result = _bench(tmp_path, "train", "--sweep", "--model", "gpt", timeout=900)
    by_name = {r["config"]: r for r in result["models"]["gpt"]}
    parts = ("quarter", "half", "three quarters")
    baselines = ["native", "checkpoint", "checkpoint reentrant"] + [f"checkpoint first {p}" for p in parts]
    budgets = ["90%", "75%", "60%", "50%", "ckpt peak"]
    pool_rows = [f"{policy} {b}" for policy in ("cost_aware", "planned") for b in budgets]
    pool_rows.append("compiled planned ckpt peak")  # CPU: one compiled pool row of each kind (inductor's
    pool_rows.append("per block planned ckpt peak")  # build)
    pool_rows += [f"{name} + chunked loss" for name in pool_rows]
    compiles = ["compile budget 0.5", "compile per block"]
    extra = compiles + ["chunked loss", "torch chunked loss"]  # CPU: no save_on_cpu
    extra += [f"{name} + chunked loss" for name in baselines[1:] + compiles]
    assert set(by_name) == set(baselines + extra + pool_rows)
    for name, row in by_name.items():
        assert "error" not in row, f"{name}: {row['error']}"
        assert row["peak_alloc_bytes"] > 0 and math.isfinite(row["loss"])
    native, ckpt = by_name["native"], by_name["checkpoint"]
    # torch.compile runs the same model (other kernels: close, not bitwise), also under the pool and with
    # the chunked loss
    for name in compiles + ["compiled planned ckpt peak", "per block planned ckpt peak"]:
        for loss in ("", " + chunked loss"):
            assert math.isclose(native["loss"], by_name[name + loss]["loss"], rel_tol=1e-3), name + loss
    # the chunked loss is the same loss (sums in another order), and backward keeps no logits
    chunked = by_name["chunked loss"]
    assert math.isclose(native["loss"], chunked["loss"], rel_tol=1e-4)
    assert chunked["peak_alloc_bytes"] < native["peak_alloc_bytes"]
    torchs = by_name["torch chunked loss"]  # torch's own F.linear_cross_entropy, beside supermem's
    assert math.isclose(native["loss"], torchs["loss"], rel_tol=1e-4)
    # CPU peaks are bytes saved for backward: checkpointing more blocks keeps fewer
    assert (
        ckpt["peak_alloc_bytes"]
        < by_name["checkpoint first half"]["peak_alloc_bytes"]
        < native["peak_alloc_bytes"]
    )
    ckpt_chunked = by_name["checkpoint + chunked loss"]
    for policy in ("cost_aware", "planned", "compiled planned", "per block planned"):
        assert by_name[f"{policy} ckpt peak"]["budget_bytes"] == ckpt["peak_alloc_bytes"]
        peak = ckpt_chunked["peak_alloc_bytes"]
        assert by_name[f"{policy} ckpt peak + chunked loss"]["budget_bytes"] == peak
    for policy in ("cost_aware", "planned"):  # a share of the same loss's native peak
        for loss, ref in (("", native), (" + chunked loss", chunked)):
            row = by_name[f"{policy} 75%{loss}"]
            assert row["budget_bytes"] == int(0.75 * ref["peak_alloc_bytes"])
    for b in budgets:
        assert by_name[f"planned {b}"]["pool"]["plan"]["predicted_peak_bytes"] > 0
    table = stdout[stdout.index("sweep (baseline: native") :]
    order = [line.split("  ")[0] for line in table.splitlines()[3 : 3 + len(by_name)]]
    peaks = [by_name[name]["peak_alloc_bytes"] for name in order]
    assert sorted(order) == sorted(by_name) and peaks == sorted(peaks), "one table, sorted by peak"
    pareto = [line for line in stdout.splitlines() if line.startswith("pareto ")]
    assert [line.split(": ")[0].split(" ", 2)[2] for line in pareto] == pool_rows
    # (a block compiled alone compiles again at each of the quick rows' steps: no plan is made from a step
    # in which the compiler ran)
    assert all("predicted" in line for line in pareto if " planned " in line and "per block" not in line)


def test_the_tools_trainer_steps_inside_the_saver_and_trains_the_same():
    """tools/diag/plan_diag.py and tools/diag/pool_overhead.py time `Trainer.step(ctx)`: the saver must hold
    forward and backward (the pool packs what autograd saves), and the step must train as plain code does."""
    import torch

    import supermem
    from supermem.bench.models import Trainer

    cpu = torch.device("cpu")
    plain, pooled = Trainer.of("gpt-quick", cpu), Trainer.of("gpt-quick", cpu)
    pool = supermem.pool(budget=1 << 16)
    for _ in range(2):
        assert plain.step() > 0 and plain.host_s > 0
        pooled.step(pool)
    assert pool.stats()["packed"] > 0
    for a, b in zip(plain.model.parameters(), pooled.model.parameters()):
        assert torch.equal(a, b)


def test_rebuild_overhead_tool_sees_every_recipe_kind():
    """tools/diag/rebuild_overhead.py: every recipe kind rebuilds in the tiny GPT's recompute-only pool, each
    has a self and a bare time, and the rebuilds' self times (nested ones counted once) fit in the step."""
    lines = _tool("rebuild_overhead.py", "--steps", "2").splitlines()
    pool_ms = float(lines[0].split("pool ")[-1].split(" ms")[0])
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[2:5]}
    assert set(rows) == {"region", "op", "cast"}
    for calls, self_us, bare_us, _ in rows.values():
        assert calls > 0 and self_us > 0 and bare_us > 0
    assert sum(calls * self_us for calls, self_us, _, _ in rows.values()) / 1e3 < pool_ms


def test_a_profile_plan_diag_keeps_is_planned_again_offline_the_same(tmp_path):
    """tools/diag/plan_diag.py DUMP= keeps the profile the pool planned from; tools/diag/replan.py,
    planning from it at the same budget, makes the plan the pool made (the planner is deterministic)."""
    dump = str(tmp_path / "gpt.pkl")
    diag = _tool("plan_diag.py", "gpt-quick", "0.3", "3", env={**os.environ, "DUMP": dump})
    made = next(line for line in diag.splitlines() if line.startswith("plan: "))
    line = _tool("replan.py", dump, "0.3").splitlines()[1]
    assert line.split(": ", 1)[1].split(", units")[0] == made.split(": ", 1)[1].split(", offload ")[0], (
        made,
        line,
    )


def test_step_phases_prints_each_rows_phases_beside_native_and_checkpointing():
    """tools/diag/step_phases.py: native, the planned pool at a budget, checkpointing the first blocks and
    native again, each with its host time per phase (on a GPU also the GPU's), in one process."""
    out = _tool("step_phases.py", "gpt-quick", "0.6")
    rows = {line[:16].strip(): line for line in out.splitlines() if " wall " in line}
    assert set(rows) == {"native", "planned 0.6", "ckpt first 1", "native again"}, out
    for line in rows.values():
        host = line.split("| host ")[1].split()  # fwd F bwd B opt O
        fwd, bwd = float(host[1]), float(host[3])
        assert fwd > 0 and bwd > 0, line
    assert "x native" in out


def test_hook_costs_times_the_pools_pieces_inside_planned_steps():
    """tools/diag/hook_costs.py: native's and the planned pool's steps, then each wrapped piece of the pool's
    host work that ran, with its calls a step and positive times; a piece nested in another (the light
    call's node in its post-hook) takes no more a call than its caller."""
    out = _tool("hook_costs.py", "resnet-quick", "0.3")
    lines = out.splitlines()
    assert {line.split()[0] for line in lines if " step " in line} == {"native", "planned"}, out
    start = next(i for i, line in enumerate(lines) if line.startswith("piece "))
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[start + 1 :]}
    assert {"Regions._pre_call", "Regions._post_call", "Pool.pack"} <= set(rows), out
    for calls, median_us, mean_us, ms in rows.values():
        assert calls > 0 and median_us > 0 and mean_us > 0, out
        # ms a step is calls x mean (a piece of 2 calls of 2 us prints 0.00): equal within their rounding
        assert abs(ms - calls * mean_us / 1e3) <= 0.005 + (0.05 * mean_us + 0.05 * calls) / 1e3, out
    if "_Light.attach" in rows:
        assert rows["_light_apply"][2] <= rows["_Light.attach"][2], out
