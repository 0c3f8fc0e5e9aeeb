"""A language model's last linear layer and its cross-entropy, taken a chunk of rows at a time, so that
the full logits never exist: `supermem.linear_cross_entropy(input, linear_weight, target)` is
`F.cross_entropy(F.linear(input, linear_weight, linear_bias).float(), target)` without the spike (in
fp64 for an fp64 weight). Its keywords and options are those of torch's own `F.linear_cross_entropy`
(torch 2.13): class `weight`, `label_smoothing`, reduction "mean", "sum" and "none", `ignore_index`.

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
For "mean" and "sum" the gradients are made in forward; "none" weighs each row by backward's own
gradient, so its backward makes each chunk's logits again. Not twice differentiable.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

CHUNK_BYTES = 1 << 28  # fp32 logits of one chunk: 256 MiB (1334 rows of a 50304-word vocabulary)
# mm and addmm into an out of another dtype (torch >= 2.8); without it the product is added in a pass
_MIXED_MM = hasattr(torch.ops.aten.mm, "dtype_out") and hasattr(torch.ops.aten.addmm, "dtype_out")


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options: Any = None,
    chunk_rows: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight=weight,
    reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing)`, a chunk of rows
    at a time; the keywords are torch's `F.linear_cross_entropy`'s (torch >= 2.13), so a call runs
    under either function. `input`: (..., d), any leading shape (torch's: (N, d)); `linear_weight`:
    (vocabulary, d); `target`: class indices, input's leading shape; `weight`: the class weights
    (vocabulary,); `ignore_index`: None is -100. `chunk_rows`: rows per chunk (default: CHUNK_BYTES
    of fp32 logits); `options`: a torch.nn.LinearCrossEntropyOptions, of which only batch_chunk_size
    is read (as chunk_rows: this function always chunks, where torch's runs unchunked for None).
    `bias`: linear_bias's name before torch had this function."""
    if bias is not None:
        if linear_bias is not None:
            raise ValueError("linear_cross_entropy: give linear_bias or bias (its older name), not both")
        linear_bias = bias
    if ignore_index is None:
        ignore_index = -100
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}; supported: 'mean', 'sum', 'none'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing={label_smoothing!r} should be in [0, 1]")
    if linear_weight.dim() != 2 or input.shape[-1] != linear_weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: input {tuple(input.shape)} and linear_weight "
            f"{tuple(linear_weight.shape)} do not make logits (input (..., d), linear_weight (vocabulary, d))"
        )
    if target.is_floating_point() or target.shape != input.shape[:-1]:
        raise ValueError(
            f"linear_cross_entropy: target {tuple(target.shape)} {target.dtype} should be class indices "
            f"of input's leading shape {tuple(input.shape[:-1])} (class probabilities: torch's "
            "F.linear_cross_entropy)"
        )
    if weight is not None and tuple(weight.shape) != (linear_weight.shape[0],):
        raise ValueError(
            f"linear_cross_entropy: weight {tuple(weight.shape)} is the class weights, one per class "
            f"({linear_weight.shape[0]},), as F.cross_entropy's; the linear layer's is linear_weight"
        )
    if chunk_rows is None and options is not None:
        chunk_rows = options.batch_chunk_size
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_BYTES // (4 * linear_weight.shape[0]))
    if chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows={chunk_rows} should be >= 1")
    rows = input.reshape(-1, input.shape[-1])
    terms = _Terms(linear_weight, weight, ignore_index, label_smoothing, chunk_rows)
    if reduction == "none":
        return _RowLosses.apply(rows, linear_weight, linear_bias, target.reshape(-1), terms).reshape(
            target.shape
        )
    grad_on = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(
        rows, linear_weight, linear_bias, target.reshape(-1), terms, reduction, grad_on
    )


