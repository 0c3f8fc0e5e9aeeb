"""A language model's last linear layer and its cross-entropy, taken a chunk of rows at a time, so that
the full logits never exist: `supermem.linear_cross_entropy(hidden, weight, target)` is
`F.cross_entropy(F.linear(hidden, weight, bias).float(), target)` without the spike (in fp64 for an
fp64 weight).

Why: the loss is the peak of a language model's step. GPT-24 (batch 8 x 1024 tokens, vocabulary 50304,
bf16 autocast) holds its bf16 logits, their fp32 copy, log_softmax's saved output and the gradients
backward makes of them at once: 3.81 GiB above everything else on an H100, a quarter of its 15.17 GiB
peak, where no pool or checkpoint can help (the tensors are made and used within the loss). Here each
chunk's logits are made, turned into that chunk's loss and logit gradient at once (softmax less the
one-hot target, scaled as the reduction says), and multiplied back into the hidden rows' and the
weight's gradients; what backward keeps is those gradients (the hidden's size and the weight's), and a
chunk's temporaries are CHUNK_BYTES of fp32 logits.

Numerics follow the unchunked expression: the logits in autocast's dtype when autocast is on (the
matmuls run under it), the loss and softmax in fp32, the logit gradient cast back to the logits' dtype
before its two matmuls. What differs is the order of sums: the loss and the weight's gradient add the
chunks' parts (close, not bitwise). Reductions "mean" and "sum" (the gradients are made in forward for
a scalar loss; "none" would need each row's own scale in backward). Not twice differentiable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_BYTES = 1 << 27  # fp32 logits of one chunk: 128 MiB (667 rows of a 50304-word vocabulary)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """The cross-entropy of `F.linear(hidden, weight, bias)` against `target` (class indices), a chunk
    of rows at a time. `hidden`: (..., d); `weight`: (vocabulary, d); `target`: hidden's leading
    shape. `chunk_rows`: rows per chunk (default: CHUNK_BYTES of fp32 logits)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}; supported: 'mean', 'sum'")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
            "do not make logits (hidden (..., d), weight (vocabulary, d))"
        )
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"linear_cross_entropy: target {tuple(target.shape)} should be hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_BYTES // (4 * weight.shape[0]))
    if chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows={chunk_rows} should be >= 1")
    rows = hidden.reshape(-1, hidden.shape[-1])
    return _LinearCrossEntropy.apply(
        rows, weight, bias, target.reshape(-1), ignore_index, reduction, chunk_rows
    )


def _matmul_dtype(rows: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in here: autocast's where it is on and would cast (not fp64),
    else the weight's."""
    device = rows.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (rows.dtype, weight.dtype):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weight, bias, target, ignore_index, reduction, chunk_rows):
        want_rows, want_weight, want_bias = ctx.needs_input_grad[:3]
        low = _matmul_dtype(rows, weight)
        wide = torch.promote_types(weight.dtype, torch.float32)  # the loss's and sums' dtype: fp32 at least
        w = weight.to(low)  # cast once, not per chunk (autocast would, per F.linear)
        b = bias.to(low) if bias is not None else None
        valid = target != ignore_index
        scale = 1.0 / valid.sum().to(wide) if reduction == "mean" else 1.0  # (a tensor: no host sync)
        total = torch.zeros((), device=rows.device, dtype=wide)
        grad_rows = torch.empty_like(rows) if want_rows else None
        grad_weight = torch.zeros_like(weight, dtype=wide) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=wide) if want_bias else None
        with torch.autocast(rows.device.type, enabled=False):
            for start in range(0, rows.shape[0], chunk_rows):
                part = slice(start, start + chunk_rows)
                h, t, keep = rows[part].to(low), target[part].clamp(min=0).unsqueeze(1), valid[part]
                z = F.linear(h, w, b).to(wide)
                lse = torch.logsumexp(z, dim=-1)
                total += torch.where(keep, lse - z.gather(1, t).squeeze(1), 0.0).sum()
                if not (want_rows or want_weight or want_bias):
                    continue
                grad = torch.exp(z.sub_(lse.unsqueeze(1)))  # softmax, in z's storage
                grad.scatter_add_(1, t, torch.full_like(z[:, :1], -1.0))  # less the one-hot target
                grad = grad.mul_(torch.where(keep, scale, 0.0).unsqueeze(1)).to(low)  # (all ignored: 0)
                if want_rows:
                    grad_rows[part] = grad @ w
                if want_weight:
                    grad_weight += grad.t() @ h
                if want_bias:
                    grad_bias += grad.to(wide).sum(0)
        ctx.save_for_backward(grad_rows, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_rows, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        out_rows = grad_rows * grad_loss.to(grad_rows.dtype) if grad_rows is not None else None
        out_weight = (grad_weight * grad_loss).to(weight_dtype) if grad_weight is not None else None
        out_bias = (grad_bias * grad_loss).to(bias_dtype) if grad_bias is not None else None
        return out_rows, out_weight, out_bias, None, None, None, None
