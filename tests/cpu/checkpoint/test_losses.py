"""supermem.linear_cross_entropy: the last linear layer and its cross-entropy a chunk of rows at a time,
against the unchunked expression it replaces."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import supermem
from supermem.losses import linear_cross_entropy

VOCAB, D = 50, 16


def inputs(dtype=torch.float64, bias=True, shape=(4, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, D, dtype=dtype, generator=g)
    w = torch.randn(VOCAB, D, dtype=dtype, generator=g)
    b = torch.randn(VOCAB, dtype=dtype, generator=g) if bias else None
    t = torch.randint(0, VOCAB, shape, generator=g)
    t.view(-1)[:3] = -100  # ignored rows
    return h, w, b, t


def run(fn, h, w, b, t, **kw):
    """fn's loss and the gradients of its leaves (fresh copies of h, w, b)."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in (h, w, b)]
    loss = fn(*leaves, t, **kw)
    loss.backward()
    return loss.detach(), [x.grad if x is not None else None for x in leaves]


def unchunked(h, w, b, t, reduction="mean", ignore_index=-100):
    logits = F.linear(h, w, b).reshape(-1, VOCAB)
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(wide, t.reshape(-1), reduction=reduction, ignore_index=ignore_index)


def chunked(h, w, b, t, **kw):
    return linear_cross_entropy(h, w, t, bias=b, **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [1, 5, 28, 100])  # one row, uneven, all rows, more than all
@pytest.mark.parametrize("bias", [True, False])
def test_it_equals_the_unchunked_loss_and_gradients(reduction, chunk_rows, bias):
    h, w, b, t = inputs(bias=bias)
    loss, grads = run(chunked, h, w, b, t, reduction=reduction, chunk_rows=chunk_rows)
    ref_loss, ref_grads = run(unchunked, h, w, b, t, reduction=reduction)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        if r is None:
            assert g is None
        else:
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_under_bf16_autocast_it_is_the_unchunked_loss_within_bf16_rounding():
    """The logits in autocast's dtype, the loss in fp32, the logit gradient cast back before its
    matmuls, as the unchunked expression does; the sums run in another order (the loss's over
    chunks, the weight gradient's over the chunks' bf16 products)."""
    h, w, _, t = inputs(dtype=torch.float32, bias=False, shape=(2, 64))
    w = w * 0.1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, (gh, gw, _) = run(chunked, h, w, None, t, chunk_rows=16)
        ref_loss, (rh, rw, _) = run(unchunked, h, w, None, t)
    assert loss.dtype == ref_loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert gh.dtype == gw.dtype == torch.float32
    for g, r in ((gh, rh), (gw, rw)):
        assert ((g - r).norm() / r.norm()).item() < 1e-2  # bf16 keeps 8 bits: 0.4% a value


def test_every_row_ignored_gives_nan_and_zero_gradients_as_cross_entropy_does():
    h, w, b, t = inputs(dtype=torch.float32)
    t.fill_(-100)
    loss, grads = run(chunked, h, w, b, t, chunk_rows=5)
    ref_loss, ref_grads = run(unchunked, h, w, b, t)
    assert loss.isnan() and ref_loss.isnan()
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


def test_a_frozen_weight_gets_no_gradient_and_no_grad_mode_makes_none():
    h, w, _, t = inputs(bias=False)
    hh = h.clone().requires_grad_()
    loss = linear_cross_entropy(hh, w, t, chunk_rows=5)
    loss.backward()
    assert w.grad is None and hh.grad is not None
    with torch.no_grad():
        quiet = linear_cross_entropy(h, w, t, chunk_rows=5)
    assert quiet.grad_fn is None
    torch.testing.assert_close(quiet, unchunked(h, w, None, t), rtol=1e-12, atol=1e-12)


def test_backward_keeps_the_gradients_not_the_logits():
    """What the loss holds for backward: the hidden's and the weight's gradients (bytes counted by
    saved-tensor hooks), where the unchunked loss keeps log_softmax's output, rows x vocabulary."""
    rows, vocab = 256, 4096
    h = torch.randn(rows, D, requires_grad=True)
    w = torch.randn(vocab, D, requires_grad=True)
    t = torch.randint(0, vocab, (rows,))

    def saved_bytes(fn):
        held = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: held.append(x.nbytes) or x, lambda x: x):
            fn()
        return sum(held)

    ours = saved_bytes(lambda: linear_cross_entropy(h, w, t, chunk_rows=32))
    theirs = saved_bytes(lambda: F.cross_entropy(F.linear(h, w), t))
    assert ours == h.nbytes + w.nbytes + 4  # and the reduction's fp32 scale
    assert theirs >= rows * vocab * 4


