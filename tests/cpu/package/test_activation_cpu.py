"""Activation paths that need no GPU: the torch.backends hook and `supermem run` on a CPU build."""

import ast
import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def run(args, env=None, cwd=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    full_env.update(env or {})
    return subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=120, cwd=cwd)


BAD_CONFS = (("limt:1GiB", "limt"), ("limit:lots", "limit"))


def test_bad_supermem_conf_leaves_a_process_that_only_imports_torch_alone():
    """Every child of a job inherits SUPERMEM_CONF; a tool that imports torch and never uses CUDA or
    autograd (a data worker, `python -c "import torch; ..."`) runs on, and says nothing."""
    for conf, _ in BAD_CONFS:
        r = run(
            [sys.executable, "-c", "import torch; print(torch.ones(2).sum().item())"],
            env={"SUPERMEM_CONF": conf},
        )
        assert r.returncode == 0 and r.stdout.split() == ["2.0"] and r.stderr == "", r.stdout + r.stderr


# As torch.cuda._lazy_init does after cuInit (a CPU build of torch never gets that far; the GPU test
# test_gpu_activation.py::test_bad_supermem_conf_stops_at_the_first_cuda_use runs the real one).
CUDA_INIT = (
    "import torch; print('ran', flush=True); [call() for call, _ in torch.cuda._queued_calls]; print('on')"
)
BACKWARD = "import torch; print('ran', flush=True); x = torch.ones(2, requires_grad=True); x * x; print('on')"


@pytest.mark.parametrize("code", [CUDA_INIT, BACKWARD], ids=["cuda_init", "first_saved_tensor"])
def test_bad_supermem_conf_stops_at_activation_with_one_line_naming_the_key(code):
    for conf, key in BAD_CONFS:
        r = run([sys.executable, "-c", code], env={"SUPERMEM_CONF": conf})
        assert r.returncode == 2 and r.stdout.split() == ["ran"], r.stdout + r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert (
            r.stderr.startswith(f"supermem: bad SUPERMEM_CONF ({conf!r}): ConfigError:") and key in r.stderr
        )


def test_bad_supermem_conf_makes_the_api_raise_config_error():
    code = textwrap.dedent(
        """
        import torch, supermem
        for call in (supermem.install, lambda: supermem.options(trace=1).__enter__()):
            try:
                call()
            except supermem.ConfigError as e:
                print("ConfigError", "limt" in str(e))
        """
    )
    r = run([sys.executable, "-c", code], env={"SUPERMEM_CONF": "limt:1GiB"})
    assert r.returncode == 0 and r.stdout.split() == ["ConfigError", "True"] * 2, r.stdout + r.stderr


def test_the_switch_on_a_torch_without_cuda_is_silent_unless_supermem_log_asks():
    """Under SUPERMEM=1 every `import torch` activates; on a CPU build there is nothing to swap, which is
    worth a line only to someone who asked (SUPERMEM_LOG=info)."""
    code = [sys.executable, "-c", "import torch"]
    assert run(code, env={"SUPERMEM": "1"}).stderr == ""
    r = run(code, env={"SUPERMEM": "1", "SUPERMEM_LOG": "info"})
    assert r.returncode == 0 and "has no CUDA; the allocator is not swapped" in r.stderr, r.stderr
    r = run(code, env={"SUPERMEM": "1", "SUPERMEM_LOG": "loud"})
    assert r.returncode == 0 and "SUPERMEM_LOG='loud' is not one of debug, info" in r.stderr, r.stderr
    assert "has no CUDA" not in r.stderr


INSTALL_WITH_A_POOL = """
import json, torch, supermem
from supermem import tensor_pool
supermem.install("pool:lru,budget:1KiB")
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
model(torch.randn(32, 64)).square().mean().backward()
print(json.dumps(tensor_pool.global_pool().stats()))
"""


def test_install_with_pool_options_gives_every_backward_a_pool_as_supermem_conf_does():
    """`supermem.install("pool:...")` (the README's way to set options in code, and `bench --conf`'s):
    the process's backwards run under a pool, as under SUPERMEM_CONF."""
    r = run([sys.executable, "-c", INSTALL_WITH_A_POOL])
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout.splitlines()[-1])
    assert s["packed"] > 0 and s["budget_bytes"] == 1024, s


