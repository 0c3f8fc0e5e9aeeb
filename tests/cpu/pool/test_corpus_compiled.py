"""The corpus' decoders with each layer compiled on its own (torch.compile per block, aot_eager), 8
layers at a tiny width, under every live policy at 40% of the bytes the compiled step saves outside the
pool: every loss, gradient, weight and optimizer state bitwise the compiled run's without the pool.
The pool lowers the compile budget share of graphs that draw no random numbers, and takes the layers'
saved tensors as eager code's where the share cannot fit (tensor_pool/compiled.py)."""

import warnings

import corpus
import pytest
import torch
from corpus import build_and_train

from supermem.policies import live_names
from supermem.tensor_pool import Pool

pytest.importorskip("torch._dynamo")
DECODERS = ("gpt2", "llama", "mistral", "qwen2")


def _layers_compiled(name):
    """CASES[name] at tiny-deep size, each decoder layer compiled alone."""

    def build(_size):
        model, batch, loss_of = corpus.CASES[name]("tiny-deep")
        layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1)
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, backend="aot_eager")
        return model, batch, loss_of

    return build


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


_reference: dict[str, tuple] = {}


def reference(case):
    """(results, bytes the compiled graphs save in a step) without the pool, checked to repeat."""
    if case not in _reference:
        ref = build_and_train(case, "tiny")
        assert _same(ref, build_and_train(case, "tiny")), f"{case} is not deterministic without the pool"
        probe = Pool(policy="lru", min_bytes=0)
        build_and_train(case, "tiny", probe, steps=1)
        _reference[case] = ref, probe.stats()["compiled_kept_bytes"]
    return _reference[case]


@pytest.mark.parametrize("policy", live_names())
@pytest.mark.parametrize("name", DECODERS)
def test_a_decoder_with_its_layers_compiled_trains_bitwise_under_the_pool(name, policy, monkeypatch):
    """GPT-2 draws dropout inside its layers: the share the pool lowers would have its partitioner
    recompute dropout in backward with another mask (torch_private.RandomGraphsAt)."""
    pytest.importorskip("transformers")
    case = f"{name}-layers-compiled"
    monkeypatch.setitem(corpus.CASES, case, _layers_compiled(name))
    torch._dynamo.reset()  # (what earlier tests compiled and dropped counts toward dynamo's limits)
    ref, saved = reference(case)
    assert saved > 0, f"{case}: no compiled graph saved a tensor"
    pool = Pool(budget=int(0.4 * saved), policy=policy, min_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = build_and_train(case, "tiny", pool)
    assert _same(got, ref), f"{case} under {policy} at 40%: training differs from the compiled run's"
    s = pool.stats()
    if name == "gpt2":  # its layers keep their share: the pool takes what they save
        assert pool.compiled.movable and s["offloaded_bytes"] + s["dropped_bytes"] > 0, s
    else:  # the share is lowered (a dropout-free graph may recompute), or the pool takes them
        assert (s["compile_share"] or 1.0) < 1.0 or pool.compiled.movable, s
