"""The typed API: supermem's lazy top-level names have their real signatures for a type checker."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import supermem

ROOT = Path(__file__).resolve().parents[3]


def test_pool_factory_signature_is_pools():
    from supermem.tensor_pool import Pool

    declared = inspect.signature(supermem.PoolFactory.__call__).parameters
    actual = inspect.signature(Pool.__init__).parameters
    assert [(p.name, p.kind, p.default) for p in declared.values()] == [
        (p.name, p.kind, p.default) for p in actual.values()
    ]


def _mypy_errors(tmp_path, code: str) -> tuple[list[str], str]:
    """mypy's error lines on a user's file holding `code`, and all it printed."""
    pytest.importorskip("mypy")
    snippet = tmp_path / "user.py"
    snippet.write_text(code)
    # cwd: the project's mypy cache (make lint fills it), so torch is not analysed again
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", str(snippet)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    return [line for line in r.stdout.splitlines() if ": error:" in line], r.stdout + r.stderr


def test_a_misspelled_keyword_to_supermem_pool_is_a_type_error(tmp_path):
    errors, said = _mypy_errors(
        tmp_path,
        "import supermem\n"
        'good = supermem.pool(budget="8GiB", policy="lru")\n'
        'bad = supermem.pool(budget="8GiB", polcy="lru")\n'
        "supermem.install(limit=1)\n",
    )
    assert len(errors) == 2, said
    assert ':3: error: Unexpected keyword argument "polcy"' in errors[0], errors
    assert ':4: error: Unexpected keyword argument "limit" for "install"' in errors[1], errors


def test_stats_has_the_keys_its_type_declares():
    import torch

    from supermem.tensor_pool import Pool, PoolStats
    from supermem.tensor_pool.stats import PlanStats
    from supermem.tensor_pool.treatments import Compress

    required, optional = PoolStats.__required_keys__, PoolStats.__optional_keys__
    pool = Pool(budget=1 << 10, policy="planned", min_bytes=0)
    x = torch.randn(32, 64, requires_grad=True)
    for _ in range(3):
        with pool:
            torch.relu(x @ x.T).sum().backward()
    s = pool.stats()
    assert set(s) == required, set(s) ^ required
    assert s["plan"] is not None and set(s["plan"]) == PlanStats.__required_keys__
    packs = Pool(budget=0, policy="cost_aware", min_bytes=0, treatments=(Compress(),))
    with packs:
        torch.relu(x @ x.T).sum().backward()
    assert set(packs.stats()) == required | optional


def test_a_misspelled_stats_key_is_a_type_error(tmp_path):
    errors, said = _mypy_errors(
        tmp_path,
        "import supermem\n"
        'p = supermem.pool(budget="8GiB")\n'
        'ok: int = p.stats()["offloads"]\n'
        'bad = p.stats()["ofloads"]\n',
    )
    assert len(errors) == 1 and ':4: error: TypedDict "PoolStats" has no key "ofloads"' in errors[0], said


def test_the_allocators_stats_have_the_keys_their_type_declares():
    from supermem.allocator import AllocatorStats, CachingAllocator, SimulatedDevice

    alloc = CachingAllocator(SimulatedDevice("1GiB"))
    assert set(alloc.stats()) == AllocatorStats.__required_keys__


def test_the_device_allocator_is_typed_and_a_misspelled_stats_key_is_an_error(tmp_path):
    errors, said = _mypy_errors(
        tmp_path,
        "import supermem\n"
        "a = supermem.device_allocator(0)\n"
        "assert a is not None  # None until the allocator serves that device\n"
        'ok: int = a.stats()["reserved_bytes_peak"]\n'
        'bad = a.stats()["reserved_peak"]\n',
    )
    assert len(errors) == 1, said
    assert ':5: error: TypedDict "AllocatorStats" has no key "reserved_peak"' in errors[0], said
