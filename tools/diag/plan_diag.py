"""What the planned policy planned and why: the profiled step (its events, times, the units it could
recompute, by kind, with their measured cost per byte), the plan (what it treats, by kind, and the
seconds it expects each to add) and the steps that ran it. GPU or CPU.

    python3 tools/diag/plan_diag.py gpt 0.75 [steps]
    python3 tools/diag/plan_diag.py resnet 4.48GiB          # a budget in bytes, not a share of native's peak
    TREATMENTS=offload,recompute,compress:full python3 tools/diag/plan_diag.py resnet 4.48GiB
    DUMP=gpt.pkl python3 tools/diag/plan_diag.py gpt 0.75   # also keeps the profile: tools/diag/replan.py
                                                      # plans from it again, offline, at other budgets
"""

import collections
import cProfile
import gc
import os
import pickle
import pstats
import sys
import time

import torch

import supermem
from supermem.bench.models import PRESETS, Trainer
from supermem.policies import Planned
from supermem.tensor_pool import Pool, profile
from supermem.units import parse_bytes

GiB = 2**30
captured: dict = {}


def spy() -> None:
    """Keeps the profile and plan the pool makes, and what kind of recipe each unit is."""
    recomputable, solve = profile.Recorder.recomputable, Planned.solve

    def recomputable_spy(self, recipe, *a, **k):
        self.__dict__.setdefault("kinds", {})[id(recipe)] = type(recipe).__name__
        return recomputable(self, recipe, *a, **k)

    def profile_spy(self, *a, **k):
        captured["recorder"] = self
        p = profile_orig(self, *a, **k)
        kinds = getattr(self, "kinds", {})
        p.kinds = {k: kinds.get(key, "?") for k, key in enumerate(self.units)}
        return p

    def solve_spy(self, p, budget):
        plan = solve(self, p, budget)
        captured["profile"], captured["plan"] = p, plan
        return plan

    profile_orig = profile.Recorder.profile
    profile.Recorder.recomputable = recomputable_spy
    profile.Recorder.profile = profile_spy
    Planned.solve = solve_spy


# (the pool's class or the part holding the method, its name)
HOOKED = (("Pool", "pack"), ("Pool", "unpack"), ("Ledger", "add_resident"), ("Budget", "fit"))
HOOKED += (("PlanRunner", "planned_pack"), ("Budget", "prefetch_before"), ("Pool", "on_pressure"))
host_s: dict = collections.defaultdict(float)