def test_fp16_under_a_loss_scale_keeps_its_gradients():
    """GradScaler multiplies the loss by 65536: the gradients must be scaled in fp32, not made small in
    fp16 first (a softmax / rows underflows there) nor multiplied by 65536 in fp16 (inf)."""
    rows, vocab = 2048, 2000
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, D, generator=g)
    w = torch.randn(vocab, D, generator=g) * 0.3
    t = torch.randint(0, vocab, (rows,), generator=g)
    ref = [x.double().requires_grad_() for x in (h, w)]
    F.cross_entropy(F.linear(*ref), t).backward()
    ours = [x.half().requires_grad_() for x in (h, w)]
    (linear_cross_entropy(*ours, t, chunk_rows=256) * 65536).backward()
    for o, r in zip(ours, ref):
        got = o.grad.double() / 65536
        assert got.isfinite().all()
        assert ((got - r.grad).norm() / r.grad.norm()).item() < 1e-2


def test_no_grad_computes_the_loss_only(monkeypatch):
    """Evaluation under no_grad with parameters that require grad: no gradient work (Tensor.exp_ makes
    the softmax of the logit gradient; the loss itself needs only log_softmax)."""
    h, w, _, t = inputs(bias=False)
    h.requires_grad_(), w.requires_grad_()
    exp, calls = torch.Tensor.exp_, []
    monkeypatch.setattr(torch.Tensor, "exp_", lambda *a, **k: calls.append(1) or exp(*a, **k))
    with torch.no_grad():
        linear_cross_entropy(h, w, t, chunk_rows=5)
    assert calls == []
    linear_cross_entropy(h, w, t, chunk_rows=5)
    assert calls  # (with grad on, it does)


def test_an_ignore_index_past_the_vocabulary_is_ignored():
    """A pad id equal to the vocabulary's size: no class, so never gathered (a device assert on CUDA)."""
    h, w, b, t = inputs()
    t.view(-1)[:3] = VOCAB
    loss, grads = run(chunked, h, w, b, t, ignore_index=VOCAB, chunk_rows=5)
    ref_loss, ref_grads = run(unchunked, h, w, b, t, ignore_index=VOCAB)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_bad_input_says_what_is_wrong():
    h, w, b, t = inputs()
    with pytest.raises(ValueError, match="reduction='max'"):
        linear_cross_entropy(h, w, t, reduction="max")
    with pytest.raises(ValueError, match="class weights"):  # supermem's weight= was the linear layer's
        linear_cross_entropy(h, w, t, weight=w)
    with pytest.raises(ValueError, match="class indices"):
        linear_cross_entropy(h, w, t.double())
    with pytest.raises(ValueError, match="label_smoothing=1.5"):
        linear_cross_entropy(h, w, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="not both"):
        linear_cross_entropy(h, w, t, bias=b, linear_bias=b)
    with pytest.raises(ValueError, match="target"):
        linear_cross_entropy(h, w, t[:, :3])
    with pytest.raises(ValueError, match="do not make logits"):
        linear_cross_entropy(h, w.t(), t)
    with pytest.raises(ValueError, match="chunk_rows=0"):
        linear_cross_entropy(h, w, t, chunk_rows=0)


def test_it_is_public():
    assert supermem.linear_cross_entropy is linear_cross_entropy


# ------------------------------------------------------------------ torch's F.linear_cross_entropy
# Its keywords (torch 2.13): linear_bias, weight (class weights), reduction ("none" too), ignore_index
# (None: -100), label_smoothing, options. The same call runs under both functions. Tolerances: in
# fp64, 1e-12 (chunks add the loss and the weight's gradient in another order than one unchunked
# sum: about 1e-16 a value here, and the inputs' norms are ~10); in fp32, rtol 1e-5 (the same
# reordering at 6e-8 a rounding, over sums of up to 28 rows and 50 classes).


def class_weights(dtype=torch.float64):
    return torch.rand(VOCAB, dtype=dtype, generator=torch.Generator().manual_seed(3)) + 0.5


