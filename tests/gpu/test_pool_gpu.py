"""The tensor pool on a GPU: real offload to pinned memory on side streams, bitwise-equal results,
no stream races, and the pool as the allocator's pressure handler."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def mlp(seed=0, d=2048, layers=6):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU()) for _ in range(layers)]
    ).cuda()


def grads(model, x, pool=None):
    model.zero_grad(set_to_none=True)
    if pool is None:
        loss = model(x).square().mean()
        loss.backward()
    else:
        with pool:
            loss = model(x).square().mean()
            loss.backward()
        pool.check()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def deterministic():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield


def test_offload_everything_is_bitwise_equal():
    from supermem.tensor_pool import Pool

    x = torch.randn(4096, 2048, device="cuda")
    ref = grads(mlp(), x)
    pool = Pool(budget=0, policy="lru")  # offload mechanics: lru offloads everything
    got = grads(mlp(), x, pool)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    pool.synchronize()
    s = pool.stats()
    assert s["offloads"] >= 6 and s["offloaded_bytes"] >= 6 * 4096 * 2048 * 4
    assert s["prefetches"] + s["sync_restores"] >= s["offloads"]
    assert s["d2h_gbps"] > 1 and s["h2d_gbps"] > 1  # real copies were timed
    assert s["tracked_bytes"] == 0
    rates = f"d2h {s['d2h_gbps']:.1f} GB/s, h2d {s['h2d_gbps']:.1f} GB/s"
    print(f"\noffload {rates}, hidden {s['hidden_fraction']:.0%}")


def test_budget_lowers_peak_memory():
    from supermem.tensor_pool import Pool

    x = torch.randn(4096, 2048, device="cuda")
    model = mlp()
    grads(model, x)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    grads(model, x)
    plain_peak = torch.cuda.max_memory_allocated()
    pool = Pool(budget=int(0.6 * plain_peak), policy="lru")
    grads(model, x, pool)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    grads(model, x, pool)
    pooled_peak = torch.cuda.max_memory_allocated()
    assert pooled_peak < 0.8 * plain_peak, (pooled_peak, plain_peak)


def test_no_race_when_offloaded_memory_is_reused_at_once():
    """An offloaded tensor's block goes back to the allocator before its copy ran; a tensor that
    compute writes right away must not land in it (record_stream events prevent that)."""
    from supermem.tensor_pool import Pool

    x = torch.randn(2048, 2048, device="cuda")
    ref = grads(mlp(layers=3), x)
    pool = Pool(budget=0, policy="lru")  # offload mechanics: lru offloads everything
    model = mlp(layers=3)
    with torch.cuda.stream(pool.copies.d2h):
        torch.cuda._sleep(200_000_000)  # the D2H stream is busy: offload copies run late
    model.zero_grad(set_to_none=True)
    with pool:
        h = x
        for layer in model:
            h = layer(h)
            for _ in range(3):  # same-size tensors, written by compute now
                torch.empty_like(h).fill_(float("nan"))
        loss = h.square().mean()
        loss.backward()
    got = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def _run(code: str, env: dict | None = None) -> str:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize("policy", ["lru", "cost_aware", "planned"])
def test_pressure_handler_offloads_instead_of_oom_then_oom_and_continue(policy):
    child = os.path.join(os.path.dirname(__file__), "pressure_child.py")
    r = subprocess.run([sys.executable, child, policy], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "OOM True" in out and "continued True" in out, out
    calls = int(out.split("pressure calls ")[1].split()[0])
    assert calls >= 1, out


def test_env_activates_the_pool_for_every_backward():
    out = _run(
        """
        import torch, supermem, supermem.tensor_pool
        m = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1)).cuda()
        m(torch.randn(8192, 2048, device="cuda")).sum().backward()
        p = supermem.tensor_pool.global_pool()
        print("offloads", p.stats()["offloads"], "installed", supermem.installed())
        """,
        env={"SUPERMEM_CONF": "pool:lru,budget:0"},
    )
    assert "installed True" in out and "offloads 0" not in out, out


# ---- recompute and the cost_aware policy -----------------------------------------------------------


def _train(build, batch, pool=None, steps=3, amp=False):
    """`steps` SGD steps of a fresh model (math SDPA: its backward is deterministic); every loss, the
    final gradients and the final state."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from supermem.bench.models import loss_fn

    torch.manual_seed(0)
    model = build().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = batch
    torch.manual_seed(1)  # dropout
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with pool if pool is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            with sdpa_kernel(SDPBackend.MATH), torch.autocast("cuda", torch.bfloat16, enabled=amp):
                o = model(x)
            loss = o.float().square().mean() if y is None else loss_fn(o, y)
            loss.backward()
        if pool is not None:
            pool.check()
        out.append(loss.detach())
        opt.step()
    torch.cuda.synchronize()
    return out + [p.grad for p in model.parameters()] + list(model.state_dict().values())


