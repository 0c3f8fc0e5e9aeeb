"""The host-cost tools' model: GPT-24's layer structure at tiny widths (24 blocks, d=64, batch 2x64), so
the kernels cost next to nothing and a step's time is the host's (Python, launches, the pool's hooks), as
a GPT-24 step under the pool is on an H100. A sibling of the tools that import it (the script's folder is
on sys.path), not part of supermem: the tools run against older commits' packages too."""

import torch

import supermem
from supermem.bench.models import GPT, Trainer, _tokens


def tiny_gpt24_step() -> tuple[torch.device, object]:
    """(device, Trainer.step) for the tiny GPT-24, seeded, one host thread; on a GPU, supermem's
    allocator installed first (the pool's budget is its soft limit)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        supermem.install()
    torch.set_num_threads(1)  # the host's cost, not the CPU's parallelism
    torch.manual_seed(0)
    with device:
        model = GPT(layers=24, d=64, heads=2, vocab=512, ctx=64)
    x, y = _tokens(2, 64, 512)(device, torch.Generator().manual_seed(0))
    return device, Trainer(model, x, y, bf16=True).step
