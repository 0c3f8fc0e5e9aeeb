"""`supermem bench train`'s rows: a `Mode` each, the ones a plain run makes (modes) and --sweep's
(sweep_modes), and the models each runs for."""

from __future__ import annotations

from dataclasses import dataclass, field

from .train_worker import compiled

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

    @property
    def loss_kind(self) -> str:
        """The step's loss: "plain" (the model's), "chunked" or "torch_chunked" (train_worker.measure)."""
        return self.options.get("loss", "plain")

    @property
    def compiled(self) -> bool:
        """The row runs a torch.compile'd model (train_worker.compiled of its spec)."""
        return compiled({**self.options, "saver": self.saver})


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
HF_SWEEP_BUDGETS = (0.75, 0.5)  # and each HF checkpointing row's peak; 15-25 s a process on an H200
# --sweep's warm-up: a planned pool records its first steps, then may record and plan again a few times
# (PlanRunner: MAX_REPLANS) before its plan holds; the rows time the steps after (an H100 sweep with 3
# warm-up steps timed GPT-24's planned 75% at 183.7 ms a step, its plan's own steps at 95.3)
SWEEP_WARMUP = 10
# a compiled pool row's, but --quick's: a recompile takes two steps (the compiling step is not measured
# on CUDA), and the pool may recompile 3 times for the share, once for checkpoints, 3 more (compiled.py)
COMPILED_POOL_WARMUP = 20
COMPILE_BUDGETS = (1.0, 0.5, 0.2)  # torch._functorch.config.activation_memory_budget


