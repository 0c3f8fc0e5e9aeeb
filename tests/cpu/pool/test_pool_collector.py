"""Python's garbage collector is off while a step's saved tensors are the pool's (step.py's
CollectorPause): from the step's first save to its backward's end, and never longer than a step."""

import gc
import os
import subprocess
import sys

import pytest
import torch
from pool_policies import policy  # noqa: F401  (autouse: every test under every live policy)

from supermem.tensor_pool import Pool


@pytest.fixture(autouse=True)
def collector_on():
    assert gc.isenabled()
    yield
    gc.enable()


def forward(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).tanh().sin().sum()  # tanh and sin save tensors: the step opens at the first


def test_off_from_the_first_save_to_the_backwards_end():
    x = torch.randn(64, 64, requires_grad=True)
    pool = Pool(budget=0, host_limit="16MiB")
    with pool:
        for _ in range(3):
            before = gc.isenabled()
            loss = forward(x)
            during = gc.isenabled()
            loss.backward()
            assert (before, during, gc.isenabled()) == (True, False, True)
    ref = x.detach().requires_grad_()
    for _ in range(3):
        forward(ref).backward()
    assert torch.equal(x.grad, ref.grad)


def test_on_again_at_the_pools_exit_when_the_step_raises():
    x = torch.randn(64, 64, requires_grad=True)
    with pytest.raises(ValueError), Pool(budget=0, host_limit="16MiB"):
        forward(x)
        assert not gc.isenabled()
        raise ValueError("the user's")
    assert gc.isenabled()


def test_forwards_without_a_backward_leave_it_on_every_other_step():
    """A pool around forwards that keep a graph but run no backward (an evaluation without no_grad): a
    step opens at each, and the collector is never off for two in a row."""
    x = torch.randn(64, 64, requires_grad=True)
    states = []
    with Pool(budget=0, host_limit="16MiB"):
        for _ in range(4):
            loss = forward(x)
            states.append(gc.isenabled())
            del loss
    assert states == [False, True, False, True]
    assert gc.isenabled()


def test_a_program_that_turned_it_off_keeps_it_off():
    x = torch.randn(64, 64, requires_grad=True)
    gc.disable()
    with Pool(budget=0, host_limit="16MiB"):
        forward(x).backward()
        assert not gc.isenabled()
    assert not gc.isenabled()


PROCESS_WIDE = """
import gc, torch
x = torch.randn(64, 64, requires_grad=True)
for i in range(3):
    loss = (x * 2).tanh().sin().sum()
    during = gc.isenabled()
    loss.backward()
    print(during, gc.isenabled())
"""


def test_the_process_wide_pool_turns_it_on_at_each_backwards_end(request):
    """SUPERMEM_CONF=pool:...: no context to exit, so the backward's end alone turns it on again (the
    process-wide pool under the policy the test runs under)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env["SUPERMEM_CONF"] = f"pool:{request.getfixturevalue('policy')},budget:0"
    r = subprocess.run(
        [sys.executable, "-c", PROCESS_WIDE], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"] * 3, r.stdout + r.stderr
