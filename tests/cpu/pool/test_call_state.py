"""The state a region's replay runs under (tensor_pool/call_state.py): the call's RNG, autocast and
attention backends with grad on inside, exactly what was there before afterwards, also when the
replayed code raises or entering fails."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from supermem.tensor_pool import call_state
from supermem.tensor_pool.call_state import CallState


def _outside():
    """The global state a replay must leave as it found it (autocast nesting included)."""
    nesting = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return (
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
        nesting,
        call_state.sdpa_backends(),
        torch.get_rng_state(),
    )


def _same(a, b):
    return a[:-1] == b[:-1] and torch.equal(a[-1], b[-1])


def _captured():
    """A call under bf16 autocast with grad on, and the random draw it would make."""
    torch.manual_seed(7)
    with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        state = CallState(torch.device("cpu"))
        draw = torch.rand(4)
    return state, draw


def test_replay_runs_under_the_call_and_puts_everything_back():
    state, draw = _captured()
    torch.manual_seed(3)
    with torch.no_grad(), torch.autocast("cpu", enabled=False, dtype=torch.float16):
        before = _outside()
        with state.replay():
            assert torch.is_grad_enabled()
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert not torch.is_autocast_cache_enabled()
            assert torch.equal(torch.rand(4), draw)  # the call's random numbers again
        assert _same(_outside(), before)


def test_replay_puts_everything_back_when_the_replayed_code_raises():
    state, _ = _captured()
    before = _outside()
    with pytest.raises(ZeroDivisionError), state.replay():
        torch.rand(3)
        1 / 0  # noqa: B018
    assert _same(_outside(), before)


def test_replay_puts_back_what_it_set_when_entering_fails(monkeypatch):
    state, _ = _captured()
    before = _outside()

    real, calls = torch.set_autocast_dtype, []

    def broken_once(*args):  # fails in the middle of entering, works when putting back
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("no")
        return real(*args)

    monkeypatch.setattr(torch, "set_autocast_dtype", broken_once)
    with pytest.raises(RuntimeError, match="no"), state.replay():
        pass
    monkeypatch.undo()
    assert _same(_outside(), before)


def test_replay_switches_the_attention_backends_of_the_call_and_back():
    state, _ = _captured()
    before = call_state.sdpa_backends()
    state.sdpa = tuple(not on for on in before)  # as captured on CUDA, with the opposite switches
    with state.replay():
        assert call_state.sdpa_backends() == state.sdpa
    assert call_state.sdpa_backends() == before


def test_replay_under_a_torch_function_mode_enters_autocast_through_torch():
    seen = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    state, draw = _captured()
    before = _outside()
    with Watch(), state.replay():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.equal(torch.rand(4), draw)
    assert _same(_outside(), before)
    assert seen  # the mode was on
