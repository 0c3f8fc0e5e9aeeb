#!/usr/bin/env python3
"""Where a recording's cost on a GPU step goes: a corpus model (default timm-resnet50, its "real" size,
bf16 autocast, AdamW) trained in one process under SUPERMEM=1, rounds interleaved (the order rotates),
each round a fresh recording whose first 3 steps (the saved-tensor hook's two backwards) run untimed;
medians over rounds of each round's median step, and of its ratio to the same round's untraced step:
    untraced
    traced              supermem.trace(): what `supermem trace` records
    traced+calls        the same, its forward's module calls recorded every step (Context.record_calls)
    traced-no-calls     the same, never (a recording's steps but 3 and every CALLS_EVERY-th)
    no context          supermem.trace(context=False): no module calls, phases or activation names
    given model         supermem.trace(model=, optimizer=): no gc walk for them
    cuda-synced         untraced, a torch.cuda.synchronize() after every step's forward (what one hidden
                        sync in the recording would cost)
    pass-through        untraced, every module call through a function in place of nn.Module.__call__
                        that only calls the module (the frame a recording's module call has)
    no-op watch         untraced, every backward through the context's watch, doing nothing
    ring only           untraced, the allocator's trace ring on at a recording's size (the allocations
                        a step are printed first)
Each row also gives the host's part of the step (until the closing sync): a step whose host part is
its whole is host-bound, and pays the recording's Python hooks in full; "cpu" is the thread's CPU time
in that part (less than it where the thread waited: for the GIL, a lock, the device's queue; backward
runs on autograd's device thread), "faults" the process's minor page faults a step (fresh memory touched),
"gc" Python's collections a step by generation (0/1/2; --gc-off: none in the timed steps); "fwd/bwd/opt"
the host's seconds in the forward, the backward and the optimizer step.
--inside runs backward inside autocast too (tests/gpu/test_trace_owners_gpu.py's script does).

    SUPERMEM=1 python3 tools/diag/trace_gpu_overhead.py [model] [--rounds 5] [--steps 10]
"""

import argparse
import gc
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import torch  # noqa: E402
from corpus import CASES  # noqa: E402

import supermem  # noqa: E402
from supermem.trace.recorder import DEFAULT_CAPACITY_EVENTS  # noqa: E402


