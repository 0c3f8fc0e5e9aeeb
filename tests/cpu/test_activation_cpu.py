"""Activation paths that need no GPU: the torch.backends hook and `supermem run` on a CPU build."""

import os
import subprocess
import sys
import textwrap


def run(args, env=None, cwd=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    full_env.update(env or {})
    return subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_bad_supermem_conf_stops_import_torch_with_the_key_and_no_traceback():
    for conf, key in (("limt:1GiB", "limt"), ("limit:lots", "limit")):
        r = run([sys.executable, "-c", "import torch; print('ran')"], env={"SUPERMEM_CONF": conf})
        assert r.returncode == 2, r.stdout + r.stderr
        assert "ran" not in r.stdout
        assert "ConfigError" in r.stderr and key in r.stderr
        assert "Traceback" not in r.stderr


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


def test_importing_supermem_stays_lazy():
    code = "import sys, supermem; print(sorted(m for m in sys.modules if m.startswith('supermem')))"
    r = run([sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['supermem']"
