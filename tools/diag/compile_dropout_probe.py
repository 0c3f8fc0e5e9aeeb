"""Does torch.compile's activation_memory_budget below 1.0 change a dropout model's gradients on this
torch and device, and does torch_private.keep_random_graphs_at keep them? A compiled Linear + GELU +
two dropouts, one step after its compile, per backend: the loss, the input's gradient against share 1.0's,
and whether backward drew random numbers (the device generator's state moved).

    python3 tools/diag/compile_dropout_probe.py [cuda|cpu]
"""

import sys

import torch
import torch._functorch.config as config

from supermem import torch_private as tp


def step(device: str, backend: str, share: float, keep: float | None):
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256, device=device)

    def f(x):
        h = torch.nn.functional.dropout(torch.nn.functional.gelu(lin(x)), 0.2, True)
        return torch.nn.functional.dropout(h * h.sin(), 0.2, True).sum()

    state = torch.cuda.get_rng_state if device == "cuda" else torch.get_rng_state
    x = torch.randn(512, 256, device=device, requires_grad=True)
    with config.patch(activation_memory_budget=share):
        tp.keep_random_graphs_at(keep)
        try:
            compiled = torch.compile(f, backend=backend)
            compiled(x).backward()
            x.grad = None
            torch.manual_seed(1)
            loss = compiled(x)
            before = state()
            loss.backward()
            drew = not torch.equal(before, state())
        finally:
            tp.keep_random_graphs_at(None)
    return loss.detach(), x.grad, drew


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    print("torch", torch.__version__, device)
    for backend in ("inductor", "aot_eager"):
        loss, grad, drew = step(device, backend, 1.0, None)
        print(f"{backend:10s} share 1.0: backward drew random numbers: {drew}")
        for keep in (None, 1.0):
            l2, g2, d2 = step(device, backend, 0.3, keep)
            what = "kept at 1.0" if keep else "as PyTorch partitions it"
            same = torch.equal(l2, loss), torch.equal(g2, grad)
            print(f"{backend:10s} share 0.3, {what:25s} loss same {same[0]}, gradient same {same[1]}", end="")
            print(f", drew {d2}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
