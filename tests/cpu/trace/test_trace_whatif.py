"""`supermem report --budget`: the floor no treatment goes under, on a model whose bytes are counted by
hand, and the plan's verdict either side of it."""

import pytest
import torch
from owners_workload import train_traced

from supermem import cli
from supermem.trace import format as fmt
from supermem.trace.cpu_source import ProfiledCPU
from supermem.trace.whatif import what_if

D, H, B = 32, 512, 64
PARAM_BYTES = (D * H + H + H * D + D) * 4  # two Linears' weights and biases, float32
HIDDEN_BYTES = B * H * 4  # the first Linear's output in forward, its gradient in backward


def _mlp():
    model = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, D))

    def batch(g):
        return torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)

    return model, batch, lambda m, x: torch.nn.functional.mse_loss(m(x[0]), x[1])


@pytest.fixture(scope="module")
def trace():
    def sgd(params):  # momentum, one tensor at a time: a buffer a parameter, no scratch
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=False)

    return train_traced(_mlp, "cpu", [ProfiledCPU()], steps=3, optimizer=sgd)[0]


def test_the_floor_is_parameters_gradients_state_and_the_largest_temporary(trace):
    w = what_if(trace, 1 << 30)
    assert w.floor_parts == {
        "parameter": PARAM_BYTES,
        "gradient": PARAM_BYTES,
        "optimizer_state": PARAM_BYTES,  # momentum buffers
        "largest_unmovable": HIDDEN_BYTES,
    }
    assert w.floor_bytes == 3 * PARAM_BYTES + HIDDEN_BYTES
    assert w.largest_unmovable["bytes"] == HIDDEN_BYTES


def test_a_budget_under_the_floor_does_not_fit_and_one_over_the_peak_moves_nothing(trace):
    w = what_if(trace, 3 * PARAM_BYTES + HIDDEN_BYTES - 1)
    assert not w.fits and any("floor" in n for n in w.notes)
    w = what_if(trace, 1 << 30)
    assert w.fits and w.peak_bytes <= 1 << 30
    assert w.by_module and not any(r["offload_bytes"] for r in w.by_module)
    assert w.predicted_peak_bytes <= w.peak_bytes


def test_a_step_that_moves_nothing_still_pays_the_pools_host_work_on_its_saves(trace):
    """Traced without a pool, a step's saves cost the host nothing; under one each is an entry
    (costs.SAVE_HOST_PRIOR_S): a budget over the peak predicts the traced step plus that, for the two
    activations this MLP saves (ReLU's output, the second Linear's input; that Linear's output, the
    loss's input)."""
    from supermem import costs
    from supermem.trace.step_profile import step_profile

    w = what_if(trace, 1 << 30)
    made = step_profile(trace, 0)
    assert [s.nbytes for s in made.profile.saved] == [HIDDEN_BYTES, B * D * 4]
    assert w.pool_host_s == pytest.approx(len(made.profile.saved) * costs.SAVE_HOST_PRIOR_S)
    assert w.predicted_step_s == pytest.approx(w.measured_step_s + w.pool_host_s)


def test_report_budget_prints_the_verdict(trace, tmp_path, capsys):
    path = tmp_path / "mlp.smtrace"
    fmt.write(trace, path)
    assert cli.main(["report", str(path), "--budget", "1KiB", "--no-png", "-q"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "floor" in out
    html = (tmp_path / "mlp.html").read_text()
    assert 'id="what-if"' in html and "does not fit" in html


def test_copies_are_priced_at_the_link_the_recording_probed(trace, tmp_path):
    """A GPU recording probes its link (an H200's: 54-55 GB/s; the default a pool prices copies at
    before it probes is 25) and the what-if prices the plan's copies at it; a CPU trace's copies are
    host memcpys that block the step, as the pool's CPU offload does."""
    import copy

    from supermem import costs
    from supermem.trace.format import TraceFormatError
    from supermem.trace.loader import load
    from supermem.trace.step_profile import step_profile
    from supermem.trace.whatif import summary

    profile = step_profile(trace, 0).profile
    assert profile.sync_copies and profile.link_bytes_per_s == costs.CPU_COPY_BYTES_PER_S
    probed = copy.copy(trace)
    probed.meta = {**trace.meta, "link_bytes_per_s": {"0": 54e9}}
    path = tmp_path / "probed.smtrace"
    fmt.write(probed, path)
    probed = load(path)
    profile = step_profile(probed, 0).profile
    assert profile.link_bytes_per_s == 54e9 and not profile.sync_copies
    assert "54.0 GB/s, probed when traced" in summary(what_if(probed, 1 << 30))
    probed.meta["link_bytes_per_s"] = {"0": -1.0}
    fmt.write(probed, path)
    with pytest.raises(TraceFormatError, match="link_bytes_per_s"):
        load(path)


def test_the_profile_reaches_the_steps_peak_where_backward_frees_a_save_before_it():
    """exp's backward makes its gradient (B x V), then frees the output exp saved (B x V): the step's
    peak is reached between the forward's last event and that free, while the free's event already
    reads one B x V less. The profile counts what rises between events at the event before, so its
    untreated curve reaches the recorded peak; counted at the free, it stopped B x V short."""
    from supermem.trace.step_profile import step_profile

    V = 4096

    def build():
        model = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, V))

        def batch(g):
            return torch.randn(B, D, generator=g), torch.zeros(1)

        return model, batch, lambda m, x: m(x[0]).exp().mean()

    trace = train_traced(
        build, "cpu", [ProfiledCPU()], steps=3, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3)
    )[0]
    made = step_profile(trace, 0)
    p = made.profile
    untreated = [b + t for b, t in zip(p.base_bytes, p.transient_bytes, strict=True)]
    assert max(untreated) == made.step_peak
    big = B * V * 4
    assert max(s.nbytes for s in p.saved) == big  # exp's output
    assert max(p.base_bytes) - p.base_bytes[p.backward_event] >= 0.99 * big  # freed first in backward
    assert max(untreated) >= max(p.base_bytes) + 0.99 * big  # its gradient, made before
