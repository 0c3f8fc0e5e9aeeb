"""supermem under torch.distributed on 2 GPUs (NCCL, launched by torchrun): a small GPT trained 20 steps
with DDP and with FSDP2, plain and under supermem (allocator only, and with the pool); an OOM on one rank;
one trace per rank. Skipped without 2 GPUs. NVLink multicast stays off in the ranks (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1: supermem.bench.ddp.launch sets them).

Every run is `python -m torch.distributed.run --nproc-per-node 2 -m supermem.bench.ddp_worker` with
supermem switched on by the environment, as a user would (see supermem/bench/ddp_worker.py).

On a 2-GPU machine (the device tool's nvidia-h100-x2), in one call of about 8 minutes:
    pip install --no-build-isolation --no-deps -e .
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    timeout 280 python -m pytest -q -s -rs tests/gpu/test_distributed_gpu.py
    timeout 110 python -m supermem bench train --ddp 2 --budgets 0.75 --steps 10 --warmup 3
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from supermem.bench import ddp
from supermem.trace.loader import load

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
    ),
]

ROOT = Path(__file__).resolve().parents[2]
NATIVE_DRY_RUN = os.environ.get("SUPERMEM_TEST_NATIVE") == "1"  # see gpu_harness.py
# GPT-8 d512 b8 T512 bf16: ~50 MiB of saved activations per block, so the pool has something to move
SIZES = ["--layers", "8", "--dim", "512", "--heads", "8", "--vocab", "8192", "--batch", "8", "--seq", "512"]
STEPS = 20
TIMEOUT_S = 240


def _run(wrap: str, env: dict[str, str], *extra: str, steps: int = STEPS) -> list[dict]:
    env = {"PYTHONPATH": str(ROOT), **env}
    if NATIVE_DRY_RUN:  # the tests themselves against PyTorch's allocator: no supermem in the ranks
        env = {k: v for k, v in env.items() if not k.startswith("SUPERMEM")}
    rows, error = ddp.launch(2, [*SIZES, "--steps", str(steps), "--wrap", wrap, *extra], env, TIMEOUT_S)
    assert not error, error
    assert [r["rank"] for r in rows] == [0, 1]
    return rows


def _same_training(a: list[dict], b: list[dict]) -> bool:
    return [r["losses"] for r in a] == [r["losses"] for r in b] and [r["params_sha256"] for r in a] == [
        r["params_sha256"] for r in b
    ]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_training_under_supermem_matches_plain(wrap):
    plain = _run(wrap, {})
    again = _run(wrap, {})
    deterministic = _same_training(plain, again)  # else only close: the comparison below says which
    assert all(r["backend"] == "native" for r in plain)
    allocator = _run(wrap, {"SUPERMEM": "1"})
    top_peak = max(r["peak_alloc_bytes"] for r in plain)
    budget = int(top_peak * 0.75)
    pooled = _run(wrap, {"SUPERMEM_CONF": f"pool:lru,budget:{budget}"})
    for name, rows in (("allocator", allocator), ("pool", pooled)):
        if not NATIVE_DRY_RUN:
            assert all(r["backend"] == "pluggable" for r in rows), (name, rows)
        if deterministic:
            assert _same_training(rows, plain), (
                name,
                [r["losses"] for r in rows],
                [r["losses"] for r in plain],
            )
        else:
            for r, p in zip(rows, plain):
                assert r["losses"] == pytest.approx(p["losses"], rel=2e-3), (name, r["rank"])
    if NATIVE_DRY_RUN:
        return
    for r, p in zip(pooled, plain):
        assert r["pool"]["offloads"] > 0, r["pool"]
        assert r["peak_alloc_bytes"] < p["peak_alloc_bytes"], (
            r["rank"],
            r["peak_alloc_bytes"],
            p["peak_alloc_bytes"],
        )

    def ms(rows):
        return [round(r["step_s"] * 1e3, 1) for r in rows]

    def mib(rows):
        return [r["peak_alloc_bytes"] >> 20 for r in rows]

    print(
        f"\n{wrap}: deterministic={deterministic}; per-rank peak plain {mib(plain)} MiB, "
        f"pool (budget {budget >> 20} MiB) {mib(pooled)} MiB; step ms plain {ms(plain)}, "
        f"allocator {ms(allocator)}, pool {ms(pooled)}"
    )


@pytest.mark.skipif(NATIVE_DRY_RUN, reason="the budget is supermem's pool")
def test_a_fraction_budget_resolves_on_each_ranks_device():
    rows = _run("ddp", {"SUPERMEM_CONF": "pool:lru,budget:0.9"}, steps=3)
    for r in rows:
        assert r["device"] == r["rank"]  # LOCAL_RANK's GPU
        assert abs(r["pool"]["budget_bytes"] - int(0.9 * r["total_bytes"])) <= 1, r


def test_an_oom_on_one_rank_is_an_out_of_memory_error_there_with_its_snapshot(tmp_path):
    conf = f"oom_snapshot:{tmp_path}/oom-{{rank}}.smtrace"
    rows = _run("ddp", {"SUPERMEM_CONF": conf}, "--oom-rank", "1", steps=4)
    assert rows[0]["oom"] is None
    assert rows[1]["oom"]["type"] == "OutOfMemoryError", rows[1]["oom"]
    assert len(rows[1]["losses"]) == 4  # training went on on both ranks after the caught OOM
    if NATIVE_DRY_RUN:
        return
    assert "CUDA out of memory." in rows[1]["oom"]["message"]
    assert not (tmp_path / "oom-0.smtrace").exists()
    snap = load(tmp_path / "oom-1.smtrace")
    assert (snap.meta["rank"], snap.meta["world_size"]) == (1, 2)
    assert snap.meta["oom"]["rank"] == 1 and snap.meta["oom"]["device"] == 1


@pytest.mark.skipif(NATIVE_DRY_RUN, reason="traces record supermem's allocator")
def test_supermem_trace_under_torchrun_writes_one_trace_per_rank_and_a_report_of_both(tmp_path):
    out = tmp_path / "run-{rank}.smtrace"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    worker = ["-m", "supermem.bench.ddp_worker", str(tmp_path), *SIZES, "--steps", "3"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env.update(PYTHONPATH=str(ROOT), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    cmd = [sys.executable, "-m", "supermem", "trace", "-o", str(out), "--", *launcher, *worker]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        t = load(tmp_path / f"run-{rank}.smtrace")
        assert (t.meta["rank"], t.meta["world_size"]) == (rank, 2)
        assert t.device_indices() == [rank] and len(t) > 0  # its own GPU's allocator, recorded
    html = tmp_path / "report.html"
    cmd = [sys.executable, "-m", "supermem", "report", str(tmp_path / "run-0.smtrace")]
    cmd += [str(tmp_path / "run-1.smtrace"), "-o", str(html), "-q"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    page = html.read_text()
    assert "rank 0 · cuda:0" in page and "rank 1 · cuda:1" in page


PRESSURE_SCRIPT = """
import json, torch
from supermem.tensor_pool import Pool
pools = [Pool(device=f"cuda:{d}") for d in (0, 1)]
for p in pools:
    p.budget.register_pressure_handler()
