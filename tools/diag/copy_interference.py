"""What copies to the host running beside a training step cost it, on a GPU: the step alone against the
step with N MiB copied device -> pinned host on a side stream from its start (an offload during the
forward), and with them copied back after the loss (a prefetch during the backward). Interleaved, medians
of 12 steps; the link's rate from the copies alone. The planner's COPY_INTERFERENCE cites it.

    python3 tools/diag/copy_interference.py gpt [512,1024]
"""

import statistics
import sys

import torch

import supermem
from supermem.bench.models import Trainer

CHUNK = 64 << 20


def copy_all(side: torch.cuda.Stream, dst: list, src: list) -> None:
    with torch.cuda.stream(side):
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)


def measure(trainer: Trainer, side: torch.cuda.Stream, mib: int) -> str:
    n = mib * 2**20 // CHUNK
    src = [torch.empty(CHUNK, dtype=torch.uint8, device="cuda") for _ in range(n)]
    dst = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(side)
    copy_all(side, dst, src)
    end.record(side)
    torch.cuda.synchronize()
    copy_ms = start.elapsed_time(end)

    def with_copies(back: bool) -> float:
        marks = [0]

        def mark() -> None:  # the step's start, then after its loss (Trainer.step)
            if marks[0] == 0:
                side.wait_stream(torch.cuda.current_stream())
                copy_all(side, dst, src)
            elif marks[0] == 1 and back:
                copy_all(side, src, dst)
            marks[0] += 1

        return trainer.step(mark=mark)

    for _ in range(3):
        trainer.step()
        with_copies(True)
    t: dict[str, list[float]] = {"alone": [], "out": [], "out+back": []}
    for _ in range(12):
        t["alone"].append(trainer.step())
        t["out"].append(with_copies(False))
        t["out+back"].append(with_copies(True))
    ms = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    out, both = ms["out"] - ms["alone"], ms["out+back"] - ms["alone"]
    return (
        f"{mib} MiB: link {mib * 2**20 / copy_ms / 1e6:.1f} GB/s ({copy_ms:.1f} ms a way); step "
        f"{ms['alone']:.1f} ms alone, {ms['out']:.1f} with the copy out (+{out:.1f}: {out / copy_ms:.2f} "
        f"of it), {ms['out+back']:.1f} with it out and back (+{both:.1f}: {both / 2 / copy_ms:.2f} a copy)"
    )


def main() -> None:
    name = sys.argv[1]
    sizes = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "512,1024").split(",")]
    supermem.install()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    trainer = Trainer.of(name, torch.device("cuda"))
    side = torch.cuda.Stream()
    for mib in sizes:
        print(f"{name}, {measure(trainer, side, mib)}", flush=True)


if __name__ == "__main__":
    main()
