"""The third-party corpus on a GPU at realistic sizes (tests/corpus.py: transformers, timm, torchvision),
as a user runs it (tools/ci/gpu_corpus.sh sets SUPERMEM=1: supermem's allocator): plain training twice
(it must repeat: deterministic kernels, math attention), then under every live policy at 90%, 60% and
40% of native's peak. fp32: every loss, gradient, weight and optimizer state bitwise native's. The peak
within the budget (x1.03), or the planner's one warning naming the floor the step cannot go below (with
PyTorch's allocator, SUPERMEM=0, the pool acts only where autograd saves: there its one warning that the
step went over the budget, naming that allocator, is the word it owes). Each
row is printed (model, policy, share: bitwise, peak / budget, step time x native) for the closing table;
SUPERMEM_CORPUS=name,name picks models."""

import os
import time
import warnings

import pytest
import torch
from corpus import CASES, build_and_train

from supermem.policies import live_names
from supermem.registry import device_allocator
from supermem.tensor_pool import Pool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHARES = (0.9, 0.6, 0.4)
NAMES = [n for n in CASES if n in os.environ.get("SUPERMEM_CORPUS", n).split(",")]
_native: dict[str, tuple] = {}


@pytest.fixture(autouse=True)
def deterministic():
    b = torch.backends
    saved = (b.cudnn.deterministic, b.cudnn.benchmark, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32)
    b.cudnn.deterministic, b.cudnn.benchmark = True, False
    b.cudnn.allow_tf32 = b.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield
    torch.use_deterministic_algorithms(False)
    b.cudnn.deterministic, b.cudnn.benchmark, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = saved


def _run(name, pool=None):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = build_and_train(name, "real", pool, device="cuda")
    torch.cuda.synchronize()
    return [x.cpu() for x in out], torch.cuda.max_memory_allocated(), time.perf_counter() - t0


def native(name):
    if name not in _native:
        first, peak, _ = _run(name)
        again, _, seconds = _run(name)
        assert len(first) == len(again) and all(torch.equal(a, b) for a, b in zip(first, again)), (
            f"{name} is not deterministic natively: nothing to compare with"
        )
        _native[name] = first, peak, seconds
    return _native[name]


@pytest.mark.parametrize("policy", live_names())
@pytest.mark.parametrize("name", NAMES)
def test_a_third_party_model_trains_bitwise_within_the_budget_under_every_policy(name, policy):
    ref, native_peak, native_s = native(name)
    failures = []
    for share in SHARES:
        budget = int(share * native_peak)
        pool = Pool(budget=budget, policy=policy)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got, peak, seconds = _run(name, pool)
        words = [str(w.message) for w in said]
        floor = [w for w in words if "no plan keeps this step" in w or "cannot go below" in w]
        theirs = device_allocator(0) is None  # PyTorch's allocator serves the device
        over = [w for w in words if theirs and "over its budget" in w and "With PyTorch's allocator" in w]
        bitwise = len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
        st = pool.stats()
        how = " ".join(
            f"{k}={st[k]}"
            for k in ("light_calls", "graph_replays", "bypassed_calls", "lean_drops", "recomputes")
        )
        how += (
            f" rest={st['rest_steps']} refused={len(pool.regions.refused)} misses={st['light_split_misses']}"
        )
        print(
            f"\nCORPUS {name:18s} {policy:10s} {share:.0%}: bitwise={bitwise} "
            f"peak/budget={peak / budget:.3f} x_native={seconds / native_s:.2f} "
            f"native_peak={native_peak / 2**30:.2f}GiB"
            + (" floor-warned" if floor else "")
            + (" over-warned" if over else "")
            + f" [{how}]"
        )
        if not bitwise:
            failures.append(f"{share:.0%}: training differs from plain PyTorch's")
        if peak > budget * 1.03 and not floor and not over:
            failures.append(f"{share:.0%}: peak {peak} over the budget {budget} without a word")
        del pool
    assert not failures, f"{name} under {policy}: {failures}"


BF16 = [n for n in ("gpt2", "llama", "bert", "bart") if n in NAMES]


@pytest.mark.parametrize("policy", live_names())
@pytest.mark.parametrize("name", BF16)
def test_a_third_party_model_trains_bitwise_under_bf16_autocast(name, policy):
    """bf16 autocast, every live policy at 60% of native's peak: bitwise native's where native repeats
    (a light call's rebuild must leave autocast's cast cache as the call found it: light.py, _fresh)."""

    def run(pool=None):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        out = build_and_train(name, "real", pool, device="cuda", autocast=torch.bfloat16)
        torch.cuda.synchronize()
        return [x.cpu() for x in out], torch.cuda.max_memory_allocated()

    ref, native_peak = run()
    again, _ = run()
    assert all(torch.equal(a, b) for a, b in zip(ref, again)), f"{name} bf16 is not deterministic natively"
    budget = int(0.6 * native_peak)
    pool = Pool(budget=budget, policy=policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, peak = run(pool)
    bitwise = len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    print(
        f"\nCORPUS-BF16 {name:10s} {policy:10s} 60%: bitwise={bitwise} peak/budget={peak / budget:.3f} "
        f"light_calls={pool.stats()['light_calls']} native_peak={native_peak / 2**30:.2f}GiB"
    )
    assert bitwise, f"{name} under {policy} at 60% with bf16 autocast: training differs from plain"