def test_python_dash_m_supermem_with_a_bad_conf_fails_the_same_way():
    r = run([sys.executable, "-m", "supermem", "run", "x.py"], env={"SUPERMEM_CONF": "limt:1"})
    assert r.returncode == 2 and "limt" in r.stderr and "Traceback" not in r.stderr


def test_supermem_run_passes_argv_name_and_exit_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            print("argv", sys.argv[1:], __name__, os.environ.get("SUPERMEM"))
            sys.exit(3)
            """
        )
    )
    r = run([sys.executable, "-m", "supermem", "run", str(script), "--epochs", "2"])
    assert r.returncode == 3, r.stdout + r.stderr
    assert "argv ['--epochs', '2'] __main__ 1" in r.stdout


def test_supermem_run_reports_a_missing_script_without_a_traceback(tmp_path):
    r = run([sys.executable, "-m", "supermem", "run", str(tmp_path / "nope.py")])
    assert r.returncode == 2 and "no such script" in r.stderr and "Traceback" not in r.stderr


def test_supermem_run_of_a_directory_without_main_is_one_line_as_under_python(tmp_path):
    r = run([sys.executable, "-m", "supermem", "run", str(tmp_path)])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"supermem run: error: can't find '__main__' module in {str(tmp_path)!r}")
    (tmp_path / "__main__.py").write_text("print('ran', __name__)")
    r = run([sys.executable, "-m", "supermem", "run", str(tmp_path)])
    assert r.returncode == 0 and r.stdout.strip() == "ran __main__", r.stdout + r.stderr


def test_importing_supermem_stays_lazy():
    code = "import sys, supermem; print(sorted(m for m in sys.modules if m.startswith('supermem')))"
    r = run([sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['supermem']"


# ---------------------------------------------------------------- every order a user has (issue 8.1)

# Under SUPERMEM=1 `import torch` runs supermem's hook; a script that also calls the API may do so
# before, after or instead of importing torch. install() is False on a CPU build, never an error.
ORDERS = {
    "install_then_torch": "import supermem; r = supermem.install(); import torch; print('ok', r)",
    "pool_then_torch": "import supermem; supermem.pool(budget='1GiB'); import torch; print('ok', 0)",
    "torch_then_install": "import torch, supermem; r = supermem.install(); print('ok', r)",
    "allocator_module_first": "import supermem.allocator, torch, supermem; print('ok', supermem.installed())",
    "trace_then_torch": "import supermem; r = supermem.trace('x.smtrace'); import torch; print('ok', 0)",
}
SWITCHES = {
    "SUPERMEM=1": {"SUPERMEM": "1"},
    "SUPERMEM_CONF": {"SUPERMEM_CONF": "limit:1GiB"},
    "pool_conf": {"SUPERMEM_CONF": "pool:lru,budget:1GiB"},
}


@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize("order", ORDERS)
def test_the_api_works_in_every_import_order_with_the_switch_on(order, switch, tmp_path):
    r = run([sys.executable, "-c", ORDERS[order]], env=SWITCHES[switch], cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    ok, result = r.stdout.split()
    assert ok == "ok" and result in ("0", "False"), r.stdout  # CPU build: nothing swapped


@pytest.mark.parametrize("switch", SWITCHES)
def test_supermem_run_with_the_switch_on_runs_the_script(switch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import supermem, torch\nprint('ran', supermem.install())\n")
    r = run([sys.executable, "-m", "supermem", "run", str(script)], env=SWITCHES[switch])
    assert r.returncode == 0 and r.stdout.split() == ["ran", "False"], r.stdout + r.stderr


def _modules() -> list[str]:
    import supermem

    names = ["supermem"]
    for m in pkgutil.walk_packages(supermem.__path__, "supermem."):
        if not m.name.endswith("__main__"):
            names.append(m.name)
    return names


# The modules PyTorch's hook needs while `import torch` may be half done: none may import torch itself
# (a module that did would be half-initialised when the hook asks for it).
GROUND_FLOOR = [
    "supermem",
    "supermem._autoload",
    "supermem.activate",
    "supermem.config",
    "supermem.control",
    "supermem.errors",
    "supermem.registry",
    "supermem.units",
    "supermem.trace.oom",
]


def test_every_module_imports_alone_with_the_switch_on_and_the_ground_floor_without_torch():
    """No import circle: each module, first in a fresh process, with the hook on (pool too)."""
    code = "import importlib, sys; importlib.import_module(sys.argv[1]); print('torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env.update(SUPERMEM="1", SUPERMEM_CONF="pool:lru")
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", code, name],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in _modules()
    }
    failed, loads_torch = {}, []
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        if p.returncode != 0:
            failed[name] = err.strip().splitlines()[-1:]
        elif out.split() == ["True"]:
            loads_torch.append(name)
    assert not failed, failed
    assert len(procs) > 30
    assert not set(GROUND_FLOOR) & set(loads_torch), sorted(set(GROUND_FLOOR) & set(loads_torch))


# ---------------------------------------------------------------- supermem run (issue 8.12)


def test_supermem_run_shows_the_programs_own_traceback_and_exits_1(tmp_path):
    for exc in ("ValueError('boom')", "FileNotFoundError('data.csv')"):
        script = tmp_path / "train.py"
        script.write_text(f"def load():\n    raise {exc}\n\nload()\n")
        r = run([sys.executable, "-m", "supermem", "run", str(script)])
        assert r.returncode == 1, r.stderr
        tb = r.stderr[r.stderr.index("Traceback (most recent call last):") :].splitlines()
        # as `python train.py` shows it: the program's frames only, then the exception
        assert tb[1:4] == [f'  File "{script}", line 4, in <module>', "    load()", tb[3]], tb
        assert tb[3] == f'  File "{script}", line 2, in load', tb
        assert tb[-1] in ("ValueError: boom", "FileNotFoundError: data.csv"), tb
        assert "supermem run: error" not in r.stderr


def test_supermem_run_conf_overrides_the_same_key_in_supermem_conf_for_children_too(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, subprocess, sys
            from supermem import config
            print("conf", os.environ["SUPERMEM_CONF"], config.current().limit, config.current().trace)
            child = "import torch; from supermem import config; print('child', config.current().limit)"
            sys.exit(subprocess.call([sys.executable, "-c", child]))
            """
        )
    )
    cmd = [sys.executable, "-m", "supermem", "run", "--conf", "limit:1GiB", str(script)]
    r = run(cmd, env={"SUPERMEM_CONF": "limit:2GiB,trace:64"})
    assert r.returncode == 0, r.stdout + r.stderr
    conf_line, child_line = r.stdout.splitlines()
    _, conf, limit, trace = conf_line.split()
    assert sorted(conf.split(",")) == ["limit:1GiB", "trace:64"] and (limit, trace) == ("1GiB", "64")
    assert child_line == "child 1GiB"


