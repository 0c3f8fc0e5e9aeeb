"""The report's answer to "why is my peak X": the owners table and treemap, phases on the timeline, each
step's peak and the what-if, rendered in headless Chromium under the page's Content-Security-Policy."""

import re

import numpy as np
import pytest
import torch
from browser import dump_dom
from owners_workload import train_traced
from small_models import ResNet

from supermem import cli
from supermem.trace import format as fmt
from supermem.trace.breakdown import phase_spans
from supermem.trace.cpu_source import ProfiledCPU
from supermem.trace.phases import PHASE_ACTION
from supermem.trace.table import Trace, empty_columns


def _resnet():
    def batch(g):
        return torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 10, (2,), generator=g)

    return ResNet(), batch, lambda m, x: torch.nn.functional.cross_entropy(m(x[0]), x[1])


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("owners")
    trace = train_traced(_resnet, "cpu", [ProfiledCPU()], steps=3)[0]
    fmt.write(trace, tmp / "run.smtrace")
    out = tmp / "run.html"
    assert cli.main(["report", str(tmp / "run.smtrace"), "-o", str(out), "--budget", "64KiB", "-q"]) == 0
    return out


def test_the_page_says_who_holds_the_peak(page):
    dom = dump_dom(page)
    assert 'data-ready="1"' in dom  # its script ran under the policy (nothing inline was added)
    owners = re.search(r'<table class="owners" id="owners-0">.*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
    rows = re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td>", owners)
    assert ("activation", "blocks.0.c1") in rows and ("parameter", "stem.0") in rows
    assert len(re.findall(r'<rect class="tile"', dom)) == len(re.findall(r"<tr><td>", owners))
    for phase in ("forward", "backward", "optimizer"):
        assert f'class="phase-{phase}"' in dom, phase
    steps = re.search(r'<table class="steps" id="steps-0">.*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
    assert [int(s) for s in re.findall(r"<tr><td>(\d+)</td>", steps)][:3] == [1, 2, 3]
    assert 'id="what-if"' in dom and "does not fit" in dom  # 64 KiB: under the floor
    assert re.search(r"100\.0% of the peak in a named category", dom)


def test_phase_bands_stay_bounded_however_many_steps():
    trace = Trace()
    n = 4000  # a thousand steps' phases
    cols = empty_columns(n)
    cols["time_ns"] = np.arange(n, dtype=np.int64) * 1000
    cols["action"][:] = trace.action_id(PHASE_ACTION)
    cols["device"][:] = -1
    names = ["forward", "backward", "", "optimizer"]
    detail = [trace.string_id(names[i % 4]) if names[i % 4] else -1 for i in range(n)]
    cols["detail"] = np.array(detail, np.int32)
    trace.cols = cols
    spans = phase_spans(trace, 0, n * 1000, 1000)
    assert 0 < len(spans) <= 1000
    assert all(0 <= a <= b < 1000 for a, b, _ in spans)
