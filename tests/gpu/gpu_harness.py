"""The parent side of the GPU tests: run Python in a fresh process and read back what it reports.

Two ways to use it:
- `run_python(code_or_args, env=...)` runs a script (activation, golden tests) and returns the result.
- `check_tests(__name__, conf=...)` at the bottom of a test module turns every `check_*` function in it
  into a parametrized test. The selected checks of a module run together in ONE swapped child process
  (`gpu_child.py`), except those marked `@isolated(...)`, which get a process each. Set
  SUPERMEM_TEST_ISOLATE=1 to give every check its own process (slower, for debugging a crash).

SUPERMEM_TEST_NATIVE=1 is a dry run of the tests themselves against PyTorch's own allocator: checks run
unswapped (those that need supermem's allocator skip), golden tests compare native with native, and
activation tests skip. A check that fails there is a wrong test, not a supermem bug.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gpu_child import BEGIN, RESULT

HERE = Path(__file__).resolve().parent
JSON_PREFIX = "@@JSON "
NATIVE_DRY_RUN = os.environ.get("SUPERMEM_TEST_NATIVE") == "1"

needs_cuda = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without supermem's switches (a child is native unless told), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    # tools/ci/gpu_sanitize.sh: options every swapped child gets too (passthrough:true for memcheck).
    forced = os.environ.get("SUPERMEM_TEST_EXTRA_CONF")
    if forced:
        env["SUPERMEM_TEST_EXTRA_CONF"] = forced  # gpu_child.py adds it to its --conf
        if env.get("SUPERMEM_CONF"):
            from supermem.config import merge_conf

            env["SUPERMEM_CONF"] = merge_conf(env["SUPERMEM_CONF"], forced)
        elif env.get("SUPERMEM") == "1":
            env["SUPERMEM_CONF"] = forced
    return env


@dataclass
class Run:
    rc: int | None  # None: killed by the timeout
    stdout: str
    stderr: str

    def json(self, index: int = -1) -> dict:
        """A `@@JSON {...}` line the child printed (see EMIT): the last one, or the index-th."""
        lines = [
            line[len(JSON_PREFIX) :] for line in self.stdout.splitlines() if line.startswith(JSON_PREFIX)
        ]
        try:
            return json.loads(lines[index])
        except IndexError:
            raise AssertionError(
                f"the child printed no {JSON_PREFIX!r} line #{index}\n{self.describe()}"
            ) from None

    def describe(self, tail: int = 3000) -> str:
        return f"rc={self.rc}\n--- stdout ---\n{self.stdout[-tail:]}\n--- stderr ---\n{self.stderr[-tail:]}"


# Scripts that report results define this (kept tiny: importing nothing else keeps scripts "unchanged").
EMIT = "import json as _j\ndef emit(**kw): print('@@JSON ' + _j.dumps(kw, default=str), flush=True)\n"


def run_command(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 120, cwd=None) -> Run:
    """Runs `cmd` with child_env(env); a timeout kills it and returns rc=None with what it printed."""
    try:
        r = subprocess.run(cmd, env=child_env(env), cwd=cwd, capture_output=True, text=True, timeout=timeout)
        return Run(r.returncode, r.stdout, r.stderr)
    except subprocess.TimeoutExpired as e:
        return Run(None, _text(e.stdout), _text(e.stderr) + f"\n[killed after {timeout} s]")


def run_python(
    code_or_args: str | list[str],
    env: dict[str, str] | None = None,
    timeout: float = 120,
    cwd: Path | None = None,
) -> Run:
    """Runs code (a str: written to a temp file after EMIT) or `python ARGS` in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        if isinstance(code_or_args, str):
            script = Path(tmp) / "script.py"
            script.write_text(EMIT + textwrap.dedent(code_or_args))
            args = [str(script)]
        else:
            args = list(code_or_args)
        return run_command([sys.executable, *args], env=env, timeout=timeout, cwd=cwd or tmp)


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode(errors="replace")