def run_any(fn, h, w, b, t, **kw):
    """run(), also for reduction "none": backward weighs each row by a fixed random gradient."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in (h, w, b)]
    loss = fn(*leaves, t, **kw)
    if loss.dim():
        weights = torch.rand(loss.shape, dtype=loss.dtype, generator=torch.Generator().manual_seed(4))
        loss.backward(weights)
    else:
        loss.backward()
    return loss.detach(), [x.grad if x is not None else None for x in leaves]


def torch_chunked(h, w, b, t, chunk_rows=5, **kw):
    """torch's own, on (N, d) rows (it takes no other leading shape), its chunked path (which, for
    label_smoothing, runs its reference instead and warns)."""
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_rows)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "linear_cross_entropy: ``options`` ignored")
        loss = F.linear_cross_entropy(
            h.reshape(-1, D), w, t.reshape(-1), linear_bias=b, options=options, **kw
        )
    return loss.reshape(t.shape) if kw.get("reduction") == "none" else loss


def reference(h, w, b, t, **kw):
    """The unchunked expression, with cross_entropy's options."""
    loss = F.cross_entropy(F.linear(h, w, b).reshape(-1, VOCAB), t.reshape(-1), **kw)
    return loss.reshape(t.shape) if kw.get("reduction") == "none" else loss


def ours(h, w, b, t, **kw):
    return linear_cross_entropy(h, w, t, linear_bias=b, **kw)


def assert_same(a, b, tol):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=tol, atol=tol)
    for x, y in zip(grads_a, grads_b):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 5, 100])
def test_torchs_options_give_cross_entropys_values_and_gradients(reduction, smoothing, weighted, chunk_rows):
    h, w, b, t = inputs()
    kw = {"reduction": reduction, "label_smoothing": smoothing}
    if weighted:
        kw["weight"] = class_weights()
    got = run_any(ours, h, w, b, t, chunk_rows=chunk_rows, **kw)
    assert got[0].shape == (t.shape if reduction == "none" else ())
    assert_same(got, run_any(reference, h, w, b, t, **kw), 1e-12)
    assert_same(got, run_any(torch_chunked, h, w, b, t, chunk_rows=chunk_rows, **kw), 1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_in_fp32_it_is_torchs_within_reordered_rounding(reduction):
    h, w, b, t = inputs(dtype=torch.float32)
    kw = {"reduction": reduction, "weight": class_weights(torch.float32), "label_smoothing": 0.05}
    got = run_any(ours, h, w, b, t, chunk_rows=5, **kw)
    for theirs in (run_any(torch_chunked, h, w, b, t, **kw), run_any(reference, h, w, b, t, **kw)):
        assert_same(got, theirs, 1e-5)


def test_one_call_runs_under_either_function():
    """torch's keywords, positional arguments and options as torch takes them, given to both."""
    h, w, b, t = inputs(shape=(28,))
    kw = {
        "linear_bias": b,
        "weight": class_weights(),
        "reduction": "sum",
        "ignore_index": None,  # torch's default: -100
        "label_smoothing": 0.2,
        "options": torch.nn.LinearCrossEntropyOptions(batch_chunk_size=5),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "linear_cross_entropy: ``options`` ignored")  # (torch's: smoothing)
        theirs = F.linear_cross_entropy(h, w, t, **kw)
    torch.testing.assert_close(linear_cross_entropy(h, w, t, **kw), theirs, rtol=1e-12, atol=1e-12)


def test_options_batch_chunk_size_is_chunk_rows(monkeypatch):
    h, w, b, t = inputs()
    seen = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, *a: seen.append(x.shape[0]) or linear(x, *a))
    linear_cross_entropy(h, w, t, options=torch.nn.LinearCrossEntropyOptions(batch_chunk_size=8))
    assert seen == [8, 8, 8, 4]


def test_bias_keyword_still_works():
    """supermem's keyword before torch's function existed."""
    h, w, b, t = inputs()
    torch.testing.assert_close(
        linear_cross_entropy(h, w, t, bias=b), linear_cross_entropy(h, w, t, linear_bias=b), rtol=0, atol=0
    )


def test_reduction_none_keeps_no_logits_and_ignored_rows_are_zero():
    rows, vocab = 256, 4096
    h = torch.randn(rows, D, requires_grad=True)
    w = torch.randn(vocab, D, requires_grad=True)
    t = torch.randint(0, vocab, (rows,))
    t[:5] = -100
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: held.append(x.nbytes) or x, lambda x: x):
        loss = linear_cross_entropy(h, w, t, reduction="none", chunk_rows=32)
    assert sum(held) <= h.nbytes + w.nbytes + t.nbytes  # its inputs, no rows x vocabulary
    assert torch.equal(loss[:5], torch.zeros(5))
    with torch.no_grad():
        assert linear_cross_entropy(h, w, t, reduction="none").grad_fn is None
