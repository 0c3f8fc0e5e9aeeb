"""Op-level replay on a GPU: bf16 LayerNorm -> cast and GELU (GPT under autocast), cuDNN BatchNorm ->
ReLU and BatchNorm + add -> ReLU (the bench's ResNet, fp32) are verified bitwise on the card, dropped
and rebuilt; training is bitwise plain PyTorch's under cost_aware and planned."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def deterministic():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True  # conv backward: its default algorithms accumulate atomically
    yield
    torch.backends.cudnn.deterministic = False


def _train(build, batch, pool=None, steps=4, amp=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from supermem.bench.models import loss_fn

    torch.manual_seed(0)
    model = build().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = batch
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with pool if pool is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            with sdpa_kernel(SDPBackend.MATH), torch.autocast("cuda", torch.bfloat16, enabled=amp):
                o = model(x)
            loss = loss_fn(o.float(), y)
            loss.backward()
        if pool is not None:
            pool.check()
        out.append(loss.detach())
        opt.step()
    torch.cuda.synchronize()
    return out + [p.grad for p in model.parameters()] + list(model.state_dict().values())


def _gpt():
    from supermem.bench.models import GPT

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 2048, (8, 129), generator=g).cuda()
    batch = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    return (lambda: GPT(layers=4, d=256, heads=4, vocab=2048, ctx=128)), batch, True


def _resnet():
    from supermem.bench.models import ResNet

    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 3, 64, 64, generator=g).cuda(), torch.randint(0, 10, (8,), generator=g).cuda())
    return (lambda: ResNet((2, 2, 2, 2), width=16, classes=10)), batch, False


@pytest.mark.parametrize("policy", ["cost_aware", "planned"])
@pytest.mark.parametrize("case", [_gpt, _resnet])
def test_training_with_op_replays_is_bitwise(case, policy):
    from supermem.tensor_pool import Pool

    build, batch, amp = case()
    ref = _train(build, batch, amp=amp)
    pool = Pool(budget=0, policy=policy, min_bytes=0)
    pool.treatments["offload"].link_bytes_per_s = 1e3  # copies priced dear: recompute what it can
    got = _train(build, batch, pool, amp=amp)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    s = pool.stats()
    assert s["replays"] > 0 and s["tracked_bytes"] == 0, s
    print(f"\n{case.__name__} {policy}: {s['replays']} op replays, {s['recomputes']} recomputes")
