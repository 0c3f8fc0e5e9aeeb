"""Golden tests: the same training run, native and under supermem (separate processes, same seeds,
deterministic settings), gives bitwise-equal losses, gradients and weights.

When they differ, a second native run tells noise from a supermem bug: if native differs from native
too, the settings are not deterministic and the test says so instead of blaming supermem.
"""

import pytest
import torch
from gpu_harness import HERE, NATIVE_DRY_RUN, needs_cuda, run_python

pytestmark = needs_cuda

MiB = 1 << 20
CASES = [
    ("gpt", "defaults", ""),
    ("gpt", "tight_limit", "limit:{limit}"),  # the cache must be recycled to stay under the limit
    ("resnet", "defaults", ""),
    ("resnet", "passthrough", "passthrough:true"),  # every tensor at a fresh cudaMalloc address
]
_native: dict[str, tuple] = {}


def train(model: str, out, conf: str | None) -> dict:
    args = [str(HERE / "golden_train.py"), model, str(out)] + ([] if conf is None else ["--conf", conf])
    run = run_python(args, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, timeout=150, cwd=HERE)
    assert run.rc == 0, f"golden run {model} conf={conf!r} failed\n{run.describe()}"
    return run.json()


def native(model: str, tmp_path_factory) -> tuple:
    if model not in _native:
        out = tmp_path_factory.mktemp("golden") / f"{model}-native.pt"
        meta = train(model, out, None)
        assert meta["backend"] == "native", meta
        _native[model] = (torch.load(out, weights_only=True), meta)
    return _native[model]


def first_difference(a: dict, b: dict) -> str | None:
    """None when every tensor is bitwise equal; else the first that is not, with its largest gap."""
    if set(a) != set(b):
        return f"different keys: {sorted(set(a) ^ set(b))}"
    for key in a:
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{key}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            gap = (x.double() - y.double()).abs().max().item()
            return f"{key} differs (max abs difference {gap:.3g})"
    return None


@pytest.mark.parametrize(("model", "variant", "conf"), CASES, ids=[f"{m}-{v}" for m, v, _ in CASES])
def test_golden(model, variant, conf, tmp_path, tmp_path_factory):
    ref, ref_meta = native(model, tmp_path_factory)
    assert torch.isfinite(ref["loss"]).all(), f"the native run itself diverged: {ref_meta['losses']}"
    limit_mib = (ref_meta["peak_alloc_bytes"] * 6 // 5) // MiB + 32
    if NATIVE_DRY_RUN:  # native vs native: are the settings deterministic at all?
        meta = train(model, tmp_path / "supermem.pt", None)
    else:
        meta = train(model, tmp_path / "supermem.pt", conf.format(limit=f"{limit_mib}MiB"))
        assert meta["backend"] == "pluggable" and meta["supermem_num_allocs"] > 0, meta
    diff = first_difference(ref, torch.load(tmp_path / "supermem.pt", weights_only=True))
    if diff is None:
        print(f"bitwise equal; native {ref_meta}, supermem {meta}")
        return
    train(model, tmp_path / "native-again.pt", None)
    noise = first_difference(ref, torch.load(tmp_path / "native-again.pt", weights_only=True))
    if noise:
        pytest.fail(f"two native runs differ ({noise}): the settings are not deterministic, fix them first")
    pytest.fail(f"supermem changed the numbers: {diff}\nnative losses {ref_meta['losses']}\nsupermem {meta}")
