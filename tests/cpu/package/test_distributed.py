"""supermem under torch.distributed on CPU (gloo): rank-aware paths and metadata, one trace per rank under
`supermem trace -- python -m torch.distributed.run`, and DDP trained under the tensor pool with a tiny
budget giving the same losses and parameters, bit for bit, as the same run without supermem."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from supermem import control, distributed
from supermem.trace import oom
from supermem.trace.loader import load

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="no gloo"
)

ROOT = Path(__file__).resolve().parents[3]

# A small MLP trained with DDP over gloo; every rank sees other data. Rank 0 writes the losses of both
# ranks and its final parameters (bitwise, as hex) to argv[1]; with the pool on, also its counters.
DDP_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
        torch.nn.Linear(256, 1),
    )
    ddp = DDP(model, bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1 + rank)
    losses = []
    for step in range(4):
        x = torch.randn(128, 64, generator=gen)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    if rank == 0:
        out = {"losses": gathered, "params": [p.detach().numpy().tobytes().hex() for p in model.parameters()]}
        import supermem.tensor_pool as tp
        pool = tp.global_pool()
        out["pool"] = None if pool is None else pool.stats()
        json.dump(out, open(sys.argv[1], "w"), default=str)
    dist.destroy_process_group()
    """
)
# Plain DDP over gloo aborts at exit now and then with no supermem at all ("terminate called without an
# active exception": 1 run in 10 on a 2-core machine, torch 2.13). The training test ends its ranks at once
# (no interpreter teardown, so no atexit: not for the trace test, whose traces are written there); the exit
# under the pool's hooks is test_gloo_shuts_down_cleanly_under_the_pool's.
EXIT_AT_ONCE = "\nimport os\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


# ---------------------------------------------------------------- rank helpers


def test_rank_from_the_launcher_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert (distributed.rank(), distributed.world_size(), distributed.is_distributed()) == (0, 1, False)
    assert distributed.info() == {"rank": 0, "world_size": 1}
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.info() == {"rank": 3, "world_size": 4, "local_rank": 1}
    assert distributed.is_distributed()
    pid = os.getpid()
    assert (
        distributed.expand_path("d/run-{rank}-of-{world_size}.{pid}.smtrace") == f"d/run-3-of-4.{pid}.smtrace"
    )
    assert distributed.expand_path("x-{local_rank}-{n}-{other}", n=2) == "x-1-2-{other}"
    assert distributed.is_template("a-{rank}") and distributed.is_template("a-{pid}")
    assert not distributed.is_template("a-{n}.smtrace")


def test_oom_snapshot_path_and_control_answer_carry_the_rank(monkeypatch):
    import supermem

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with supermem.options(oom_snapshot="/tmp/oom-r{rank}-{pid}-{n}.smtrace"):
        assert oom.oom_snapshot_path(5) == f"/tmp/oom-r1-{os.getpid()}-5.smtrace"
    answer = control.collect()
    assert (answer["rank"], answer["world_size"]) == (1, 2)


def test_a_recording_in_a_rank_writes_its_own_file_with_rank_in_meta(tmp_path, monkeypatch):
    import supermem.trace

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with supermem.trace(str(tmp_path / "t-{rank}.smtrace"), allocators=[]):
        pass
    t = load(tmp_path / "t-1.smtrace")
    assert (t.meta["rank"], t.meta["world_size"]) == (1, 2)
    assert not (tmp_path / "t-{rank}.smtrace").exists()


# ---------------------------------------------------------------- supermem trace -- torchrun


