"""`supermem bench frag`'s model workloads (gpt, resnet, llama-varlen, llama-ramp): selectable, each row's
spec carries its allocator's options and the same steps, the limit search caps each allocator its own
way; without CUDA one line, or --quick skips them. The GPU runs themselves are not here."""

import importlib.util
import subprocess
import sys

import pytest

from supermem import cli
from supermem.bench import frag

WORKLOADS = ("gpt", "resnet", "llama-varlen", "llama-ramp")
GIB = 1 << 30


def _args(*argv):
    parser = cli.build_parser("bench")
    return parser.parse_args(["bench", "frag", *argv])


@pytest.mark.parametrize("workload", WORKLOADS)
def test_model_workloads_are_listed_and_selectable(workload):
    assert _args("--pattern", workload, "--pattern", "varlen").pattern == [workload, "varlen"]
    assert workload in frag.MODEL_WORKLOADS


def _record(monkeypatch, fits_at=1.05):
    """runner.run replaced: the specs sent, in order; a trial completes at `fits_at` x the 10 GiB peak."""
    specs = []

    def run(spec, timeout_s, label=""):
        specs.append(spec)
        limit = spec.get("limit_bytes") or next(
            (int(o[len("limit:") :]) for o in (spec.get("conf") or "").split(",") if o.startswith("limit:")),
            None,
        )
        if limit is not None and limit < fits_at * 10 * GIB:
            return {"oom": True, "error": "OOM"}
        return {"allocated_bytes_peak": 10 * GIB, "reserved_bytes_peak": 11 * GIB, "step_ms": 5.0} | {
            "peak_reserved_ratio": 1.1
        }

    monkeypatch.setattr(frag.runner, "run", run)
    return specs


def _run(*argv):
    args = _args("--device", "cuda", *argv)
    args.device = "cuda"  # what cli.main sets; no GPU is touched: runner.run is replaced
    args.repeats = args.repeats or 2  # (cli.main's default)
    return frag.run(args)


def test_each_row_sends_its_allocator_and_options(monkeypatch):
    specs = _record(monkeypatch)
    result = _run("--pattern", "llama-varlen", "--conf", "trace:64", "--repeats", "1")
    firsts = [s for s in specs if "limit_bytes" not in s and "limit:" not in (s.get("conf") or "")]
    got = [(s["allocator"], s.get("pytorch_alloc_conf"), s.get("conf")) for s in firsts]
    assert got == [
        ("native", None, None),
        ("native", "expandable_segments:True", None),
        ("supermem", None, "trace:64"),
        ("supermem", None, "trace:64,expandable_segments:true"),
    ]
    assert all(s["preset"] == "hf-llama" and s["steps"] == 200 and s["device"] == "cuda" for s in specs)
    # the limit search: native by its memory fraction, supermem by its limit: option, keeping the row's own
    trials = specs[4:]  # (each row's run first, then each row's trials)
    for s in trials[:3]:  # native's trials at 1.00, 1.02 OOM, 1.05 completes
        assert s["pytorch_alloc_conf"] is None and "conf" not in s
    assert [s["limit_bytes"] for s in trials[:3]] == [int(10 * GIB * f) for f in (1.00, 1.02, 1.05)]
    expandable = [s for s in specs if s["allocator"] == "supermem" and "expandable" in (s["conf"] or "")]
    assert [s["conf"] for s in expandable[1:]] == [
        f"trace:64,expandable_segments:true,limit:{int(10 * GIB * f)}" for f in (1.00, 1.02, 1.05)
    ]
    assert all("limit_bytes" not in s for s in specs if s["allocator"] == "supermem")
    assert [r["min_limit_x"] for r in result["rows"]] == [1.05] * 4
    assert [r["config"] for r in result["rows"]] == [name for name, _, _ in frag.ROWS]


def test_rows_run_round_robin_and_each_is_its_median_process(monkeypatch, capsys):
    """--repeats processes a row, interleaved (native, native expandable, supermem, supermem expandable,
    native, ...): a slow spell of the machine lands on every row. A row is its median process by step
    time, with the spread; the step target compares medians and prints both spreads."""
    order, times = [], iter([10.0, 10.0, 10.0, 30.0, 12.0, 11.0, 10.5, 10.4, 11.0, 12.0, 10.2, 10.3])

    def run(spec, timeout_s, label=""):
        if "limit_bytes" in spec or "limit:" in (spec.get("conf") or ""):
            return {"allocated_bytes_peak": 10 * GIB, "step_ms": 1.0}
        order.append((spec["allocator"], spec.get("pytorch_alloc_conf") or spec.get("conf")))
        peaks = {
            "allocated_bytes_peak": 10 * GIB,
            "reserved_bytes_peak": 10 * GIB,
            "peak_reserved_ratio": 1.0,
        }
        return peaks | {"step_ms": next(times)}

    monkeypatch.setattr(frag.runner, "run", run)
    result = _run("--pattern", "llama-varlen", "--repeats", "3")
    rows = [(a, o) for _, a, o in frag.ROWS]
    assert order == rows * 3
    by = {r["config"]: r for r in result["rows"]}
    assert [by[n]["step_ms"] for n, _, _ in frag.ROWS] == [11.0, 11.0, 10.2, 10.4]  # (30 ms: one slow run)
    assert (by["supermem expandable"]["step_ms_min"], by["supermem expandable"]["step_ms_max"]) == (
        10.3,
        30.0,
    )
    assert all(r["runs"] == 3 for r in result["rows"])
    out = capsys.readouterr().out
    spreads = "medians of 3 and 3 processes: 10.3-30.0 against 10.0-10.5 ms"
    assert f"step <= 1.01x supermem: 1.020x ({spreads}): MISSED" in out


