"""The autouse fixture of the CPU pool suites (tests/cpu/pool/test_pool.py, test_pool_safety.py): every test
runs under every live policy, which becomes Pool()'s default policy."""

import inspect

import pytest

from supermem.policies import live_names
from supermem.tensor_pool import Pool


@pytest.fixture(autouse=True, params=live_names())
def policy(request, monkeypatch):
    """Every test here runs under every live policy: it becomes Pool()'s default policy."""
    defaults = list(Pool.__init__.__defaults__)
    positional = [p for p in inspect.signature(Pool.__init__).parameters.values() if p.default is not p.empty]
    defaults[[p.name for p in positional].index("policy")] = request.param
    monkeypatch.setattr(Pool.__init__, "__defaults__", tuple(defaults))
    return request.param
