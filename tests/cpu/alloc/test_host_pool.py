"""The host pool's blocks: a block's storage owns it, so it returns to the pool when its last view dies
(after the copy streams' queued work), or earlier and once only when given back. One pool per device,
shared through shares that each keep within their own limit."""

import gc

import pytest
import torch

from supermem.transfer import host
from supermem.transfer.host import HostPool, shared_host_pool

MiB = 1 << 20
COPY_STREAM = 7


def test_a_block_returns_when_its_last_view_dies_and_not_before():
    pool = HostPool(16 * MiB, pinned=False)
    block = pool.take(MiB)
    view = block.tensor[100:200].view(torch.float32)
    del block
    gc.collect()
    assert pool.allocator.allocated_bytes >= MiB  # a view still reads it
    view.fill_(1.0)
    del view
    assert pool.allocator.allocated_bytes == 0
    pool.allocator.check()


def test_given_back_then_dropped_frees_once():
    pool = HostPool(16 * MiB, pinned=False)
    block = pool.take(MiB)
    pool.give_back(block)
    assert pool.allocator.allocated_bytes == 0
    pool.give_back(block)  # twice: harmless
    again = pool.take(MiB)  # may reuse the same address: the old block's death must not free it
    del block
    gc.collect()
    assert pool.allocator.allocated_bytes >= MiB
    pool.give_back(again)
    pool.allocator.check()


def test_a_dropped_block_waits_for_the_copy_streams():
    """Dropped while a copy on a copy stream may still read it: not reused before that copy is done."""
    pool = HostPool(16 * MiB, pinned=False)
    pool.copy_streams.add(COPY_STREAM)
    block = pool.take(MiB)
    address = block.address
    pool.allocator.device.hold_events(True)  # the simulated copy stream has not finished yet
    del block
    assert pool.allocator.allocated_bytes == 0
    other = pool.take(MiB)
    assert other.address != address
    pool.allocator.device.hold_events(False)
    pool.give_back(other)
    pool.allocator.check()


@pytest.fixture
def fresh_registry(monkeypatch):
    """No host pools made yet in this process (other tests' pools stay out of the way)."""
    monkeypatch.setattr(host, "_shared", {})


def test_one_host_pool_per_device_its_limit_the_largest_asked(fresh_registry):
    cpu = torch.device("cpu")
    small = shared_host_pool(cpu, 1 * MiB)
    large = shared_host_pool(cpu, 4 * MiB)
    middle = shared_host_pool(cpu, 2 * MiB)  # smaller than the pool's limit: changes nothing
    assert small.pool is large.pool is middle.pool
    assert large.pool.limit_bytes == 4 * MiB
    assert small.take(2 * MiB) is None  # over its own share
    held = large.take(3 * MiB)
    assert held is not None and large.in_use_bytes == 3 * MiB
    assert middle.take(2 * MiB) is None  # within its share, but the device's pool would pass 4 MiB
    assert large.pool.reserved_bytes <= 4 * MiB
    del held
    assert large.in_use_bytes == 0
    assert middle.take(2 * MiB) is not None  # room again (and its block, dropped at once, goes back)
    assert middle.in_use_bytes == 0 and large.pool.allocator.allocated_bytes == 0
    large.pool.allocator.check()


def test_a_limit_of_zero_takes_nothing(fresh_registry):
    share = shared_host_pool(torch.device("cpu"), 0)
    assert share.take(1) is None
    assert shared_host_pool(torch.device("cpu"), MiB).take(1) is not None
    assert share.take(1) is None  # its own share stays 0