def test_cost_aware_mlp_is_bitwise_with_real_recompute():
    from supermem.tensor_pool import Pool

    x = torch.randn(4096, 2048, device="cuda")
    build = lambda: mlp(layers=6)  # noqa: E731
    ref = _train(build, (x, None))
    pool = Pool(budget=0, policy="cost_aware")
    pool.treatments["offload"].link_bytes_per_s = 1e3  # price copies dear: recompute everything it can
    got = _train(build, (x, None), pool)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    pool.synchronize()
    s = pool.stats()
    assert s["regions"] >= 6 and s["dropped_bytes"] > 0 and s["recomputes"] > 0, s
    assert s["tracked_bytes"] == 0
    print(
        f"\ncost_aware mlp: offloaded {s['offloaded_bytes'] >> 20} MiB, "
        f"recomputed {s['dropped_bytes'] >> 20} MiB"
    )


def test_cost_aware_gpt_dropout_bf16_is_bitwise():
    """Dropout replayed from the CUDA RNG state, autocast's bf16 weight copies rebuilt from the fp32
    parameters: the same losses, gradients and weights as plain PyTorch."""
    from supermem.bench.models import GPT
    from supermem.tensor_pool import Pool

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 2048, (8, 129), generator=g).cuda()
    batch = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    build = lambda: GPT(layers=4, d=256, heads=4, vocab=2048, ctx=128, dropout=0.1)  # noqa: E731
    ref = _train(build, batch, amp=True, steps=4)
    for budget in (0, 64 << 10, 1 << 40):
        pool = Pool(budget=budget, policy="cost_aware", min_bytes=0)
        if budget == 0:
            pool.treatments[
                "offload"
            ].link_bytes_per_s = 1e3  # price copies dear: recompute everything it can
        got = _train(build, batch, pool, amp=True, steps=4)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), budget
        s = pool.stats()
        if budget == 0:
            assert s["recomputes"] > 0 and s["regions"] >= 4, s
        if budget == 1 << 40:
            assert s["offloads"] == 0 and s["dropped"] == 0, s


# A child process's small GPT (8 blocks, d1024, bf16) under supermem's allocator: step(pool=None)
_GPT_STEP = """
import json, sys, torch, supermem
from supermem.bench.models import GPT, loss_fn
supermem.install()
torch.manual_seed(0)
model = GPT(layers=8, d=1024, heads=16, vocab=8192, ctx=512).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
idx = torch.randint(0, 8192, (8, 513), device="cuda")
x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
plain = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
def step(pool=None):
    with pool if pool is not None else plain:
        with torch.autocast("cuda", torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""

_BUDGET_RUN = (
    _GPT_STEP
    + """
def peak(pool=None, warm=4, timed=5):
    for _ in range(warm):
        step(pool)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t[0].record()
    for _ in range(timed):
        step(pool)
    t[1].record()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), t[0].elapsed_time(t[1]) / timed
native, native_ms = peak()
budget = int(0.75 * native)
rows = {"native": {"peak": native, "ms": native_ms}}
for policy in sys.argv[1:]:
    pool = supermem.pool(budget=budget, policy=policy)
    p, ms = peak(pool)
    s = pool.stats()
    keys = ("offloads", "dropped", "recomputes", "prefetches", "sync_restores", "pressure_calls", "plans")
    rows[policy] = {"peak": p, "ms": ms, "budget": budget, **{k: s[k] for k in keys}, "plan": s["plan"]}
print(json.dumps(rows))
"""
)


def _budget_rows(*policies: str) -> dict:
    """A small GPT (8 blocks, d1024, bf16) in a fresh process with supermem's allocator: native, then
    each policy at 75% of native's peak after warm-up; per row the peak, step ms and pool counters."""
    r = subprocess.run(
        [sys.executable, "-c", _BUDGET_RUN, *policies], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr  # a crashed child is an error, never a missed target
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    for name, row in rows.items():
        print(f"{name:<10} peak {row['peak'] / 2**30:.3f} GiB  {row['ms']:.1f} ms  {row}")
    return rows


def test_cost_aware_keeps_the_peak_at_the_budget_and_beats_lru():
    """The budget is the allocator's soft limit, so the loss's transient (which the pool never sees at
    a save) makes entries leave too: the peak stays within 5% of the budget; cost_aware (recompute
    where cheaper) is faster than lru (offload only) and peaks no higher."""
    rows = _budget_rows("lru", "cost_aware")
    lru, ca = rows["lru"], rows["cost_aware"]
    assert ca["peak"] <= 1.05 * ca["budget"], rows
    assert ca["peak"] <= 1.01 * lru["peak"], rows
    assert ca["ms"] < lru["ms"], rows


# ---- the planned policy ----------------------------------------------------------------------------


def test_planned_gpt_dropout_bf16_is_bitwise():
    """The plan runs from the third step (regions found, then one step profiled): the same losses,
    gradients and weights as plain PyTorch, with real offloads, prefetches and recomputes."""
    from supermem.bench.models import GPT
    from supermem.tensor_pool import Pool

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 2048, (8, 129), generator=g).cuda()
    batch = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    build = lambda: GPT(layers=4, d=256, heads=4, vocab=2048, ctx=128, dropout=0.1)  # noqa: E731
    ref = _train(build, batch, amp=True, steps=6)
    for budget in (64 << 10, 1 << 40):
        pool = Pool(budget=budget, policy="planned", min_bytes=0)
        got = _train(build, batch, pool, amp=True, steps=6)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), budget
        s = pool.stats()
        assert s["plans"] == 1 and s["plan"] is not None, s
        if budget == 1 << 40:
            assert s["offloads"] == 0 and s["dropped"] == 0, s