def test_trace_under_torchrun_writes_one_trace_per_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "run-{rank}.smtrace"
    cmd = [
        sys.executable,
        "-m",
        "supermem",
        "trace",
        "-o",
        str(out),
        "--",
        *_torchrun(str(script), str(tmp_path / "r.json")),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 trace(s)" in r.stderr
    for rank in (0, 1):
        t = load(tmp_path / f"run-{rank}.smtrace")
        assert (t.meta["rank"], t.meta["world_size"]) == (rank, 2)
    assert not (tmp_path / "run-{rank}.smtrace").exists()  # the parent never wrote the template itself
    assert sorted(p.name for p in tmp_path.glob("*.smtrace")) == ["run-0.smtrace", "run-1.smtrace"]


def test_trace_under_torchrun_needs_rank_in_the_output(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "supermem",
        "trace",
        "-o",
        str(tmp_path / "one.smtrace"),
        "--",
        "torchrun",
        "t.py",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 2 and "{rank}" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_trace_of_one_process_fills_in_the_template(tmp_path):
    out = tmp_path / "p-{rank}-{pid}.smtrace"
    cmd = [sys.executable, "-m", "supermem", "trace", "-o", str(out), "--", sys.executable, "-c", "pass"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 0, r.stderr
    (written,) = tmp_path.glob("*.smtrace")
    assert written.name.startswith("p-0-") and written.name[4:-8].isdigit()
    assert load(written).meta["rank"] == 0


# ---------------------------------------------------------------- DDP under the pool


def test_ddp_over_gloo_under_the_pool_trains_bitwise_like_plain_ddp(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT + EXIT_AT_ONCE)
    runs = {}
    for name, extra in (
        ("plain", {}),
        ("supermem", {"SUPERMEM": "1", "SUPERMEM_CONF": "pool:lru,budget:64KiB"}),
    ):
        res = tmp_path / f"{name}.json"
        r = subprocess.run(
            _torchrun(str(script), str(res)), capture_output=True, text=True, timeout=120, env=_env(**extra)
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = json.loads(res.read_text())
    plain, pooled = runs["plain"], runs["supermem"]
    assert plain["pool"] is None
    assert pooled["pool"]["offloads"] > 0, pooled["pool"]  # the tiny budget really moved tensors
    assert pooled["losses"] == plain["losses"]  # both ranks, every step (floats from JSON: exact)
    assert pooled["params"] == plain["params"]  # bitwise
    assert plain["losses"][0] != plain["losses"][1]  # the ranks saw different data


# The pool's hooks at gloo's shutdown (issue 13). SUPERMEM_CONF=pool:... keeps the pool's saved-tensor hooks
# (Python functions) in the main thread's thread-local state; gloo copies that state into every work and
# frees the copy on its run-loop thread, which needs the GIL to drop the hooks. A barrier's work holds
# nothing else of Python's: without the pool the same script is clean. The main thread keeps the GIL until
# it blocks here (a long switch interval makes deterministic what a busy machine does at random), so:
# - "reducer": DDP's Reducer, the group's last owner after destroy_process_group (as at the end of a
#   main()), joins gloo's threads holding the GIL while one of them waits for it: a hang;
# - "exit": a gloo thread that asks for the GIL during finalisation aborts the process ("terminate called
#   without an active exception" / "FATAL: exception not rethrown").
GLOO_SHUTDOWN_SCRIPT = textwrap.dedent(
    """
    import faulthandler, gc, sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    faulthandler.dump_traceback_later(30, exit=True)  # a hang fails the run, with its stacks
    dist.init_process_group("gloo")
    if sys.argv[1] == "reducer":
        group = dist.new_group(backend="gloo")
        ddp = DDP(torch.nn.Linear(4, 4), process_group=group)
        ddp(torch.ones(2, 4)).sum().backward()
        reducer = ddp.reducer
        del ddp
        gc.collect()
        sys.setswitchinterval(1000)
        dist.barrier(group=group, async_op=True)  # the handle is dropped: a gloo thread frees the work
        dist.destroy_process_group(group)
        del group
        del reducer  # the group's last owner: joins gloo's threads
    else:
        sys.setswitchinterval(1000)
        dist.barrier(async_op=True)  # freed by a gloo thread while this process exits
    print("clean", flush=True)
    """
)


@pytest.mark.parametrize("scenario", ["reducer", "exit"])
@pytest.mark.parametrize("extra", [{}, {"SUPERMEM_CONF": "pool:lru,budget:64KiB"}], ids=["plain", "pool"])
def test_gloo_shuts_down_cleanly_under_the_pool(tmp_path, extra, scenario):
    script = tmp_path / "shutdown.py"
    script.write_text(GLOO_SHUTDOWN_SCRIPT)
    cmd = _torchrun(str(script), scenario)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(**extra))
    assert r.returncode == 0 and r.stdout.count("clean") == 2, (r.stdout + r.stderr)[-3000:]


# ---------------------------------------------------------------- report of several ranks


def _rank_trace(tmp_path, monkeypatch, rank, layers):
    """A trace of rank `rank` (of 2): a simulated device on which `layers` layers train 2 steps."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/cpu: trace_workload.py
    from trace_workload import Workload, make_allocator

    import supermem.trace

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    alloc = make_allocator()
    with supermem.trace(str(tmp_path / "r-{rank}.smtrace"), allocators=[(0, alloc)]):
        Workload(alloc, layers=layers).run(2)
    return tmp_path / f"r-{rank}.smtrace"


def test_report_shows_ranks_side_by_side(tmp_path, monkeypatch, capsys):
    from supermem import cli
    from supermem.trace.analysis import analyze

    paths = [_rank_trace(tmp_path, monkeypatch, r, layers) for r, layers in ((1, 9), (0, 4))]
    single = {load(p).meta["rank"]: analyze(load(p)).devices[0].peak_bytes for p in paths}
    assert single[0] != single[1]  # the ranks differ, so a mix-up shows
    html_path = tmp_path / "report.html"
    assert cli.main(["report", str(paths[0]), str(paths[1]), "-o", str(html_path), "--no-png", "-q"]) == 0
    page = html_path.read_text()
    assert page.count('<section class="device"') == 2
    assert page.index("rank 0 · cuda:0") < page.index("rank 1 · cuda:0")  # rank order, not argument order
    from supermem.trace.ranks import merge_ranks

    merged = analyze(merge_ranks([load(p) for p in paths]))
    assert [d.peak_bytes for d in merged.devices] == [single[0], single[1]]
    # the same rank twice is a mistake: one line, no page
    assert cli.main(["report", str(paths[0]), str(paths[0]), "-o", str(tmp_path / "x.html")]) == 2
    assert "same rank" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()


def test_rank_fields_of_a_trace_are_checked(tmp_path, monkeypatch):
    import supermem.trace
    from supermem.trace.format import TraceFormatError, read, write

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with supermem.trace(str(tmp_path / "t.smtrace"), allocators=[]):
        pass
    t = read(tmp_path / "t.smtrace")
    for bad in ({"rank": 2}, {"rank": -1}, {"world_size": 0}, {"rank": "1"}):
        t2 = read(tmp_path / "t.smtrace")
        t2.meta.update(bad)
        write(t2, tmp_path / "bad.smtrace")
        with pytest.raises(TraceFormatError, match="rank|world_size"):
            read(tmp_path / "bad.smtrace")
    del t.meta["rank"], t.meta["world_size"]  # a trace from before ranks: read as rank 0 of 1
    write(t, tmp_path / "old.smtrace")
    assert "rank" not in read(tmp_path / "old.smtrace").meta


# ---------------------------------------------------------------- the bench's worker: DDP and FSDP2 over gloo


def test_bench_train_ddp_quick_on_cpu(capsys):
    import argparse

    from supermem.bench import ddp

    args = argparse.Namespace(
        ddp=2, quick=True, device="cpu", steps=2, warmup=1, budgets=[0.5], conf=None, timeout=120
    )
    out = ddp.run(args)
    rows = out["rows"]
    assert list(rows) == ["native DDP", "supermem", "pool 64KiB"]
    assert all(not r["error"] for r in rows.values()), rows
    native = rows["native DDP"]["ranks"]
    for name in ("supermem", "pool 64KiB"):
        assert [r["losses"] for r in rows[name]["ranks"]] == [r["losses"] for r in native]
        assert [r["params_sha256"] for r in rows[name]["ranks"]] == [r["params_sha256"] for r in native]
    assert all(r["pool"]["offloads"] > 0 for r in rows["pool 64KiB"]["ranks"])
    assert "baseline: native DDP, this run" in capsys.readouterr().out
    with pytest.raises(Exception, match="number of ranks"):
        ddp.run(argparse.Namespace(**{**vars(args), "ddp": 0}))


def test_fsdp2_over_gloo_under_the_pool_trains_bitwise_like_plain_fsdp2():
    from supermem.bench import ddp

    worker = [*ddp.QUICK, "--steps", "3", "--device", "cpu", "--wrap", "fsdp"]
    plain, error = ddp.launch(2, worker, {"OMP_NUM_THREADS": "1"}, 120)
    assert not error, error
    pooled, error = ddp.launch(
        2, worker, {"OMP_NUM_THREADS": "1", "SUPERMEM_CONF": "pool:lru,budget:64KiB"}, 120
    )
    assert not error, error
    assert all(r["pool"]["offloads"] > 0 for r in pooled)
    assert [r["losses"] for r in pooled] == [r["losses"] for r in plain]
    assert [r["params_sha256"] for r in pooled] == [r["params_sha256"] for r in plain]  # each rank's shard
    assert plain[0]["params_sha256"] != plain[1]["params_sha256"]  # shards, not copies


def test_top_says_which_rank_it_watches():
    from supermem import top

    snap = {"pid": 42, "rank": 1, "world_size": 2, "argv": ["train.py"], "time_unix_s": 0, "providers": {}}
    assert "pid 42  rank 1/2  train.py" in top.render(snap)
    assert "rank" not in top.render({**snap, "rank": 0, "world_size": 1}).splitlines()[0]
