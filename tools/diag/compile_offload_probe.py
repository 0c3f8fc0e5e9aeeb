"""Does the installed torch's partitioner offload what a joint_custom_pass marks should_offload, and at
what cost? A compiled MLP (16 x Linear 4096 + GELU, batch 8192, fp32) trained a few steps: eager, compiled
without offload, compiled at activation_memory_budget 0.5 (the partitioner recomputes), and compiled
with the first share of the joint graph's nodes marked (forward order; 1.0: all), the offload's wait
where the partitioner puts it or sunk to the forward's end (sink). Prints per config: the tensors
offloaded, the peak, the median step, and whether losses and gradients are bitwise the compiled run's.

    python3 tools/diag/compile_offload_probe.py ["offload all" ...]     # (default: every config)
"""

import statistics
import sys
import time

import torch
import torch._functorch.config as fc

KNOBS = (
    "enable_activation_offloading",
    "activation_offload_separate_stream",
    "activation_reload_prefetch",
    "activation_offload_sink_wait",
)


def marker(share: float):
    def mark(gm, inputs):  # the joint graph: forward nodes first, in order
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        for n in nodes[: int(len(nodes) * share)]:
            n.meta["should_offload"] = True
        return gm

    return mark


offloaded = [0]


def spy() -> None:
    """Counts the forward nodes the partitioner chose to offload (saved_for_offloading)."""
    from torch._functorch._activation_offloading import activation_offloading as ao

    real = ao.choose_offload_sets

    def choose(fwd, *args):
        out = real(fwd, *args)
        offloaded[0] += sum(1 for n in fwd.graph.nodes if n.meta.get("saved_for_offloading"))
        return out

    ao.choose_offload_sets = choose


def run(
    share: float | None,
    sink: bool = False,
    compiled_share: float = 1.0,
    eager: bool = False,
    stream: bool = True,
    steps: int = 6,
):
    torch._dynamo.reset()
    offloaded[0] = 0
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU()) for _ in range(16)]
    model = torch.nn.Sequential(*layers).cuda()
    x = torch.randn(8192, 4096, device="cuda")
    on = share is not None
    with fc.patch(
        enable_activation_offloading=on,
        activation_offload_separate_stream=on and stream,
        activation_reload_prefetch=on and stream,
        activation_offload_sink_wait=sink,
        joint_custom_pass=marker(share) if on else None,
        activation_memory_budget=compiled_share,
    ):
        compiled = model if eager else torch.compile(model)
        losses, times = [], []
        for i in range(steps):
            if i == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            loss = compiled(x).square().mean()
            loss.backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            losses.append(loss.detach().clone())
            if i < steps - 1:
                for p in model.parameters():
                    p.grad = None
    grads = [p.grad.clone() for p in model.parameters()]
    return losses, grads, torch.cuda.max_memory_allocated(), statistics.median(times[2:]) * 1e3


def main() -> int:
    from supermem import torch_private as tp

    print("torch", torch.__version__, {k: hasattr(fc, k) for k in KNOBS})
    print("record_stream's fake repaired:", tp.repair_record_stream_fake())
    if not all(hasattr(fc, k) for k in KNOBS):
        return 0
    spy()
    configs = {
        "compiled": {"share": None},
        "eager": {"share": None, "eager": True},
        "compiled amb 0.5": {"share": None, "compiled_share": 0.5},
        "offload all": {"share": 1.0},
        "offload first half": {"share": 0.5},
        "offload all, sink": {"share": 1.0, "sink": True},
        "offload all, no stream": {"share": 1.0, "stream": False},  # device_put in the graph, in order
    }
    ref = None
    for name, kw in configs.items():
        if sys.argv[1:] and name not in sys.argv[1:]:
            continue
        try:
            losses, grads, peak, ms = run(**kw)
        except Exception as e:  # noqa: BLE001  (a probe: say what failed)
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        same = ref is None or (
            all(torch.equal(a, b) for a, b in zip(losses, ref[0]))
            and all(torch.equal(a, b) for a, b in zip(grads, ref[1]))
        )
        ref = ref or (losses, grads)
        what = f"offloaded {offloaded[0]:3d}  peak {peak / 2**30:6.2f} GiB  step {ms:7.1f} ms"
        print(f"{name:20s} {what}  bitwise {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
