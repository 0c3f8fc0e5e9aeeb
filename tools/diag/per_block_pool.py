"""GPT-24 with each block compiled alone, under the planned pool: the pool as it is (the compile budget
share first; where the share cannot fit, the pool plans what the blocks save as eager code's:
tensor_pool/compiled.py) against the share alone ("share only": no graph taken for a block's), beside
native eager and the blocks compiled at fixed shares. Rows are interleaved `repeats` times, one process
each; prints each row's median step, its spread, and the highest peak.

    python3 tools/diag/per_block_pool.py [repeats] [budget fractions of native's peak, e.g. 0.75,0.5]
    PRESET=gpt-host DEVICE=cpu python3 tools/diag/per_block_pool.py    # a smoke test on CPU
"""

import os
import statistics
import sys

from supermem.bench import runner


def main() -> int:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    fractions = [float(f) for f in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0.75, 0.5]
    preset, device = os.environ.get("PRESET", "gpt"), os.environ.get("DEVICE", "cuda")
    base = {"bench": "train", "preset": preset, "device": device, "steps": 10, "warmup": 10}
    base.update(saved_peak=True, conf=None)
    blocks = {"compile": True, "per_block": True, "memory_budget": 1.0}
    rows = {"native": {"allocator": "native", "saver": "none"}}
    for b in (1.0, 0.5, 0.2):
        native = {"allocator": "native", "saver": "compile"}
        rows[f"compile per block {b}"] = {**native, **blocks, "memory_budget": b}
    pool = {"allocator": "supermem", "saver": "pool", "policy": "planned", **blocks}
    for f in fractions:
        rows[f"pool {f:.0%}"] = {**pool, "fraction": f}
        rows[f"pool {f:.0%} share only"] = {**pool, "fraction": f, "blocks": False}
    runs: dict[str, list[dict]] = {name: [] for name in rows}
    native_peak = None
    for _ in range(repeats):
        for name, opts in rows.items():
            spec = {**base, **opts}
            if "fraction" in spec:
                spec["budget_bytes"] = int(spec.pop("fraction") * native_peak)
            r = runner.run(spec, 600, name)
            runs[name].append(r)
            if name == "native" and native_peak is None:
                native_peak = r["peak_alloc_bytes"]
    native_ms = statistics.median(r["step_ms"] for r in runs["native"])
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            print(f"{name:32s} {rs[0].get('error')}")
            continue
        ms = statistics.median(r["step_ms"] for r in ok)
        peak = max(r["peak_alloc_bytes"] for r in ok) / 2**30
        spread = f"{min(r['step_ms'] for r in ok):.1f}-{max(r['step_ms'] for r in ok):.1f}"
        print(f"{name:32s} {ms:7.1f} ms ({spread})  {ms / native_ms:5.2f}x  peak {peak:6.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
