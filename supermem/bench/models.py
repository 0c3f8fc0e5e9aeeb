"""The benchmark models: a GPT and a bottleneck ResNet defined here, and Hugging Face's Llama (transformers,
imported only when a preset of it is built).

GPT and ResNet can checkpoint each block (`model.checkpoint_blocks = True`) or the first N (`= N`), the
pure-PyTorch memory savers the benchmarks compare against; the Llama checkpoints the way its users do,
by `model.gradient_checkpointing_enable()`. `PRESETS` names the sizes the benchmarks and golden tests
use; the full GPT and ResNet are the reference models of docs/design.md#reference-models (GPT-24 d1024 b8
T1024 bf16; ResNet-152 b64 224px fp32).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _blocks(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Runs model.blocks; checkpoints all of them (checkpoint_blocks True) or the first N (an int), by
    torch's default non-reentrant checkpoint or (checkpoint_reentrant) its reentrant one; selectively
    where model.checkpoint_saves names what it keeps (SELECTIVE)."""
    ck: Any = model.checkpoint_blocks  # True or an int (nn.Module's attributes type as tensor or module)
    blocks: Any = model.blocks
    n = len(blocks) if ck is True else int(ck)
    reentrant = getattr(model, "checkpoint_reentrant", False)
    saves = getattr(model, "checkpoint_saves", None)
    kw: dict[str, Any] = {"context_fn": SELECTIVE[saves]} if saves else {}
    for i, b in enumerate(blocks):
        x = checkpoint(b, x, use_reentrant=reentrant, **kw) if i < n else b(x)
    return x


def _ops(*names: str) -> frozenset:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _keeping(saved: frozenset) -> Callable[[], Any]:
    """A checkpoint context_fn that keeps the outputs of the ops in `saved` and recomputes the rest (a
    partial made here, outside the forward: dynamo takes no function made inside what it traces)."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


_ATTENTION = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
# Selective checkpointing: what a block keeps of its forward, the rest recomputed in its backward.
# "matmuls": every matmul's, convolution's and the attention's output (torchtitan's "op" SAC without
# its every-other-matmul rule)
SELECTIVE = {"matmuls": _keeping(_ops("mm", "addmm", "bmm", "convolution", *_ATTENTION))}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (SDPA) and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.heads = heads
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, layers=24, d=1024, heads=16, vocab=50304, ctx=1024, dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.checkpoint_blocks: bool | int = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(idx))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """What the head reads (supermem.linear_cross_entropy takes it with the head's weight)."""
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.ln(_blocks(self, x))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int = 1):
        super().__init__()
        cout = mid * 4
        self.c1, self.b1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.c2, self.b2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.c3, self.b3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        y = self.b3(self.c3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """Bottleneck ResNet with stage depths `depths`: (3, 8, 36, 3) is ResNet-152 (3*sum+2 layers).
    `width` is the first stage's bottleneck width (64 in ResNet; smaller for tests)."""

    def __init__(self, depths=(3, 8, 36, 3), width=64, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        blocks, cin = [], width
        for stage, n in enumerate(depths):
            mid = width << stage
            for i in range(n):
                blocks.append(Bottleneck(cin, mid, 2 if i == 0 and stage > 0 else 1))
                cin = mid * 4
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, classes)
        self.checkpoint_blocks: bool | int = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = _blocks(self, x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def hf_llama(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, ctx: int
) -> Callable[[], nn.Module]:
    """A builder of transformers' LlamaForCausalLM from a config (random weights, fp32, in train mode;
    use_cache left at its default, as users keep it)."""

    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM  # optional: only the Llama presets need it

        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            vocab_size=vocab,
            max_position_embeddings=ctx,
        )
        return LlamaForCausalLM(config)

    return build


def logits_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss_fn(model(x), y)


def hf_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's own loss: it shifts the labels (y is x) and upcasts the logits."""
    return model(x, labels=y).loss


@dataclass(frozen=True)
class Preset:
    """A model at one size with its batch: `build()` makes the module, `batch(device, generator)` (x, y),
    `loss(model, x, y)` the step's loss (run under the step's autocast)."""

    label: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.device, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    bf16: bool  # train under bf16 autocast (on CUDA)
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = logits_loss


def _tokens(b: int, t: int, vocab: int):
    def make(device, gen):
        idx = torch.randint(0, vocab, (b, t + 1), generator=gen)  # on CPU: independent of device RNG
        return idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)

    return make


def _hf_tokens(b: int, t: int, vocab: int):
    """input_ids twice: a Hugging Face causal LM is given labels=input_ids and shifts them itself."""

    def make(device, gen):
        idx = torch.randint(0, vocab, (b, t), generator=gen).to(device)
        return idx, idx

    return make


