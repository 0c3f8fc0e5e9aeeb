"""The host cost of the tensor pool's rebuilds: per recipe kind (a region's module call replayed, an op
chain run again, an autocast weight copy cast again), its calls per step, its own (self) time per call
with the rebuilds nested inside it left out (an op replay whose input is itself away rebuilds that input
first), and the bare torch work it must do: the module's forward up to the replay's early stop (under
the call's autocast, with grad and a saved-tensor hook that only counts), the op chain on its inputs,
the cast. Self less bare is the rebuild's overhead. Tiny GPT-24 (the step is the host's, as on an H100
under the pool); the step times of native PyTorch and of the pool are printed beside it, best of
--steps each, measured without the probes.

    python3 tools/diag/rebuild_overhead.py [--steps 10] [--policy planned|cost_aware] [--profile]

On a 2-core CPU shared with other jobs (planned policy, four alternating runs, means), self us per call
before / after the rebuild-host branch: region 454 / 382 (bare 256 / 253), op 38.7 / 28.8 (bare 15.7 /
15.0), cast 13.5 / 9.0 (bare 4.3 / 4.2); the pool's step 72.9 / 70.7 ms beside native's 30.7 / 31.6 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time
from typing import Any

import torch
from tiny_gpt import tiny_gpt24_step
from torch.utils._pytree import TreeSpec, tree_map, tree_unflatten

import supermem
from supermem.tensor_pool import cast, op_replay, region
from supermem.tensor_pool.entry import Entry, Kept, State

KINDS = {"region": region.Region, "op": op_replay.OpReplay, "cast": cast.Cast}
BARE_PASSES = 5  # passes over the captured bare work; the fastest counts


class _Stop(Exception):  # noqa: N818
    pass


class Probe:
    """Wraps each kind's rebuild: self seconds per kind (nested rebuilds subtracted) and, when
    `capture` is set, what each call had to do, for timing the bare work after the step."""

    def __init__(self) -> None:
        self.self_s = dict.fromkeys(KINDS, 0.0)
        self.calls = dict.fromkeys(KINDS, 0)
        self.capture = False
        self.work: list[tuple[str, Any]] = []
        self._nested: list[float] = []  # per open rebuild: seconds its nested rebuilds took
        self._saved: dict[str, Any] = {}

    def reset(self) -> None:
        self.self_s = dict.fromkeys(KINDS, 0.0)
        self.calls = dict.fromkeys(KINDS, 0)

    @contextlib.contextmanager
    def installed(self) -> Any:
        for kind, cls in KINDS.items():
            self._saved[kind] = cls.rebuild
            cls.rebuild = self._wrap(kind, cls.rebuild)
        try:
            yield self
        finally:
            for kind, cls in KINDS.items():
                cls.rebuild = self._saved[kind]

    def _wrap(self, kind: str, f: Any) -> Any:
        def rebuild(recipe: Any, pool: Any, e: Entry) -> None:
            stop = _stop_count(recipe) if kind == "region" and self.capture else None
            self._nested.append(0.0)
            t0 = time.perf_counter()
            try:
                f(recipe, pool, e)
            finally:
                took = time.perf_counter() - t0
                nested = self._nested.pop()
                if self._nested:
                    self._nested[-1] += took
                self.self_s[kind] += took - nested
                self.calls[kind] += 1
            if self.capture:
                w = _capture(kind, recipe, e, stop)
                if w is not None:
                    self.work.append((kind, w))

        return rebuild


def _stop_count(r: region.Region) -> int:
    """Tensors the replay will see saved before its early stop (what Region.rebuild's `want` ends at)."""
    last = -1
    for k, ref in enumerate(r.slots):
        x = ref() if ref is not None else None
        if x is not None and x.recipe is r and x.state is State.AWAY:
            last = k
    return last + 1


def _tensor_of(packed: Any) -> torch.Tensor | None:
    if isinstance(packed, Entry):
        return packed.tensor
    if isinstance(packed, Kept):
        return packed.tensor
    return packed


def _capture(kind: str, recipe: Any, e: Entry, stop: int | None) -> Any:
    """A copy of what the rebuild just ran on (its inputs are resident now), or None if one is not."""
    if kind == "cast":
        return (recipe.param, recipe.dtype)
    if kind == "op":
        inputs = [_tensor_of(x) if isinstance(x, Entry) else x for x in recipe.leaves]
        if any(x is None for x in inputs):
            return None
        return (recipe.prog, [x.detach().clone() for x in inputs], recipe.site.variant)
    missing = []

    def arg(x: Any) -> Any:
        if not isinstance(x, region._Input):
            return x
        t = _tensor_of(x.packed)
        if t is None:
            missing.append(x)
            return None
        return t.detach().clone().requires_grad_(x.requires_grad)

    args = tree_map(arg, recipe.args)
    if missing:
        return None
    if isinstance(args[1], TreeSpec):  # kept flat, with the tree's spec
        args = tree_unflatten(*args)
    return (recipe.module, args, stop)


def _bare_s(kind: str, w: Any) -> float:
    """One run of a captured rebuild's torch work, seconds."""
    if kind == "cast":
        param, dtype = w
        t0 = time.perf_counter()
        param.detach().to(dtype)
        return time.perf_counter() - t0
    if kind == "op":
        prog, inputs, variant = w
        t0 = time.perf_counter()
        values = list(inputs)
        for _, op, a, operands in prog:
            values.append(op.run(a, variant, *[values[k] for k in operands]))
        return time.perf_counter() - t0
    module, (args, kwargs), stop = w
    count = [0]

    def pack(t: torch.Tensor) -> None:
        count[0] += 1
        if count[0] == stop:
            raise _Stop

    device_type = next(module.parameters()).device.type
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autocast(device_type, dtype=torch.bfloat16))  # as Trainer's forward
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None))
            module.forward(*args, **kwargs)  # .forward: the region's own hooks are no part of the work
    except _Stop:
        pass
    return time.perf_counter() - t0


