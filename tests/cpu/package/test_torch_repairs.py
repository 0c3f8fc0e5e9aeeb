"""Repairs of the installed torch that supermem applies before it relies on the part repaired."""

import pytest
import torch

from supermem import torch_private as tp


def test_a_record_stream_fake_with_another_ops_parameters_is_repaired_and_a_right_one_left_alone():
    streams = pytest.importorskip("torch._dynamo.variables.streams")
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = streams.record_stream
    right = op._abstract_fn
    assert not tp.repair_record_stream_fake()  # this torch's own fake: two parameters
    assert op._abstract_fn is right

    def broken(src_stream_index, wait_event_index, to_dealloc):  # torch 2.11's
        return None

    op.register_fake(broken)
    try:
        with FakeTensorMode(), pytest.raises(TypeError, match="to_dealloc"):
            torch.ops.streams.record_stream.default(torch.randn(4), 0)
        assert tp.repair_record_stream_fake()
        with FakeTensorMode():
            torch.ops.streams.record_stream.default(torch.randn(4), 0)
        assert torch.ops.streams.record_stream.default in torch.fx.node._side_effectful_functions
    finally:
        op.register_fake(right)