def time_hooks() -> None:
    """Host seconds spent in the pool's hooks (outermost calls only) and in Python's garbage collector."""
    from supermem.tensor_pool import Pool, budget, ledger, plan_run

    owners = {
        "Pool": Pool,
        "Ledger": ledger.Ledger,
        "Budget": budget.Budget,
        "PlanRunner": plan_run.PlanRunner,
    }
    for owner, name in HOOKED:
        fn = getattr(owners[owner], name)

        def timed(self, *a, _fn=fn, _name=name, **k):
            depth = self.__dict__.setdefault("_diag_depth", collections.Counter())
            depth[_name] += 1
            t0 = time.perf_counter()
            try:
                return _fn(self, *a, **k)
            finally:
                depth[_name] -= 1
                if not depth[_name]:
                    host_s[_name] += time.perf_counter() - t0

        setattr(owners[owner], name, timed)
    start = [0.0]

    def gc_timer(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            host_s[f"gc{info['generation']}"] += time.perf_counter() - start[0]

    gc.callbacks.append(gc_timer)


def hook_report(steps: int) -> None:
    print("host ms per step: " + ", ".join(f"{k} {v * 1e3 / steps:.2f}" for k, v in sorted(host_s.items())))
    host_s.clear()


COUNTS = (
    "num_device_alloc",
    "num_device_free",
    "num_alloc_retries",
    "num_sync_all_streams",
    "num_pressure_calls",
)


def allocator_counts(cuda: bool) -> dict:
    """The allocator's event counters (a device malloc or free, a retry, a sync of all streams)."""
    if not cuda:
        return {}
    from supermem.registry import device_allocator

    alloc = device_allocator(torch.cuda.current_device())
    s = alloc.nested_stats() if alloc is not None else {}
    return {k: s.get(k, 0) for k in COUNTS}


def counts_since(before: dict, cuda: bool) -> str:
    now = allocator_counts(cuda)
    return " ".join(f"{k[4:]} {now[k] - before.get(k, 0)}" for k in now if now[k] - before.get(k, 0))


def report() -> None:
    p, plan = captured.get("profile"), captured.get("plan")
    if p is None:
        print("no plan was made")
        return
    n, b = len(p.times_s), p.backward_event
    peak = max(x + y for x, y in zip(p.base_bytes, p.transient_bytes))
    print(
        f"profile: {n} events, backward at event {b} ({p.times_s[min(b, n - 1)] * 1e3:.1f} ms), "
        f"last event {p.times_s[-1] * 1e3:.1f} ms, step {p.step_s * 1e3:.1f} ms, "
        f"link {p.link_bytes_per_s / 1e9:.1f} GB/s, untreated peak {peak / GiB:.2f} GiB, "
        f"spike {max(p.transient_bytes) / GiB:.2f} GiB, budget {plan.budget_bytes / GiB:.2f} GiB"
    )
    saved = sum(s.nbytes for s in p.saved)
    off = sum(s.nbytes for s in p.saved if s.offloadable and s.save < b)
    print(f"saved: {len(p.saved)} tensors {saved / GiB:.2f} GiB, offloadable in forward {off / GiB:.2f} GiB")
    by_unit = collections.defaultdict(list)
    for s in p.saved:
        if s.unit is not None:
            by_unit[s.unit].append(s)
    chosen = {s.unit for s in p.saved if plan.treatment.get(s.ordinal) == "recompute"}
    rows = collections.defaultdict(lambda: [0, 0, 0.0, 0, 0, 0.0])
    for u, ms in by_unit.items():
        r = rows[p.kinds.get(u, "?")]
        nbytes = sum(s.nbytes for s in ms)
        r[0] += 1
        r[1] += nbytes
        r[2] += p.unit_cost_s.get(u, 0.0)
        if u in chosen:
            r[3] += 1
            r[4] += nbytes
            r[5] += p.unit_cost_s.get(u, 0.0)
    head = f"{'unit kind':<12} {'units':>6} {'GiB':>7} {'cost ms':>8} {'ms/GiB':>7}"
    print(f"{head} | {'chosen':>6} {'GiB':>7} {'ms':>7}")
    for kind, r in sorted(rows.items()):
        per = r[2] * 1e3 / (r[1] / GiB) if r[1] else 0
        print(
            f"{kind:<12} {r[0]:>6} {r[1] / GiB:7.2f} {r[2] * 1e3:8.2f} {per:7.2f} | "
            f"{r[3]:>6} {r[4] / GiB:7.2f} {r[5] * 1e3:7.2f}"
        )
    offb = sum(s.nbytes for s in p.saved if plan.treatment.get(s.ordinal) == "offload")
    print(
        f"plan: {plan.counts()}, offload {offb / GiB:.2f} GiB, feasible {plan.feasible}, "
        f"added {plan.added_s * 1e3:.1f} ms, predicted step {plan.predicted_step_s * 1e3:.1f} ms, "
        f"predicted peak {plan.predicted_peak_bytes / GiB:.2f} GiB, plan time {plan.plan_s:.2f} s"
    )
    top(p, plan)


def top(p, plan) -> None:
    """The plan's highest point: the step's bytes there (with nothing treated, and what the pool did not
    see) and the saves alive at it, by treatment and by why the planner could not lower them."""
    if not plan.curve:
        return
    e = max(range(len(plan.curve)), key=plan.curve.__getitem__)
    phase = "backward" if e >= p.backward_event else "forward"
    print(
        f"highest point: event {e} of {len(plan.curve)} ({phase}, {p.times_s[e] * 1e3:.1f} ms), "
        f"planned {plan.curve[e] / GiB:.2f} GiB, untreated {p.base_bytes[e] / GiB:.2f} "
        f"+ unseen {p.transient_bytes[e] / GiB:.2f}"
    )
    rows: dict = collections.defaultdict(lambda: [0, 0])
    for s in p.saved:
        if not s.save <= e < s.end:
            continue
        why = plan.treatment.get(s.ordinal)
        if why is None:
            why = "used now" if s.use <= e else "shared" if s.shared else "kept"
            if s.unit is None and not s.offloadable:
                why += ", no unit, not offloadable"
            elif s.unit is None:
                why += ", no unit"
            elif s.save >= p.backward_event:
                why += ", saved in backward"
        key = (why, p.kinds.get(s.unit, "-"))
        rows[key][0] += 1
        rows[key][1] += s.counted
    for (why, kind), (n, b) in sorted(rows.items(), key=lambda r: -r[1][1])[:12]:
        print(f"  {why:<40} {kind:<14} {n:>5} saves {b / GiB:7.3f} GiB")


def main() -> None:
    name, budget_arg = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    cuda = torch.cuda.is_available()
    if cuda:
        supermem.install()
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda" if cuda else "cpu")
    trainer = Trainer.of(name, device)
    step = trainer.step
    for _ in range(2):
        step()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    native_s = min(step() for _ in range(3))
    if cuda:
        native_peak = torch.cuda.max_memory_allocated()
    else:
        probe = Pool(budget=None)  # (not supermem.pool's: that one is kept for its options)
        step(probe)
        native_peak = probe.stats()["peak_resident_bytes"]
        del probe  # (its region hooks would run in every later step: native's and the pool's)
    if budget_arg.replace(".", "", 1).isdigit():  # a share of native's peak
        budget = int(native_peak * float(budget_arg))
    else:
        try:
            budget = parse_bytes(budget_arg)
        except ValueError as e:  # a mistyped budget: its reason, no traceback
            sys.exit(f"plan_diag.py: budget {e}")
    print(f"{PRESETS[name].label}: native {native_s * 1e3:.1f} ms, peak {native_peak / GiB:.2f} GiB", end="")
    print(f"; budget {budget / GiB:.2f}")
    if os.environ.get("PROFILE"):
        profiled(lambda: step(), cuda, host=False)
    spy()
    if os.environ.get("INTERFERENCE"):  # what a copy beside compute costs it, as a share of the copy
        from supermem import costs

        costs.COPY_INTERFERENCE = float(os.environ["INTERFERENCE"])  # (what the planner reads)
    if os.environ.get("HOOKS"):
        time_hooks()
        for _ in range(3):
            step()
        hook_report(3)
    treatments = os.environ.get("TREATMENTS")
    options = {"treatments": treatments.split(",")} if treatments else {}
    pool = supermem.pool(budget=budget, policy="planned", **options)
    last: list = []  # the last plan-running step's event counter (the bytes in use at its events), plan
    step_ended = pool.plans.step_ended

    def keep_counter(s):
        rec, plan = pool.plans.rec, pool.plans.plan
        step_ended(s)
        if rec is not None and not rec.full:  # each planned step against its plan, as it ends
            over_curve(rec, plan, pool.budget.last_peak_bytes)
            last[:] = [rec, plan]

    pool.plans.step_ended = keep_counter
    before = allocator_counts(cuda)
    step()
    print(
        f"native step: host {trainer.host_s * 1e3:.1f} ms, "
        f"allocator events: {counts_since(before, cuda) or 'none'}"
    )
    for i in range(steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        before = allocator_counts(cuda)
        s = step(pool)
        events = counts_since(before, cuda)
        peak = torch.cuda.max_memory_allocated() / GiB if cuda else float("nan")
        st = pool.stats()
        print(
            f"step {i}: {s * 1e3:.1f} ms ({s / native_s:.2f}x), peak {peak:.2f} GiB, "
            f"sync_restores {st.get('sync_restores', 0)} recomputes {st.get('recomputes', 0)} "
            f"offloads {st.get('offloads', 0)} waits {st.get('backpressure_waits', 0)} "
            f"pressure {st.get('pressure_calls', 0)} plans {st.get('plans', 0)}, "
            f"host {trainer.host_s * 1e3:.1f} ms "
            f"| allocator: {events or 'none'}",
            flush=True,
        )
        pool.reset_stats()
        if os.environ.get("HOOKS"):
            hook_report(1)
    report()
    rec = captured.get("recorder")
    if rec is not None and rec.segs:
        b = captured["profile"].backward_event
        print(
            f"segments: forward {sum(rec.segs[:b]) * 1e3:.1f} ms, backward {sum(rec.segs[b:]) * 1e3:.1f}, "
            f"tail {rec.clock.seg * 1e3:.1f}; {rec.clock.late} of {len(rec.segs)} outran their spin"
        )
        p = captured["profile"]
        what = {s.save: f"pack o{s.ordinal} {s.nbytes >> 20} MiB {p.kinds.get(s.unit, '-')}" for s in p.saved}
        what.update((s.use, f"use o{s.ordinal}") for s in p.saved if s.use < len(rec.segs))
        slow = sorted(range(len(rec.segs)), key=rec.segs.__getitem__)[-8:]
        print(
            "slowest segments (ms, event, what ends it):",
            [(round(rec.segs[i] * 1e3, 2), i, what.get(i)) for i in slow],
        )
    if last and os.environ.get("DUMP"):  # the last planned step's bytes at each event
        captured["used_at"], captured["plan"] = last[0].used_at, last[1]
    if os.environ.get("DUMP") and "profile" in captured:
        with open(os.environ["DUMP"], "wb") as f:
            keep = {k: captured.get(k) for k in ("profile", "plan", "used_at")}
            rec = captured.get("recorder")  # each event's segment seconds, the tail last
            keep["segs"] = [*rec.segs, rec.clock.seg] if rec is not None else None
            pickle.dump({**keep, "native_peak_bytes": native_peak, "model": name}, f)
    print(  # the pool prices each kind at its least sample (RebuildTimes.cost_s)
        "rebuild host ms by kind, least / median (samples):",
        {
            k: f"{min(v) * 1e3:.3f} / {sorted(v)[len(v) // 2] * 1e3:.3f} ({len(v)})"
            for k, v in pool.rebuild_times.samples.items()
        },
    )
    if os.environ.get("PROFILE"):
        profiled(lambda: step(pool), cuda)


def over_curve(rec, plan, peak: int) -> None:
    """Where a planned step's bytes rose above its plan's curve, beside the step's measured peak and
    the plan's predicted one: a step over its budget plans the shape again, lower."""
    over = sorted(((u - plan.curve[e], e, u) for e, u in rec.used_at.items() if 0 <= e < len(plan.curve)))
    print(
        f"  planned step: measured peak {peak / GiB:.2f} GiB, "
        f"predicted {plan.predicted_peak_bytes / GiB:.2f}, aim {plan.budget_bytes / GiB:.2f}, "
        f"most in use at an event "
        f"{max(rec.used_at.values(), default=0) / GiB:.2f}; above the curve, most (GiB over, event, in use):",
        [(round(d / GiB, 2), e, round(u / GiB, 2)) for d, e, u in over[-4:]],
    )


def profiled(run, cuda: bool, host: bool = True) -> None:
    """One more step under cProfile (where the host's time goes) and torch's profiler (the GPU's busy
    time beside the step's wall time: a step slower than its kernels is host-bound)."""
    if host:
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
        pstats.Stats(prof).sort_stats("cumulative").print_stats("tensor_pool", 40)
        pstats.Stats(prof).print_callers(r"pool.py:\d+\(_pack\)")
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as tp:
        wall = time.perf_counter()
        run()
        wall = time.perf_counter() - wall
    ka = tp.key_averages()
    # the kernels' own rows (device events), as torch's table footer sums them: an op's row repeats them
    device = torch.autograd.DeviceType.CUDA
    gpu_us = sum(e.self_device_time_total for e in ka if e.device_type == device and not e.is_user_annotation)
    print(f"profiled step: wall {wall * 1e3:.1f} ms, GPU busy {gpu_us / 1e3:.1f} ms")
    if host:
        print(ka.table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
