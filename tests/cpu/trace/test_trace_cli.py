"""`supermem trace -- python script.py`, `supermem export`, and OOM snapshots (SUPERMEM_CONF=oom_snapshot)."""

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from supermem import cli
from supermem.errors import UsageError
from supermem.trace.cli_trace import child_argv
from supermem.trace.loader import load
from supermem.trace.timeline import lifetimes, series

HERE = Path(__file__).resolve().parents[1]  # tests/cpu: trace_workload.py

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {here!r})
    import supermem.trace
    from trace_workload import Workload, make_allocator
    alloc = make_allocator()
    supermem.trace.register_allocator(alloc, device=0)  # a simulated device standing in for a GPU
    w = Workload(alloc, layers=6)
    w.run(int(sys.argv[1]))
    print("live", sum(s for s, _ in w.live.values()), "peak", w.ledger.peak_live_bytes, flush=True)
    if sys.argv[2] == "raise":
        raise RuntimeError("the training script failed")
    sys.exit(int(sys.argv[2]))
    """
)


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(SCRIPT.format(here=str(HERE)))
    return p


def supermem_trace(capfd, *args):
    """`supermem trace ...` run by this process's CLI (the program still runs in a child Python)."""
    rc = cli.main(["trace", *args])
    out = capfd.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


def numbers(stdout):
    words = stdout.split()
    return int(words[words.index("live") + 1]), int(words[words.index("peak") + 1])


@pytest.mark.parametrize("exit_with", ["3", "raise"])  # exit 0 is the export test's run
def test_trace_runs_the_script_and_writes_the_trace(tmp_path, script, capfd, exit_with):
    out = tmp_path / "run.smtrace"
    r = supermem_trace(capfd, "-o", str(out), "--report", "--", sys.executable, str(script), "2", exit_with)
    assert r.returncode == {"3": 3, "raise": 1}[exit_with], r.stderr
    if exit_with == "raise":
        assert "the training script failed" in r.stderr  # the script's traceback is shown
    live, peak = numbers(r.stdout)
    tr = load(out)
    assert tr.meta["argv"] == [str(script), "2", exit_with]
    lt = lifetimes(tr, 0)
    s = series(tr, 0, lt)
    assert int(s.active[-1]) == live and int(s.active.max()) == peak
    # the model and optimizer were made after the recording started and never named: gc finds them
    # at the dump, PyTorch's global optimizer hooks saw each step's gradients
    cats = {tr.categories[c] for c in lt.category}
    assert {"parameter", "gradient", "optimizer_state", "activation"} <= cats
    assert (tmp_path / "run.html").exists() and (tmp_path / "run.png").exists()


def test_child_argv_forms():
    py = sys.executable
    base = ["-m", "supermem.trace.run_script", "--output", "o", "--capacity", "10"]
    assert child_argv(["--", "python3", "t.py", "-x"], "o", 10, False) == [
        py,  # a bare python is supermem's own interpreter
        *base,
        "--",
        "t.py",
        "-x",
    ]
    assert child_argv(["t.py"], "o", 10, True) == [py, *base, "--stacks", "--", "t.py"]
    assert child_argv(["t.py"], "o", 10, False, True) == [py, *base, "--exact-activations", "--", "t.py"]
    assert child_argv(["python", "-m", "pkg.train", "a"], "o", 10, False)[-4:] == [
        "--",
        "-m",
        "pkg.train",
        "a",
    ]
    for bad, msg in (
        ([], "nothing to run"),
        (["torchrun", "t.py"], "runs Python programs"),
        (["python"], "no script"),
    ):
        with pytest.raises(UsageError, match=msg):
            child_argv(bad, "o", 10, False)
    assert child_argv(["/opt/py/bin/python3", "t.py"], "o", 10, False)[0] == "/opt/py/bin/python3"
    assert child_argv(["python3.99", "t.py"], "o", 10, False)[0] == "python3.99"