# ---- check modules -------------------------------------------------------------------------------


@dataclass
class GroupRun:
    run: Run
    names: list[str]  # the checks the child was asked to run, in order
    results: dict[str, dict]  # name -> the child's record


_groups: dict[tuple[str, str], GroupRun] = {}


def _checks(module) -> dict:
    """name -> function, for the module's own `check_*` functions (not imported ones like check_tests)."""
    return {
        n[len("check_") :]: f
        for n, f in vars(module).items()
        if n.startswith("check_") and callable(f) and getattr(f, "__module__", None) == module.__name__
    }


def _group(fn, name: str) -> str:
    """The group a check runs in: "" is the module's shared process, else the check's own name."""
    if getattr(fn, "isolated", False) or os.environ.get("SUPERMEM_TEST_ISOLATE") == "1":
        return name
    return ""


def _selected(request, module) -> list[str]:
    """The module's checks pytest will run this session (so `-k one` starts only what it needs)."""
    out = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is module and callspec is not None and "check" in callspec.params:
            out.append(callspec.params["check"])
    return out


def _run_group(request, module, group: str, conf: str | None, native: bool, timeout: float) -> GroupRun:
    checks = _checks(module)
    names = [n for n in _selected(request, module) if _group(checks[n], n) == group]
    if group:
        names = [group]
        conf = getattr(checks[group], "isolated_conf", None) or conf
    tmp = tempfile.mkdtemp(prefix="supermem-gpu-test-")  # "{tmp}" in a conf; SUPERMEM_TEST_TMP in the child
    conf = conf.replace("{tmp}", tmp) if conf else conf
    args = [str(HERE / "gpu_child.py"), module.__name__, *names, "--path", str(Path(module.__file__).parent)]
    args += ["--native"] if native or NATIVE_DRY_RUN else (["--conf", conf] if conf else [])
    run = run_python(args, env={"SUPERMEM_TEST_TMP": tmp}, timeout=timeout, cwd=HERE)
    results = {}
    for line in run.stdout.splitlines():
        if line.startswith(RESULT):
            rec = json.loads(line[len(RESULT) :])
            results[rec["name"]] = rec
    return GroupRun(run, names, results)


def _last_begun(stdout: str) -> str:
    begun = [line[len(BEGIN) :] for line in stdout.splitlines() if line.startswith(BEGIN)]
    return begun[-1] if begun else "(nothing: it died while starting, in supermem.install or an import)"


def check_tests(module_name: str, conf: str | None = None, native: bool = False, timeout: float = 150):
    """A test parametrized over the module's `check_*` functions, each run in a child (see module doc).

    conf: options for `supermem.install` in the shared child; native: run the checks unswapped."""
    module = sys.modules[module_name]

    @pytest.mark.parametrize("check", list(_checks(module)))
    def test(check, request):
        key = (module_name, _group(_checks(module)[check], check))
        if key not in _groups:
            _groups[key] = _run_group(request, module, key[1], conf, native, timeout)
        g = _groups[key]
        run, rec = g.run, g.results.get(check)
        if rec is None:
            pytest.fail(
                f"the child process ended before check {check!r} reported; it was running "
                f"{_last_begun(run.stdout)!r}\n{run.describe()}",
                pytrace=False,
            )
        if rec["status"] == "skip":
            pytest.skip(rec["reason"])
        if rec["status"] == "fail":
            pytest.fail(f"{rec['error']}\n--- child stderr (tail) ---\n{run.stderr[-2000:]}", pytrace=False)
        if run.rc != 0 and len(g.results) == len(g.names):
            pytest.fail(
                f"check {check!r} passed, but its process exited with rc={run.rc} after all its checks "
                f"(a crash at interpreter exit?)\n{run.describe()}",
                pytrace=False,
            )
        print(f"{check}: {rec['seconds']} s, info={rec['info']}")

    return test
