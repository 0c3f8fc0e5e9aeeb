"""Files the trace tools write: never over an input, output paths checked before the work (before the
program runs, for `supermem trace`), written atomically, nothing left behind when a write fails, and a
one-line error (no traceback) for every bad output path."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trace_workload import Workload, make_allocator

import supermem
from supermem import cli
from supermem.trace.output import OutputError, atomic_output, check_output, write_bytes


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("out")
    alloc = make_allocator()
    w = Workload(alloc, layers=3, seed=1)
    with supermem.trace(tmp / "run.smtrace", allocators=[alloc], model=w.model, optimizer=w.opt):
        w.run(1)
    return tmp / "run.smtrace"


@pytest.fixture
def trace_copy(small_trace, tmp_path):
    p = tmp_path / "run.smtrace"
    p.write_bytes(small_trace.read_bytes())
    return p


def listing(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def run_cli(capsys, *argv) -> tuple[int, str]:
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def test_export_of_a_pickle_without_o_keeps_the_snapshot(trace_copy, capsys):
    snap = trace_copy.with_suffix(".pickle")
    assert cli.main(["export", str(trace_copy), "-o", str(snap)]) == 0
    before = listing(trace_copy.parent)
    rc, err = run_cli(capsys, "export", snap)  # the default output would be snap itself
    assert rc == 2 and "run.pickle" in err and "input" in err, err
    assert listing(trace_copy.parent) == before


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "{t}", "-o", "{t}"],
        ["report", "{t}", "--png", "{t}"],
        ["report", "{t}", "-o", "{d}/r.html", "--png", "{d}/r.html"],
        ["export", "{t}", "-o", "{t}"],
        ["export", "{t}", "-o", "{d}/./run.smtrace"],
        ["export", "{t}", "-o", "{d}/link.smtrace"],  # a hard link to the input
    ],
)
def test_no_command_writes_over_its_input(trace_copy, capsys, argv):
    d = trace_copy.parent
    os.link(trace_copy, d / "link.smtrace")
    before = listing(d)
    rc, err = run_cli(capsys, *[a.format(t=trace_copy, d=d) for a in argv])
    assert rc == 2 and "Traceback" not in err and ("input" in err or "same file" in err), err
    assert listing(d) == before


@pytest.mark.parametrize("link", [os.link, os.symlink], ids=["hard link", "symlink"])
def test_report_png_that_is_the_html_through_a_link_is_refused(trace_copy, capsys, link):
    d = trace_copy.parent
    (d / "r.html").write_text("an older report")
    link(d / "r.html", d / "r.png")
    before = listing(d)
    rc, err = run_cli(capsys, "report", trace_copy, "-o", d / "r.html", "--png", d / "r.png", "-q")
    assert rc == 2 and "same file as the HTML output" in err and "Traceback" not in err, err
    assert listing(d) == before


@pytest.mark.parametrize("cmd", ["report", "export", "png"])
@pytest.mark.parametrize("where", ["dir", "missing", "devfull"])
def test_bad_output_paths_give_one_line(trace_copy, capsys, cmd, where):
    target = {
        "dir": str(trace_copy.parent),
        "missing": str(trace_copy.parent / "no" / "such" / "x.out"),
        "devfull": "/dev/full",
    }[where]
    if where == "devfull" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    argv = {
        "report": ["report", trace_copy, "-o", target, "-q"],
        "export": ["export", trace_copy, "-o", target],
        "png": ["report", trace_copy, "-o", trace_copy.parent / "ok.html", "--png", target, "-q"],
    }[cmd]
    before = listing(trace_copy.parent)
    rc, err = run_cli(capsys, *argv)
    assert rc == 2, err
    assert err.startswith(f"supermem {argv[0]}: error:") and target in err and err.count("\n") == 1, err
    assert listing(trace_copy.parent) == before  # checked before writing anything, also the HTML


def test_atomic_output_leaves_nothing_when_the_write_fails(tmp_path):
    target = tmp_path / "x.html"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_output(target) as f:
        f.write(b"half of the new")
        raise RuntimeError("disk gone")
    assert listing(tmp_path) == {"x.html": b"old"}
    with atomic_output(target) as f:
        f.write(b"new")
    assert listing(tmp_path) == {"x.html": b"new"}


def test_write_errors_become_output_errors_naming_the_file(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with pytest.raises(OutputError, match="/dev/full"):
        check_output("/dev/full")
    with pytest.raises(OutputError, match="directory"):
        check_output(tmp_path)
    with pytest.raises(OutputError, match="same file"):
        check_output(tmp_path / "a" / ".." / "x", inputs=[tmp_path / "x"])


def test_a_failed_smtrace_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    from supermem.trace import format as fmt
    from supermem.trace.table import Trace

    class Full:  # the fixed header is the first thing written into the file
        def pack(self, *a):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(fmt, "_PREFIX", Full())
    with pytest.raises((OSError, OutputError)):  # OutputError through the CLI's helper
        fmt.write(Trace(), tmp_path / "t.smtrace")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- supermem trace


def run_trace(tmp_path, *args):
    script = tmp_path / "prog.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    r = subprocess.run(
        [sys.executable, "-m", "supermem", "trace", *args, "--", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    return r, (tmp_path / "prog.py.ran").exists()


@pytest.mark.parametrize(
    "args, expect",
    [
        (["-o", "/no/such/dir/x.smtrace"], "/no/such/dir"),
        (["-o", "."], "directory"),
        (["-o", "prog.py"], "input"),  # would write the trace over the script it runs
        (["--capacity", "0"], "--capacity"),
        (["--capacity", "-5"], "--capacity"),
    ],
)
def test_trace_checks_its_arguments_before_running_the_program(tmp_path, args, expect):
    r, ran = run_trace(tmp_path, *args)
    assert r.returncode == 2 and not ran, (r.returncode, r.stderr)
    assert r.stderr.startswith("supermem trace: error:") and expect in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("program", [["missing.py"], ["python", "missing.py"], ["python", "."]])
def test_trace_of_a_missing_script_is_one_line_and_writes_no_trace(tmp_path, program):
    r = subprocess.run(
        [sys.executable, "-m", "supermem", "trace", "-o", "x.smtrace", "--", *program],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("supermem trace: error:"), r.stderr
    assert not (tmp_path / "x.smtrace").exists()


def test_trace_errors_name_the_command(capsys):
    rc, err = run_cli(capsys, "trace", "--", "ls")
    assert rc == 2 and err.startswith("supermem trace: error:"), err


@pytest.mark.parametrize("report", [False, True])
def test_a_trace_block_with_a_bad_path_fails_before_it_runs(tmp_path, report):
    ran = []
    with pytest.raises(OutputError, match="does not exist"):
        with supermem.trace(str(tmp_path / "missing" / "run.smtrace"), report=report):
            ran.append(1)
    assert not ran
    (tmp_path / "run.html").mkdir()  # the report's HTML path is checked too
    with pytest.raises(OutputError, match="is a directory") if report else contextlib.nullcontext():
        with supermem.trace(str(tmp_path / "run.smtrace"), report=report):
            ran.append(2)
    assert ran == ([] if report else [2])


def test_a_replaced_output_keeps_its_mode(tmp_path):
    out = tmp_path / "private.html"
    out.write_bytes(b"old")
    os.chmod(out, 0o600)
    write_bytes(out, b"new")
    assert out.read_bytes() == b"new"
    assert (out.stat().st_mode & 0o777) == 0o600
    fresh = tmp_path / "fresh.html"
    write_bytes(fresh, b"x")  # a new file: 0666 less the umask, as open() gives
    umask = os.umask(0)
    os.umask(umask)
    assert (fresh.stat().st_mode & 0o777) == 0o666 & ~umask