def test_exact_activations_keeps_the_hook_in_the_child_and_is_refused_under_a_launcher(tmp_path, capsys):
    """The child's recording keeps its saved-tensor hook for the whole run (it comes off after two
    backwards otherwise); a launcher's ranks push none, so the flag cannot hold there."""
    out = tmp_path / "x.smtrace"
    code = (
        "from supermem.trace import recorder; rec = recorder.active(); "
        "assert rec.context.hook_backwards is None, rec.context.hook_backwards"
    )
    cmd = [
        sys.executable,
        "-m",
        "supermem",
        "trace",
        "--exact-activations",
        "-o",
        str(out),
        "--",
        "python",
        "-c",
    ]
    r = subprocess.run([*cmd, code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (
        cli.main(
            [
                "trace",
                "--exact-activations",
                "-o",
                str(tmp_path / "r-{rank}.smtrace"),
                "--",
                "torchrun",
                "t.py",
            ]
        )
        != 0
    )
    assert "not for a launcher" in capsys.readouterr().err


def test_bare_python_is_supermems_interpreter_not_paths(tmp_path):
    """`-- python x.py` ran PATH's first python, outside supermem's environment ("No module named
    'supermem'"); here PATH's python is one that fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).write_text('#!/bin/sh\necho "PATH\'s $0" >&2\nexit 97\n')
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])}
    for name in ("python", "python3"):
        out = tmp_path / f"{name}.smtrace"
        cmd = ["trace", "-o", str(out), "--", name, "-c", "import supermem, sys; print(sys.executable)"]
        r = subprocess.run(
            [sys.executable, "-m", "supermem", *cmd], capture_output=True, text=True, timeout=120, env=env
        )
        assert r.returncode == 0 and r.stdout.strip() == sys.executable, r.stderr
        assert len(load(out)) == 0


def test_bare_python_launcher_is_supermems_interpreter(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(
        "supermem.trace.cli_trace.subprocess.call", lambda argv, env=None: ran.append(argv) or 0
    )
    out = str(tmp_path / "r-{rank}.smtrace")
    cli.main(["trace", "-o", out, "--", "python", "-m", "torch.distributed.run", "t.py"])
    assert ran == [[sys.executable, "-m", "torch.distributed.run", "t.py"]]


def test_trace_of_code_in_a_real_supermem_process(tmp_path):
    out = tmp_path / "c.smtrace"
    cmd = ["trace", "-o", str(out), "--", sys.executable, "-c", "import sys; print(sys.argv)", "a"]
    r = subprocess.run([sys.executable, "-m", "supermem", *cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "['-c', 'a']" in r.stdout, r.stderr
    assert len(load(out)) == 0  # no allocator in that program: an empty, valid trace


def test_export_writes_a_pickle(tmp_path, script, capfd):
    out = tmp_path / "run.smtrace"
    r = supermem_trace(capfd, "-o", str(out), "--", sys.executable, str(script), "1", "0")
    assert r.returncode == 0, r.stderr
    assert cli.main(["export", str(out), "-o", str(tmp_path / "x.pickle")]) == 0
    snap = pickle.loads((tmp_path / "x.pickle").read_bytes())
    assert set(snap) == {"segments", "device_traces"} and snap["device_traces"][0]
    assert cli.main(["export", str(out), "-o", str(tmp_path / "y.pickle"), "--no-pool-events"]) == 0
    actions = {e["action"] for e in pickle.loads((tmp_path / "y.pickle").read_bytes())["device_traces"][0]}
    assert "offload" not in actions and "alloc" in actions


OOM_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import supermem.trace
    from supermem.allocator import CachingAllocator, SimulatedDevice
    from supermem.trace import oom
    alloc = CachingAllocator(SimulatedDevice("1GiB"), limit_bytes="96MiB",
                             trace_capacity=oom.ring_events_for_config())
    supermem.trace.register_allocator(alloc, device=0)
    model = torch.nn.Linear(4, 4)  # found by the gc scan (its parameters are not on the device)
    held = []
    try:
        while True:
            held.append(alloc.malloc(10 << 20))
    except torch.OutOfMemoryError as e:  # what the activation code will do when it raises an OOM
        written = oom.on_oom(0, 10 << 20, str(e))
        print("written", written, "held", len(held), "ring", alloc.trace_capacity, flush=True)
    """
)


@pytest.mark.parametrize("recording", [False, True])
def test_oom_snapshot_writes_trace_and_report(tmp_path, recording):
    script = tmp_path / "oom.py"
    body = OOM_SCRIPT
    if recording:  # a recording in progress: the snapshot is its trace so far
        body = body.replace("held = []", "rec = supermem.trace.record(allocators=[alloc]).start()\nheld = []")
    script.write_text(body)
    env = dict(
        os.environ, SUPERMEM_CONF=f"oom_snapshot:{tmp_path}/oom-{{pid}}.smtrace", RANK="3", WORLD_SIZE="4"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    path = Path(words[1])
    assert path.name.startswith("oom-") and path.name != "oom-{pid}.smtrace"
    assert "OOM snapshot written to" in r.stderr
    held = int(words[3])
    assert held == 9 and (int(words[5]) == 65536 or recording)  # 9 x 10 MiB fit under 96 MiB
    tr = load(path)
    assert tr.meta["oom"]["requested_bytes"] == 10 << 20
    assert (tr.meta["oom"]["rank"], tr.meta["oom"]["world_size"]) == (3, 4)  # torchrun's, from the env
    oom_events = tr.cols["action"] == tr.actions.index("oom")
    assert int(oom_events.sum()) == 1
    lt = lifetimes(tr, 0)
    assert int(lt.size[lt.end < 0].sum()) == held * (10 << 20)
    html = path.with_suffix(".html").read_text()
    assert "OOMs" in html and path.with_suffix(".png").exists()


def test_oom_snapshot_off_without_the_option(monkeypatch):
    from supermem import config
    from supermem.trace import oom

    monkeypatch.setattr(config, "_current", config.Config())
    assert oom.oom_snapshot_path() is None
    assert oom.on_oom(0, 1, "x") is None
    assert oom.recent_ooms()["recent"][-1]["requested_bytes"] == 1