def _images(b: int, px: int, classes: int):
    def make(device, gen):
        x = torch.randn(b, 3, px, px, generator=gen)
        return x.to(device), torch.randint(0, classes, (b,), generator=gen).to(device)

    return make


PRESETS: dict[str, Preset] = {
    "gpt": Preset("gpt24_d1024_b8_t1024_bf16", lambda: GPT(), _tokens(8, 1024, 50304), True),
    "resnet": Preset(
        "resnet152_b64_224px_fp32", lambda: ResNet((3, 8, 36, 3)), _images(64, 224, 1000), False
    ),
    # transformers' Llama at GPT-24's width: 12 layers, grouped-query attention (16 heads, 4 KV), 32k vocab
    "hf-llama": Preset(
        "hf_llama12_d1024_b4_t1024_bf16",
        hf_llama(1024, 2816, 12, 16, 4, 32768, 2048),
        _hf_tokens(4, 1024, 32768),
        True,
        hf_loss,
    ),
    # --quick: seconds on a CPU, for smoke tests of the harness
    "hf-llama-quick": Preset(
        "hf_llama2_d64_b2_t64", hf_llama(64, 176, 2, 4, 2, 512, 64), _hf_tokens(2, 64, 512), True, hf_loss
    ),
    "gpt-quick": Preset(
        "gpt2_d64_b2_t64", lambda: GPT(layers=2, d=64, heads=2, vocab=512, ctx=64), _tokens(2, 64, 512), True
    ),
    "resnet-quick": Preset(
        "resnet14_w8_b2_32px", lambda: ResNet((1, 1, 1, 1), width=8, classes=10), _images(2, 32, 10), False
    ),
    # the full models' depth at toy width: a CPU step is all host, so the pool's own host cost per
    # call and per save shows against native's (tools/diag/hook_costs.py, tools/diag/pool_step.py on a CPU)
    "gpt-host": Preset(
        "gpt24_d32_b1_t16",
        lambda: GPT(layers=24, d=32, heads=2, vocab=256, ctx=16),
        _tokens(1, 16, 256),
        False,
    ),
    "resnet-host": Preset(
        "resnet152_w4_b2_32px", lambda: ResNet((3, 8, 36, 3), width=4, classes=10), _images(2, 32, 10), False
    ),
    # golden tests: small, but every kind of layer of the full models (dropout exercises the RNG)
    "gpt-golden": Preset(
        "gpt4_d256_b8_t128_bf16",
        lambda: GPT(layers=4, d=256, heads=4, vocab=2048, ctx=128, dropout=0.1),
        _tokens(8, 128, 2048),
        True,
    ),
    "resnet-golden": Preset(
        "resnet26_w16_b8_64px_fp32",
        lambda: ResNet((2, 2, 2, 2), width=16, classes=100),
        _images(8, 64, 100),
        False,
    ),
}


def _nothing() -> None:
    pass


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


class Trainer:
    """A model, its batch and an SGD optimizer: `step(ctx)` runs one timed training step (forward under
    bf16 autocast where the preset trains so, loss, backward inside `ctx`, then the optimizer) and
    returns its seconds; `host_s` is the host's part of the last step (before the closing device
    sync: about the whole step when the host is the slower side). The tools' shared step."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool, loss=logits_loss):
        self.model, self.x, self.y, self.bf16, self.loss = model, x, y, bf16, loss
        self.device = x.device
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        self.host_s = 0.0

    @classmethod
    def of(cls, name: str, device: torch.device) -> Trainer:
        """PRESETS[name] built on `device`, seeded (the same weights and batch in every process)."""
        preset = PRESETS[name]
        torch.manual_seed(0)
        with device:
            model = preset.build()
        x, y = preset.batch(device, torch.Generator().manual_seed(0))
        return cls(model, x, y, preset.bf16, preset.loss)

    def step(self, ctx: Any = None, mark: Callable[[], None] | None = None) -> float:
        """`mark`: called at the step's start (after the device sync), after the loss, after backward
        and after the optimizer (phase timing: tools/diag/step_phases.py)."""
        cuda = self.device.type == "cuda"
        mark = mark or _nothing
        if cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        mark()
        with ctx if ctx is not None else contextlib.nullcontext():
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                if self.loss is not logits_loss:  # a model that takes its labels (hf_loss)
                    loss = self.loss(self.model, self.x, self.y)
                else:
                    out = self.model(self.x)
            if self.loss is logits_loss:
                loss = loss_fn(out, self.y)
                del out  # (held through backward, GPT-24's bf16 logits added 0.77 GiB to every peak)
            mark()
            loss.backward()
        mark()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        mark()
        self.host_s = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0
