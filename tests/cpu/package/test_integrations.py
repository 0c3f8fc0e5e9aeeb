"""supermem.integrations: transformers' Trainer, Lightning and Accelerate train a tiny CPU model under
a pool, under each live policy, with a budget that makes the pool act: the losses and the weights are
bitwise those of the same training without it, and the pool counts a step per backward (6 optimizer
steps of 2 micro-batches: 12)."""

import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import supermem
from supermem.policies import live_names

OPTIMIZER_STEPS, ACCUMULATE, BATCH = 6, 2, 8
SAMPLES = OPTIMIZER_STEPS * ACCUMULATE * BATCH


class Net(nn.Module):
    """An MLP whose saved activations the pool can move (CPU: min_bytes 0); keeps every loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
        )
        self.losses = []

    def forward(self, x, labels=None):
        loss = F.cross_entropy(self.layers(x), labels)
        self.losses.append(loss.detach().clone())
        return {"loss": loss}


def samples():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, 32, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(SAMPLES)]


def options(policy):
    """A budget under the step's saved bytes (about 10 KiB), above what a plan can reach (2 KiB)."""
    return {"budget": "4KiB", "policy": policy, "host_limit": "64MiB"}


def acted(stats):
    """What the pool did to saved tensors: offloaded, dropped or rebuilt them, or ran calls light."""
    keys = ("offloads", "dropped", "recomputes", "light_calls", "lean_drops", "replays")
    return sum(stats[k] for k in keys)


def same_training(a, b):
    (losses_a, params_a), (losses_b, params_b) = a, b
    assert len(losses_a) == len(losses_b) == OPTIMIZER_STEPS * ACCUMULATE
    assert all(torch.equal(x, y) for x, y in zip(losses_a, losses_b))
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))


def test_importing_supermem_imports_no_framework():
    code = (
        "import sys, supermem, supermem.integrations; supermem.pool\n"
        "names = ('transformers', 'lightning', 'pytorch_lightning', 'accelerate')\n"
        "print(sorted(m for m in names if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# ------------------------------------------------------------------ transformers' Trainer


def hf_train(tmp_path, callbacks=()):
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=OPTIMIZER_STEPS,
        learning_rate=0.1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        dataloader_pin_memory=False,
        seed=0,
    )
    model = Net()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=samples(), callbacks=list(callbacks))
    trainer.train()
    return model.losses, [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def hf_plain(tmp_path_factory):
    return hf_train(tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("policy", live_names())
def test_hf_trainer_callback_is_bitwise_and_counts_micro_batches(policy, hf_plain, tmp_path):
    from supermem.integrations.hf import PoolCallback

    callback = PoolCallback(**options(policy))
    pooled = hf_train(tmp_path, [callback])
    same_training(hf_plain, pooled)
    s = callback.pool.stats()
    assert acted(s) > 0, s
    assert s["steps"] == OPTIMIZER_STEPS * ACCUMULATE  # a step per backward: 12
    assert not callback.steps.inside
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # the pool's hooks are off
    callback.pool.close()


# ------------------------------------------------------------------ Lightning


def lightning_train(callbacks=()):
    pl = pytest.importorskip("pytorch_lightning")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    loader = torch.utils.data.DataLoader(samples(), batch_size=BATCH, shuffle=False)
    trainer = pl.Trainer(
        max_steps=OPTIMIZER_STEPS,
        accumulate_grad_batches=ACCUMULATE,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, loader)
    return module.net.losses, [p.detach().clone() for p in module.parameters()]


@pytest.fixture(scope="module")
def lightning_plain():
    return lightning_train()


@pytest.mark.parametrize("policy", live_names())
def test_lightning_callback_is_bitwise_and_counts_micro_batches(policy, lightning_plain):
    from supermem.integrations.lightning import PoolCallback

    callback = PoolCallback(**options(policy))
    pooled = lightning_train([callback])
    same_training(lightning_plain, pooled)
    s = callback.pool.stats()
    assert acted(s) > 0, s
    assert s["steps"] == OPTIMIZER_STEPS * ACCUMULATE
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    callback.pool.close()


# ------------------------------------------------------------------ Accelerate


def accelerate_train(step):
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(samples(), batch_size=BATCH, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for batch in loader:
        with step(accelerator, model):
            loss = model(**batch)["loss"]
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    return model.losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", live_names())
def test_accelerate_pool_step_is_bitwise_and_counts_micro_batches(policy):
    pytest.importorskip("accelerate")
    from supermem.integrations.accelerate import pool_step

    plain = accelerate_train(lambda accelerator, model: accelerator.accumulate(model))
    pooled = accelerate_train(lambda accelerator, model: pool_step(accelerator, model, **options(policy)))
    same_training(plain, pooled)
    p = supermem.pool(**options(policy), device="cpu")  # the pool each step found by its options
    s = p.stats()
    assert acted(s) > 0, s
    assert s["steps"] == OPTIMIZER_STEPS * ACCUMULATE
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    p.close()
