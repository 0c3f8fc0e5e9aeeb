"""`supermem bench train`'s rows: a `Mode` each, the ones a plain run makes (modes) and --sweep's
(sweep_modes), and the models each runs for."""

from __future__ import annotations

from dataclasses import dataclass, field

BLOCK_MODELS = ("gpt", "resnet")  # the bench's own models: model.blocks, checkpointed by torch's checkpoint
HF_MODELS = ("hf-llama",)  # transformers' models: checkpointed by gradient_checkpointing_enable()
MODELS = BLOCK_MODELS + HF_MODELS


@dataclass(frozen=True)
class Mode:
    name: str  # the row's label
    allocator: str  # "native" | "supermem"
    saver: str  # a key of SAVERS
    budget: float | None = None  # pool: the fraction of the native row's peak allocated bytes
    table: str = "savers"  # "allocator" | "savers"
    options: dict = field(default_factory=dict)  # extra spec keys for the saver, e.g. {"policy": "lru"}
    models: tuple[str, ...] = ()  # the models it runs for ("gpt", "resnet"); empty: all
    budget_of: str = "native"  # the row (run earlier) whose peak allocated bytes `budget` is a fraction of


def runs_on(m: Mode, model: str) -> bool:
    return not m.models or model in m.models


def modes(device: str, budgets: list[float]) -> list[Mode]:
    """The rows this machine can run, native first (the pool's budgets are fractions of its peak)."""
    import supermem

    cuda = device == "cuda"
    out = [Mode("native", "native", "none", table="allocator")]
    if cuda:
        out.append(Mode("supermem", "supermem", "none", table="allocator"))
    out.append(Mode("checkpoint", "native", "checkpoint", models=BLOCK_MODELS))
    out.append(Mode("checkpoint first half", "native", "checkpoint_half", models=BLOCK_MODELS))
    out += hf_checkpoint_modes()
    if cuda:
        out.append(Mode("save_on_cpu", "native", "save_on_cpu"))
    if cuda and hasattr(supermem, "pool"):
        for b in budgets:
            out.append(Mode(f"lru {b:.0%}", "supermem", "pool", budget=b, options={"policy": "lru"}))
            out.append(
                Mode(f"cost_aware {b:.0%}", "supermem", "pool", budget=b, options={"policy": "cost_aware"})
            )
            # ReLU compression as a third treatment; ResNet only (GPT has no ReLU: the same as cost_aware)
            compress = {"policy": "cost_aware", "treatments": ["offload", "recompute", "compress"]}
            out.append(
                Mode(
                    f"cost_aware+compress {b:.0%}",
                    "supermem",
                    "pool",
                    b,
                    options=compress,
                    models=("resnet",),
                )
            )
            out.append(Mode(f"planned {b:.0%}", "supermem", "pool", budget=b, options={"policy": "planned"}))
    return out


def hf_checkpoint_modes() -> list[Mode]:
    """HF's own checkpointing of every decoder layer, as its users turn it on: non-reentrant (HF's default)
    and reentrant."""
    return [
        Mode(name, "native", "hf_checkpoint", options={"reentrant": reentrant}, models=HF_MODELS)
        for name, reentrant in (("hf checkpoint", False), ("hf checkpoint reentrant", True))
    ]


SWEEP_BUDGETS = (0.9, 0.75, 0.6, 0.5)
HF_SWEEP_BUDGETS = (0.75, 0.5)  # and each HF checkpointing row's peak: the sweep in ~4 minutes on an H200
# --sweep's warm-up: a planned pool records its first steps, then may record and plan again a few times
# (PlanRunner: MAX_REPLANS) before its plan holds; the rows time the steps after (an H100 sweep with 3
# warm-up steps timed GPT-24's planned 75% at 183.7 ms a step, its plan's own steps at 95.3)
SWEEP_WARMUP = 10
COMPILE_BUDGETS = (1.0, 0.5, 0.2)  # torch._functorch.config.activation_memory_budget


def sweep_modes(device: str) -> list[Mode]:
    """--sweep: every baseline, then cost_aware and planned at fractions of native's peak and at
    checkpoint's own peak (an HF model: at HF_SWEEP_BUDGETS and each HF checkpointing row's peak). On
    CPU one torch.compile row only: inductor's build takes ~15 s a row; none for an HF model."""
    cuda = device == "cuda"
    out = [Mode("native", "native", "none", table="allocator")]
    out.append(Mode("checkpoint", "native", "checkpoint", models=BLOCK_MODELS))
    reentrant = {"reentrant": True}
    out.append(Mode("checkpoint reentrant", "native", "checkpoint", options=reentrant, models=BLOCK_MODELS))
    for name, f in (("quarter", 0.25), ("half", 0.5), ("three quarters", 0.75)):
        opts: dict = {"fraction": f}
        out.append(
            Mode(f"checkpoint first {name}", "native", "checkpoint_first", options=opts, models=BLOCK_MODELS)
        )
    out += hf_checkpoint_modes()
    if cuda:
        out.append(Mode("save_on_cpu", "native", "save_on_cpu"))
    # supermem.linear_cross_entropy in place of the head and its loss (GPT only: its loss is the spike)
    out.append(Mode("chunked loss", "native", "none", options={"loss": "chunked"}, models=("gpt",)))
    import torch

    if hasattr(torch.nn, "LinearCrossEntropyOptions"):  # torch's own (2.13), its chunked path, beside it
        torchs = {"loss": "torch_chunked"}
        out.append(Mode("torch chunked loss", "native", "none", options=torchs, models=("gpt",)))
    for b in COMPILE_BUDGETS if cuda else COMPILE_BUDGETS[1:2]:
        opts = {"memory_budget": b}
        out.append(Mode(f"compile budget {b}", "native", "compile", options=opts, models=BLOCK_MODELS))
    for policy in ("cost_aware", "planned"):
        opts = {"policy": policy}
        for b in SWEEP_BUDGETS:
            ms = () if b in HF_SWEEP_BUDGETS else BLOCK_MODELS
            out.append(Mode(f"{policy} {b:.0%}", "supermem", "pool", budget=b, options=opts, models=ms))
        name = f"{policy} ckpt peak"
        out.append(
            Mode(name, "supermem", "pool", 1.0, options=opts, models=BLOCK_MODELS, budget_of="checkpoint")
        )
        for ck in hf_checkpoint_modes():  # "cost_aware hf ckpt peak", "... hf ckpt reentrant peak"
            name = f"{policy} {ck.name.replace('checkpoint', 'ckpt')} peak"
            out.append(Mode(name, "supermem", "pool", 1.0, options=opts, models=HF_MODELS, budget_of=ck.name))
    # ReLU compression offered to the plan (packs that wait for nothing: Compress(room="full")); ResNet
    # only (GPT has no ReLU)
    opts = {"policy": "planned", "treatments": ["offload", "recompute", "compress:full"]}
    for label, b, of in (("75%", 0.75, "native"), ("50%", 0.5, "native"), ("ckpt peak", 1.0, "checkpoint")):
        name = f"planned+compress {label}"
        out.append(Mode(name, "supermem", "pool", b, options=opts, models=("resnet",), budget_of=of))
    # The plan over a step without the loss's spike (GPT only), at the same budgets as the rows above
    opts = {"policy": "planned", "loss": "chunked"}
    budgets = [(f"{b:.0%}", b, "native") for b in SWEEP_BUDGETS] + [("ckpt peak", 1.0, "checkpoint")]
    for label, b, of in budgets:
        name = f"planned+chunked loss {label}"
        out.append(Mode(name, "supermem", "pool", b, options=opts, models=("gpt",), budget_of=of))
    return out
