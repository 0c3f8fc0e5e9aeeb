"""`supermem bench train`, worker side (one fresh process a row): build the model, set it up for the
row's saver, run warm-up then timed steps; step ms, peaks, the pool's stats."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .models import Preset


def _no_saver(spec: dict) -> Callable[[], contextlib.AbstractContextManager]:
    return contextlib.nullcontext


def _save_on_cpu(spec: dict) -> Callable[[], contextlib.AbstractContextManager]:
    import torch

    return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)


def _pool(spec: dict) -> Callable[[], contextlib.AbstractContextManager]:
    import supermem

    # Treatments by name: supermem.pool reuses one Pool for the same names on every step.
    treatments = tuple(spec["treatments"]) if spec.get("treatments") else None  # None: Pool's default
    if spec.get("blocks") is False:  # (tools/diag/per_block_pool.py) no compiled graph a block's: the
        from ..tensor_pool import compiled as graphs  # share alone plans them all

        graphs.BLOCK_SHARE = 0.0
    return lambda: supermem.pool(
        budget=spec["budget_bytes"], policy=spec.get("policy", "lru"), treatments=treatments
    )


# saver name -> (spec -> a context-manager factory entered around forward+backward). "checkpoint",
# "checkpoint_half" and "checkpoint_first" also set model.checkpoint_blocks (all blocks, the first half,
# the first spec["fraction"]); "hf_checkpoint" calls an HF model's gradient_checkpointing_enable();
# "compile" runs torch.compile(model) under spec["memory_budget"], with the partitioner's CPU offload
# when spec["partitioner_offload"] (_prepare does these; spec["compile"] compiles the model under
# another saver: the pool around a compiled model). When the `as` value has stats() (the pool:
# cumulative counters), they are read over the timed steps (reset_stats() before, synchronize() after,
# when it has them).
SAVERS = {
    "none": _no_saver,
    "checkpoint": _no_saver,
    "checkpoint_half": _no_saver,
    "checkpoint_first": _no_saver,
    "hf_checkpoint": _no_saver,
    "compile": _no_saver,
    "save_on_cpu": _save_on_cpu,
    "pool": _pool,
}


def measure(spec: dict) -> dict:
    """Worker side: build the model, run warm-up then timed steps; step ms, peaks, pool stats."""
    import torch
    import torch.nn.functional as F

    from ..losses import linear_cross_entropy

    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    preset, model, opt = build(spec)
    forward = _prepare(model, spec)
    x, y = preset.batch(device, torch.Generator().manual_seed(0))
    saver = SAVERS[spec["saver"]](spec)
    chunked_loss = spec.get("loss") == "chunked"
    torch_chunked_loss = spec.get("loss") == "torch_chunked"
    hidden: Any = None  # what the chunked losses read: the model up to its head, compiled as the model is
    if chunked_loss or torch_chunked_loss:
        whole = compiled(spec) and not spec.get("per_block")  # (per block: its blocks are compiled)
        hidden = torch.compile(model.hidden) if whole else model.hidden
    amp = preset.bf16 and cuda
    entered: list = []  # the saver's `as` value, when it keeps stats (the pool)
    # CPU has no allocator watermark: --sweep counts the bytes saved for backward (what the pool budgets)
    saved = _SavedBytes(model) if spec.get("saved_peak") and not cuda and spec["saver"] != "pool" else None

    def step() -> torch.Tensor:
        with saver() as ctx, saved or contextlib.nullcontext():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                if chunked_loss:  # the head and its loss a chunk of rows at a time: no full logits
                    loss = linear_cross_entropy(hidden(x), model.head.weight, y)
                elif torch_chunked_loss:  # torch's own, chunked as its options pick; (N, d) rows only
                    h, options = hidden(x).flatten(0, -2), torch.nn.LinearCrossEntropyOptions()
                    loss = F.linear_cross_entropy(h, model.head.weight, y.flatten(), options=options)
                else:
                    loss = preset.loss(forward, x, y)
            loss.backward()
        if hasattr(ctx, "stats") and not entered:
            entered.append(ctx)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()  # allocates gradients and optimizer state
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    warmup_peaks = []  # each warm-up step's peak: a planned pool's recorded steps may rise higher
    for _ in range(spec["warmup"] - 1):
        step()
        if cuda:
            sync()
            warmup_peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
    warmup_plans = {}  # how often the pool planned (and planned again, lower) before the timed steps
    for ctx in entered:  # count the timed steps only
        if hasattr(ctx, "synchronize"):
            ctx.synchronize()
        if hasattr(ctx, "stats"):
            warmup_plans = {k: ctx.stats().get(k, 0) for k in ("plans", "replans")}
        if hasattr(ctx, "reset_stats"):
            ctx.reset_stats()
    times_ms: list[float] = []
    host_ms: list[float] = []  # host: until step() returns, before the device's sync
    for _ in range(spec["steps"]):
        times_ms.append(_timed(step, cuda, host_ms))
    row: dict[str, Any] = {
        "preset": preset.label,
        "step_ms": round(statistics.median(times_ms), 2),
        "step_ms_all": [round(t, 2) for t in times_ms],
        "host_ms": round(statistics.median(host_ms), 2),
    }
    if cuda:
        alloc, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        row.update(peak_alloc_bytes=alloc, peak_reserved_bytes=reserved, frag=reserved / alloc)
        row["warmup_peak_alloc_bytes"] = max(warmup_peaks, default=None)
        row["warmup_step_peak_bytes"] = warmup_peaks
    row["warmup_plans"] = warmup_plans
    row["pool"] = _saver_stats(entered, spec["steps"])
    if saved is not None:
        row["peak_alloc_bytes"] = saved.peak_bytes
    elif spec.get("saved_peak") and not cuda and row["pool"]:
        row["peak_alloc_bytes"] = row["pool"]["peak_resident_bytes"]
    row["loss"] = float(step())
    return row


def build(spec: dict) -> tuple[Preset, Any, torch.optim.Optimizer]:
    """spec["preset"]'s model on spec["device"], seeded, and its SGD: (preset, model, optimizer), as the
    anchors were measured (TF32 on CUDA). `supermem bench frag` trains the same models."""
    import torch

    from .models import PRESETS

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = False
    preset = PRESETS[spec["preset"]]
    torch.manual_seed(0)
    # Any: the chunked losses call its hidden() and head (nn.Module's attributes type as tensor or module)
    model: Any
    with device:
        model = preset.build()
    return preset, model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def _prepare(model, spec: dict):
    """Sets the model up for spec's saver (checkpointing, compile); returns what the step calls."""
    saver = spec["saver"]
    reentrant = spec.get("reentrant", False)
    if saver == "hf_checkpoint":
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ValueError(f"hf_checkpoint needs a Hugging Face model, not {type(model).__name__}")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model
    if hasattr(model, "blocks"):
        n = len(model.blocks)
        first = int(spec.get("fraction", 0) * n)
        model.checkpoint_blocks = {
            "checkpoint": True,
            "checkpoint_half": n // 2,
            "checkpoint_first": first,
        }.get(saver, False)
        model.checkpoint_reentrant = reentrant
        model.checkpoint_saves = spec.get("checkpoint_saves")  # models.SELECTIVE's key, or None: all
    elif saver.startswith("checkpoint"):  # an HF model: its own checkpointing is hf_checkpoint
        raise ValueError(f"{saver} checkpoints model.blocks; {type(model).__name__} has none")
    if compiled(spec):
        import torch

        from .. import torch_private as tp

        tp.set_compile_memory_budget(spec["memory_budget"])  # read when the backward graph is partitioned
        if spec.get("partitioner_offload"):
            tp.enable_partitioner_offload()
        if spec.get("per_block"):  # each block a graph of its own (torchtitan's way); the rest eager
            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch.compile(block)
            return model
        return torch.compile(model)
    return model


