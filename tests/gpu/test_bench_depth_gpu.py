"""bench depth's model set-up on CUDA: a model built on meta and materialised on the card (in chunks that
come to the host in one copy each) holds bitwise the values of the same model built on the card directly,
parameters on the host and buffers on the card; and a supermem trial runs and reports its phases."""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 16, 1 << 30])
def test_materialize_on_cuda_gives_the_values_of_a_direct_build(chunk_bytes):
    from supermem.bench.depth import materialize_on_host
    from supermem.bench.models import ResNet

    torch.manual_seed(0)
    with torch.device("cuda"):
        direct = ResNet((1, 2, 3, 1), width=8, classes=10)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = ResNet((1, 2, 3, 1), width=8, classes=10)
    materialize_on_host(model, "cuda", chunk_bytes=chunk_bytes)
    assert all(p.device.type == "cpu" and p.requires_grad for p in model.parameters())
    assert all(b.device.type == "cuda" for b in model.buffers())
    got, want = model.state_dict(), direct.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name].cpu(), want[name].cpu()), name


def test_a_supermem_trial_on_cuda_reports_its_phases():
    spec = {"config": "supermem", "device": "cuda", "n": 8, "batch": 2, "px": 32, "width": 8, "classes": 10}
    spec.update(unit_bytes=1 << 16, checkpoints=2, cap_bytes=2 << 30, threads=2)
    r = subprocess.run(
        [sys.executable, "-m", "supermem.bench.depth", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    from supermem.bench.runner import parse_row

    row = parse_row(r.stdout)
    assert r.returncode == 0 and row is not None and "error" not in row, (row, r.stderr[-2000:])
    assert set(row["phase_s"]) == {"build", "place", "step1", "forward", "backward", "optimizer"}
    assert row["threads"] == 2 and row["h2d_gb"] > 0
