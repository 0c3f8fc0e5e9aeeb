"""`supermem bench train --sweep`'s fair baselines (issue 39): each saver row also with the chunked loss, the
planned pool around a compiled model, the partitioner's own offload; every row repeated, interleaved,
its median and spread printed; each pool row's Pareto line against rows of its own loss and compile mode.
No process runs here: the runner is replaced by one that records the specs."""

import argparse
import json
import math

import pytest
import torch

from supermem import cli
from supermem import torch_private as tp
from supermem.bench import runner, train_tables, train_worker
from supermem.bench.models import PRESETS
from supermem.bench.train_modes import (
    BLOCK_MODELS,
    COMPILE_BUDGETS,
    COMPILED_POOL_WARMUP,
    SWEEP_BUDGETS,
    SWEEP_WARMUP,
    sweep_modes,
)

LABELS = [f"{b:.0%}" for b in SWEEP_BUDGETS] + ["ckpt peak"]
CKPTS = ["checkpoint", "checkpoint reentrant"] + [
    f"checkpoint first {p}" for p in ("quarter", "half", "three quarters")
]


def _by_name(device):
    return {m.name: m for m in sweep_modes(device)}


def test_every_checkpoint_compile_and_pool_row_also_runs_with_the_chunked_loss():
    modes = _by_name("cuda")
    plain = CKPTS + [f"compile budget {b}" for b in COMPILE_BUDGETS]
    plain += [f"{p} {label}" for p in ("cost_aware", "planned", "compiled planned") for label in LABELS]
    if tp.has_partitioner_offload():
        plain.append("compile partitioner offload")
    for name in plain:
        m, c = modes[name], modes[f"{name} + chunked loss"]
        assert (c.allocator, c.saver, c.budget, c.models) == (m.allocator, m.saver, m.budget, ("gpt",))
        assert c.options == {**m.options, "loss": "chunked"} and c.loss_kind == "chunked"
        assert m.loss_kind == "plain" and c.compiled == m.compiled
        # a fraction of native's peak with the chunked loss, or the chunked checkpoint's peak
        same_loss = {"native": "chunked loss", "checkpoint": "checkpoint + chunked loss"}
        assert c.budget_of == same_loss[m.budget_of]
    names = list(modes)
    for i, m in enumerate(modes.values()):  # each reference row runs before the rows it gives a budget
        assert m.budget is None or m.budget_of in names[:i], m.name


def test_the_compiled_pool_rows_wrap_a_compiled_model_from_compile_budget_1():
    for device, labels in (("cuda", LABELS), ("cpu", ["ckpt peak"])):  # CPU: one inductor build
        modes = _by_name(device)
        rows = [m for m in modes.values() if m.name.startswith("compiled planned") and m.loss_kind == "plain"]
        assert [m.name for m in rows] == [f"compiled planned {label}" for label in labels]
        for m in rows:
            assert (m.allocator, m.saver, m.models, m.compiled) == ("supermem", "pool", BLOCK_MODELS, True)
            assert m.options == {"policy": "planned", "compile": True, "memory_budget": 1.0}
            assert m.budget_of == ("checkpoint" if m.name.endswith("ckpt peak") else "native")
    # the worker compiles the model under the pool's saver (torch.compile is lazy: nothing builds here)
    spec = {"saver": "pool", **_by_name("cpu")["compiled planned ckpt peak"].options}
    model = PRESETS["gpt-quick"].build()
    assert train_worker.compiled(spec)
    assert isinstance(train_worker._prepare(model, spec), torch._dynamo.eval_frame.OptimizedModule)


@pytest.fixture
def functorch_config():
    """torch._functorch.config's keys the bench sets, restored after the test (by setattr: pytest's
    monkeypatch would delete them, and a deleted key of torch's config reads as absent after)."""
    import torch._functorch.config as config

    keys = ["activation_memory_budget", "joint_custom_pass"]
    keys += [k for k in dir(config) if k.startswith(("enable_activation_offloading", "activation_offload"))]
    keys += [k for k in dir(config) if k == "activation_reload_prefetch"]
    before = {k: getattr(config, k) for k in keys}
    yield config
    for k, v in before.items():
        setattr(config, k, v)


