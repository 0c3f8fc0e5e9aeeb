"""Headless Chromium for the report tests (Debian's `chromium`; .ci/run installs it).

Without Chromium the browser tests skip, unless SUPERMEM_REQUIRE_CHROMIUM=1 (set by CI), where they fail.
The browser runs with every host name unresolvable and a dead proxy, so a page that needs the network
shows it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("SUPERMEM_REQUIRE_CHROMIUM") == "1":
        pytest.fail("chromium is required (SUPERMEM_REQUIRE_CHROMIUM=1) but not installed")
    pytest.skip("chromium is not installed (apt-get install chromium)")


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            chromium(),
            "--headless",
            "--no-sandbox",  # CI runs as root
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--proxy-server=127.0.0.1:9",
            *args,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)


def dump_dom(page: Path, timeout_s: float = 60) -> str:
    """The DOM after the page's scripts ran."""
    r = _run(["--dump-dom", page.resolve().as_uri()], timeout_s)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def screenshot(page: Path, out: Path, width: int = 1000, height: int = 900, timeout_s: float = 60) -> bytes:
    r = _run([f"--screenshot={out}", f"--window-size={width},{height}", page.resolve().as_uri()], timeout_s)
    assert r.returncode == 0 and out.exists(), r.stderr[-2000:]
    return out.read_bytes()
