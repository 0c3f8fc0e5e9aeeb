"""Who owns the peak, on real models on CPU: each block's category and module, recorded with no change to
the training code (allocations from torch.profiler's memory events: supermem.trace.cpu_source). The
expected bytes come from the model, the optimizer and autograd's saves, never from the trace tool."""

import pytest
import torch
from corpus import CASES
from owners_workload import parameter_bytes_by_module, print_peak_table, saved_bytes, storages, train_traced
from small_models import ResNet

from supermem.trace.analysis import analyze
from supermem.trace.breakdown import owners_at_peak
from supermem.trace.cpu_source import ProfiledCPU
from supermem.trace.owners import stack_owners
from supermem.trace.timeline import lifetimes
from supermem.trace.torch_snapshot import to_torch_snapshot


def _small_resnet(size):
    def batch(g):
        return torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 10, (2,), generator=g)

    return ResNet(), batch, lambda m, x: torch.nn.functional.cross_entropy(m(x[0]), x[1])


BUILDS = {
    "gpt2": CASES["gpt2"],
    "llama": CASES["llama"],
    "timm-resnet50": CASES["timm-resnet50"],
    "resnet": _small_resnet,  # timm's stand-in where timm is not installed
}


@pytest.fixture(scope="module", params=list(BUILDS))
def traced(request):
    name = request.param
    src = ProfiledCPU()
    trace, model, opt, inputs, loss_of = train_traced(lambda: BUILDS[name]("tiny"), "cpu", [src])
    return name, trace, analyze(trace), model, opt, inputs, loss_of


def _owners(trace, category):
    rows, _ = owners_at_peak(trace, 0)
    return {r["module"]: r["bytes"] for r in rows if r["category"] == category}


def test_the_peak_is_named_and_its_activations_placed(traced):
    name, trace, rep, *_ = traced
    print_peak_table(name, rep)
    d = rep.devices[0]
    assert not d.peak_owners_other["rows"] or d.peak_owners_other["bytes"] < d.peak_bytes
    assert d.coverage["categorised"] >= 0.95
    assert d.coverage["activation_bytes"] > 0
    assert d.coverage["activation_with_module"] >= 0.90


def test_parameters_by_module_are_the_models(traced):
    name, trace, rep, model, *_ = traced
    expected = parameter_bytes_by_module(model)
    got = _owners(trace, "parameter")
    assert got == expected


def test_optimizer_state_is_adams_two_moments_per_parameter(traced):
    name, trace, rep, model, opt, *_ = traced
    state = storages([v for s in opt.state.values() for v in s.values() if v.numel() > 1])
    params = {p.untyped_storage().nbytes() for p in model.parameters()}
    assert params  # (AdamW keeps exp_avg and exp_avg_sq, each a parameter's size)
    assert sum(_owners(trace, "optimizer_state").values()) == sum(state.values())
    assert sum(state.values()) == 2 * sum(storages(model.parameters()).values())


def test_activations_are_what_autograd_saved_in_the_last_forward(traced):
    name, trace, rep, model, opt, inputs, loss_of = traced
    lt = lifetimes(trace, 0)
    modules, phases = stack_owners(trace)
    t = trace.cols["time_ns"]
    act = trace.categories.index("activation")
    forward_starts = [
        int(t[i])
        for i in range(len(t))
        if trace.actions[int(trace.cols["action"][i])] == "phase"
        and trace.strings[int(trace.cols["detail"][i])] == "forward"
    ]
    last = forward_starts[-1]
    began = (lt.start >= 0) & (t[lt.start.clip(0)] >= last)
    traced_bytes = int(lt.size[began & (lt.category == act)].sum())
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    assert traced_bytes == saved_bytes(model, inputs, loss_of)


def test_gradients_belong_to_their_parameters_modules(traced):
    name, trace, rep, model, *_ = traced
    lt = lifetimes(trace, 0)
    modules, _ = stack_owners(trace)
    grad = trace.categories.index("gradient")
    owners = set(parameter_bytes_by_module(model))
    got = {modules[int(s)] for s in lt.stack[lt.category == grad]}
    assert got and got <= owners


def test_every_module_path_names_a_module_of_the_model(traced):
    name, trace, rep, model, *_ = traced
    names = {n for n, _ in model.named_modules() if n} | {type(model).__name__}
    modules, _ = stack_owners(trace)
    lt = lifetimes(trace, 0)
    used = {modules[int(s)] for s in lt.stack if s >= 0} - {""}
    assert used and all(u in names or u.rpartition(".")[0] in names for u in used), used - names


def test_steps_and_phases(traced):
    name, trace, rep, *_ = traced
    d = rep.devices[0]
    full = [(s["step"], s["partial"]) for s in d.steps if not s["partial"]]
    assert full == [(1, False), (2, False)]  # (and the part after the last step, if it moved memory)
    assert all(s["owners"] and s["peak_bytes"] <= d.peak_bytes for s in d.steps)
    assert max(s["peak_bytes"] for s in d.steps) == d.peak_bytes
    assert {p for _, _, p in d.phase_spans} == {"forward", "backward", "optimizer"}


def test_the_export_keeps_module_and_phase_as_frames(traced):
    """memory_viz shows the same owners: each alloc's frames start with its module and phase."""
    name, trace, rep, model, *_ = traced
    snap = to_torch_snapshot(trace)
    entries = snap["device_traces"][0]
    allocs = [e for e in entries if e["action"] == "alloc" and e.get("category") == "activation"]
    names = {n for n, _ in model.named_modules() if n} | {type(model).__name__}
    heads = [[f for f in e["frames"][:2] if f["filename"] in ("<module>", "<phase>")] for e in allocs]
    placed = [h[0]["name"] for h in heads if h[0]["filename"] == "<module>"]
    assert placed and set(placed) <= names  # (a loss computed outside the model: no module, a phase)
    assert {h[-1]["filename"] for h in heads} == {"<phase>"} and {h[-1]["name"] for h in heads} == {"forward"}


def test_gradients_are_observed_after_the_optimizer_gains_a_parameter_group():
    """before_step looks its parameters' paths up again when the optimizer's lists change: a group added
    after the first steps has its gradients observed, with their module's path, at the next step."""
    from supermem.trace.attribution import ModelScanner, Observations

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    obs = Observations()
    scanner = ModelScanner(obs, [model], [opt], find=False)
    scanner.scan()

    def step_gradients() -> dict[int, str]:
        model(torch.ones(3, 4)).sum().backward()
        obs.rows.clear()
        scanner.before_step(opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {r[1]: r[4] for r in obs.rows if r[2] == "gradient"}

    def storage(p: torch.Tensor) -> int:
        return p.grad.untyped_storage().data_ptr()

    for _ in range(2):
        assert set(step_gradients().values()) == {"0"}
    opt.add_param_group({"params": list(model[1].parameters())})
    model(torch.ones(3, 4)).sum().backward()
    want = {storage(p): name.rpartition(".")[0] for name, p in model.named_parameters()}
    obs.rows.clear()
    scanner.before_step(opt)
    assert {r[1]: r[4] for r in obs.rows if r[2] == "gradient"} == want