def test_supermem_run_of_a_missing_module_is_one_clear_line(tmp_path):
    r = run([sys.executable, "-m", "supermem", "run", "-m", "no_such_module_xyz"], cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == ["supermem run: error: no module named 'no_such_module_xyz'"]
    (tmp_path / "here_mod.py").write_text("import sys; print('mod', sys.argv[1:]); sys.exit(4)\n")
    r = run([sys.executable, "-m", "supermem", "run", "-m", "here_mod", "x"], cwd=tmp_path)
    assert r.returncode == 4 and r.stdout.split() == ["mod", "['x']"], r.stderr


def _import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the supermem modules it imports anywhere in its code (function-level imports too:
    a lazy import hides a circle from the module-alone test, not from the design)."""
    files = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or "" if node.level == 0 else package.rsplit(".", node.level - 1)[0]
                if node.level and node.module:
                    base += "." + node.module
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name not in files and "." in name:
                    name = name.rpartition(".")[0]
                if name in files and name != "supermem" and not mod.startswith(name + "."):
                    deps.add(name)  # (a package's own __init__ and its ancestors are not edges)
        graph[mod] = deps - {mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, out = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_circles():
    import supermem

    assert _cycles(_import_graph(Path(supermem.__file__).parent)) == []


def test_import_torch_with_the_switch_on_loads_only_supermem_modules_beyond_plain_torch():
    """The autoload hook runs inside every `import torch`: it must not drag in other modules (the
    options are parsed there, sizes included)."""
    code = "import sys, torch; print(' '.join(sorted(sys.modules)))"
    plain = set(run([sys.executable, "-c", code]).stdout.split())
    switch = {"SUPERMEM": "1", "SUPERMEM_CONF": "allocator:native,limit:1.5GiB"}
    r = run([sys.executable, "-c", code], env=switch)
    assert r.returncode == 0, r.stderr
    extra = set(r.stdout.split()) - plain
    assert extra and all(m.startswith("supermem") for m in extra), sorted(extra)
