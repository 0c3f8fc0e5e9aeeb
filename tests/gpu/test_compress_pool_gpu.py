"""The Compress treatment on a GPU: a ResNet (BatchNorm, ReLU) trained with its ReLU outputs kept
packed by the CUDA kernels gives gradients bitwise equal to plain training, and a lower peak.

Run: python -m pytest -q tests/gpu/test_compress_pool_gpu.py -s   (prints the peaks)"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MiB = 1 << 20


@pytest.fixture(autouse=True)
def deterministic():
    """Plain training must repeat bitwise, or comparing with it tests noise (docs/design.md#determinism)."""
    saved = (
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
    )
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    (
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
    ) = saved


def resnet():
    from supermem.bench.models import ResNet

    return ResNet((1, 2, 2, 1), width=16, classes=100)


def batch(n=16, px=64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, px, px, generator=g).cuda(), torch.randint(0, 100, (n,), generator=g).cuda()


def train(pool=None, steps=3, n=16, px=64):
    """`steps` SGD steps of a fresh ResNet: every loss, the final gradients, weights and BatchNorm
    statistics, and the peak allocated bytes of the last step."""
    from supermem.bench.models import loss_fn

    torch.manual_seed(0)
    model = resnet().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    x, y = batch(n, px)
    out = []
    for i in range(steps):
        if i == steps - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        opt.zero_grad(set_to_none=True)
        with pool if pool is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = loss_fn(model(x), y)
            loss.backward()
        if pool is not None:
            pool.check()
        out.append(loss.detach())
        opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return out + [p.grad for p in model.parameters()] + list(model.state_dict().values()), peak


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def compressing_pool(*treatments, **kw):
    from supermem.tensor_pool import Pool
    from supermem.tensor_pool.treatments import make_treatments

    return Pool(budget=0, policy="cost_aware", treatments=make_treatments(treatments), **kw)


def test_resnet_training_with_compression_is_bitwise():
    ref, _ = train()
    again, _ = train()
    assert same(ref, again), "plain training does not repeat bitwise here: the comparison would be noise"
    for treatments in (("compress",), ("offload", "recompute", "compress")):
        pool = compressing_pool(*treatments, min_bytes=0)
        if "offload" in pool.treatments:
            pool.treatments["offload"].link_bytes_per_s = 1e3  # copies priced dear
        got, _ = train(pool)
        assert same(ref, got), treatments
        s = pool.stats()
        assert s["compressions"] > 0 and s["tracked_bytes"] == 0, s
        assert s["compressed_payload_bytes"] < 0.7 * s["compressed_bytes"], s  # ReLU outputs: ~half zeros


def test_compression_lowers_the_peak_at_a_tiny_budget():
    """At budget 0 with compression as the only way out, the last step's peak is below plain
    training's by at least a quarter of the bytes compressed per step (about half of each ReLU
    output is zeros; all of them are away at the peak, the end of the forward). Saved tensors of
    1 MiB or more only (the GPU default), at a batch where most activations are that large."""
    size = {"n": 32, "px": 128}
    _, plain_peak = train(**size)
    pool = compressing_pool("compress")
    _, peak = train(pool, **size)
    pool.reset_stats()
    train(pool, steps=1, **size)
    per_step = pool.stats()["compressed_bytes"]
    print(f"\nresnet peak: plain {plain_peak / MiB:.1f} MiB, compressed {peak / MiB:.1f} MiB, "
          f"compressed {per_step / MiB:.1f} MiB/step")  # fmt: skip
    assert per_step > 0
    assert peak < plain_peak and plain_peak - peak >= 0.25 * per_step, (plain_peak, peak, per_step)


def test_full_room_compression_is_bitwise_and_lowers_the_peak():
    """Compress(room="full"): packs with room for every element wait for no count and never miss;
    each is trimmed to its exact size once its count is back. At budget 0 training is bitwise and the
    last step's peak is below plain training's (a pack frees its bytes when its count is back, not
    when it is made: how much lower is printed)."""
    from supermem.tensor_pool import Pool
    from supermem.tensor_pool.treatments import Compress

    size = {"n": 32, "px": 128}
    ref, plain_peak = train(**size)
    pool = Pool(budget=0, policy="cost_aware", treatments=(Compress(room="full"),))
    got, peak = train(pool, **size)
    s = pool.stats()
    print(f"\nresnet peak: plain {plain_peak / MiB:.1f} MiB, full-room packs {peak / MiB:.1f} MiB, "
          f"{s['compressions']} packs")  # fmt: skip
    assert same(ref, got)
    assert s["compressions"] > 0 and not s.get("room_misses"), s
    assert peak < plain_peak, (plain_peak, peak)


def test_compression_under_supermem_allocator_is_bitwise_and_lower():
    """The same in a fresh process with supermem's allocator (the pool reads its byte counters)."""
    code = textwrap.dedent(
        f"""
        import sys, torch, supermem
        supermem.install()
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import test_compress_pool_gpu as t
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        ref, plain_peak = t.train(n=32, px=128)
        again, _ = t.train(n=32, px=128)
        pool = t.compressing_pool("compress")
        got, peak = t.train(pool, n=32, px=128)
        s = pool.stats()
        print("RESULT", t.same(ref, got), plain_peak, peak, s["compressions"], t.same(ref, again))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT"))
    print("\n" + line)
    _, same_, plain_peak, peak, compressions, repeats = line.split()
    assert repeats == "True", "plain training does not repeat bitwise here: the comparison would be noise"
    assert same_ == "True" and int(compressions) > 0, line
    assert int(peak) < int(plain_peak), line
