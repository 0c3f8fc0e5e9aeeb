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