held = []
try:
    while True:  # fill cuda:1 under its 2 GiB limit: only its pool may be asked to free memory
        held.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda:1"))
except torch.OutOfMemoryError:
    pass
print("@@" + json.dumps([p.stats()["pressure_calls"] for p in pools]))
"""


@pytest.mark.skipif(NATIVE_DRY_RUN, reason="pressure handlers are supermem's allocator's")
def test_pressure_on_one_device_asks_only_that_devices_pool():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env.update(PYTHONPATH=str(ROOT), SUPERMEM_CONF="limit:2GiB")
    r = subprocess.run(
        [sys.executable, "-c", PRESSURE_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    calls = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("@@"))[2:])
    assert calls[0] == 0 and calls[1] > 0, calls  # before: every pool was asked, whatever device was short


@pytest.mark.skipif(NATIVE_DRY_RUN, reason="supermem.pool")
def test_supermem_pool_gives_a_pool_per_current_device():
    code = (
        "import torch, supermem\n"
        "torch.cuda.set_device(1); a = supermem.pool(budget='1GiB')\n"
        "torch.cuda.set_device(0); b = supermem.pool(budget='1GiB')\n"
        "print('@@', a.device, b.device, supermem.pool(budget='1GiB') is b)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env.update(PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "@@ cuda:1 cuda:0 True" in r.stdout, r.stderr[-3000:]  # before: the cuda:1 pool twice