@pytest.mark.skipif(not tp.has_partitioner_offload(), reason="this torch has no partitioner offload")
def test_the_partitioner_offload_row_marks_every_node_of_a_compiled_model_cuda_only(functorch_config):
    m = _by_name("cuda")["compile partitioner offload"]
    assert (m.allocator, m.saver, m.models, m.compiled) == ("native", "compile", BLOCK_MODELS, True)
    assert m.options == {"memory_budget": 1.0, "partitioner_offload": True}
    assert not any("partitioner offload" in name for name in _by_name("cpu"))
    train_worker._prepare(PRESETS["gpt-quick"].build(), {"saver": "compile", **m.options})
    config = functorch_config
    assert config.enable_activation_offloading and config.activation_offload_separate_stream
    graph = torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    assert all(n.meta.get("should_offload") for n in config.joint_custom_pass(graph, None).graph.nodes)


def test_the_compiled_checkpoint_rows_checkpoint_inside_the_graph_cuda_only(functorch_config):
    modes = _by_name("cuda")
    assert not any(name.startswith("compile checkpoint") for name in _by_name("cpu"))  # (inductor builds)
    saved = {}
    for name in ("compile budget 1.0", "compile selective checkpoint", "compile checkpoint"):
        m = modes[name]
        assert m.compiled and m.models == BLOCK_MODELS and modes[f"{name} + chunked loss"].compiled
        spec = {"bench": "train", "preset": "gpt-quick", "device": "cpu", "steps": 1, "warmup": 1}
        row = train_worker.measure(
            {**spec, "saved_peak": True, "allocator": "native", "saver": m.saver, **m.options}
        )
        saved[name] = row["peak_alloc_bytes"]
        assert math.isfinite(row["loss"])
    # the compiled graph saves fewer bytes for backward with each block checkpointed inside it, fewest
    # where a block keeps none of its matmuls' outputs
    assert saved["compile checkpoint"] < saved["compile selective checkpoint"] < saved["compile budget 1.0"]


ROWS = ["checkpoint first half", "checkpoint + chunked loss", "cost_aware ckpt peak + chunked loss"]


def _fake_runner(monkeypatch, step_ms):
    """runner.run records (label, spec) and answers a row whose step ms is step_ms(label, n-th call)."""
    calls = []

    def run(spec, timeout_s, label=""):
        calls.append((label, dict(spec)))
        ms = step_ms(label, len(calls))
        if ms is None:
            return {"error": "worker exited rc=1 without a row"}
        peak = (1 << 20) * (1 + len(calls))  # another peak each run: the row's is their median
        return {"step_ms": ms, "peak_alloc_bytes": peak, "preset": "gpt-quick", "loss": 1.0, "pool": None}

    monkeypatch.setattr(runner, "run", run)
    return calls


def _sweep(*extra, rows=ROWS):
    argv = ["bench", "train", "--sweep", "--quick", "--device", "cpu", "--model", "gpt"]
    return cli.main([*argv, "--modes", ",".join(rows), *extra])


def _round(label):
    return int(label[-4])  # "gpt native (2/3)": 2


def test_sweep_rows_run_round_robin_three_times_by_default_at_one_budget(monkeypatch, capsys):
    calls = _fake_runner(monkeypatch, lambda label, n: 10.0)
    rows = ["checkpoint first half", "chunked loss", "cost_aware 60%"]
    assert _sweep(rows=rows) == 0  # no --repeats: 3 under --sweep
    labels = [label for label, _ in calls]
    assert labels == [f"gpt {r} ({i}/3)" for i in (1, 2, 3) for r in ["native", *rows]]
    # the pool row's budget: 60% of native's first peak (its first call's), the same bytes every round
    pool = [spec for label, spec in calls if "cost_aware" in label]
    assert [s["budget_bytes"] for s in pool] == [int(0.6 * (1 << 20) * 2)] * 3
    assert "medians of 3 runs a row, interleaved" in capsys.readouterr().out


def test_a_compiled_pool_row_warms_up_through_its_recompiles_but_under_quick(monkeypatch):
    calls = _fake_runner(monkeypatch, lambda label, n: 10.0)
    rows = ["checkpoint", "compiled planned ckpt peak", "per block planned ckpt peak"]
    argv = ["bench", "train", "--sweep", "--device", "cpu", "--model", "gpt", "--repeats", "1"]
    assert cli.main([*argv, "--modes", ",".join(rows)]) == 0
    warmups = {label.split(" (")[0]: spec["warmup"] for label, spec in calls}
    assert sum("planned" in name for name in warmups) == 2 and "gpt native" in warmups, warmups
    for name, warmup in warmups.items():
        assert warmup == (COMPILED_POOL_WARMUP if "planned" in name else SWEEP_WARMUP), name
    calls.clear()
    assert _sweep("--repeats", "1", rows=rows) == 0  # --quick: its few steps
    assert {spec["warmup"] for _, spec in calls} == {2}


