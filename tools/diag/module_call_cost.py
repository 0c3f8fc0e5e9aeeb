#!/usr/bin/env python3
"""What a recording costs one module call on this host: a chain of 300 modules that return their input
(CPU tensors: nothing but the calls), run untraced and inside supermem.trace(), rounds interleaved; the
median over rounds of each round's fastest pass, per module call.

    python3 tools/diag/module_call_cost.py [--rounds 30]
"""

import argparse
import statistics
import tempfile
import time

import torch

import supermem


class Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    n = 300
    chain = torch.nn.Sequential(*[Identity() for _ in range(n)])
    x = torch.ones(2)

    def per_call_us() -> float:
        t = time.perf_counter()
        chain(x)
        return (time.perf_counter() - t) / (n + 1) * 1e6

    for _ in range(20):
        per_call_us()
    plain, traced = [], []
    path = f"{tempfile.mkdtemp()}/calls.smtrace"
    for _ in range(args.rounds):
        plain.append(min(per_call_us() for _ in range(20)))
        with supermem.trace(path):
            for _ in range(5):
                per_call_us()
            traced.append(min(per_call_us() for _ in range(20)))
    a, b = statistics.median(plain), statistics.median(traced)
    print(f"a module call: untraced {a:.3f} us, traced {b:.3f} us (+{b - a:.3f} us)")


if __name__ == "__main__":
    main()
