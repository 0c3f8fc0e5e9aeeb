"""`supermem bench train --sweep`'s fair baselines (issue 39): each saver row also with the chunked loss, the
planned pool around a compiled model, the partitioner's own offload. No process runs here."""

import pytest
import torch

from supermem import torch_private as tp
from supermem.bench import train_worker
from supermem.bench.models import PRESETS
from supermem.bench.train_modes import BLOCK_MODELS, COMPILE_BUDGETS, SWEEP_BUDGETS, sweep_modes

LABELS = [f"{b:.0%}" for b in SWEEP_BUDGETS] + ["ckpt peak"]
CKPTS = ["checkpoint", "checkpoint reentrant"] + [
    f"checkpoint first {p}" for p in ("quarter", "half", "three quarters")
]


def _by_name(device):
    return {m.name: m for m in sweep_modes(device)}


def test_every_checkpoint_compile_and_pool_row_also_runs_with_the_chunked_loss():
    modes = _by_name("cuda")
    plain = CKPTS + [f"compile budget {b}" for b in COMPILE_BUDGETS]
    plain += [f"{p} {label}" for p in ("cost_aware", "planned", "compiled planned") for label in LABELS]
    if tp.has_partitioner_offload():
        plain.append("compile partitioner offload")
    for name in plain:
        m, c = modes[name], modes[f"{name} + chunked loss"]
        assert (c.allocator, c.saver, c.budget, c.models) == (m.allocator, m.saver, m.budget, ("gpt",))
        assert c.options == {**m.options, "loss": "chunked"} and c.loss_kind == "chunked"
        assert m.loss_kind == "plain" and c.compiled == m.compiled
        # a fraction of native's peak (the plain rows' bytes), or the chunked checkpoint's peak
        assert c.budget_of == {"native": "native", "checkpoint": "checkpoint + chunked loss"}[m.budget_of]
    names = list(modes)
    for i, m in enumerate(modes.values()):  # each reference row runs before the rows it gives a budget
        assert m.budget is None or m.budget_of in names[:i], m.name


def test_the_compiled_pool_rows_wrap_a_compiled_model_from_compile_budget_1():
    for device, labels in (("cuda", LABELS), ("cpu", ["ckpt peak"])):  # CPU: one inductor build
        modes = _by_name(device)
        rows = [m for m in modes.values() if m.name.startswith("compiled planned") and m.loss_kind == "plain"]
        assert [m.name for m in rows] == [f"compiled planned {label}" for label in labels]
        for m in rows:
            assert (m.allocator, m.saver, m.models, m.compiled) == ("supermem", "pool", BLOCK_MODELS, True)
            assert m.options == {"policy": "planned", "compile": True, "memory_budget": 1.0}
            assert m.budget_of == ("checkpoint" if m.name.endswith("ckpt peak") else "native")
    # the worker compiles the model under the pool's saver (torch.compile is lazy: nothing builds here)
    spec = {"saver": "pool", **_by_name("cpu")["compiled planned ckpt peak"].options}
    model = PRESETS["gpt-quick"].build()
    assert train_worker.compiled(spec)
    assert isinstance(train_worker._prepare(model, spec), torch._dynamo.eval_frame.OptimizedModule)


@pytest.fixture
def functorch_config(monkeypatch):
    """torch._functorch.config's keys the bench sets, restored after the test."""
    import torch._functorch.config as config

    keys = ["activation_memory_budget", "joint_custom_pass"]
    keys += [k for k in dir(config) if k.startswith(("enable_activation_offloading", "activation_offload"))]
    keys += [k for k in dir(config) if k == "activation_reload_prefetch"]
    for k in keys:
        monkeypatch.setattr(config, k, getattr(config, k))
    return config


@pytest.mark.skipif(not tp.has_partitioner_offload(), reason="this torch has no partitioner offload")
def test_the_partitioner_offload_row_marks_every_node_of_a_compiled_model_cuda_only(functorch_config):
    m = _by_name("cuda")["compile partitioner offload"]
    assert (m.allocator, m.saver, m.models, m.compiled) == ("native", "compile", BLOCK_MODELS, True)
    assert m.options == {"memory_budget": 1.0, "partitioner_offload": True}
    assert not any("partitioner offload" in name for name in _by_name("cpu"))
    train_worker._prepare(PRESETS["gpt-quick"].build(), {"saver": "compile", **m.options})
    config = functorch_config
    assert config.enable_activation_offloading and config.activation_offload_separate_stream
    graph = torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    assert all(n.meta.get("should_offload") for n in config.joint_custom_pass(graph, None).graph.nodes)
