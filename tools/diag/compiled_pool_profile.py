"""One train-bench worker row (its JSON spec, argv[1]) with 20 timed steps: steps 0-9 as the bench runs
them, 10-16 with Python's garbage collector off, 17-19 under torch.profiler, its Chrome trace written
gzipped to argv[2]. Prints the row's @@ROW line; then `--read TRACE` prints, per profiled step, the
device's busy and idle ms and the longest idle gaps with the host op running before each. Where a
compiled step under the pool loses time against compile checkpoint (compiled_pool_gap.sh)."""

import gc
import gzip
import json
import os
import shutil
import sys


def run(spec: dict, trace: str) -> None:
    import torch

    from supermem.bench import train_worker

    timed, count, prof = train_worker._timed, [0], []

    def diag_timed(step, cuda, host_ms=None):
        i = count[0]
        count[0] += 1
        if i == 17:
            p = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            p.__enter__()
            prof.append(p)
        if 10 <= i < 17:
            gc.disable()
        try:
            return timed(step, cuda, host_ms)
        finally:
            gc.enable()
            if i == 19:
                prof[0].__exit__(None, None, None)
                prof[0].export_chrome_trace(trace + ".json")
                with open(trace + ".json", "rb") as f, gzip.open(trace, "wb") as g:
                    shutil.copyfileobj(f, g)
                os.remove(trace + ".json")

    train_worker._timed = diag_timed
    spec = {**spec, "steps": 20}
    row = train_worker.measure(spec)
    print("@@ROW " + json.dumps(row), flush=True)


def read(trace: str) -> None:
    events = json.load(gzip.open(trace))["traceEvents"]
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )
    host = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in e
    )
    if not kernels:
        print("no device work in the trace")
        return
    gaps, busy, end = [], 0.0, kernels[0][0]
    for s, e, name in kernels:
        if s > end:
            gaps.append((s - end, end, name))
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    span = end - kernels[0][0]
    print(
        f"device span {span / 1e3:.2f} ms over 3 steps, busy {busy / 1e3:.2f}, idle {(span - busy) / 1e3:.2f}"
    )
    for gap, at, nxt in sorted(gaps, reverse=True)[:15]:  # the host's ops while the device idled
        during = sorted((h for h in host if h[0] < at + gap and h[1] > at), key=lambda h: h[0] - h[1])
        names = [f"{h[2][:40]} {(h[1] - h[0]) / 1e3:.2f}" for h in during[:4]]
        print(f"  idle {gap / 1e3:7.3f} ms before {nxt[:50]!r}; host then: {names}")


if __name__ == "__main__":
    if sys.argv[1] == "--read":
        read(sys.argv[2])
    else:
        run(json.loads(sys.argv[1]), sys.argv[2])