def sweep_modes(device: str) -> list[Mode]:
    """--sweep: every baseline, then cost_aware and planned at fractions of native's peak and at
    checkpoint's own peak (an HF model: at HF_SWEEP_BUDGETS and each HF checkpointing row's peak), the
    planned pool around the compiled model, and on GPT each checkpointing, compile and pool row again with
    the chunked loss ("... + chunked loss"; its pool rows' checkpoint peak is the chunked checkpoint's).
    On CPU one torch.compile row of each kind only: inductor's build takes ~15 s a row; none for an HF
    model. A reference row (native, checkpoint) comes before the rows whose budget it gives."""
    import torch

    from .. import torch_private as tp

    cuda = device == "cuda"
    out = [Mode("native", "native", "none", table="allocator")]
    ckpts = [Mode("checkpoint", "native", "checkpoint", models=BLOCK_MODELS)]
    reentrant = {"reentrant": True}
    ckpts.append(Mode("checkpoint reentrant", "native", "checkpoint", options=reentrant, models=BLOCK_MODELS))
    for name, f in (("quarter", 0.25), ("half", 0.5), ("three quarters", 0.75)):
        opts: dict = {"fraction": f}
        ckpts.append(
            Mode(f"checkpoint first {name}", "native", "checkpoint_first", options=opts, models=BLOCK_MODELS)
        )
    out += ckpts
    out += hf_checkpoint_modes()
    if cuda:
        out.append(Mode("save_on_cpu", "native", "save_on_cpu"))
    # supermem.linear_cross_entropy in place of the head and its loss (GPT only: its loss is the spike)
    out.append(Mode("chunked loss", "native", "none", options={"loss": "chunked"}, models=("gpt",)))
    if hasattr(torch.nn, "LinearCrossEntropyOptions"):  # torch's own (2.13), its chunked path, beside it
        torchs = {"loss": "torch_chunked"}
        out.append(Mode("torch chunked loss", "native", "none", options=torchs, models=("gpt",)))
    compiles = []
    for b in COMPILE_BUDGETS if cuda else COMPILE_BUDGETS[1:2]:
        opts = {"memory_budget": b}
        compiles.append(Mode(f"compile budget {b}", "native", "compile", options=opts, models=BLOCK_MODELS))
    if cuda and tp.has_partitioner_offload():  # the partitioner's own CPU offload of what graphs save
        opts = {"memory_budget": 1.0, "partitioner_offload": True}
        compiles.append(
            Mode("compile partitioner offload", "native", "compile", options=opts, models=BLOCK_MODELS)
        )
    blocks = {"memory_budget": 1.0, "per_block": True}  # each block compiled alone (torchtitan's way)
    compiles.append(Mode("compile per block", "native", "compile", options=blocks, models=BLOCK_MODELS))
    if cuda:  # the model compiled whole, each block checkpointed inside its graph, fully or selectively
        for name, saves in (("compile checkpoint", None), ("compile selective checkpoint", "matmuls")):
            opts = {"compile": True, "memory_budget": 1.0, "checkpoint_saves": saves}
            compiles.append(Mode(name, "native", "checkpoint", options=opts, models=BLOCK_MODELS))
    out += compiles
    out += [_chunked(m) for m in ckpts + compiles]
    budgets = [(f"{b:.0%}", b, "native") for b in SWEEP_BUDGETS] + [("ckpt peak", 1.0, "checkpoint")]
    pools = []  # the pool's rows for GPT and ResNet (GPT runs them again with the chunked loss)
    for policy in ("cost_aware", "planned"):
        opts = {"policy": policy}
        for label, b, of in budgets:
            ms = () if b in HF_SWEEP_BUDGETS else BLOCK_MODELS  # an HF model's: 75%, 50%
            pools.append(
                Mode(f"{policy} {label}", "supermem", "pool", b, options=opts, models=ms, budget_of=of)
            )
    # The planned pool around the compiled model: it sets the compiler's activation_memory_budget itself
    # (tensor_pool/compiled.py), from 1.0, and checkpoints its blocks inside the graph where no share fits
    opts = {"policy": "planned", "compile": True, "memory_budget": 1.0}
    for label, b, of in budgets if cuda else budgets[-1:]:
        name = f"compiled planned {label}"
        pools.append(Mode(name, "supermem", "pool", b, options=opts, models=BLOCK_MODELS, budget_of=of))
    # The planned pool around each block compiled alone: the compile budget share first, then, where the
    # share cannot fit, what the blocks' graphs save planned as eager code's (tensor_pool/compiled.py)
    opts = {"policy": "planned", "compile": True, "memory_budget": 1.0, "per_block": True}
    for label, b, of in budgets if cuda else budgets[-1:]:
        name = f"per block planned {label}"
        pools.append(Mode(name, "supermem", "pool", b, options=opts, models=BLOCK_MODELS, budget_of=of))
    out += pools
    for policy in ("cost_aware", "planned"):  # "cost_aware hf ckpt peak", "... hf ckpt reentrant peak"
        for ck in hf_checkpoint_modes():
            name = f"{policy} {ck.name.replace('checkpoint', 'ckpt')} peak"
            opts = {"policy": policy}
            out.append(Mode(name, "supermem", "pool", 1.0, options=opts, models=HF_MODELS, budget_of=ck.name))
    # ReLU compression offered to the plan (packs that wait for nothing: Compress(room="full")); ResNet
    # only (GPT has no ReLU)
    opts = {"policy": "planned", "treatments": ["offload", "recompute", "compress:full"]}
    for label, b, of in (("75%", 0.75, "native"), ("50%", 0.5, "native"), ("ckpt peak", 1.0, "checkpoint")):
        name = f"planned+compress {label}"
        out.append(Mode(name, "supermem", "pool", b, options=opts, models=("resnet",), budget_of=of))
    return out + [_chunked(m) for m in pools]


def _chunked(m: Mode) -> Mode:
    """`m` with supermem.linear_cross_entropy for GPT's head and loss; its budget from the same-loss
    row of its reference: native's with the chunked loss ("chunked loss", whose peak is GPT-24's 11.30
    GiB: 90% of plain native's would move nothing), or a checkpoint's with it."""
    of = "chunked loss" if m.budget_of == "native" else f"{m.budget_of} + chunked loss"
    opts = {**m.options, "loss": "chunked"}
    return Mode(f"{m.name} + chunked loss", m.allocator, m.saver, m.budget, m.table, opts, ("gpt",), of)
