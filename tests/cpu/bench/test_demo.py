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
    compared = (run["warmup_steps"] + 1) * layers  # then one untimed step counts its saved activations
    assert run["warmup_steps"] >= demo.WARMUP
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


def test_warm_up_runs_until_steady():
    """The first run of a process paid first-time costs past the 3 warm-up steps (a GPU row at 1592 ms
    a step, 29.9 ms run again): the warm-up goes on until STEADY steps in a row agree."""
    from supermem import demo

    assert not demo.steady([1.0, 1.0])  # fewer than WARMUP
    assert demo.steady([1.0, 1.0, 1.0])
    assert not demo.steady([50.0, 1.0, 1.0])  # the slow first step is one of the last 3
    assert demo.steady([50.0, 1.0, 1.0, 1.05])
    assert not demo.steady([50.0, 1.0, 1.0, 1.2])  # 20% apart
    assert demo.steady([50.0, 1.0] * (demo.MAX_WARMUP // 2))  # never steady: MAX_WARMUP steps at most


def test_train_warms_up_as_steady_says_and_keeps_every_loss(monkeypatch):
    import torch

    from supermem import demo

    asked = []
    monkeypatch.setattr(demo, "steady", lambda times: asked.append(len(times)) or len(times) == 5)
    run = demo.train(torch.device("cpu"), 2, None, ckpt=True)
    assert asked == [0, 1, 2, 3, 4, 5] and run["warmup_steps"] == 5
    assert len(run["losses"]) == 5 + 2  # warm-up's too (the untimed counting step's is not one)
    fastest, slowest = run["ms_range"]
    assert fastest <= run["ms"] <= slowest


def pool_stats(**moved):
    s = {"offloaded_bytes": 0, "prefetched_bytes": 0, "copy_seconds": 0.0, "d2h_gbps": 0.0, "h2d_gbps": 0.0}
    s.update(hidden_fraction=1.0, light_calls=0, lean_drops=0, dropped_bytes=1 << 20)
    return {**s, **moved}


def test_a_row_shows_the_spread_and_says_no_copies_when_nothing_was_copied():
    """A pool that only recomputed printed "copy GB/s 0.1, hidden 100%" (stats' hidden fraction of no
    copy time is 1): it says "no copies"; every row shows its steps' fastest and slowest."""
    from supermem import demo

    run = {"ms": 30.0, "ms_range": (29.14, 31.42), "peak": 1 << 30}
    line = demo.row("pool", {**run, "pool": pool_stats()}, 2)
    assert "29.1-31.4ms" in line and line.split()[-2:] == ["no", "copies"] and "%" not in line
    assert demo.row("plain", {**run, "pool": None}, 2).split()[-4:] == ["-"] * 4
    copied = pool_stats(offloaded_bytes=8 << 20, prefetched_bytes=8 << 20, copy_seconds=0.01)
    copied.update(d2h_gbps=12.5, hidden_fraction=0.25)
    assert demo.row("pool", {**run, "pool": copied}, 2).split()[-2:] == ["12.5", "25%"]
    untimed = demo.row("pool", {**run, "pool": pool_stats(offloaded_bytes=8 << 20)}, 2)
    assert untimed.split()[-2:] == ["-", "-"]  # copies whose timings had not come back
    assert "spread" in demo.HEADER


def test_taking_the_hooks_off_where_pytorch_cannot_read_them(monkeypatch):
    """A PyTorch without the hooks' getter (torch_private.top_saved_hooks None): nothing is taken off,
    nothing put back (it raised 'NoneType' not callable)."""
    from supermem import demo
    from supermem import torch_private as tp

    monkeypatch.setattr(tp, "top_saved_hooks", None)
    with demo._NoSavedTensorHooks() as off:
        pass
    assert off is None
