#!/usr/bin/env python3
"""Where a recording's host time goes on a corpus model's GPU step: the same steps untraced and inside
supermem.trace() (after its first 3 steps), each under cProfile and with gc's collections timed; prints
both profiles' top functions by own time, the functions only the traced steps ran, gc's collections and
seconds per generation, and whether the saved-tensor hook came off.

    SUPERMEM=1 python3 tools/diag/trace_host_profile.py [model] [--steps 8] [--size real]
"""

import cProfile
import gc
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import torch  # noqa: E402
from trace_gpu_overhead import corpus_parser, corpus_training  # noqa: E402  (this folder: the script's own)

import supermem  # noqa: E402


def main() -> int:
    args = corpus_parser("gpt2", 8).parse_args()
    dev, sync, model, inputs, loss_of, opt = corpus_training(args.model, args.size)
    cuda = dev == "cuda"

    def step() -> float:
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, torch.bfloat16, enabled=cuda):
            loss_of(model, inputs).backward()
        opt.step()
        sync()
        return time.perf_counter() - t0

    gc_s = [0.0, 0.0, 0.0]
    gc_n = [0, 0, 0]
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gc_n[info["generation"]] += 1
            gc_s[info["generation"]] += time.perf_counter() - started[0]

    gc.callbacks.append(on_gc)

    def profiled(label: str) -> pstats.Stats:
        gc_s[:], gc_n[:] = [0.0] * 3, [0] * 3
        prof = cProfile.Profile()
        prof.enable()
        times = sorted(step() for _ in range(args.steps))
        prof.disable()
        ms = ", ".join(f"gen{g} {gc_n[g]} ({gc_s[g] * 1e3:.1f} ms)" for g in range(3))
        print(f"{label}: median step {times[len(times) // 2] * 1e3:.2f} ms (profiled); gc: {ms}")
        return pstats.Stats(prof)

    for _ in range(3):
        step()
    plain = profiled("untraced")
    rec = supermem.trace("/tmp/trace_host_profile.smtrace")
    rec.__enter__()
    for _ in range(3):
        step()
    traced = profiled("traced")
    c = rec.context
    print(f"saved-tensor hook off: {c.hook_off_ns is not None}, backwards {c.backwards}")
    rec.__exit__(None, None, None)
    for label, st in (("untraced", plain), ("traced", traced)):
        out = io.StringIO()
        st.stream = out
        st.sort_stats("tottime").print_stats(18)
        print(f"----- {label}\n" + "\n".join(out.getvalue().splitlines()[6:]))
    base = {k: v for k, v in plain.stats.items()}  # type: ignore[attr-defined]
    extra = []
    for k, v in traced.stats.items():  # type: ignore[attr-defined]
        b = base.get(k)
        extra.append((v[2] - (b[2] if b else 0.0), v[1] - (b[1] if b else 0), k))
    extra.sort(reverse=True)
    print("----- own time the traced steps spent beyond the untraced (s, calls, function)")
    for s, n, k in extra[:25]:
        print(f"  {s * 1e3:8.2f} ms {n:8d}  {k[0]}:{k[1]}({k[2]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
