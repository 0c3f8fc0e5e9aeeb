"""Smoke test of `supermem bench depth --quick --device cpu`: each configuration's trial runs in its own
process (supermem's with streaming, binomial checkpointing and the pool); the table and rows make sense."""

import json
import os
import subprocess
import sys

from supermem.bench.depth import layers, search


def test_bench_depth_quick_cpu(tmp_path):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    r = subprocess.run(
        [sys.executable, "-m", "supermem", "bench", "depth", "--quick", "--device", "cpu"]
        + ["--configs", "native,supermem", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    by_config = {row["config"]: row for row in result["rows"]}
    assert set(by_config) == {"native", "supermem"}
    for config, row in by_config.items():
        assert row["n"] == 2 and row["layers"] == layers(2), f"{config}: {row}"
        assert row["step_s"] > 0 and row["layer_ms"] > 0
    # the same seed, batch and weights: streaming and binomial checkpointing give native's losses (supermem
    # runs more steps: its timed one runs the pool's plan)
    native_losses = by_config["native"]["losses"]
    assert len(native_losses) == 2 and by_config["supermem"]["losses"][:2] == native_losses
    assert by_config["supermem"]["h2d_gb"] > 0 and by_config["supermem"]["prefetch_hits"] > 0
    assert "ms/layer" in r.stdout and "supermem" in r.stdout


def test_search_finds_the_boundary_with_few_probes(monkeypatch):
    """The search against a fake trial that fits up to n=37: galloping then bisection lands within 2%."""
    from supermem.bench import depth

    calls = []

    def fake(spec, timeout_s):
        calls.append(spec["n"])
        return {"n": spec["n"], "step_s": 1.0} if spec["n"] <= 37 else {"error": "OOM", "oom": True}

    monkeypatch.setattr(depth, "_run_trial", fake)
    assert search({"config": "x"}, start=10, max_n=1000, probes=12, timeout_s=1)["n"] == 37
    assert len(calls) <= 12
    calls.clear()
    assert search({"config": "x"}, start=100, max_n=1000, probes=12, timeout_s=1)["n"] == 37
    calls.clear()
    assert search({"config": "x"}, start=10, max_n=20, probes=12, timeout_s=1)["n"] == 20  # capped: at max
    monkeypatch.setattr(depth, "_run_trial", lambda spec, t: {"error": "OOM", "oom": True})
    assert search({"config": "x"}, start=10, max_n=20, probes=12, timeout_s=1) is None


def test_materialize_on_host_initialises_every_module():
    import torch

    from supermem.bench.depth import materialize_on_host
    from supermem.bench.models import ResNet

    with torch.device("meta"):
        model = ResNet((1, 1, 1, 1), width=4, classes=3)
    materialize_on_host(model, "cpu")
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    bn = model.stem[1]
    assert torch.equal(bn.weight, torch.ones(4)) and torch.equal(bn.running_var, torch.ones(4))
    conv = model.stem[0].weight
    assert conv.std() > 0 and conv.abs().max() <= 1  # kaiming uniform, not uninitialised memory
    x = torch.randn(2, 3, 32, 32)
    assert torch.isfinite(model(x)).all()


def test_a_trial_with_company_is_marked_crowded():
    from supermem.bench.depth import _Crowd

    crowd = _Crowd()
    a, b, c = {}, {}, {}
    crowd.enter(a)
    crowd.enter(b)  # b starts while a runs: both had company
    crowd.leave(a)
    crowd.leave(b)
    crowd.enter(c)  # c runs alone
    crowd.leave(c)
    assert a["crowded"] and b["crowded"] and not c["crowded"]


def test_bad_arguments_are_one_line_usage_errors():
    for bad in (["--cap", "12XB"], ["--jobs", "0"], ["--checkpoints", "-1"], ["--configs", "nope"]):
        r = subprocess.run(
            [sys.executable, "-m", "supermem", "bench", "depth", "--device", "cpu", "--quick", *bad],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert bad[0].lstrip("-") in r.stderr or "unknown config" in r.stderr, r.stderr


def test_a_trial_row_says_where_its_time_went():
    """One trial process: its row splits the wall time into phases (the timed step's forward, backward and
    optimizer add up to step_s) and the process ran on the threads it was given."""
    spec = {"config": "supermem", "device": "cpu", "n": 2, "batch": 2, "px": 32, "width": 8, "classes": 10}
    spec.update(unit_bytes=1 << 16, checkpoints=1, cap_bytes=None, threads=1)
    r = subprocess.run(
        [sys.executable, "-m", "supermem.bench.depth", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    from supermem.bench.runner import parse_row

    row = parse_row(r.stdout)
    assert "error" not in row, row
    assert row["threads"] == 1
    phases = row["phase_s"]
    assert set(phases) == {"build", "place", "step1", "forward", "backward", "optimizer"}
    assert all(v >= 0 for v in phases.values())
    timed = phases["forward"] + phases["backward"] + phases["optimizer"]
    assert abs(timed - row["step_s"]) < 0.01 + 0.05 * row["step_s"]


def test_materialize_on_host_gives_the_values_of_a_direct_build():
    """Built on meta and materialised (in chunks of any size), a model holds bitwise the parameters and
    buffers of one built directly under the same seed: every configuration of the bench starts alike."""
    import torch

    from supermem.bench.depth import materialize_on_host
    from supermem.bench.models import ResNet

    torch.manual_seed(0)
    direct = ResNet((1, 2, 3, 1), width=4, classes=3)
    for chunk_bytes in (1, 4096, 1 << 30):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = ResNet((1, 2, 3, 1), width=4, classes=3)
        materialize_on_host(model, "cpu", chunk_bytes=chunk_bytes)
        got, want = model.state_dict(), direct.state_dict()
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        assert all(p.requires_grad and p.is_leaf for p in model.parameters())
