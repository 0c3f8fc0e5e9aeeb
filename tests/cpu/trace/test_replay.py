"""`supermem replay` / tools/diag/replay: the what-would-fit advisor."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from trace_workload import Workload, make_allocator

import supermem
from supermem import cli
from supermem.trace.loader import load
from supermem.trace.replay import min_capacity, replay
from supermem.trace.torch_snapshot import write_torch_snapshot

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A workload recorded from an empty allocator: the trace holds its whole history."""
    tmp = tmp_path_factory.mktemp("replay")
    alloc = make_allocator()
    with supermem.trace(tmp / "run.smtrace", allocators=[alloc], model=[], optimizer=[]):
        w = Workload(alloc, layers=12, seed=5)
        w.run(3)
    # categories as the pool would have named them: make every activation-like block "activation"
    # only where the workload announced it (the rest stays unknown)
    tr = load(tmp / "run.smtrace")
    return {"alloc": alloc, "w": w, "trace": tr, "path": tmp / "run.smtrace", "tmp": tmp}


def test_replay_on_a_big_device_reproduces_the_run(run):
    stats = run["alloc"].stats()
    r = replay(run["trace"], 16 << 30)
    assert r.fits and r.num_ooms == 0
    # the same allocator given the same requests in the same order: the same peaks, to the byte
    assert r.peak_reserved_bytes == stats["reserved_bytes_peak"]
    assert r.peak_allocated_bytes == stats["allocated_bytes_peak"] == run["w"].ledger.peak_live_bytes
    assert r.trace_peak_active_bytes == run["w"].ledger.peak_live_bytes


def test_a_small_device_ooms_and_offloading_helps(run):
    tr = run["trace"]
    peak = run["w"].ledger.peak_live_bytes
    cap = int(peak * 0.8) // (2 << 20) * (2 << 20)
    none = replay(tr, cap, "none")
    assert none.num_ooms > 0 and not none.fits
    assert none.peak_reserved_bytes <= cap
    for policy in ("lru", "planned"):
        r = replay(tr, cap, policy)
        assert r.offloaded_bytes > 0 and r.offloads > 0, policy
        assert r.num_ooms < none.num_ooms, policy
        assert r.peak_reserved_bytes <= cap
        assert r.restored_bytes <= r.offloaded_bytes


def test_min_capacity_is_tight(run):
    tr = run["trace"]
    step = 2 << 20
    for policy in ("none", "planned"):
        m = min_capacity(tr, policy)
        assert replay(tr, m, policy).fits, policy
        below = (m - max(step, int(m * 0.01))) // step * step
        assert not replay(tr, below, policy).fits, policy
    assert min_capacity(tr, "planned") < min_capacity(tr, "none")


def test_cli_and_tools_replay_agree(run, capsys):
    args = [str(run["path"]), "--capacity", "16GiB", "--policy", "planned"]
    assert cli.main(["replay", *args]) == 0
    text = capsys.readouterr().out
    assert "OOMs                        0  -> fits" in text
    r = subprocess.run(
        [sys.executable, str(REPO / "tools" / "diag" / "replay"), *args], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == text


def test_cli_json_find_min_and_exit_code(run, capsys):
    tr_peak = run["w"].ledger.peak_live_bytes
    rc = cli.main(["replay", str(run["path"]), "--capacity", str(tr_peak // 2), "--json", "--find-min"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["fits"] is False and out["num_ooms"] > 0  # exit 1: does not fit
    assert out["min_capacity_bytes"] >= tr_peak
    assert replay(run["trace"], out["min_capacity_bytes"]).fits


def test_pytorch_pickle_replays_like_the_trace(run, capsys):
    pk = run["tmp"] / "run.pickle"
    write_torch_snapshot(run["trace"], pk)
    a = replay(load(pk), 16 << 30)
    b = replay(run["trace"], 16 << 30)
    assert (a.peak_reserved_bytes, a.peak_allocated_bytes) == (b.peak_reserved_bytes, b.peak_allocated_bytes)
    # no categories in a plain PyTorch snapshot: planned offloads nothing unless told to
    plain = load(pk)
    plain.cols["category"][:] = plain.categories.index("unknown")
    for d in plain.devices:
        for s in d["segments"]:
            for blk in s["blocks"]:
                blk.pop("category", None)
    cap = int(run["w"].ledger.peak_live_bytes * 0.8)
    assert replay(plain, cap, "planned").offloads == 0
    assert replay(plain, cap, "planned", offload_categories=("unknown",)).offloads > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--capacity", "8Gx"], "--capacity"),
        (["--capacity", "0"], "must be > 0"),
        (["--capacity", "1GiB", "--device", "5"], "device 5 is not in the trace"),
    ],
)
def test_bad_arguments_give_clear_errors(run, capsys, args, message):
    assert cli.main(["replay", str(run["path"]), *args]) == 2
    assert message in capsys.readouterr().err
