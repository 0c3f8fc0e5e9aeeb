"""The child side of the GPU tests: runs `check_*` functions of a test module in this process.

    python tests/gpu/gpu_child.py MODULE NAME... [--conf CONF | --native] [--path DIR]

supermem's allocator is process-global and cannot be swapped back, so the checks of a test module run
in a fresh process: swapped first (`supermem.install(conf)`, before anything touches CUDA) unless
--native, then each named check in order. Each check prints `@@BEGIN name` before it starts and one
`@@RESULT {json}` line after (status ok / skip / fail), so the parent knows which check was running
if the process dies. Also holds small helpers the checks share.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

BEGIN = "@@BEGIN "
RESULT = "@@RESULT "
MiB = 1 << 20
GiB = 1 << 30


class Skip(Exception):
    """Raised by a check that cannot run here (e.g. fewer than two GPUs)."""


def isolated(conf: str | None = None):
    """Runs the decorated check in a process of its own, swapped with `conf` (else the module's)."""

    def mark(fn):
        fn.isolated_conf = conf
        fn.isolated = True
        return fn

    return mark


def device_allocator(index: int = 0):
    """supermem's allocator serving PyTorch on device `index`; Skip in an unswapped (native) process."""
    import supermem

    if not supermem.installed():
        raise Skip("supermem is not installed in this process (a native dry run)")
    alloc = supermem.device_allocator(index)
    if alloc is None:  # None until the device's first allocation
        import torch

        torch.zeros(1, device=f"cuda:{index}")
        alloc = supermem.device_allocator(index)
    assert alloc is not None, f"supermem.device_allocator({index}) is None in a swapped process"
    return alloc


def used_bytes(device: int = 0) -> int:
    """Device memory in use by anyone, as the driver sees it (independent of any allocator's books)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return total - free


def cookie(t, value: int):
    """Fills a uint8 tensor with a value derived from `value` (to detect aliasing or reuse)."""
    return t.fill_(value % 251 + 1)


def assert_cookie(t, value: int, what: str = "tensor") -> None:
    """Checks on the host, in pieces: no device memory is needed (the device may be full to its limit)."""
    expected = value % 251 + 1
    flat, piece, bad = t.reshape(-1), 64 << 20, 0
    for i in range(0, flat.numel(), piece):
        bad += int((flat[i : i + piece].cpu() != expected).sum())
    assert bad == 0, f"{what}: {bad} of {t.numel()} bytes changed (expected {expected})"


def _run(module, name: str) -> dict:
    t0 = time.perf_counter()
    try:
        info = getattr(module, "check_" + name)() or {}
        rec = {"status": "ok", "info": info}
    except Skip as e:
        rec = {"status": "skip", "reason": str(e)}
    except BaseException:  # noqa: BLE001  (report everything, including KeyboardInterrupt from a timeout)
        rec = {"status": "fail", "error": traceback.format_exc()}
    rec.update(name=name, seconds=round(time.perf_counter() - t0, 3))
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("module")
    p.add_argument("names", nargs="+")
    p.add_argument("--conf", default=None, help="SUPERMEM_CONF-style options for supermem.install")
    p.add_argument("--native", action="store_true", help="do not swap the allocator")
    p.add_argument("--path", default=None, help="the directory holding MODULE")
    args = p.parse_args(argv)
    if args.path:
        sys.path.insert(0, args.path)
    if not args.native:
        import supermem
        from supermem.config import merge_conf

        forced = os.environ.get("SUPERMEM_TEST_EXTRA_CONF", "")  # see gpu_harness.child_env
        supermem.install(merge_conf(args.conf or "", forced) or None)
    module = importlib.import_module(args.module)
    for name in args.names:
        print(BEGIN + name, flush=True)
        print(RESULT + json.dumps(_run(module, name), default=str), flush=True)
    return 0


if __name__ == "__main__":
    import gpu_child  # run as the module test files import, so `except Skip` sees their Skip class

    sys.exit(gpu_child.main())