def compiled(spec: dict) -> bool:
    """The row runs a torch.compile'd model: the "compile" saver, or spec["compile"] under another."""
    return spec["saver"] == "compile" or bool(spec.get("compile"))


def _saver_stats(entered: list, steps: int) -> dict | None:
    """The pool's stats over the timed steps (its counters are cumulative; bytes become per step)."""
    if not entered:
        return None
    ctx = entered[0]
    if hasattr(ctx, "synchronize"):
        ctx.synchronize()
    all_stats = ctx.stats()
    stats = {k: v for k, v in all_stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if all_stats.get("plan"):  # the planned policy: predictions beside the last step's measurements
        stats["plan"] = all_stats["plan"]
    for key in ("offloaded_bytes", "prefetched_bytes", "dropped_bytes", "compressed_bytes"):
        if key in stats:
            stats[key + "_per_step"] = stats[key] / steps
    return stats


class _SavedBytes:
    """Saved-tensor hooks that count the bytes autograd holds for backward (parameters excluded, each
    storage once) and their peak since the first step. Checkpointed blocks' own hooks win inside them."""

    def __init__(self, model) -> None:
        import torch

        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.held: dict[int, list] = {}  # storage data_ptr -> [holders alive, bytes]
        self.live_bytes = self.peak_bytes = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.t)

    def __enter__(self):
        return self.hooks.__enter__()

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)

    def _pack(self, t) -> _Held:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params:
            return _Held(t)
        held = self.held.setdefault(ptr, [0, storage.nbytes()])
        if held[0] == 0:
            self.live_bytes += held[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        held[0] += 1
        return _Held(t, lambda: self._release(ptr))

    def _release(self, ptr: int) -> None:
        held = self.held[ptr]
        held[0] -= 1
        if held[0] == 0:
            self.live_bytes -= held[1]
            del self.held[ptr]


class _Held:
    """A saved tensor; autograd frees it with the graph after backward, and then it is released."""

    def __init__(self, t, release: Callable[[], None] | None = None) -> None:
        self.t, self.release = t, release

    def __del__(self) -> None:
        if self.release is not None:
            self.release()


def _timed(step: Callable[[], object], cuda: bool, host_ms: list[float] | None = None) -> float:
    """One step's ms (on CUDA, between events around it); its host's ms appended to host_ms."""
    t = time.perf_counter()
    if not cuda:
        step()
        host = (time.perf_counter() - t) * 1e3
        if host_ms is not None:
            host_ms.append(host)
        return host
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    if host_ms is not None:
        host_ms.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return start.elapsed_time(end)
