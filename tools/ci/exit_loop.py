"""Exit loop lane: runs a child N times and counts those that abort at exit (SIGABRT: exit status -6,
or 134 through a shell). The abort it hunts is "terminate called without an active exception": a
thread that asks for the GIL once the interpreter is finalizing is ended by pthread_exit (Python
3.11-3.13), and that unwinding through a destructor or a noexcept frame is std::terminate.

    python tools/ci/exit_loop.py --mode sim -n 200            # CPU: the simulated device
    python tools/ci/exit_loop.py --mode gpu -n 200 --jobs 4   # a GPU: supermem's allocator and a pool

sim: an allocator on a simulated device with a Python pressure handler that "offloads" (frees what it
    holds); the main thread fills it, catches an OOM, and exits while a second thread allocates under
    pressure (the handler takes the GIL there) and frees through the bindings (which let go of the GIL
    and take it back), as the autograd engine's device threads do on a GPU.
gpu: tests/gpu/test_pool_gpu.py's pressure test, a tensor pool (cost_aware) that offloads under the
    allocator's pressure and then an OOM caught, where the abort was seen.
gpu-native: the same steps on PyTorch's allocator without supermem (its baseline: an abort there is
    not supermem's).
Prints one line per abort (its stderr's last line) and a summary: aborts, other failures, runs.
Exits 1 if any child aborted or failed.
"""

from __future__ import annotations

import argparse
import os
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

# gpu: the pressure test's own child, under cost_aware
GPU_CHILD = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu", "pressure_child.py")
CHILDREN = {"sim": ["-c", SIM_CHILD], "gpu": [GPU_CHILD, "cost_aware"], "gpu-native": [GPU_CHILD, "native"]}
ABORTS = (-6, 134)  # SIGABRT, and as a shell reports it


def run_once(args: list[str], timeout_s: float) -> tuple[int | None, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env["PYTHONFAULTHANDLER"] = "1"  # an abort also writes every Python thread's stack
    try:
        r = subprocess.run(
            [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return None, "timed out"
    return r.returncode, r.stderr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=sorted(CHILDREN), default="sim")
    p.add_argument("-n", type=int, default=200, help="runs (default 200)")
    p.add_argument("--jobs", type=int, default=2, help="children at a time (default 2)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a child may take (default 300)")
    args = p.parse_args(argv)
    child = CHILDREN[args.mode]
    t0 = time.perf_counter()
    aborts = failures = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for i, (rc, err) in enumerate(pool.map(lambda _: run_once(child, args.timeout), range(args.n))):
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
