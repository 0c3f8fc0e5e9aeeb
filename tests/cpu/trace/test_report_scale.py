"""A 10^6-event trace: recorded, written, reported and rendered in bounded time and size, with the peak
table still exact."""

import random
import re
import time

import pytest
from browser import dump_dom

import supermem
from supermem import cli
from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.trace.analysis import analyze
from supermem.trace.loader import load
from supermem.units import format_bytes

PAIRS = 495_000  # alloc + free each: 990,000 events plus segment events, under the 10^6 ring
SIZES = [512, 4096, 65536, 1 << 20, 2 << 20, 12 << 20]  # already rounded: block size == request


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("big")
    alloc = CachingAllocator(SimulatedDevice("64GiB"))
    for s in SIZES:
        a = alloc.malloc(s)
        assert alloc.allocation_size(a) == s
        alloc.free(a)
    rng = random.Random(7)
    sizes = [rng.choice(SIZES) for _ in range(8192)]
    live: list[tuple[int, int]] = []
    total = peak = peak_blocks = 0
    t0 = time.perf_counter()
    with supermem.trace(
        tmp / "big.smtrace", allocators=[alloc], capacity_events=1_000_000, model=[], optimizer=[]
    ):
        m, f = alloc.malloc, alloc.free
        for i in range(PAIRS):
            s = sizes[i & 8191]
            live.append((m(s), s))
            total += s
            if total > peak:
                peak, peak_blocks = total, len(live)
            if len(live) > 400:
                a, s = live.pop(rng.randrange(len(live)))
                f(a)
                total -= s
        for a, _ in live:
            f(a)
    record_s = time.perf_counter() - t0
    return {
        "path": tmp / "big.smtrace",
        "tmp": tmp,
        "peak": peak,
        "peak_blocks": peak_blocks,
        "record_s": record_s,
    }


def test_a_million_events_are_kept_and_written_compactly(big):
    tr = load(big["path"])
    assert 10**6 - 10_000 < len(tr) <= 10**6
    assert tr.meta["dropped_events"] == {"0": 0}
    assert big["path"].stat().st_size < 20 * len(tr)  # bytes per event on disk
    assert big["record_s"] < 60


def test_report_of_a_million_events_is_bounded_and_exact(big, capsys):
    t0 = time.perf_counter()
    assert cli.main(["report", str(big["path"]), "-o", str(big["tmp"] / "big.html")]) == 0
    report_s = time.perf_counter() - t0
    out = capsys.readouterr().out
    assert report_s < 30, f"report took {report_s:.1f} s"
    assert (big["tmp"] / "big.html").stat().st_size < 1 << 20  # downsampled: does not grow with the trace
    assert f"peak active {format_bytes(big['peak'])}" in out
    assert f"{big['peak_blocks']} blocks live at the peak" in out
    rep = analyze(load(big["path"]), max_blocks=10**6)
    assert len(rep.devices[0].peak_blocks) == big["peak_blocks"]  # full detail at the peak
    assert sum(b["size"] for b in rep.devices[0].peak_blocks) == big["peak"]


def test_browser_renders_it_quickly(big):
    html = big["tmp"] / "big.html"
    if not html.exists():
        assert cli.main(["report", str(big["path"]), "-o", str(html), "-q"]) == 0
    t0 = time.perf_counter()
    dom = dump_dom(html, timeout_s=60)
    render_s = time.perf_counter() - t0
    assert 'data-ready="1"' in dom
    assert render_s < 20, f"chromium took {render_s:.1f} s"
    assert len(re.findall(r"<tr><td class=\"num\">", dom)) == min(500, big["peak_blocks"])