def test_each_rows_median_and_spread_are_printed(monkeypatch, capsys, tmp_path):
    def step_ms(label, n):
        if "checkpoint first half (" in label:
            return {1: 30.0, 2: 10.0, 3: 20.0}[_round(label)]
        if "checkpoint + chunked loss (" in label:  # its second run fails
            return None if _round(label) == 2 else 5.0 * _round(label)
        return 10.0

    calls = _fake_runner(monkeypatch, step_ms)
    out = tmp_path / "rows.json"
    assert _sweep("--repeats", "3", "--json", str(out)) == 0
    stdout = capsys.readouterr().out
    line = next(x for x in stdout.splitlines() if x.startswith("checkpoint first half  "))
    assert " 20.0 " in line and " 10.0-30.0 " in line, stdout  # the median 20, min-max 10-30
    line = next(x for x in stdout.splitlines() if x.startswith("checkpoint + chunked loss  "))
    assert " 10.0 " in line and " 5.0-15.0 " in line and "1 of 3 runs failed" in line, stdout
    by_name = {r["config"]: r for r in json.loads(out.read_text())["models"]["gpt"]}
    ckpt = by_name["checkpoint first half"]
    assert (ckpt["step_ms"], ckpt["step_ms_min"], ckpt["step_ms_max"]) == (20.0, 10.0, 30.0)
    peaks = [(1 << 20) * (1 + n) for n, (label, _) in enumerate(calls, 1) if "half (" in label]
    assert len(peaks) == 3 and ckpt["peak_alloc_bytes"] == sorted(peaks)[1]  # the median peak
    assert (by_name["native"]["runs"], by_name["native"]["runs_failed"]) == (3, 0)
    assert (ckpt["loss_kind"], ckpt["compiled"]) == ("plain", False)


def _row(config, step_x, peak, loss_kind="plain", compiled=False, allocator="native"):
    return {
        "config": config,
        "allocator": allocator,
        "step_ms": 10.0 * step_x,
        "peak_alloc_bytes": peak << 20,
        "loss_kind": loss_kind,
        "compiled": compiled,
        "table": "savers",
        "preset": "gpt-quick",
    }


def test_the_pareto_line_compares_only_rows_of_the_same_loss_and_compile_mode(capsys):
    rows = [
        _row("native", 1.0, 100),
        _row("checkpoint", 1.5, 30),
        _row("chunked loss", 0.5, 20, loss_kind="chunked"),  # faster and smaller than every pool row
        _row("compile budget 0.5", 0.5, 10, compiled=True),
        _row("torch chunked loss", 0.5, 10, loss_kind="torch_chunked"),
        _row("planned 60%", 2.0, 60, allocator="supermem"),
        _row("planned 60% + chunked loss", 2.0, 60, loss_kind="chunked", allocator="supermem"),
        _row("compiled planned 60%", 2.0, 60, compiled=True, allocator="supermem"),
        _row("compiled planned 60% + chunked loss", 2.0, 60, "chunked", True, "supermem"),
    ]
    train_tables.print_sweep("gpt", rows, argparse.Namespace(quick=True, repeats=1))
    lines = {
        x.split(": ")[0].split(" ", 2)[2]: x.split(": ", 1)[1]
        for x in capsys.readouterr().out.splitlines()
        if x.startswith("pareto ")
    }
    assert lines["planned 60%"] == "2.00x 60.00MiB, dominated by checkpoint (1.50x 30.00MiB)"
    assert lines["planned 60% + chunked loss"] == "2.00x 60.00MiB, dominated by chunked loss (0.50x 20.00MiB)"
    assert lines["compiled planned 60%"] == "2.00x 60.00MiB, dominated by compile budget 0.5 (0.50x 10.00MiB)"
    assert lines["compiled planned 60% + chunked loss"] == (
        "2.00x 60.00MiB, no baseline of its kind (compiled, chunked loss) ran"
    )
