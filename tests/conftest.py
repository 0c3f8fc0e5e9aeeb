import os
import stat
import sys

import pytest

# Helpers that hold assertions: let pytest explain their failures too.
pytest.register_assert_rewrite("conformance", "fuzz_model", "live_blocks")


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="run tests marked slow (10^6-op fuzz)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def interpreter_under_test(tmp_path_factory):
    """Every subprocess a test starts runs the interpreter under test (sys.executable), never whatever
    `python3` PATH finds first: on a fresh machine that one has no torch (a CI that passed only because
    the machine's python3 had torch installed by hand). A `python`/`python3` found on PATH fails loudly."""
    shims = tmp_path_factory.mktemp("no-path-python")
    for name in ("python", "python3"):
        shim = shims / name
        shim.write_text(
            "#!/bin/sh\necho 'a test ran python from PATH; run tools with sys.executable' >&2\nexit 97\n"
        )
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{shims}{os.pathsep}{old}"
    yield sys.executable
    os.environ["PATH"] = old
