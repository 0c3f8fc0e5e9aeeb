"""The conformance suite against the simulated device, in each allocator configuration."""

import pytest
from alloc_spec import GiB, MiB
from conformance import AllocatorConformance, Target
from live_blocks import HostMemory

from supermem.allocator import CachingAllocator, SimulatedDevice

CAPACITY = 4 * GiB  # mmap'd lazily: only touched pages cost host memory
LIMIT = GiB + 64 * MiB  # leaves room for the 1 GiB boundary size

CONFIGS = {
    "default": {},
    "passthrough": {"passthrough": True},
    "limited": {"limit_bytes": LIMIT},
    "debug2": {"debug": 2},
    "expandable": {"expandable_segments": True},
    "expandable-limited": {"expandable_segments": True, "limit_bytes": LIMIT},
    "expandable-debug2": {"expandable_segments": True, "debug": 2},
}


@pytest.fixture(params=list(CONFIGS), scope="module")
def target(request) -> Target:
    options = CONFIGS[request.param]
    return Target(
        name=f"sim-{request.param}",
        make=lambda: CachingAllocator(SimulatedDevice(CAPACITY), **options),
        memory=HostMemory(),
        streams=(1, 2),
        passthrough=options.get("passthrough", False),
        expandable=options.get("expandable_segments", False),
        limit_bytes=options.get("limit_bytes"),
        device_used_bytes=lambda alloc: alloc.device.used_bytes,
    )


class TestSimulatedDevice(AllocatorConformance):
    pass