def _bare_per_call_s(work: list[tuple[str, Any]]) -> dict[str, float]:
    """Each kind's bare work per call: passes over a step's rebuilds in their order (caches about as
    warm as in the step: a workload timed back to back would read too fast), the fastest pass."""
    best = dict.fromkeys(KINDS, float("inf"))
    for _ in range(BARE_PASSES):
        took = dict.fromkeys(KINDS, 0.0)
        for kind, w in work:
            took[kind] += _bare_s(kind, w)
        best = {k: min(best[k], took[k]) for k in KINDS}
    calls = {k: sum(1 for kind, _ in work if kind == k) for k in KINDS}
    return {k: best[k] / calls[k] if calls[k] else 0.0 for k in KINDS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--policy", choices=("planned", "cost_aware"), default="planned")
    ap.add_argument("--budget", type=int, default=300_000, help="bytes of saved tensors kept (CPU)")
    ap.add_argument("--profile", action="store_true", help="cProfile 5 pool steps, by the rebuilds' callees")
    args = ap.parse_args()
    device, step = tiny_gpt24_step()
    pool = supermem.pool(
        budget=args.budget,
        policy=args.policy,
        min_bytes=0,
        treatments=(supermem.tensor_pool.treatments.Recompute(),),
    )
    for _ in range(3):
        step()
    for _ in range(5):
        step(pool)
    # Alternating native and pool steps: load on the machine hits both alike.
    native_s, pool_s = [], []
    for _ in range(args.steps):
        native_s.append(step())
        pool_s.append(step(pool))
    probe = Probe()
    per_step: list[tuple[dict, dict]] = []
    with probe.installed():
        for _ in range(args.steps):
            probe.reset()
            step(pool)
            per_step.append((dict(probe.self_s), dict(probe.calls)))
        probe.capture = True
        step(pool)
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # the replays' RNG use changes nothing
        bare = _bare_per_call_s(probe.work)
    print(
        f"tiny GPT-24 bf16 on {device}, {args.policy} recompute-only pool at {args.budget} bytes: "
        f"native {min(native_s) * 1e3:.2f} ms, pool {min(pool_s) * 1e3:.2f} ms (best of {args.steps})"
    )
    print(f"{'kind':8s} {'calls/step':>10s} {'self us/call':>12s} {'bare us/call':>12s} {'overhead us':>11s}")
    for k in KINDS:
        calls = per_step[0][1][k]
        if not calls:
            print(f"{k:8s} {0:10d}")
            continue
        self_us = min(s[k] / max(c[k], 1) for s, c in per_step) * 1e6  # the least loaded step
        bare_us = bare[k] * 1e6
        print(f"{k:8s} {calls:10d} {self_us:12.1f} {bare_us:12.1f} {self_us - bare_us:11.1f}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            step(pool)
        prof.disable()
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
