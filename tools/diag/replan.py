"""Plans again, offline, from a profile `tools/diag/plan_diag.py` kept (DUMP=path): the planner's choices,
predicted added seconds and peak at other budgets, without a GPU. For work on the planner against a
real card's profile (its unit costs, link rate and timeline), not a simulated one.

    python3 tools/diag/replan.py gpt.pkl 0.9 0.75 0.6 0.5     # budgets: fractions of native's peak
"""

import collections
import dataclasses
import pickle
import sys

from supermem.tensor_pool.planner import make_plan
from supermem.tensor_pool.profile import Profile, Saved

GiB = 2**30


def upgraded(p: Profile) -> Profile:
    """A dump made before some of Profile's or Saved's fields existed, with their defaults (no lean
    prices, no compressible saves, no call records: what the planner then plans without)."""
    for f in dataclasses.fields(Profile):
        if f.name not in p.__dict__:
            factory = f.default_factory
            p.__dict__[f.name] = factory() if factory is not dataclasses.MISSING else f.default
    names = [f.name for f in dataclasses.fields(Saved)]
    defaults = {f.name: f.default for f in dataclasses.fields(Saved)}
    p.saved = [Saved(**{n: getattr(s, n, defaults[n]) for n in names}) for s in p.saved]
    return p


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        dumped = pickle.load(f)
    p, native = upgraded(dumped["profile"]), dumped["native_peak_bytes"]
    kinds = getattr(p, "kinds", {})  # unit -> recipe kind, where plan_diag recorded them
    print(f"{dumped['model']}: {len(p.saved)} saved tensors, native peak {native / GiB:.2f} GiB")
    for fraction in [float(x) for x in sys.argv[2:]] or [0.75]:
        plan = make_plan(p, int(native * fraction))
        units = {s.unit for s in p.saved if plan.treatment.get(s.ordinal) == "recompute"}
        by_kind = collections.Counter(kinds.get(u, "?") for u in units)
        print(
            f"{fraction:g}: {plan.counts()}, units {dict(by_kind)}, feasible {plan.feasible}, "
            f"added {plan.added_s * 1e3:.1f} ms, predicted peak {plan.predicted_peak_bytes / GiB:.2f} GiB, "
            f"plan time {plan.plan_s:.2f} s"
        )


if __name__ == "__main__":
    main()
