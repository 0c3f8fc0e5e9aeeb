"""The tensor pool's host cost per saved tensor: GPT-24's layer structure at tiny widths, so the kernels
cost next to nothing and the step's time is the host's (Python, launches, the pool's hooks). Prints
native's step, the pool's with no budget (every saved tensor packed, nothing moved) and, on CPU, the
planned and cost_aware policies at 75% of the bytes saved. On an H100 the real GPT-24 step's host is
the slower side under the pool, so this number bounds how close to native a pool step can get.

    python3 tools/diag/pool_overhead.py [--profile POLICY]   # POLICY: none, planned or cost_aware
"""

import argparse
import cProfile
import pstats

import torch
from tiny_gpt import tiny_gpt24_step

from supermem.tensor_pool import Pool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", choices=("none", "planned", "cost_aware"), help="cProfile that row's steps")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    device, step = tiny_gpt24_step()
    for _ in range(3):
        step()
    native_s = min(step() for _ in range(args.steps))
    probe = Pool(budget=None, min_bytes=0)  # (not supermem.pool's: that one is kept for its options)
    step(probe)
    saved = probe.stats()["peak_resident_bytes"]
    del probe  # (its region hooks would run in every later step)
    print(f"tiny GPT-24 on {device}: native {native_s * 1e3:.2f} ms, {saved / 2**20:.1f} MiB saved a step")
    # On a GPU a budget counts every allocated byte (the weights too), not only the saved ones.
    # hooks: identity saved-tensor hooks, the floor of anything that runs Python per saved tensor;
    # planned 2: a plan that keeps everything (the budget is twice what is saved)
    rows = [("hooks", None), ("none", None), ("planned", 2.0)]
    rows += [] if device.type == "cuda" else [("planned", 0.75), ("cost_aware", 0.75)]
    for policy, fraction in rows:
        budget = None if fraction is None else int(saved * fraction)
        if policy == "hooks":
            pool = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        else:
            name = "cost_aware" if policy == "none" else policy
            pool = Pool(budget=budget, policy=name, min_bytes=0)  # (gone after its row, with its hooks)
        for _ in range(4):
            step(pool)
        if policy == "hooks":
            best = min(step(pool) for _ in range(args.steps))
            print(f"hooks     : {best * 1e3:.2f} ms (+{(best - native_s) * 1e3:.2f} ms)")
            continue
        pool.reset_stats()
        best = min(step(pool) for _ in range(args.steps))
        st = pool.stats()
        per = (best - native_s) / max(st["packed"] / args.steps, 1)
        print(
            f"{policy} {fraction or '':<4}: {best * 1e3:.2f} ms (+{(best - native_s) * 1e3:.2f} ms, "
            f"{per * 1e6:.1f} us per saved tensor), {st['packed'] // args.steps} saved, "
            f"{st['recomputes'] // args.steps} recomputes, {st['offloads'] // args.steps} offloads a step"
        )
        if args.profile == policy:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                step(pool)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
