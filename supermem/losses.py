"""A language model's last linear layer and its cross-entropy, taken a chunk of rows at a time, so that
the full logits never exist: `supermem.linear_cross_entropy(hidden, weight, target)` is
`F.cross_entropy(F.linear(hidden, weight, bias).float(), target)` without the spike (in fp64 for an
fp64 weight).

Why: the loss is the peak of a language model's step. GPT-24 (batch 8 x 1024 tokens, vocabulary 50304,
bf16 autocast) holds its bf16 logits, their fp32 copy, log_softmax's saved output and the gradients
backward makes of them at once: 3.81 GiB above everything else on an H100, a quarter of its 15.17 GiB
peak, where no pool or checkpoint can help (the tensors are made and used within the loss). Here each
chunk's logits are made, turned into that chunk's loss and logit gradient at once (softmax less the
one-hot target), and multiplied back into the hidden rows' and the weight's gradients; what backward
keeps is those gradients, in fp32 (the hidden's and the weight's shapes), scaled there as the reduction
and backward's own gradient say. A chunk's temporaries are at most two times CHUNK_BYTES (its fp32
logits and their log_softmax, which becomes the softmax in place), and, off CUDA, one weight-sized
matmul product (on CUDA cuBLAS adds the products into the fp32 gradients itself).
Time, GPT-24's head and loss (forward and backward) on an H200: 9.0 ms, against 8.9 ms unchunked and
16.0 ms for this function's first form (128 MiB chunks, logsumexp, a weight-sized product added in
another pass, and a pass to zero ignored rows).

Numerics follow the unchunked expression: the logits in autocast's dtype when autocast is on (the
matmuls run under it), the loss and softmax in fp32, the logit gradient cast back to the logits' dtype
before its two matmuls (whose products, on CUDA, go into the fp32 gradients unrounded). What differs
is the order of sums: the loss and the weight's gradient add the chunks' parts (close, not bitwise).
Reductions "mean" and "sum" (the gradients are made in forward for a scalar loss; "none" would need
each row's own scale in backward). Not twice differentiable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_BYTES = 1 << 28  # fp32 logits of one chunk: 256 MiB (1334 rows of a 50304-word vocabulary)
# mm and addmm into an out of another dtype (torch >= 2.8); without it the product is added in a pass
_MIXED_MM = hasattr(torch.ops.aten.mm, "dtype_out") and hasattr(torch.ops.aten.addmm, "dtype_out")


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
    grad_on = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(
        rows, weight, bias, target.reshape(-1), ignore_index, reduction, chunk_rows, grad_on
    )


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    """out = a @ b, or out += a @ b, in out's dtype. On CUDA, fp16/bf16 products go straight into an
    fp32 out (cuBLAS accumulates in fp32: torch's out_dtype), with no low-precision product to round,
    keep and add in another pass (for GPT-24's weight gradient: 2.6 of a 16.0 ms loss on an H200)."""
    if _MIXED_MM and out.is_cuda and a.dtype != out.dtype and out.dtype == torch.float32:
        if add:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif add:
        out += a @ b
    else:
        out.copy_(a @ b)


def _matmul_dtype(rows: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in here: autocast's where it is on and would cast (not fp64),
    else the weight's."""
    device = rows.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (rows.dtype, weight.dtype):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weight, bias, target, ignore_index, reduction, chunk_rows, grad_on):
        # (needs_input_grad says requires_grad, not grad mode: under no_grad, the loss only)
        want_rows, want_weight, want_bias = want = [grad_on and n for n in ctx.needs_input_grad[:3]]
        low = _matmul_dtype(rows, weight)
        wide = torch.promote_types(weight.dtype, torch.float32)  # the loss's and sums' dtype: fp32 at least
        w = weight.to(low)  # cast once, not per chunk (autocast would, per F.linear)
        b = bias.to(low) if bias is not None else None
        valid = target != ignore_index
        ones = torch.ones((), device=rows.device, dtype=wide)
        scale = ones / valid.sum() if reduction == "mean" else ones  # (a tensor: no host sync)
        total = torch.zeros((), device=rows.device, dtype=wide)
        # The gradients of the rows' summed loss, kept in `wide`: backward scales them by `scale` and
        # its own gradient there, so fp16 under a loss scale (GradScaler's 65536) neither underflows
        # (a softmax / rows in fp16) nor overflows (65536 in fp16).
        grad_rows = torch.zeros(rows.shape, device=rows.device, dtype=wide) if want_rows else None
        grad_weight = torch.zeros_like(weight, dtype=wide) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=wide) if want_bias else None
        with torch.autocast(rows.device.type, enabled=False):
            for start in range(0, rows.shape[0], chunk_rows):
                part = slice(start, start + chunk_rows)
                keep = valid[part].unsqueeze(1)
                h, t = rows[part].to(low), torch.where(keep, target[part].unsqueeze(1), 0)
                z = F.linear(h, w, b).to(wide)  # (the low logits go here: at most two chunks live)
                logp = torch.log_softmax(z, dim=-1)  # one fused kernel, as the unchunked loss's
                del z
                total -= torch.where(keep, logp.gather(1, t), 0.0).sum()
                if any(want):
                    grad = logp.exp_()  # softmax, in logp's storage
                    grad.scatter_add_(1, t, -keep.to(wide))  # less the one-hot target
                    grad = grad.to(low)
                    # An ignored row's gradient is not zeroed here (a pass over the chunk): its row
                    # of grad_rows is, and its hidden row is out of the weight's and bias's sums.
                    if want_rows:
                        _mm_into(grad_rows[part], grad, w, add=False)
                        grad_rows[part] *= keep
                    if want_weight:
                        _mm_into(grad_weight, grad.t(), h * keep, add=True)
                    if want_bias:
                        _mm_into(grad_bias.unsqueeze(0), keep.t().to(low), grad, add=True)
                    del grad
                del logp  # (before the next chunk's logits are made)
        grad_scale = scale.nan_to_num(posinf=0.0)  # every row ignored: a nan loss, zero gradients
        ctx.save_for_backward(grad_rows, grad_weight, grad_bias, grad_scale)
        ctx.dtypes = (rows.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        *grads, scale = ctx.saved_tensors
        by = scale * grad_loss.to(scale.dtype)
        out = [(g * by).to(dtype) if g is not None else None for g, dtype in zip(grads, ctx.dtypes)]
        return (*out, None, None, None, None, None)
