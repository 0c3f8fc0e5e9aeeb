"""What training code does, under supermem: cuDNN autotuning, every SDPA backend, bf16 autocast,
a DataLoader with pinned memory and forked workers. Each result is compared with a reference computed
in the same process (the math backend, or cudnn.benchmark off).
"""

import torch
import torch.nn.functional as F
from gpu_child import device_allocator
from gpu_harness import check_tests, needs_cuda

pytestmark = needs_cuda


def check_cudnn_benchmark():
    """cudnn.benchmark=True asks the allocator for cacheInfo (rmm#1362 failed there)."""
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(64, 128, 3, padding=1).cuda()
    grads = {}
    for bench in (True, False):
        torch.backends.cudnn.benchmark = bench
        for shape in ((16, 64, 56, 56), (8, 64, 28, 28)):
            x = torch.randn(*shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
            x.requires_grad_(True)
            conv(x).square().mean().backward()
            grads[bench, shape] = (x.grad.clone(), conv.weight.grad.clone())
            conv.zero_grad(set_to_none=True)
    torch.backends.cudnn.benchmark = False
    for shape in ((16, 64, 56, 56), (8, 64, 28, 28)):
        for a, b in zip(grads[True, shape], grads[False, shape], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def check_sdpa_every_backend():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(2, 8, 512, 64, device="cuda", generator=gen) for _ in range(4))

    def run(backend, dtype):
        qkv = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*qkv, is_causal=True)
        grads = torch.autograd.grad(out, qkv, dout.to(dtype))
        return [t.float() for t in (out, *grads)]

    ref = run(SDPBackend.MATH, torch.float32)
    ran = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            got = run(backend, torch.bfloat16)
        except RuntimeError as e:
            if "No available kernel" in str(e):
                ran[backend.name] = "not available here"
                continue
            raise
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
            torch.testing.assert_close(
                a, b, rtol=0.05, atol=0.05, msg=lambda m, n=f"{backend.name} {name}": f"{n}: {m}"
            )
        ran[backend.name] = "ok"
    assert "ok" in (ran.get("FLASH_ATTENTION"), ran.get("EFFICIENT_ATTENTION")), ran
    return ran


def check_bf16_autocast_training():
    from supermem.bench.models import PRESETS, loss_fn

    preset = PRESETS["gpt-quick"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = preset.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = preset.batch(torch.device("cuda"), torch.Generator().manual_seed(0))
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], f"20 steps on one batch did not lower the loss: {losses}"
    return {"first_loss": losses[0], "last_loss": losses[-1]}


def check_dataloader_pinned_memory_fork_workers():
    from torch.utils.data import DataLoader, TensorDataset

    n = 4096
    data = torch.arange(n * 64, dtype=torch.float32).view(n, 64)
    loader = DataLoader(
        TensorDataset(data, torch.arange(n)),
        batch_size=256,
        num_workers=2,
        pin_memory=True,
        multiprocessing_context="fork",
    )
    total = torch.zeros((), dtype=torch.float64, device="cuda")
    seen = 0
    for _epoch in range(2):
        for xb, yb in loader:
            assert xb.is_pinned(), "pin_memory=True gave an unpinned batch"
            total += xb.to("cuda", non_blocking=True).double().sum()
            seen += yb.numel()
    expected = 2 * float(data.double().sum())
    assert seen == 2 * n and total.item() == expected, (seen, total.item(), expected)


def check_invariants_hold():
    device_allocator().check()


test_compat = check_tests(__name__)
