"""Which part of a planned pool makes a corpus model train otherwise than plain PyTorch on this device:
the model (tests/corpus.py, realistic size on a GPU) natively twice, then under `planned` at a share of
native's peak as it is, with every light call's inputs given a slot per use, with no call run light,
and with no call that takes state (held.py) run light. Each: bitwise or not, and which modules ran light.

    python3 tools/diag/held_diag.py t5 0.6
    python3 tools/diag/held_diag.py t5,mistral 0.6 all      # several models, the pool as it is only
"""

import collections
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..", "tests")]
from corpus import build_and_train  # noqa: E402

import supermem  # noqa: E402
from supermem.tensor_pool import Pool, held, outside_uses, plan_run, regions  # noqa: E402

ran_light: collections.Counter = collections.Counter()
mode = {"light": "all"}
frozen_now = [False]


def patch() -> None:
    light, unseen, freeze_call = regions.Regions._light, plan_run.PlanRunner.unseen_call, regions.freeze_call
    of = outside_uses.OutsideUses.of

    def _light(self, module, call, pool, end):
        ran_light[type(module).__name__] += 1
        return light(self, module, call, pool, end)

    def unseen_call(self, start, light_ok, bypass_ok):
        if mode["light"] == "none" or (mode["light"] == "no-held" and frozen_now[0]):
            light_ok = False
        return unseen(self, start, light_ok, bypass_ok)

    def freeze(call):
        got = freeze_call(call)
        frozen_now[0] = any(isinstance(x, held.Frozen) for x in torch.utils._pytree.tree_leaves(got[0]))
        return got

    def slots(self, module, n):
        return (True,) * n if mode["light"] == "slots" else of(self, module, n)

    regions.Regions._light, plan_run.PlanRunner.unseen_call, regions.freeze_call = _light, unseen_call, freeze
    outside_uses.OutsideUses.of = slots


CUDA = torch.cuda.is_available()


def run(name, pool=None):
    """On a CPU (a smoke test of this tool) the tiny size."""
    out = build_and_train(name, "real" if CUDA else "tiny", pool, device="cuda" if CUDA else "cpu")
    return [x.cpu() for x in out]


def main() -> None:
    names, share = sys.argv[1].split(","), float(sys.argv[2])
    modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["all", "slots", "none", "no-held"]
    if CUDA:
        supermem.install()
    b = torch.backends
    b.cudnn.deterministic, b.cudnn.benchmark = True, False
    b.cudnn.allow_tf32 = b.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    patch()
    with sdpa_kernel(SDPBackend.MATH):
        for name in names:
            compare(name, share, modes)


def compare(name: str, share: float, modes: list[str]) -> None:
    probe = Pool(policy="lru", min_bytes=0)  # (CPU: the budget is of the bytes saved)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    ref = run(name, None if CUDA else probe)
    peak = torch.cuda.max_memory_allocated() if CUDA else probe.stats()["peak_resident_bytes"]
    again = run(name)
    print(f"{name}: native repeats bitwise {all(torch.equal(a, b) for a, b in zip(ref, again))}")
    for light in modes:
        mode["light"] = light
        ran_light.clear()
        pool = Pool(budget=int(share * peak), policy="planned", **({} if CUDA else {"min_bytes": 0}))
        got = run(name, pool)
        same = [torch.equal(a, b) for a, b in zip(ref, got)]
        s = pool.stats()
        first = same.index(False) if not all(same) else "-"
        print(
            f"  light {light:<8} bitwise {all(same)} (first differing result {first} of {len(same)}) "
            f"light_calls {s['light_calls']} split misses {s['light_split_misses']} "
            f"ran light {dict(ran_light)} refused {sorted({type(m).__name__ for m in pool.regions.refused})}",
            flush=True,
        )


if __name__ == "__main__":
    main()
