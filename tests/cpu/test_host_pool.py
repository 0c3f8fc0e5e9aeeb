"""The host pool's blocks: a block's storage owns it, so it returns to the pool when its last view dies
(after the copy streams' queued work), or earlier and once only when given back."""

import gc

import torch

from supermem.tensor_pool.host import HostPool

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
