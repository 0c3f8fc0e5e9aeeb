"""`supermem --version`: the installed distribution's version, or pyproject's in a source tree."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import supermem
from supermem import cli

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def _pyproject_version() -> str:
    return re.search(r'^version = "([^"]+)"', PYPROJECT.read_text(), re.M).group(1)


def test_version_prints_and_exits_0():
    r = subprocess.run(
        [sys.executable, "-m", "supermem", "--version"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"supermem {importlib.metadata.version('supermem')}"


def test_version_without_metadata_is_pyprojects(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cli.version() == _pyproject_version()


def test_dunder_version_is_pyprojects():
    assert supermem.__version__ == _pyproject_version()
