"""supermem.linear_cross_entropy on a GPU: a GPT-2-sized head (8 x 1024 tokens, vocabulary 50304, bf16
autocast) without the loss's spike, and its loss and gradients as the unchunked expression's.

Run: python -m pytest -q tests/gpu/test_losses_gpu.py -s   (prints the peaks)"""

import pytest
import torch
import torch.nn.functional as F

from supermem.losses import CHUNK_BYTES, linear_cross_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS, D, VOCAB = 8 * 1024, 1024, 50304


def step(loss_fn, h, w, t):
    """The loss's own peak above what was allocated before it, its value and the gradients."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_fn(h, w, t)
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, loss.detach(), h.grad, w.grad


def test_a_gpt_head_without_the_spike_and_with_the_same_loss():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(ROWS, D, device="cuda", generator=g)
    w = torch.randn(VOCAB, D, device="cuda", generator=g) * D**-0.5
    t = torch.randint(0, VOCAB, (ROWS,), device="cuda", generator=g)
    native = step(lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t), h, w, t)
    ours = step(lambda h, w, t: linear_cross_entropy(h, w, t), h, w, t)
    logits_fp32 = ROWS * VOCAB * 4
    print(f"\nloss's peak: unchunked {native[0] / 2**30:.2f} GiB, chunked {ours[0] / 2**30:.2f} GiB")
    assert native[0] > 2 * logits_fp32  # bf16 logits, their fp32 copy, log_softmax's output, gradients
    # the fp32 gradients it keeps, the weight's bf16 copy, one chunk's temporaries (two fp32 logits)
    bound = (ROWS + VOCAB) * D * 4 + VOCAB * D * 2 + 2 * CHUNK_BYTES
    assert ours[0] < 1.05 * bound < logits_fp32 / 1.5
    torch.testing.assert_close(ours[1], native[1], rtol=1e-5, atol=0)
    for a, b in zip(ours[2:], native[2:]):
        assert ((a - b).norm() / b.norm()).item() < 1e-2
