"""The HTML report rendered in headless Chromium (DOM and a screenshot), and the PNG."""

import html
import re
from collections import Counter

import pytest
from browser import dump_dom, screenshot
from pngread import color_counts, has_color_near, read_png
from trace_workload import EXPECTED_CATEGORY, Workload, make_allocator

import supermem
from supermem import cli
from supermem.trace.svg_plot import CATEGORY_COLORS
from supermem.units import format_bytes


def rgb(hex_color):
    return tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    alloc = make_allocator()
    w = Workload(alloc, layers=12, seed=3)
    with supermem.trace(tmp / "run.smtrace", allocators=[alloc], model=w.model, optimizer=w.opt):
        w.run(3)
    assert cli.main(["report", str(tmp / "run.smtrace"), "-o", str(tmp / "report.html"), "-q"]) == 0
    out = {"w": w, "tmp": tmp, "html": tmp / "report.html", "png": tmp / "report.png"}
    out["dom"] = dump_dom(out["html"])
    return out


def test_report_is_self_contained(report):
    text = report["html"].read_text()
    assert len(text) < 1 << 20
    # nothing is fetched: no external scripts, styles, images, fonts or imports
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert not re.search(r"""url\(\s*["']?(https?:)?//|import\s.*from\s*["']https?:|@import""", text)


def test_dom_after_scripts(report):
    dom = report["dom"]
    assert 'data-ready="1"' in dom  # the script ran to its end
    assert 'id="device-0"' in dom
    for cat in ("parameter", "gradient", "optimizer_state", "activation", "unknown"):
        assert f'class="area cat-{cat}"' in dom, cat
    assert 'class="line reserved"' in dom
    assert 'class="peak-marker"' in dom
    peak = report["w"].ledger.peak_live_bytes
    readout = re.search(r'id="readout-0">([^<]*)<', dom).group(1)
    assert f"active {format_bytes(peak)}" in html.unescape(readout)  # the read-out starts at the peak
    assert len(re.findall(r"<svg class=\"plot ", dom)) >= 3  # memory, fragmentation, pool


def test_peak_table_lists_exactly_the_blocks_live_at_the_peak(report):
    dom = report["dom"]
    body = re.search(r'<table class="peak">.*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
    rows = re.findall(r"<tr><td class=\"num\">([^<]*)</td><td>([^<]*)</td>", body)
    want = Counter(
        (format_bytes(size), EXPECTED_CATEGORY[role])
        for size, role in report["w"].ledger.live_at_peak.values()
    )
    assert Counter(rows) == want


def test_screenshot_is_not_blank(report):
    shot = screenshot(report["html"], report["tmp"] / "shot.png")
    w, h, rows = read_png(shot)
    assert (w, h) == (1000, 900)
    counts = color_counts(rows, step=2)
    total = sum(counts.values())
    white = sum(v for c, v in counts.items() if min(c) >= 250)
    assert white / total < 0.9, "the page is (almost) all white"
    assert len(counts) > 50
    for cat in ("parameter", "activation", "unknown"):
        assert has_color_near(counts, rgb(CATEGORY_COLORS[cat])), cat


def test_png_shows_the_categories(report):
    w, h, rows = read_png(report["png"].read_bytes())
    assert w == 1000 and h >= 300
    counts = color_counts(rows)
    for cat in ("parameter", "gradient", "optimizer_state", "activation", "unknown"):
        assert has_color_near(counts, rgb(CATEGORY_COLORS[cat]), tol=2), cat


def test_png_opens_in_a_real_decoder(report, tmp_path):
    page = tmp_path / "img.html"
    page.write_text(
        f'<img id=i src="{report["png"].resolve().as_uri()}">'
        "<script>const i=document.getElementById('i');"
        "i.onload=()=>document.body.dataset.size=i.naturalWidth+'x'+i.naturalHeight;"
        "i.onerror=()=>document.body.dataset.size='error';</script>"
    )
    dom = dump_dom(page)
    w, h, _ = read_png(report["png"].read_bytes())
    assert f'data-size="{w}x{h}"' in dom


def test_report_of_an_empty_trace(tmp_path):
    alloc = make_allocator()
    with supermem.trace(tmp_path / "e.smtrace", allocators=[alloc]):
        pass
    assert cli.main(["report", str(tmp_path / "e.smtrace"), "-q"]) == 0
    dom = dump_dom(tmp_path / "e.html")
    assert 'data-ready="1"' in dom