class _Terms:
    """A row's loss and its logits' gradient, as F.cross_entropy has them: with class weights w and
    smoothing e over C classes, a kept row of target t loses (1 - e) w[t] (-logp[t]) + e/C sum_c w[c]
    (-logp[c]) (w = 1 without weights), an ignored row 0; "mean" divides the sum by sum w[t] over the
    kept rows. The gradient of that loss in the logits is softmax (1 - e) w[t] + e/C sum w) less
    (1 - e) w[t] at t and e/C w everywhere; without weights and smoothing, softmax less one-hot (no
    other pass over the chunk)."""

    def __init__(self, linear_weight, class_weight, ignore_index, smoothing, chunk_rows):
        self.wide = torch.promote_types(linear_weight.dtype, torch.float32)  # the loss's: fp32 at least
        self.classes = linear_weight.shape[0]
        self.class_weight = class_weight.to(self.wide) if class_weight is not None else None
        self.ignore_index = ignore_index
        self.smoothing = float(smoothing)
        self.chunk_rows = chunk_rows

    def target_weights(self, t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """w[t] of each row (0 where ignored), (rows, 1) in wide."""
        if self.class_weight is None:
            return keep.to(self.wide)
        return self.class_weight[t] * keep

    def divisor(self, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """What "mean" divides by: the kept rows, or their targets' weights summed."""
        if self.class_weight is None:
            return valid.sum()
        return (self.class_weight[torch.where(valid, target, 0)] * valid).sum()

    def losses(self, logp: torch.Tensor, t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Each row's loss (rows, 1); 0 where ignored."""
        nll = -logp.gather(1, t)
        if self.class_weight is not None:
            nll = nll * self.class_weight[t]
        if self.smoothing:
            spread = logp @ self.class_weight if self.class_weight is not None else logp.sum(1)
            nll = (1 - self.smoothing) * nll - (self.smoothing / self.classes) * spread.unsqueeze(1)
        return torch.where(keep, nll, 0.0)

    def logit_grad_(self, p: torch.Tensor, t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The gradient of the rows' losses in their logits, made in place of their softmax `p`. An
        ignored row's is not zeroed here: callers leave it out of their sums."""
        eps, w = self.smoothing, self.class_weight
        if w is None and not eps:
            return p.scatter_add_(1, t, -keep.to(self.wide))
        at_target = (1 - eps) * self.target_weights(t, keep)
        total = w.sum() if w is not None else self.classes
        p *= at_target + (eps / self.classes) * total
        p.scatter_add_(1, t, -at_target)
        if eps:
            p -= (eps / self.classes) * (w if w is not None else 1.0)
        return p


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
    """Reductions "mean" and "sum": the gradients are made in forward, chunk by chunk, and backward
    scales them (nothing of the logits is kept, and no logit is made twice)."""

    @staticmethod
    def forward(ctx, rows, weight, bias, target, terms, reduction, grad_on):
        # (needs_input_grad says requires_grad, not grad mode: under no_grad, the loss only)
        want_rows, want_weight, want_bias = want = [grad_on and n for n in ctx.needs_input_grad[:3]]
        low, wide = _matmul_dtype(rows, weight), terms.wide  # the sums' dtype: fp32 at least
        w = weight.to(low)  # cast once, not per chunk (autocast would, per F.linear)
        b = bias.to(low) if bias is not None else None
        valid = target != terms.ignore_index
        ones = torch.ones((), device=rows.device, dtype=wide)
        scale = ones / terms.divisor(target, valid) if reduction == "mean" else ones  # (no host sync)
        total = torch.zeros((), device=rows.device, dtype=wide)
        # The gradients of the rows' summed loss, kept in `wide`: backward scales them by `scale` and
        # its own gradient there, so fp16 under a loss scale (GradScaler's 65536) neither underflows
        # (a softmax / rows in fp16) nor overflows (65536 in fp16).
        grad_rows = torch.zeros(rows.shape, device=rows.device, dtype=wide) if want_rows else None
        grad_weight = torch.zeros_like(weight, dtype=wide) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=wide) if want_bias else None
        with torch.autocast(rows.device.type, enabled=False):
            for part, h, t, keep, logp in _chunks(rows, w, b, target, valid, terms, low):
                total += terms.losses(logp, t, keep).sum()
                if any(want):
                    grad = terms.logit_grad_(logp.exp_(), t, keep).to(low)  # (softmax in logp's storage)
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
        return (*out, None, None, None, None)


class _RowLosses(torch.autograd.Function):
    """Reduction "none": each row's loss. Its gradient weighs each row by backward's own gradient, so
    the weight's and bias's sums cannot be made in forward: backward makes each chunk's logits again
    (one more matmul a chunk, as torch's chunked "none" does), and forward keeps nothing but its
    inputs, which the step holds anyway."""

    @staticmethod
    def forward(ctx, rows, weight, bias, target, terms):
        low = _matmul_dtype(rows, weight)
        valid = target != terms.ignore_index
        out = torch.empty(rows.shape[0], device=rows.device, dtype=terms.wide)
        with torch.autocast(rows.device.type, enabled=False):
            w, b = weight.to(low), bias.to(low) if bias is not None else None
            for part, _, t, keep, logp in _chunks(rows, w, b, target, valid, terms, low):
                out[part] = terms.losses(logp, t, keep).squeeze(1)
                del logp
        ctx.save_for_backward(rows, weight, bias, target)
        ctx.terms, ctx.low = terms, low
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        rows, weight, bias, target = ctx.saved_tensors
        terms, low = ctx.terms, ctx.low
        want_rows, want_weight, want_bias = ctx.needs_input_grad[:3]
        wide = terms.wide
        by = grad_out.to(wide)
        valid = target != terms.ignore_index
        grad_rows = torch.zeros(rows.shape, device=rows.device, dtype=wide) if want_rows else None
        grad_weight = torch.zeros_like(weight, dtype=wide) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=wide) if want_bias else None
        with torch.autocast(rows.device.type, enabled=False):
            w, b = weight.to(low), bias.to(low) if bias is not None else None
            for part, h, t, keep, logp in _chunks(rows, w, b, target, valid, terms, low):
                grad = terms.logit_grad_(logp.exp_(), t, keep)
                grad *= torch.where(keep, by[part].unsqueeze(1), 0.0)  # ignored rows: out of every sum
                grad = grad.to(low)
                if want_rows:
                    _mm_into(grad_rows[part], grad, w, add=False)
                if want_weight:
                    _mm_into(grad_weight, grad.t(), h, add=True)
                if want_bias:
                    grad_bias += grad.sum(0)
                del grad, logp
        out = [
            g.to(x.dtype) if g is not None else None
            for g, x in ((grad_rows, rows), (grad_weight, weight), (grad_bias, bias))
        ]
        return (*out, None, None)


def _chunks(rows, w, b, target, valid, terms, low):
    """Each chunk of rows: its slice, its rows in `low`, its targets (ignored rows' as 0: a class),
    which rows are kept (rows, 1), and the log_softmax of its logits in terms.wide, one fused kernel
    as the unchunked loss's (the low logits go once it is made: at most two chunks live)."""
    for start in range(0, rows.shape[0], terms.chunk_rows):
        part = slice(start, start + terms.chunk_rows)
        keep = valid[part].unsqueeze(1)
        h, t = rows[part].to(low), torch.where(keep, target[part].unsqueeze(1), 0)
        yield part, h, t, keep, torch.log_softmax(F.linear(h, w, b).to(terms.wide), dim=-1)