def test_allocator_picks_the_rows_of_one_allocator(monkeypatch):
    specs = _record(monkeypatch)
    result = _run("--pattern", "gpt", "--allocator", "supermem")
    assert {s["allocator"] for s in specs} == {"supermem"}
    assert [r["config"] for r in result["rows"]] == ["supermem", "supermem expandable"]


def test_native_rows_alone_without_cuda_is_a_usage_error():
    from supermem.errors import UsageError

    args = _args("--device", "cpu", "--allocator", "native")
    args.device = "cpu"
    with pytest.raises(UsageError, match="need CUDA"):
        frag.run(args)


def test_varlen_lengths_are_seeded_in_range_and_the_same_in_every_row(monkeypatch):
    specs = _record(monkeypatch)
    _run("--pattern", "llama-varlen", "--pattern", "llama-ramp", "--steps", "50", "--repeats", "1")
    varlen = [s["shapes"] for s in specs if s["pattern"] == "llama-varlen"]
    assert len(varlen) == 4 * 4  # four rows, each its run and three limit trials
    assert all(shapes == varlen[0] for shapes in varlen)
    assert [tuple(bs) for bs in varlen[0]] == list(frag.lengths("varlen", 50))  # seed 0: every run
    assert len(varlen[0]) == 50 and all(b == 4 and 128 <= t <= 2048 for b, t in varlen[0])
    assert len({t for _, t in varlen[0]}) > 10  # drawn, not one length
    ramp = next(s["shapes"] for s in specs if s["pattern"] == "llama-ramp")
    assert [b for b, _ in ramp] == sorted(b for b, _ in ramp) and ramp[0][0] == 1 and ramp[-1][0] == 16


def test_fixed_shape_workloads_run_their_bench_batch(monkeypatch):
    specs = _record(monkeypatch)
    _run("--pattern", "gpt", "--pattern", "resnet")
    assert {s["preset"] for s in specs} == {"gpt", "resnet"}
    assert all("shapes" not in s and s["steps"] == frag.FIXED_SHAPE_STEPS for s in specs)


def test_a_model_workload_without_cuda_is_one_line():
    cmd = [sys.executable, "-m", "supermem", "bench", "frag", "--device", "cpu", "--pattern", "gpt"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert r.stderr.count("\n") == 1 and "need CUDA" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_quick_without_cuda_skips_model_workloads_with_a_note(capsys):
    args = _args("--device", "cpu", "--quick", "--pattern", "llama-varlen", "--pattern", "ramp")
    result = frag.run(args)
    assert "skipping llama-varlen" in capsys.readouterr().out
    assert {r["pattern"] for r in result["rows"]} == {"ramp"}


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.parametrize("preset, shapes", [("gpt-quick", None), ("hf-llama-quick", [[2, 128], [1, 300]])])
def test_model_steps_train_on_cpu(preset, shapes):
    """The worker's steps (frag.measure times them on CUDA): the model trains, one step each."""
    spec = {"device": "cpu", "preset": preset, "steps": 2, "shapes": shapes}
    done = 0
    for step in frag._model_steps(spec):
        step()
        done += 1
    assert done == 2


def test_chunked_loss_reaches_gpts_rows_and_trains_and_is_refused_elsewhere(monkeypatch):
    """--loss chunked: GPT's head and loss through supermem.linear_cross_entropy, in every row's spec."""
    from supermem.errors import UsageError

    specs = _record(monkeypatch)
    _run("--pattern", "gpt", "--loss", "chunked", "--no-limits", "--repeats", "1")
    assert len(specs) == 4 and all(s["loss"] == "chunked" for s in specs)
    with pytest.raises(UsageError, match="--loss chunked"):
        _run("--pattern", "resnet", "--loss", "chunked")
    import supermem.losses

    calls = []
    real = supermem.losses.linear_cross_entropy
    monkeypatch.setattr(supermem.losses, "linear_cross_entropy", lambda *a: calls.append(1) or real(*a))
    for step in frag._model_steps({"device": "cpu", "preset": "gpt-quick", "steps": 2, "loss": "chunked"}):
        step()
    assert calls == [1, 1]


def test_targets_judge_supermem_expandable_against_its_baselines(monkeypatch, capsys):
    specs = _record(monkeypatch)
    _run("--pattern", "llama-varlen")  # every row: 11/10 GiB, 5 ms, completes at 1.05x
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("target ")]
    assert lines == [
        "target frag llama-varlen reserved/allocated <= 1.02: 1.100: MISSED",
        "target frag llama-varlen step <= 1.01x supermem: 1.000x (medians of 2 and 2 processes: 5.0-5.0 "
        "against 5.0-5.0 ms): met",
        "target frag llama-varlen completes at 1.05x, native not (min limit x): 1.05 vs native 1.05: MISSED",
    ]
    rows = [
        {"pattern": "llama-varlen", "config": "native", "min_limit_x": None},
        {"pattern": "llama-varlen", "config": "supermem", "step_ms": 10.0, "peak_reserved_ratio": 1.3},
        {"pattern": "llama-varlen", "config": "supermem expandable", "step_ms": 10.05}
        | {"peak_reserved_ratio": 1.01, "min_limit_x": 1.02},
    ]
    assert [line.rsplit(": ", 1)[1] for line in frag.targets(rows)] == ["met"] * 3
    assert len(specs) == 4 * (2 + 3)  # each row: its 2 runs, then 1.00 and 1.02 OOM, 1.05 completes
