"""The README's first command: `supermem demo` trains with and without the pool and checks the losses."""

import subprocess
import sys


def test_demo_runs_on_cpu_and_losses_are_identical():
    r = subprocess.run(
        [sys.executable, "-m", "supermem", "demo", "--steps", "2", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "losses identical: True" in r.stdout
    assert "memory saved:" in r.stdout and "supermem pool" in r.stdout
    assert "checkpoint per block" in r.stdout and "supermem pool at checkpoint's peak" in r.stdout
    plain = next(line for line in r.stdout.splitlines() if line.startswith("plain PyTorch"))
    assert plain.split()[-4:] == ["-"] * 4  # no pool, so nothing moved or rebuilt


def test_plain_rows_run_without_saved_tensor_hooks(monkeypatch):
    """The plain row ran under a pool without a budget (its hooks cost time), and under a process-wide
    pool's hooks when SUPERMEM_CONF set one: each of its forwards must see no saved-tensor hooks."""
    import torch

    from supermem import demo

    seen = []
    forward = demo.Block.forward

    def recording(self, x):
        seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        return forward(self, x)

    monkeypatch.setattr(demo.Block, "forward", recording)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
        run = demo.train(torch.device("cpu"), 1, None)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None  # put back
    layers = demo.SIZES["cpu"][0]
    compared = (demo.WARMUP + 1) * layers  # then one untimed step counts its saved activations
    assert seen[:compared] == [None] * compared
    assert len(seen) == compared + layers and seen[-1] is not None
    assert not packed and run["peak"] > 0 and run["pool"] is None


def test_recomputed_column_counts_what_the_plan_rebuilds():
    """A plan that recomputes runs block calls light (nothing saved, rebuilt in backward) and drops
    saves of lean calls: the column said "0 bytes" for those (it showed the reactive drops only)."""
    import torch

    from supermem import demo
    from supermem.tensor_pool import Pool

    cpu = torch.device("cpu")
    pool = Pool(16 << 20, "planned", device=cpu, min_bytes=0, treatments="recompute")  # plain: ~26 MiB
    run = demo.train(cpu, 2, pool)
    s = run["pool"]
    assert s["plan"]["recompute"] > 0 and s["light_calls"] + s["lean_drops"] > 0, s
    cell = demo.recomputed(s, 2)
    assert " calls" in cell or " saves" in cell
    assert cell in demo.row("pool", run, 2)
    assert demo.recomputed(dict(s, light_calls=0, lean_drops=0, dropped_bytes=0), 2) == "0 bytes"
    assert demo.recomputed(None, 2) == "-"
