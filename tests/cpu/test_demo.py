"""The README's first command: `supermem demo` trains with and without the pool and checks the losses."""

import subprocess
import sys


def test_demo_runs_on_cpu_and_losses_are_identical():
    r = subprocess.run(
        [sys.executable, "-m", "supermem", "demo", "--steps", "2", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "losses identical: True" in r.stdout
    assert "memory saved:" in r.stdout and "supermem pool" in r.stdout
    assert "checkpoint per block" in r.stdout and "supermem pool at checkpoint's peak" in r.stdout