def test_planned_profile_counts_attentions_qkv_storage_once(monkeypatch):
    """Attention's q, k and v are views of one projection, each spanning most of it: the profile counts
    the storage once (the allocator, which the budget reads, does), and the plan copies or packs none
    of them alone (that would free nothing). Training stays bitwise."""
    from supermem.bench.models import GPT
    from supermem.policies import Planned
    from supermem.tensor_pool import Pool

    profiles, solve = [], Planned.solve

    def spy(self, p, budget):
        profiles.append(p)
        return solve(self, p, budget)

    monkeypatch.setattr(Planned, "solve", spy)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 2048, (8, 129), generator=g).cuda()
    batch = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    build = lambda: GPT(layers=4, d=256, heads=4, vocab=2048, ctx=128, dropout=0.1)  # noqa: E731
    ref = _train(build, batch, amp=True, steps=5)
    pool = Pool(budget=64 << 10, policy="planned", min_bytes=0)
    got = _train(build, batch, pool, amp=True, steps=5)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert profiles, pool.stats()
    shared = [s for s in profiles[0].saved if s.shared]
    # (math SDPA scales q into a tensor of its own first: k and v are the views it saves, 2 a block)
    assert len(shared) >= 2 * 4, [(s.ordinal, s.nbytes, s.counted) for s in profiles[0].saved]
    assert sum(s.counted for s in shared) <= 0.6 * sum(s.nbytes for s in shared), shared
    treatments = {pool.plans.plan.treatment.get(s.ordinal) for s in shared}
    assert not treatments & {"offload", "compress"}, treatments
    # the plan priced copies at a measured rate (its copies', or the probe's), not the default: 25 GB/s
    # is half an H100's link
    from supermem.costs import GPU_LINK_BYTES_PER_S

    rate = profiles[0].link_bytes_per_s
    assert rate != GPU_LINK_BYTES_PER_S and 1e9 < rate < 1e12, rate


def test_planned_keeps_the_peak_at_the_budget_and_beats_lru():
    """planned's peak within 5% of the budget and its step faster than lru's; the plan's predicted peak
    and step time are printed beside the measured ones."""
    rows = _budget_rows("lru", "planned")
    assert rows["planned"]["peak"] <= 1.05 * rows["planned"]["budget"], rows
    assert rows["planned"]["ms"] < rows["lru"]["ms"], rows


def test_planned_keeps_its_peak_within_3_percent_of_the_budget():
    """Issue 10's peak target at 75% of native's peak, beside cost_aware (printed). The time against
    cost_aware is the bench sweep's to compare: this model's step is host-bound, and on one H100 the
    same commit's planned/cost_aware ratio ranged 0.77-1.41 over three runs (it failed a 5% bound on
    main and on its successor alike)."""
    rows = _budget_rows("cost_aware", "planned")
    assert rows["planned"]["peak"] <= 1.03 * rows["planned"]["budget"], rows


def test_planned_steps_taken_between_native_ones_keep_their_plan():
    """Planned steps alternating with steps run without the pool (at native's peak, over the budget):
    the pool measures its own steps' peak, so each keeps its plan (before, each overshot by native's
    peak, was planned again that much lower, and the plans went infeasible)."""
    out = _run(
        _GPT_STEP
        + """
step()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
step()
native = torch.cuda.max_memory_allocated()
pool = supermem.pool(budget=int(0.75 * native), policy="planned")
for _ in range(4):
    step(pool)
for _ in range(6):
    step()
    step(pool)
s = pool.stats()
print(json.dumps({"native": native, "budget": pool.budget_bytes, "replans": s["replans"],
                  "feasible": s["plan"]["feasible"], "peak": s["plan"]["measured_peak_bytes"]}))
"""
    )
    r = json.loads(out.strip().splitlines()[-1])
    assert r["replans"] == 0 and r["feasible"], r
    assert r["peak"] <= 1.03 * r["budget"] < r["native"], r
