"""supermem.checkpoint.binomial on CUDA: bitwise-equal gradients (dropout's CUDA RNG replayed) and a peak
that grows with the checkpoints held, not with the chain's length."""

import pytest
import torch
import torch.nn as nn

from supermem.checkpoint import binomial

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def chain(n, width, seed=0):
    torch.manual_seed(seed)
    blocks = [
        nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU(), nn.Dropout(0.2))
        for _ in range(n)
    ]
    return nn.Sequential(*blocks).cuda()


def grads(model, x, run):
    torch.manual_seed(7)
    x = x.clone().requires_grad_()
    loss = run(model, x).square().mean()
    loss.backward()
    out = [loss.detach(), x.grad] + [p.grad for p in model.parameters()] + list(model.buffers())
    return out + [torch.rand(3, device="cuda")]  # the CUDA RNG stream after the step


@pytest.mark.parametrize("checkpoints", [0, 2, "log"])
def test_bitwise_equal_on_cuda(checkpoints):
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.randn(64, 256, device="cuda")
    plain = grads(chain(24, 256), x, lambda m, t: m(t))
    ours = grads(chain(24, 256), x, lambda m, t: binomial(m, t, checkpoints))
    for a, b in zip(plain, ours):
        assert torch.equal(a, b)


def test_peak_grows_with_checkpoints_not_length():
    def peak(n, run):
        model = chain(n, 256)  # small weights, large activations: the peak is activations
        x = torch.randn(4096, 256, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(model, x).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    act = 4096 * 256 * 4  # one boundary, bytes
    plain = peak(128, lambda m, t: m(t))
    ours = peak(128, lambda m, t: binomial(m, t, 6))
    print(f"chain of 128: plain peak {plain / 2**20:.0f} MiB, binomial(6) {ours / 2**20:.0f} MiB")
    assert plain > 128 * 3 * act  # Linear, BatchNorm and GELU outputs of every block
    assert ours < plain / 4
