"""The third-party model corpus: architectures people train, from transformers, timm and torchvision,
built from configs (nothing downloaded), at a tiny size for the CPU lane and a realistic one for the GPU.

Each case is `build(size) -> (model, batch, loss)`: `batch(generator)` makes the step's inputs once,
`loss(model, inputs)` is the step's scalar loss. The models are left as their libraries make them:
Hugging Face decoders keep `use_cache` on in training (their forward builds a KV cache that each layer
appends to), dropout stays at its configured rate, GPT-2 ties its embeddings.
"""

import pytest
import torch


def _hf():
    return pytest.importorskip("transformers")


def _tokens(vocab, batch, seq):
    return lambda g: torch.randint(0, vocab, (batch, seq), generator=g)


def _causal_lm(model_cls, config_cls, config_of):
    """A decoder trained on next-token loss; `config_of(width, layers, vocab)`: its config's arguments.
    Sizes: "tiny", "tiny-deep" (8 layers: each an eighth of the step, as in a real decoder), "real"."""

    def build(size):
        t = _hf()
        shapes = {"tiny": (64, 3, 2, 32), "tiny-deep": (64, 8, 2, 32)}
        d, layers, batch, seq = shapes.get(size, (1024, 12, 4, 1024))
        vocab = 512 if size in shapes else 32768
        model = getattr(t, model_cls)(getattr(t, config_cls)(**config_of(d, layers, vocab)))
        return model, _tokens(vocab, batch, seq), lambda m, ids: m(input_ids=ids, labels=ids).loss

    return build


def _gpt2(attn):
    return _causal_lm(
        "GPT2LMHeadModel",
        "GPT2Config",
        lambda d, layers, vocab: dict(
            n_embd=d,
            n_layer=layers,
            n_head=d // 32,
            vocab_size=vocab,
            n_positions=1024,
            attn_implementation=attn,
        ),
    )


