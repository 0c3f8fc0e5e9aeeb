"""One benchmark configuration in this fresh process: `python -m supermem.bench.worker SPEC_JSON`.

spec["allocator"] == "supermem" swaps supermem's allocator in before anything touches CUDA. Prints one
`@@ROW {json}` line: the measurement, or oom=True after a torch.OutOfMemoryError (exit 0), or an
error (exit 1). The row says which allocator really served the run ("backend").
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

from .runner import ROW


def _environment(cuda: bool) -> dict:
    import platform

    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


def measure(spec: dict) -> dict:
    import torch

    from . import alloc, frag, trace, train_worker

    fn = {
        "alloc": alloc.measure,
        "train": train_worker.measure,
        "trace": trace.measure,
        "frag": frag.measure,
    }[spec["bench"]]
    cuda = spec["device"] == "cuda"
    row: dict = {}
    try:
        row.update(fn(spec))
    except torch.OutOfMemoryError as e:
        row.update(oom=True, error="OOM: " + str(e).strip().splitlines()[0][:300])
    if cuda:
        row["backend"] = torch.cuda.get_allocator_backend()
        want = "pluggable" if spec["allocator"] == "supermem" else "native"
        if row["backend"] != want:
            row["error"] = f"{spec['allocator']} run was served by the {row['backend']!r} allocator"
        if spec["allocator"] == "supermem":
            import supermem

            device_alloc = supermem.device_allocator(0)
            if device_alloc is not None:  # (served by the plug-in, checked above: it is there)
                s = device_alloc.stats()
                row["supermem_peaks_gib"] = {
                    "allocated_bytes_peak": round(s["allocated_bytes_peak"] / 2**30, 3),
                    "reserved_bytes_peak": round(s["reserved_bytes_peak"] / 2**30, 3),
                }
    row["env"] = _environment(cuda)
    return row


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    if spec.get(
        "pytorch_alloc_conf"
    ):  # native's options (expandable_segments:True): read at its first malloc
        import os

        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = spec["pytorch_alloc_conf"]
    if spec["allocator"] == "supermem":
        import supermem

        supermem.install(spec.get("conf") or None)
    try:
        row = measure(spec)
    except Exception:  # noqa: BLE001  (the parent prints the reason in its table)
        traceback.print_exc()
        print(ROW + json.dumps({"error": traceback.format_exc().strip().splitlines()[-1][:400]}), flush=True)
        return 1
    print(ROW + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
