"""Exit loop lane: runs a child N times and counts those that abort at exit (SIGABRT: exit status -6,
or 134 through a shell). The abort it hunts is "terminate called without an active exception": a
thread that asks for the GIL once the interpreter is finalizing is ended by pthread_exit (Python
3.11-3.13), and that unwinding through a destructor or a noexcept frame is std::terminate.

    python tools/ci/exit_loop.py --mode sim -n 200            # CPU: the simulated device
    python tools/ci/exit_loop.py --mode gpu -n 200 --jobs 4   # a GPU: supermem's allocator and a pool
    python tools/ci/exit_loop.py --mode gloo -n 200           # CPU: DDP over gloo under the pool

sim: an allocator on a simulated device with a Python pressure handler that "offloads" (frees what it
    holds); the main thread fills it, catches an OOM, and exits while a second thread allocates under
    pressure (the handler takes the GIL there) and frees through the bindings (which let go of the GIL
    and take it back), as the autograd engine's device threads do on a GPU.
gpu: tests/gpu/test_pool_gpu.py's pressure test, a tensor pool (cost_aware) that offloads under the
    allocator's pressure and then an OOM caught, where the abort was seen.
gpu-native: the same steps on PyTorch's allocator without supermem (its baseline: an abort there is
    not supermem's).
gloo: two ranks (torchrun) train a small DDP model over gloo on CPU under SUPERMEM_CONF's pool
    (cost_aware), then exit with a barrier's work still held by a gloo thread: where gloo's threads
    free the pool's hooks they copied, and one may ask for the GIL while the process finalises.
gloo-native: the same without supermem (its baseline: plain DDP over gloo aborts at exit now and then
    on its own). A rank's abort shows in torchrun's report (exitcode -6).
Prints one line per abort (its stderr's last line) and a summary: aborts, other failures, runs.
Exits 1 if any child aborted or failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SIM_CHILD = r"""
import threading, time
from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.errors import OutOfMemoryError

MiB = 1 << 20
device = SimulatedDevice(64 * MiB)
alloc = CachingAllocator(device)
held = []  # "resident" blocks the pressure handler may offload


def offload(need):
    freed = 0
    while held and freed < need:
        address, nbytes = held.pop()
        alloc.free(address)
        freed += nbytes
    return freed


alloc.add_pressure_handler(offload)
for _ in range(40):  # 40 MiB resident of 64
    held.append((alloc.malloc(MiB), MiB))
try:
    alloc.malloc(128 * MiB)  # more than the device: the handler offloads all, then an OOM
    print("no OOM")
except OutOfMemoryError:
    print("OOM")


def worker():  # allocates under pressure until the process ends
    mine = []
    while True:
        try:
            mine.append(alloc.malloc(8 * MiB))
            held.append((alloc.malloc(MiB), MiB))
        except OutOfMemoryError:
            pass
        while len(mine) > 4:
            alloc.free(mine.pop(0))


threading.Thread(target=worker, daemon=True).start()
time.sleep(0.02)
print("exit")
"""

GLOO_CHILD = r"""
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)]
model = DDP(torch.nn.Sequential(*blocks))
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    model(torch.randn(256, 64)).square().mean().backward()  # 64 KiB a saved tensor: the pool moves them
    opt.step()
    opt.zero_grad()
dist.barrier(async_op=True)  # the handle is dropped: a gloo thread frees the work as the process exits
print("exit", flush=True)
"""

# gpu: the pressure test's own child, under cost_aware
GPU_CHILD = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu", "pressure_child.py")
GLOO_RANKS = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
GLOO_RANKS += ["--no-python", sys.executable, "-c", GLOO_CHILD]  # two ranks of GLOO_CHILD
GLOO_POOL = {"SUPERMEM_CONF": "pool:cost_aware,budget:64KiB"}
CHILDREN = {  # mode -> (arguments to python, environment added)
    "sim": (["-c", SIM_CHILD], {}),
    "gpu": ([GPU_CHILD, "cost_aware"], {}),
    "gpu-native": ([GPU_CHILD, "native"], {}),
    "gloo": (GLOO_RANKS, GLOO_POOL),
    "gloo-native": (GLOO_RANKS, {}),
}
ABORTS = (-6, 134)  # SIGABRT, and as a shell reports it
RANK_ABORT = re.compile(r"exitcode\s*:\s*-6\b")  # torchrun's report of a rank ended by SIGABRT


def run_once(args: list[str], extra: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env["PYTHONFAULTHANDLER"] = "1"  # an abort also writes every Python thread's stack
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    env.update(extra)
    try:
        r = subprocess.run(
            [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return None, "timed out"
    if r.returncode != 0 and RANK_ABORT.search(r.stderr):
        return ABORTS[0], r.stderr  # a rank aborted (torchrun itself exits 1)
    return r.returncode, r.stderr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=sorted(CHILDREN), default="sim")
    p.add_argument("-n", type=int, default=200, help="runs (default 200)")
    p.add_argument("--jobs", type=int, default=2, help="children at a time (default 2)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a child may take (default 300)")
    args = p.parse_args(argv)
    child, extra = CHILDREN[args.mode]
    t0 = time.perf_counter()
    aborts = failures = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = pool.map(lambda _: run_once(child, extra, args.timeout), range(args.n))
        for i, (rc, err) in enumerate(runs):
            lines = err.strip().splitlines() or [""]
            said = [line for line in lines if "terminate" in line or "FATAL" in line or "Fatal" in line]
            tail = (said or lines)[-1]
            if rc in ABORTS:
                aborts += 1
                print(f"run {i}: abort (exit status {rc}): {tail}", flush=True)
                if aborts <= 2:  # the first ones whole: the native and Python stacks say where
                    print("\n".join(lines[-80:]), flush=True)
            elif rc != 0:
                failures += 1
                print(f"run {i}: failed (exit status {rc}): {tail}", flush=True)
            if (i + 1) % 25 == 0:  # a lane cut by its time limit still says how far it got
                print(f"{i + 1} runs: {aborts} aborts, {failures} other failures", flush=True)
    seconds = time.perf_counter() - t0
    print(f"{args.mode}: {aborts} aborts, {failures} other failures in {args.n} runs ({seconds:.0f} s)")
    return 1 if aborts or failures else 0


if __name__ == "__main__":
    sys.exit(main())