def _llama_like(model_cls, config_cls, **extra):
    """RoPE, grouped-query attention (4 query heads a key head), SwiGLU."""
    return _causal_lm(
        model_cls,
        config_cls,
        lambda d, layers, vocab: dict(
            hidden_size=d,
            intermediate_size=d * 11 // 4,
            num_hidden_layers=layers,
            num_attention_heads=d // 32,
            num_key_value_heads=max(1, d // 128),
            vocab_size=vocab,
            max_position_embeddings=2048,
            **extra,
        ),
    )


def _bert(size):
    t = _hf()
    d, layers, batch, seq = (64, 2, 2, 32) if size == "tiny" else (768, 12, 16, 512)
    config = t.BertConfig(
        hidden_size=d,
        num_hidden_layers=layers,
        num_attention_heads=d // 32,
        intermediate_size=4 * d,
        vocab_size=512 if d < 256 else 30522,
        max_position_embeddings=seq,
    )

    def batch_of(g):
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, seq // 2 :] = 0  # a padded row: the attention mask matters
        return ids, mask

    def loss(m, inputs):
        ids, mask = inputs
        return m(input_ids=ids, attention_mask=mask, labels=ids).loss

    return t.BertForMaskedLM(config), batch_of, loss


def _seq2seq(kind):
    def build(size):
        t = _hf()
        d, layers, batch, seq = (64, 2, 2, 24) if size == "tiny" else (768, 6, 8, 512)
        vocab = 512 if d < 256 else 32128
        if kind == "t5":
            config = t.T5Config(
                d_model=d,
                d_kv=32,
                d_ff=4 * d,
                num_layers=layers,
                num_heads=d // 32,
                vocab_size=vocab,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
            model = t.T5ForConditionalGeneration(config)
        else:
            config = t.BartConfig(
                d_model=d,
                encoder_layers=layers,
                decoder_layers=layers,
                encoder_attention_heads=d // 32,
                decoder_attention_heads=d // 32,
                encoder_ffn_dim=4 * d,
                decoder_ffn_dim=4 * d,
                vocab_size=vocab,
                max_position_embeddings=seq,
            )
            model = t.BartForConditionalGeneration(config)

        def batch_of(g):
            return torch.randint(2, vocab, (batch, seq), generator=g), torch.randint(
                2, vocab, (batch, seq), generator=g
            )

        return model, batch_of, lambda m, x: m(input_ids=x[0], labels=x[1]).loss

    return build


def _images(batch, side, classes):
    return lambda g: (
        torch.randn(batch, 3, side, side, generator=g),
        torch.randint(0, classes, (batch,), generator=g),
    )


def _hf_vision(config, cls, tiny, real, **extra):
    def build(size):
        t = _hf()
        kwargs, batch, side = (tiny, 2, 32) if size == "tiny" else (real, 32, 224)
        model = getattr(t, cls)(getattr(t, config)(num_labels=10, image_size=side, **kwargs, **extra))
        return model, _images(batch, side, 10), lambda m, x: m(pixel_values=x[0], labels=x[1]).loss

    return build


def _timm(name, tiny_side=64):
    def build(size):
        timm = pytest.importorskip("timm")
        model = timm.create_model(name, pretrained=False, num_classes=10)
        batch, side = (2, tiny_side) if size == "tiny" else (64, 224)
        return model, _images(batch, side, 10), _classify

    return build


def _torchvision(name):
    def build(size):
        models = pytest.importorskip("torchvision.models")
        model = getattr(models, name)(num_classes=10)
        batch, side = (2, 64) if size == "tiny" else (64, 224)
        return model, _images(batch, side, 10), _classify

    return build


def _classify(m, x):
    return torch.nn.functional.cross_entropy(m(x[0]).float(), x[1])


# name -> build(size); the first part is transformers alone (the CPU lane's), then timm and torchvision
CASES = {
    "gpt2": _gpt2("sdpa"),
    "gpt2-eager": _gpt2("eager"),
    "llama": _llama_like("LlamaForCausalLM", "LlamaConfig"),
    "mistral": _llama_like("MistralForCausalLM", "MistralConfig", sliding_window=16),
    "qwen2": _llama_like("Qwen2ForCausalLM", "Qwen2Config"),
    "bert": _bert,
    "t5": _seq2seq("t5"),
    "bart": _seq2seq("bart"),
    "vit": _hf_vision(
        "ViTConfig",
        "ViTForImageClassification",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, patch_size=8),
        dict(
            hidden_size=384,
            num_hidden_layers=12,
            num_attention_heads=6,
            intermediate_size=1536,
            patch_size=16,
        ),
    ),
    "convnext": _hf_vision(
        "ConvNextConfig",
        "ConvNextForImageClassification",
        dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1]),
        dict(hidden_sizes=[96, 192, 384, 768], depths=[3, 3, 9, 3]),
    ),
    "efficientnet": _hf_vision(
        "EfficientNetConfig",
        "EfficientNetForImageClassification",
        dict(width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320),
        dict(),
    ),
    "mobilenet-v2": _hf_vision(
        "MobileNetV2Config", "MobileNetV2ForImageClassification", dict(depth_multiplier=0.25), dict()
    ),
    "timm-mobilenetv3": _timm("mobilenetv3_small_100"),
    "timm-convnext": _timm("convnext_atto"),
    "timm-efficientnet": _timm("efficientnet_b0"),
    "timm-resnet50": _timm("resnet50"),
    "tv-resnet50": _torchvision("resnet50"),
    "tv-mobilenet-v3": _torchvision("mobilenet_v3_large"),
}
HF_CASES = [n for n in CASES if not n.startswith(("timm-", "tv-"))]


def build_and_train(name, size, pool=None, steps=6, device="cpu", autocast=None):
    """`steps` AdamW steps of a fresh `CASES[name](size)` on one batch, under `pool` (or under identity
    saved-tensor hooks: autograd's saving runs the same code path): every loss, then every gradient,
    weight and optimizer state at the end. `autocast`: a dtype to run the forward in."""
    torch.manual_seed(0)
    model, batch, loss_of = CASES[name](size)
    model = model.to(device).train()
    inputs = batch(torch.Generator().manual_seed(1))
    inputs = inputs.to(device) if isinstance(inputs, torch.Tensor) else tuple(x.to(device) for x in inputs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(2)  # dropout: the same draws in every run
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with pool if pool is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            with torch.autocast(
                torch.device(device).type, autocast or torch.float32, enabled=autocast is not None
            ):
                loss = loss_of(model, inputs)
            loss.backward()
        losses.append(loss.detach())
        opt.step()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return losses + [p.grad for p in model.parameters()] + list(model.state_dict().values()) + state