def corpus_training(name: str, size: str):
    """(device, sync, model, inputs, loss_of, AdamW) for a corpus model, seeded, on CUDA if there is one."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    model, batch, loss_of = CASES[name](size)
    model = model.to(dev).train()
    inputs = batch(torch.Generator().manual_seed(1))
    inputs = inputs.to(dev) if isinstance(inputs, torch.Tensor) else tuple(x.to(dev) for x in inputs)
    return dev, sync, model, inputs, loss_of, torch.optim.AdamW(model.parameters(), lr=1e-4)


def corpus_parser(model: str, steps: int) -> argparse.ArgumentParser:
    """The arguments the corpus diagnostics share: a model, its steps and its size."""
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default=model)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--size", default="real", help="the corpus size (tiny: a CPU check of this script)")
    return p


def passthrough(orig, on):
    """A module call that only calls the module (torch_private.patch_module_call's make): the frame a
    recording's module call has, doing nothing in it."""

    def call(module, *args, **kwargs):
        return orig(module, *args, **kwargs)

    return call


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> int:
    p = corpus_parser("timm-resnet50", 10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--inside", action="store_true", help="backward inside autocast")
    p.add_argument("--gc-off", action="store_true", help="Python's collector off in the timed steps")
    p.add_argument("--rows", help="the rows to run, comma-separated (default: all; untraced always)")
    args = p.parse_args()
    dev, sync, model, inputs, loss_of, opt = corpus_training(args.model, args.size)
    cuda = dev == "cuda"

    host: list[float] = []
    cpu: list[float] = []  # the thread's CPU time until the closing sync (time.thread_time)
    faults: list[int] = []  # the process's page faults in the step (minor: fresh memory touched)
    phase_s: list[tuple[float, float, float]] = []  # the host's forward, backward and optimizer seconds
    collections = [0, 0, 0]  # Python's collections so far, by generation

    def on_gc(phase: str, info: dict) -> None:
        if phase == "stop":
            collections[info["generation"]] += 1

    gc.callbacks.append(on_gc)

    def step(sync_forward: bool = False) -> float:
        sync()
        t0, c0, f0 = time.perf_counter(), time.thread_time(), minor_faults()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, torch.bfloat16, enabled=cuda):
            loss = loss_of(model, inputs)
            if sync_forward:
                sync()
            t1 = time.perf_counter()
            if args.inside:
                loss.backward()
        if not args.inside:
            loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        host.append(t3 - t0)
        phase_s.append((t1 - t0, t2 - t1, t3 - t2))
        cpu.append(time.thread_time() - c0)
        faults.append(minor_faults() - f0)
        sync()
        return time.perf_counter() - t0

    tmp = tempfile.mkdtemp()
    configs = {
        "untraced": None,
        "traced": {},
        "traced+calls": {},
        "traced-no-calls": {},
        "no context": {"context": False},
        "given model": {"model": model, "optimizer": opt},
        "cuda-synced": None,
        "pass-through": None,
        "no-op watch": None,
        "ring only": None,
    }
    from supermem import torch_private as tp

    def noop(*_):
        return None

    alloc = supermem.device_allocator(0) if cuda else None

    def ring_only():  # the allocator's trace ring alone, at a recording's size, no Python context
        alloc.trace_capacity = DEFAULT_CAPACITY_EVENTS

        def off() -> None:
            alloc.trace_capacity = 0

        return off

    parts = {
        "pass-through": lambda: tp.patch_module_call(passthrough),
        "no-op watch": lambda: tp.watch_backward(noop, noop),
    }
    if alloc is not None:
        parts["ring only"] = ring_only
    else:
        del configs["ring only"]
    if args.rows:
        keep = {"untraced", *args.rows.split(",")}
        configs = {k: v for k, v in configs.items() if k in keep}
    for _ in range(3):
        step()
    if alloc is not None:

        def allocs() -> int:
            return alloc.nested_stats()["allocation"]["all"]["allocated"]

        before = allocs()
        step()
        print(f"allocations a step: {allocs() - before}")
    got: dict[str, list[float]] = {name: [] for name in configs}
    hosts: dict[str, list[float]] = {name: [] for name in configs}
    cpus: dict[str, list[float]] = {name: [] for name in configs}
    fault_counts: dict[str, list[float]] = {name: [] for name in configs}
    phases: dict[str, list[tuple[float, ...]]] = {name: [] for name in configs}
    gc_counts: dict[str, list[list[float]]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            kw = configs[name]
            rec = supermem.trace(f"{tmp}/{name.replace(' ', '_')}.smtrace", **kw) if kw is not None else None
            if rec is not None:
                rec.__enter__()
            undo = parts[name]() if name in parts else None
            for _ in range(3):
                step()
            host.clear()
            cpu.clear()
            faults.clear()
            phase_s.clear()
            gcs = list(collections)
            if args.gc_off:
                gc.disable()
            times = []
            for _ in range(args.steps):
                if rec is not None and name.startswith("traced") and name != "traced":
                    rec.context.record_calls = name == "traced+calls"
                times.append(step(sync_forward=name == "cuda-synced"))
            gc.enable()
            gc_counts[name].append([(b - a) / args.steps for a, b in zip(gcs, collections)])
            hosts[name].append(statistics.median(host))
            cpus[name].append(statistics.median(cpu))
            fault_counts[name].append(statistics.median(faults))
            phases[name].append(tuple(statistics.median(x) for x in zip(*phase_s)))
            if rec is not None:
                rec.__exit__(None, None, None)
            if undo is not None:
                undo()
            got[name].append(statistics.median(times))
    where = f"{args.model} on {torch.cuda.get_device_name() if cuda else 'cpu'}"
    print(
        f"{where}: medians of {args.rounds} rounds of {args.steps} steps; backward in autocast: "
        f"{args.inside}; x: the median of each round's ratio to that round's untraced step (over: the "
        "rounds it was slower in)"
    )
    for name, xs in got.items():
        ms = statistics.median(xs)
        ratios = [x / b for x, b in zip(xs, got["untraced"])]
        over = sum(r > 1 for r in ratios)
        spread = f"{min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f}"
        hs = statistics.median(hosts[name]) * 1e3
        cs = statistics.median(cpus[name]) * 1e3
        fs = statistics.median(fault_counts[name])
        per_gen = "/".join(f"{sum(g) / len(g):.2f}" for g in zip(*gc_counts[name]))
        fbo = "/".join(f"{statistics.median(x) * 1e3:.2f}" for x in zip(*phases[name]))
        print(
            f"  {name:16s} {ms * 1e3:7.2f} ms  {statistics.median(ratios):.3f}x  over {over:2d}/{len(ratios)}"
            f"  host {hs:7.2f} ms  cpu {cs:7.2f} ms  fwd/bwd/opt {fbo} ms  faults {fs:5.0f}  gc {per_gen}"
            f"  (rounds {spread})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
