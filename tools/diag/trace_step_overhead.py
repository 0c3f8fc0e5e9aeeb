#!/usr/bin/env python3
"""What a recording's Python hooks cost a host-bound training step on CPU, beside the untraced step in the
same process: a ResNet of 16 basic blocks (tests/cpu/small_models.py; 119 module calls and ~300 saved
tensors a step), batch 2 at 8x8, one thread, AdamW. CPU tensors are no supermem blocks, so what is timed is
the module, optimizer and backward hooks (context.py) and the saved-tensor hook, which a GPU step pays too
where its host is the bottleneck.

Configurations, interleaved (the order rotates each round), each round a fresh recording whose first
backwards (the saved-tensor hook's check) run untimed before the timed steps; medians of the rounds, of
this thread's CPU time (steady on a shared machine) and of wall time:
    untraced
    traced                  supermem.trace(): activations from the phases once the hook is off
    exact activations       supermem.trace(exact_activations=True): the hook on throughout (before: the
                            default)
    no context              supermem.trace(context=False): no module, phase or activation names
    no-op module hooks      untraced, under two global module hooks that do nothing: what PyTorch's
                            dispatch of the context's hooks costs by itself

    python tools/diag/trace_step_overhead.py [--rounds 7] [--steps 30] [--blocks 16]
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "cpu")]

import torch  # noqa: E402
from small_models import ResNet  # noqa: E402

import supermem  # noqa: E402


def noop_module_hooks() -> list:
    """Global forward pre and post hooks that do nothing, registered as context.py registers its own."""
    from torch.nn.modules import module as nn_module

    return [
        nn_module.register_module_forward_pre_hook(lambda m, a: None),
        nn_module.register_module_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=30, help="timed steps a round")
    p.add_argument("--blocks", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ResNet(blocks=args.blocks).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def timed() -> tuple[float, float]:
        """(wall, this thread's CPU) seconds a step: on a shared machine the CPU time is the steadier
        (a step descheduled costs wall time, not CPU time)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(args.steps):
            step()
        return (time.perf_counter() - t0) / args.steps, (time.thread_time() - c0) / args.steps

    has_exact = "exact_activations" in inspect.signature(supermem.trace.record).parameters
    configs: dict[str, dict | None] = {
        "untraced": None,
        "traced": {},
        "exact activations": {"exact_activations": True} if has_exact else {},
        "no context": {"context": False},
        "no-op module hooks": None,
    }
    for _ in range(10):  # warm up: AdamW makes its state, kernels load
        step()
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            kwargs = configs[name]
            if kwargs is None:
                hooks = [] if name == "untraced" else noop_module_hooks()
                step()
                step()
                rows[name].append(timed())
                for h in hooks:
                    h.remove()
                continue
            rec = supermem.trace(allocators=[], model=model, optimizer=opt, **kwargs).start()
            try:
                step()  # the saved-tensor hook's two backwards (or, exact, the same steps as the others)
                step()
                rows[name].append(timed())
            finally:
                rec.stop()
    print(
        f"torch {torch.__version__}, supermem {supermem.__version__} ({ROOT.name}), {os.cpu_count()} CPUs, "
        f"1 thread; ResNet blocks={args.blocks}, batch 2x3x8x8, AdamW; medians of {args.rounds} "
        f"interleaved rounds of {args.steps} steps"
        + ("" if has_exact else "; this supermem has no exact_activations: 'exact' is its default")
    )
    for which, label in ((1, "thread CPU"), (0, "wall")):
        base = statistics.median(v[which] for v in rows["untraced"])
        print(f"  {label}:")
        for name, vals in rows.items():
            xs = [v[which] for v in vals]
            m = statistics.median(xs)
            extra = (
                "" if name == "untraced" else f"  {(m / base - 1) * 100:+6.1f}%  ({(m - base) * 1e3:+.2f} ms)"
            )
            spread = f"[{min(xs) * 1e3:.2f} .. {max(xs) * 1e3:.2f}]"
            print(f"    {name:<18} {m * 1e3:7.2f} ms per step {spread:>18}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
