"""Turning supermem on: never initialises CUDA by itself, works for an unchanged script (SUPERMEM=1,
SUPERMEM_CONF, `python -m supermem run`, `supermem run`), refuses clearly when too late or misconfigured.

Each case is a script in a fresh process. "CUDA not initialised" is checked twice: torch's flag, and
the driver itself (cuDeviceGetCount returns CUDA_ERROR_NOT_INITIALIZED = 3 before cuInit), as
PyTorch's test_lazy_init does.
"""

import importlib.metadata
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from gpu_harness import EMIT, NATIVE_DRY_RUN, needs_cuda, run_command, run_python

pytestmark = [*needs_cuda, pytest.mark.skipif(NATIVE_DRY_RUN, reason="activation needs supermem")]

DRIVER_STATE = """
import ctypes
def driver_initialised():
    count = ctypes.c_int()
    rc = ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(count))
    assert rc in (0, 3), f"cuDeviceGetCount returned {rc}"
    return rc == 0
"""

# An unchanged training script: it never mentions supermem.
UNCHANGED = """
import sys, torch
model = torch.nn.Linear(512, 512).cuda()
for _ in range(3):
    model(torch.randn(64, 512, device="cuda")).square().mean().backward()
emit(backend=torch.cuda.get_allocator_backend(), allocated=torch.cuda.memory_allocated(),
     supermem_loaded="supermem" in sys.modules, argv=sys.argv[1:], name=__name__)
"""


def script(tmp_path: Path, code: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(EMIT + textwrap.dedent(code))
    return path


def test_supermem_is_a_torch_backends_entry_point():
    names = [ep.name for ep in importlib.metadata.entry_points(group="torch.backends")]
    assert "supermem" in names, (
        f"no torch.backends entry point 'supermem' (found {names}): reinstall supermem"
    )


@pytest.mark.parametrize("env", [{}, {"SUPERMEM": "1"}], ids=["plain", "SUPERMEM=1"])
def test_import_does_not_initialise_cuda(env):
    r = run_python(
        DRIVER_STATE
        + """
import torch, supermem
emit(torch_initialised=torch.cuda.is_initialized(), driver=driver_initialised(),
     installed=supermem.installed())
""",
        env=env,
    )
    out = r.json()
    assert out["installed"] == bool(env), out
    assert not out["torch_initialised"] and not out["driver"], out


def test_install_does_not_initialise_cuda():
    r = run_python(
        DRIVER_STATE
        + """
import torch, supermem
supermem.install()
supermem.install()  # idempotent
emit(torch_initialised=torch.cuda.is_initialized(), driver=driver_initialised(),
     installed=supermem.installed())
x = torch.ones(1000, device="cuda")
emit(backend=torch.cuda.get_allocator_backend(), total=x.sum().item())
""",
    )
    out = r.json()
    assert out == {"backend": "pluggable", "total": 1000.0}, r.describe()
    assert r.json(index=0) == {"torch_initialised": False, "driver": False, "installed": True}, r.describe()


def test_fork_after_activation_can_use_cuda_in_the_child():
    """Activation must leave CUDA untouched, so a forked child may still use it (it fails after cuInit)."""
    r = run_python(
        """
import multiprocessing as mp, torch
def child(q):
    q.put((torch.ones(10, device="cuda").sum().item(), torch.cuda.get_allocator_backend()))
ctx = mp.get_context("fork")
q = ctx.Queue()
p = ctx.Process(target=child, args=(q,))
p.start()
got = q.get(timeout=120)
p.join()
emit(exitcode=p.exitcode, got=got)
""",
        env={"SUPERMEM": "1"},
    )
    assert r.json() == {"exitcode": 0, "got": [10.0, "pluggable"]}, r.describe()


@pytest.mark.parametrize(
    ("env", "backend"),
    [
        ({}, "native"),
        ({"SUPERMEM": "1"}, "pluggable"),
        ({"SUPERMEM": "0"}, "native"),
        ({"SUPERMEM_CONF": "limit:80%"}, "pluggable"),
        ({"SUPERMEM_CONF": "allocator:native"}, "native"),
    ],
    ids=["nothing", "SUPERMEM=1", "SUPERMEM=0", "SUPERMEM_CONF", "allocator-native"],
)
def test_env_switches_an_unchanged_script(tmp_path, env, backend):
    r = run_python([str(script(tmp_path, UNCHANGED))], env=env)
    out = r.json()
    assert out["backend"] == backend, r.describe()
    assert out["allocated"] >= 512 * 512 * 4, out  # the stats work either way


def test_supermem_conf_limit_applies_to_an_unchanged_script():
    r = run_python(
        """
import torch
ok = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
try:
    torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    emit(raised=None)
except torch.OutOfMemoryError as e:
    emit(raised=type(e).__name__, message=str(e)[:300])
""",
        env={"SUPERMEM_CONF": "limit:3GiB"},
    )
    out = r.json()
    assert out["raised"] is not None and "CUDA out of memory." in out["message"], out


def test_spawned_child_inherits_activation():
    r = run_python(
        """
import multiprocessing as mp, torch
def child(q):
    import torch
    torch.ones(1, device="cuda")
    q.put(torch.cuda.get_allocator_backend())
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    emit(child=q.get(timeout=120))
    p.join()
""",
        env={"SUPERMEM": "1"},
    )
    assert r.json() == {"child": "pluggable"}, r.describe()


def _runners() -> list[list[str]]:
    console = Path(sys.executable).parent / "supermem"
    console_cmd = [str(console)] if console.exists() else [shutil.which("supermem") or ""]
    return [[sys.executable, "-m", "supermem", "run"], [*console_cmd, "run"]]


@pytest.mark.parametrize("runner", _runners(), ids=["python -m supermem run", "supermem run"])
def test_run_command(tmp_path, runner):
    if not runner[0]:
        pytest.skip("no supermem console script on PATH")
    path = script(tmp_path, UNCHANGED + "sys.exit(3)\n")
    # TORCH_DEVICE_BACKEND_AUTOLOAD=0: the explicit runner must not depend on the entry point
    r = run_command([*runner, str(path), "a1", "--flag"], env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    out = r.json()
    assert out["backend"] == "pluggable", r.describe()
    assert out["argv"] == ["a1", "--flag"] and out["name"] == "__main__", out
    assert r.rc == 3, f"the script's exit code was not passed on\n{r.describe()}"


def test_install_after_cuda_init_says_what_to_do():
    r = run_python(
        """
import torch, supermem
from supermem.errors import ActivationError
torch.zeros(1, device="cuda")
try:
    supermem.install()
    emit(raised=None)
except Exception as e:
    emit(raised=type(e).__name__, activation=isinstance(e, ActivationError),
         runtime=isinstance(e, RuntimeError), message=str(e), installed=supermem.installed(),
         still_works=torch.ones(10, device="cuda").sum().item(), backend=torch.cuda.get_allocator_backend())
"""
    )
    out = r.json()
    assert out["raised"] and out["activation"] and out["runtime"], out
    msg = out["message"]
    assert "supermem.install" in msg or "SUPERMEM" in msg, f"the message names no remedy: {msg!r}"
    assert "before" in msg.lower(), f"the message does not say it must come before CUDA init: {msg!r}"
    assert not out["installed"] and out["still_works"] == 10 and out["backend"] == "native", out


def test_install_when_already_active_is_a_no_op():
    """A script that calls supermem.install() itself, run with SUPERMEM=1, after CUDA is up."""
    r = run_python(
        """
import torch, supermem
torch.zeros(1, device="cuda")
supermem.install()
emit(installed=supermem.installed(), backend=torch.cuda.get_allocator_backend())
""",
        env={"SUPERMEM": "1"},
    )
    assert r.json() == {"installed": True, "backend": "pluggable"}, r.describe()


def test_install_rejects_bad_options_and_stays_usable():
    r = run_python(
        """
import torch, supermem
from supermem.errors import ConfigError
caught = {}
for conf in ("limt:1GiB", {"limit": "lots"}, "limit:12GiB,limit:1GiB"):
    try:
        supermem.install(conf)
        caught[str(conf)] = None
    except ConfigError as e:
        caught[str(conf)] = str(e)
emit(caught=caught, installed=supermem.installed(), cuda=torch.cuda.is_initialized())
supermem.install("limit:1GiB")
torch.ones(1, device="cuda")
emit(installed=supermem.installed(), limit=supermem.device_allocator(0).limit_bytes)
"""
    )
    first = r.json(index=0)
    caught = first["caught"]
    assert caught["limt:1GiB"] and "limt" in caught["limt:1GiB"], caught
    assert caught["{'limit': 'lots'}"] and "limit" in caught["{'limit': 'lots'}"], caught
    assert caught["limit:12GiB,limit:1GiB"], caught
    assert not first["installed"] and not first["cuda"], first
    assert r.json() == {"installed": True, "limit": 1 << 30}, r.describe()


@pytest.mark.parametrize(("conf", "key"), [("limt:1GiB", "limt"), ("limit:lots", "limit")])
def test_bad_supermem_conf_fails_loudly_naming_the_key(tmp_path, conf, key):
    r = run_python([str(script(tmp_path, UNCHANGED))], env={"SUPERMEM_CONF": conf})
    assert r.rc not in (0, None), f"a bad SUPERMEM_CONF was ignored\n{r.describe()}"
    assert "ConfigError" in r.stderr and key in r.stderr, r.describe()
    r = run_python(["-m", "supermem", "run", str(tmp_path / "train.py")], env={"SUPERMEM_CONF": conf})
    assert r.rc not in (0, None) and key in r.stderr, r.describe()


def test_bad_supermem_conf_stops_at_the_first_cuda_use(tmp_path):
    """Not at `import torch`: a process that never touches CUDA runs on
    (tests/cpu/package/test_activation_cpu.py)."""
    code = "import torch\nprint('ran', flush=True)\ntorch.ones(1, device='cuda')\nprint('on')\n"
    r = run_python(code, env={"SUPERMEM_CONF": "limt:1GiB"})
    assert r.rc == 2 and r.stdout.split() == ["ran"], r.describe()
    assert r.stderr.startswith("supermem: bad SUPERMEM_CONF ('limt:1GiB'): ConfigError:"), r.describe()
    assert r.stderr.count("\n") == 1, r.describe()


def test_pytorch_alloc_conf_is_taken_where_it_means_a_supermem_option_and_said_ignored_otherwise():
    r = run_python(
        """
import torch
total = torch.cuda.get_device_properties(0).total_memory
try:
    torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
    emit(raised=None)
except torch.OutOfMemoryError as e:
    emit(raised=type(e).__name__)
""",
        env={
            "SUPERMEM": "1",
            "PYTORCH_CUDA_ALLOC_CONF": (
                "per_process_memory_fraction:0.25,expandable_segments:True,max_split_size_mb:64"
            ),
        },
    )
    assert r.json() == {"raised": "OutOfMemoryError"}, r.describe()
    said = [line for line in r.stderr.splitlines() if "PYTORCH_CUDA_ALLOC_CONF" in line]
    assert len(said) == 1 and "ignored: max_split_size_mb" in said[0], r.describe()
    assert "per_process_memory_fraction:0.25 as limit:0.25" in said[0], r.describe()
    assert "expandable_segments:True as expandable_segments:True" in said[0], r.describe()


def test_clean_exit_with_live_tensors_graphs_and_streams():
    """Tensors still alive at interpreter exit are freed (or dropped) without a crash or a message."""
    r = run_python(
        """
import torch, supermem
supermem.install()
keep = [torch.randn(n, device="cuda") for n in (1, 1000, 1 << 20, 1 << 26)]
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    side = torch.randn(1 << 20, device="cuda")
side.record_stream(torch.cuda.current_stream())
x = torch.randn(256, 256, device="cuda")
g = torch.cuda.CUDAGraph()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    (x @ x).relu()
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g):
    y = (x @ x).relu()
g.replay()
emit(ok=True)
"""
    )
    assert r.rc == 0 and r.json() == {"ok": True}, r.describe()
    for bad in (
        "terminate called",
        "Trying to free a pointer",
        "Segmentation fault",
        "Traceback",
        "core dumped",
    ):
        assert bad not in r.stderr, r.describe()


# ---------------------------------------------------------------- issue 8.1 and 8.2: the user's order


@pytest.mark.parametrize(
    "env", [{"SUPERMEM": "1"}, {"SUPERMEM_CONF": "pool:lru,budget:1GiB"}], ids=["SUPERMEM=1", "pool"]
)
@pytest.mark.parametrize("first", ["install", "pool"])
def test_the_api_before_import_torch_with_the_switch_on(env, first):
    call = "supermem.install()" if first == "install" else "supermem.pool(budget='1GiB')"
    r = run_python(
        f"""
import supermem
{call}
import torch
m = torch.nn.Linear(256, 256).cuda()
m(torch.randn(8, 256, device="cuda")).sum().backward()
emit(installed=supermem.installed(), backend=torch.cuda.get_allocator_backend())
""",
        env=env,
    )
    assert r.rc == 0, r.describe()
    assert r.json() == {"installed": True, "backend": "pluggable"}, r.describe()


# Ordinary: the recording starts before the first CUDA tensor, so the device allocator is made during it.
TRACED = """
import torch
xs = [torch.randn(1 << n, device="cuda") for n in range(10, 20)]
y = sum(x.sum() for x in xs)
del xs
m = torch.nn.Linear(512, 512).cuda()
for _ in range(3):
    m(torch.randn(64, 512, device="cuda")).square().mean().backward()
print("done", float(y))
"""


def _allocator_events(path: Path) -> int:
    from supermem.trace.loader import load
    from supermem.trace.table import ALLOC

    tr = load(path)
    return int(((tr.cols["action"] == ALLOC) & (tr.cols["device"] == 0)).sum())


@pytest.mark.parametrize("env", [{}, {"SUPERMEM": "1"}], ids=["plain", "SUPERMEM=1"])
def test_trace_context_entered_before_the_first_cuda_tensor_records_it(tmp_path, env):
    """Plain: the recording swaps supermem's allocator in (CUDA is not initialised yet), as `supermem
    trace` does; it recorded nothing before, silently."""
    out = tmp_path / "ctx.smtrace"
    code = f"import supermem\nwith supermem.trace({str(out)!r}):\n" + textwrap.indent(TRACED, "    ")
    r = run_python(code, env=env)
    assert r.rc == 0 and out.exists(), r.describe()
    assert _allocator_events(out) >= 10, r.describe()
    assert "records no device memory" not in r.stderr, r.describe()


def test_trace_context_entered_after_cuda_began_under_torchs_allocator_says_it_records_none(tmp_path):
    out = tmp_path / "late.smtrace"
    code = "import torch, supermem\ntorch.ones(1, device='cuda')\n"
    code += f"with supermem.trace({str(out)!r}):\n" + textwrap.indent(TRACED, "    ")
    r = run_python(code)
    assert r.rc == 0 and "done" in r.stdout and out.exists(), r.describe()
    assert r.stderr.count("this trace records no device memory") == 1, r.describe()


@pytest.mark.parametrize("env", [{}, {"SUPERMEM": "1"}], ids=["plain", "SUPERMEM=1"])
def test_supermem_trace_of_a_plain_script_records_its_allocations(tmp_path, env):
    path = tmp_path / "train.py"
    path.write_text(TRACED)
    out = tmp_path / "run.smtrace"
    r = run_command(
        [sys.executable, "-m", "supermem", "trace", "-o", str(out), "--", sys.executable, str(path)],
        env=env,
        cwd=tmp_path,
    )
    assert r.rc == 0 and "done" in r.stdout and out.exists(), r.describe()
    assert _allocator_events(out) >= 10, r.describe()


def test_run_conf_wins_over_supermem_conf_for_the_installed_allocator(tmp_path):
    path = script(
        tmp_path,
        """
import supermem, torch
x = torch.ones(1, device="cuda")
emit(limit=supermem.device_allocator(0).limit_bytes)
""",
    )
    cmd = [sys.executable, "-m", "supermem", "run", "--conf", "limit:1GiB", str(path)]
    r = run_command(cmd, env={"SUPERMEM_CONF": "limit:2GiB"})
    assert r.rc == 0 and r.json() == {"limit": 1 << 30}, r.describe()


def test_a_planted_socket_directory_does_not_stop_training(tmp_path):
    """issue 8.10: the control server is optional; install() (here via SUPERMEM=1) warns once."""
    import os

    planted = tmp_path / f"supermem-{os.getuid()}"
    planted.mkdir()
    os.chmod(planted, 0o777)
    r = run_python(UNCHANGED, env={"SUPERMEM": "1", "TMPDIR": str(tmp_path), "XDG_RUNTIME_DIR": ""})
    assert r.rc == 0 and r.json()["backend"] == "pluggable", r.describe()
    assert r.stderr.count("`supermem top` is off") == 1, r.describe()
