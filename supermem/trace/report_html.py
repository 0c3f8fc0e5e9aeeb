"""`supermem report`: one self-contained HTML file (inline CSS, SVG and a little JS; no network).

The plots are SVG drawn here from the downsampled series (a fixed number of points however long the
trace), so a 10^6-event trace gives a page of a few hundred KB that opens at once. The JS only adds a
hover read-out and a filter for the peak table; the page is complete without it.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import os
from pathlib import Path
from typing import Any

from ..units import format_bytes
from . import treemap
from .analysis import DeviceReport, Report, analyze, summary_text
from .breakdown import PHASE_COLORS
from .output import check_output, write_bytes
from .owners import rule_note
from .svg_plot import RESERVED_COLOR, TOP, H, Plot, attr, color_of, css_token
from .table import Trace

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:16px;color:#222}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 6px;border-bottom:1px solid #ccc}
h3{font-size:15px;margin:18px 0 6px} .meta{color:#555;margin:0} .note{background:#fff6d5;padding:6px 10px}
svg.plot{width:100%;height:auto;display:block;background:#fff} svg text{font-size:11px;fill:#444}
.grid{stroke:#eee} .axis{stroke:#888} .cursor{stroke:#000;stroke-width:1}
.legend span{display:inline-block;margin-right:14px} .legend svg{margin-right:4px;vertical-align:-1px}
.readout{font:12px monospace;min-height:1.4em;color:#333}
table{border-collapse:collapse;width:100%;font-size:13px} td,th{border-bottom:1px solid #eee;padding:3px 6px;
text-align:left;vertical-align:top} td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
pre{margin:2px 0;font-size:12px;white-space:pre-wrap} details summary{cursor:pointer;color:#456}
.kv td:first-child{color:#555;width:220px} input.filter{margin:4px 0;padding:3px;width:320px}
"""

JS = r"""
(function () {
  const data = JSON.parse(document.getElementById('report-data').textContent);
  const fmt = b => {
    const u = ['bytes', 'KiB', 'MiB', 'GiB', 'TiB']; let i = 0; let v = b;
    while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return i ? v.toFixed(2) + ' ' + u[i] : Math.round(v) + ' bytes';
  };
  function show(dev, i) {
    const d = data.devices[dev];
    if (!d || i < 0 || i >= d.active.length) return;
    const parts = ['t=' + (i * data.bin_s).toPrecision(4) + (data.time_is_index ? ' (events/1e6)' : ' s'),
                   'active ' + fmt(d.active[i]), 'reserved ' + fmt(d.reserved[i])];
    for (const [c, v] of Object.entries(d.by_category)) if (v[i]) parts.push(c + ' ' + fmt(v[i]));
    document.getElementById('readout-' + d.device).textContent = parts.join('  |  ');
  }
  data.devices.forEach((d, dev) => {
    const sec = document.getElementById('device-' + d.device);
    sec.querySelectorAll('svg.plot').forEach(svg => {
      const cursor = svg.querySelector('.cursor');
      svg.addEventListener('mousemove', ev => {
        const r = svg.getBoundingClientRect();
        const x = (ev.clientX - r.left) / r.width * %(W)d;
        const frac = (x - %(LEFT)d) / (%(W)d - %(LEFT)d - %(RIGHT)d);
        const i = Math.round(frac * (d.active.length - 1));
        if (i < 0 || i >= d.active.length) return;
        cursor.setAttribute('x1', x); cursor.setAttribute('x2', x);
        cursor.setAttribute('visibility', 'visible');
        show(dev, i);
      });
      svg.addEventListener('mouseleave', () => cursor.setAttribute('visibility', 'hidden'));
    });
    show(dev, d.peak_bin);
    const filter = document.getElementById('filter-' + d.device);
    if (filter) filter.addEventListener('input', () => {
      const q = filter.value.toLowerCase();
      sec.querySelectorAll('table.peak tbody tr').forEach(tr => {
        tr.style.display = tr.textContent.toLowerCase().includes(q) ? '' : 'none';
      });
    });
  });
  document.body.dataset.ready = '1';
})();
"""


def render(rep: Report, title: str = "") -> str:
    """The report as an HTML string. Every string from the trace is escaped; the page's policy (CSP)
    lets only its own style and script (by hash) run, and nothing load from anywhere."""
    from .svg_plot import LEFT, RIGHT, W

    title = title or rep.source or "trace"
    js = JS % {"W": W, "LEFT": LEFT, "RIGHT": RIGHT}
    policy = (
        f"default-src 'none'; style-src {_sha256(CSS)}; script-src {_sha256(js)}; "
        "base-uri 'none'; form-action 'none'"
    )
    out = [
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">',
        f"<title>supermem memory report: {html.escape(title)}</title><style>{CSS}</style></head><body>",
        "<h1>supermem memory report</h1>",
        f'<p class="meta" id="summary">{html.escape(_header_line(rep))}</p>',
    ]
    for note in rep.notes:
        out.append(f'<p class="note">{html.escape(note)}</p>')
    if not rep.devices:
        out.append('<p class="note" id="empty">This trace has no device events and no snapshot.</p>')
    for w in rep.what_if:
        out.append(_what_if_section(w))
    for d in rep.devices:
        out.append(_device_section(rep, d))
    out.append(f"<h2>Summary (text)</h2><pre id=summary-text>{html.escape(summary_text(rep))}</pre>")
    payload = {
        "bin_s": rep.bin_s,
        "time_is_index": rep.time_is_index,
        "devices": [
            {
                "device": d.device,
                "active": d.active,
                "reserved": d.reserved,
                "by_category": d.by_category,
                "peak_bin": _peak_bin(rep, d),
            }
            for d in rep.devices
        ],
    }
    # Category names are keys here: no "<" may reach the page, or a name could end the block.
    blob = json.dumps(payload, separators=(",", ":"))
    blob = blob.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    out.append(f'<script id="report-data" type="application/json">{blob}</script>')
    out.append(f"<script>{js}</script>")
    out.append("</body></html>")
    return "".join(out)


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _swatch(color: str, line: bool = False) -> str:
    """A legend's colour square (SVG: the policy allows no style attributes)."""
    shape = 'y="4.5" width="11" height="2"' if line else 'width="11" height="11"'
    return f'<svg width="11" height="11"><rect {shape} fill="{attr(color)}"/></svg>'


def _header_line(rep: Report) -> str:
    m = rep.meta
    bits = [f"{rep.num_events} events", f"{len(rep.devices)} device(s)"]
    bits.append(f"{rep.span_s * 1e6:.0f} events" if rep.time_is_index else f"{rep.span_s:.3f} s")
    if m.get("ranks"):  # several ranks merged (supermem.trace.ranks)
        bits.append("ranks " + ", ".join(f"{r['rank']} ({r['file']})" for r in m["ranks"]))
    elif m.get("world_size", 1) > 1:
        bits.append(f"rank {m.get('rank', 0)} of {m['world_size']}")
    if m.get("pid"):
        bits.append(f"pid {m['pid']}")
    if m.get("argv"):
        bits.append("argv: " + " ".join(map(str, m["argv"]))[:200])
    if rep.source:
        bits.insert(0, rep.source)
    return " · ".join(bits)


def _peak_bin(rep: Report, d: DeviceReport) -> int:
    if d.peak_time_s is None:
        return 0
    return min(rep.width - 1, int(d.peak_time_s / rep.bin_s)) if rep.bin_s else 0


def _x_label(rep: Report):
    if rep.time_is_index:
        return lambda x: f"{x * 1e6:.0f}"
    return lambda x: f"{x:.3g} s" if x >= 1 or x == 0 else f"{x * 1e3:.3g} ms"


def _device_section(rep: Report, d: DeviceReport) -> str:
    cap = d.limit_bytes or d.total_bytes
    head = f"Device {d.device}" + (f" ({html.escape(d.name)})" if d.name else "")
    if cap:
        head += f" — {'limit' if d.limit_bytes else 'capacity'} {format_bytes(cap)}"
    dev = int(d.device)
    parts = [f'<section class="device" id="device-{dev}" data-device="{dev}"><h2>{head}</h2>']
    rows = [
        ("peak active", format_bytes(d.peak_bytes) + _at(rep, d.peak_time_s)),
        (
            "peak reserved",
            format_bytes(d.peak_reserved_bytes) + ("" if d.reserved_known else " (lower bound)"),
        ),
        ("blocks live at the peak", str(d.peak_num_blocks)),
        (
            "events",
            str(d.num_events) + (f" ({d.dropped_events} older ones overwritten)" if d.dropped_events else ""),
        ),
    ]
    if d.reserved_at_peak_bytes:
        idle = max(d.reserved_at_peak_bytes - d.peak_bytes, 0)
        share = idle / d.reserved_at_peak_bytes * 100
        rows.append(
            ("reserved, holding no block, at the peak", f"{format_bytes(idle)} ({share:.1f}% of reserved)")
        )
    if d.max_idle_reserved_bytes:
        rows.append(("reserved, holding no block, at most", format_bytes(d.max_idle_reserved_bytes)))
    if d.ooms:
        rows.append(("OOMs", str(len(d.ooms))))
    parts.append(
        '<table class="kv">' + "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows) + "</table>"
    )

    n = len(d.active)
    x_label = _x_label(rep)
    # Memory over time, stacked by category, with reserved on top.
    y_max = max(max(d.reserved, default=0), max(d.active, default=0), cap if cap and d.ooms else 0) * 1.05
    p = Plot(n, y_max, "memory", x_label=x_label, x_max=rep.span_s)
    lower = [0] * n
    legend = []
    for i, (cat, vals) in enumerate(d.by_category.items()):
        upper = [a + b for a, b in zip(lower, vals, strict=True)]
        p.area(lower, upper, color_of(cat, i), f"cat-{css_token(cat)}", cat)
        legend.append((cat, color_of(cat, i)))
        lower = upper
    p.line(d.reserved, RESERVED_COLOR, "reserved")
    for b0, b1, phase in reversed(d.phase_spans):  # (inserted under the data: the first ends on top)
        p.band(b0, b1, PHASE_COLORS[phase], f"phase-{phase}", phase)
    if d.peak_time_s is not None:
        p.marker(_peak_bin(rep, d), f"peak {format_bytes(d.peak_bytes)}", "#c00", "peak-marker")
    for o in d.ooms:
        p.marker(min(n - 1, o["time_s"] / rep.bin_s if rep.bin_s else 0), "OOM", "#000", "oom-marker")
    legend_html = "".join(f"<span>{_swatch(c)}{html.escape(k)}</span>" for k, c in legend)
    legend_html += f"<span>{_swatch(RESERVED_COLOR, line=True)}reserved</span>"
    if d.phase_spans:
        shown = dict.fromkeys(p for _, _, p in d.phase_spans)
        legend_html += "".join(f"<span>{_swatch(PHASE_COLORS[k])}{k} (phase)</span>" for k in shown)
    parts.append("<h3>Memory over time, by category</h3>")
    parts.append(p.svg(f"memory over time on device {d.device}"))
    parts.append(
        f'<div class="legend">{legend_html}</div><div class="readout" id="readout-{d.device}"></div>'
    )

    # Fragmentation: what is reserved but holds no live block.
    free = [max(r - a, 0) for r, a in zip(d.reserved, d.active, strict=True)]
    p = Plot(n, max(d.reserved, default=0) * 1.05, "fragmentation", x_label=x_label, x_max=rep.span_s)
    p.area([0] * n, d.active, "#9ab", "allocated", "active")
    p.area(d.active, d.reserved, "#e8a0a0", "cached-free", "reserved, not active")
    parts.append("<h3>Fragmentation: reserved vs active</h3>")
    parts.append(p.svg(f"reserved versus active on device {d.device}"))
    worst = max(free, default=0)
    parts.append(
        f'<div class="legend"><span>{_swatch("#9ab")}active</span><span>{_swatch("#e8a0a0")}'
        f"reserved but not active (max {format_bytes(worst)})</span></div>"
    )

    if d.pool_bytes:
        parts.append("<h3>Pool actions</h3>")
        parts.append(_pool_plot(rep, d, x_label))
    if d.copy_rate:
        parts.append("<h3>Copy throughput (bytes issued per second)</h3>")
        rmax = max(max(v) for v in d.copy_rate.values()) * 1.1
        p = Plot(
            n, rmax, "bandwidth", y_label=lambda v: f"{v / 1e9:.3g} GB/s", x_label=x_label, x_max=rep.span_s
        )
        colors = {"d2h": "#e15759", "h2d": "#4e79a7"}
        for k, v in d.copy_rate.items():
            p.line(v, colors[k], f"rate-{k}")
        parts.append(p.svg(f"copy throughput on device {d.device}"))
        parts.append(
            '<div class="legend">'
            + "".join(f"<span>{_swatch(colors[k])}{k}</span>" for k in d.copy_rate)
            + "</div>"
        )
    parts.append(_peak_tables(rep, d))
    if d.ooms:
        parts.append(
            "<h3>OOMs</h3><table class=ooms><thead><tr><th>time</th><th class=num>requested</th>"
            "<th class=num>active</th><th class=num>reserved</th></tr></thead><tbody>"
        )
        for o in d.ooms:
            parts.append(
                f"<tr><td>{_at(rep, o['time_s'])[4:]}</td>"
                f"<td class=num>{format_bytes(o['requested_bytes'])}</td>"
                f"<td class=num>{format_bytes(o['active_bytes'])}</td>"
                f"<td class=num>{format_bytes(o['reserved_bytes'])}</td></tr>"
            )
        parts.append("</tbody></table>")
    parts.append("</section>")
    return "".join(parts)


def _pool_plot(rep: Report, d: DeviceReport, x_label) -> str:
    lanes = sorted(d.pool_bytes)
    n = len(d.active)
    p = Plot(n, 1.0, "pool", x_label=x_label, x_max=rep.span_s, grid=False)
    lane_h = (H - TOP - 26) / len(lanes)
    for i, name in enumerate(lanes):
        vals = d.pool_bytes[name]
        y0 = TOP + lane_h * (i + 1) - 2
        vmax = max(vals) or 1
        p.bars(
            vals,
            color_of(name, i + 2)
            if name not in ("offload", "prefetch")
            else ("#e15759" if name == "offload" else "#4e79a7"),
            f"lane-{css_token(name)}",
            y0,
            y0 - lane_h + 4,
            vmax,
        )
        p.parts.append(
            f'<text x="4" y="{y0 - lane_h / 2 + 4:.1f}">{html.escape(name)} ×{d.pool_counts[name]}</text>'
        )
    return p.svg(f"pool actions on device {d.device}")


def _at(rep: Report, t: float | None) -> str:
    if t is None:
        return " (before the first event)"
    if rep.time_is_index:
        return f" at event {t * 1e6:.0f}"
    return f" at {t:.6f} s"


def _owners_section(d: DeviceReport, note: str = "") -> str:
    """Who holds the peak: category x module, largest first, a treemap of the same, coverage; `note`:
    how activations were named (owners.rule_note)."""
    if not d.peak_owners:
        return ""
    total = d.peak_bytes or 1
    cov = d.coverage
    parts = [
        "<h3>Who holds the peak (category x module)</h3>",
        f'<p class=meta id="coverage-{d.device}">{cov["categorised"]:.1%} of the peak in a named category; '
        f"{cov['activation_with_module']:.1%} of its activations attributed to a module"
        + (f"; {html.escape(note)}" if note else "")
        + "</p>",
        treemap.svg(d.peak_owners, d.peak_bytes, f"the peak by category and module on device {d.device}"),
        f'<table class="owners" id="owners-{d.device}"><thead><tr><th>category</th><th>module</th>'
        "<th class=num>bytes</th><th class=num>share</th><th class=num>blocks</th></tr></thead><tbody>",
    ]
    for r in d.peak_owners:
        parts.append(
            f"<tr><td>{html.escape(r['category'])}</td><td>{html.escape(r['module'])}</td>"
            f"<td class=num>{format_bytes(r['bytes'])}</td><td class=num>{r['bytes'] / total:.1%}</td>"
            f"<td class=num>{r['blocks']}</td></tr>"
        )
    other = d.peak_owners_other
    if other.get("rows"):
        parts.append(
            f"<tr><td colspan=2>{other['rows']} more (category, module) pairs</td>"
            f"<td class=num>{format_bytes(other['bytes'])}</td>"
            f"<td class=num>{other['bytes'] / total:.1%}</td><td></td></tr>"
        )
    cached = max(d.reserved_at_peak_bytes - d.peak_bytes, 0)
    if cached:
        parts.append(
            f"<tr><td>cached_free</td><td>(the allocator's cache: reserved, no block)</td>"
            f"<td class=num>{format_bytes(cached)}</td><td class=num>+{cached / total:.1%}</td><td></td></tr>"
        )
    for action, nbytes in d.off_device_at_peak.items():
        parts.append(
            f"<tr><td>{html.escape(action)} (pool)</td><td>(off the device: in host memory)</td>"
            f"<td class=num>{format_bytes(nbytes)}</td><td class=num>—</td><td></td></tr>"
        )
    parts.append("</tbody></table>")
    if d.steps:
        parts.append(
            f'<h3>Each step\'s peak</h3><table class="steps" id="steps-{d.device}"><thead><tr><th>step</th>'
            "<th class=num>peak</th><th>when</th><th>reached by</th><th>largest owners then</th></tr>"
            "</thead><tbody>"
        )
        for r in d.steps:
            by = r["set_by"]
            set_by = (
                f"{html.escape(by['category'])} {html.escape(by['module'])} {format_bytes(by['bytes'])}"
                if by
                else "—"
            )
            top = "; ".join(
                f"{html.escape(o['category'])} {html.escape(o['module'])} {format_bytes(o['bytes'])}"
                for o in r["owners"]
            )
            label = f"{r['step']}" + (" (after the last step)" if r["partial"] else "")
            parts.append(
                f"<tr><td>{label}</td><td class=num>{format_bytes(r['peak_bytes'])}</td>"
                f"<td>{r['time_s']:.6f} s</td><td>{set_by}</td><td>{top}</td></tr>"
            )
        parts.append("</tbody></table>")
    return "".join(parts)


def _what_if_section(w: Any) -> str:
    from .whatif import summary

    verdict = "fits" if w.fits else "does not fit"
    rows = "".join(
        f"<tr><td>{html.escape(r['module'])}</td><td class=num>{format_bytes(r['keep_bytes'])}</td>"
        f"<td class=num>{format_bytes(r['offload_bytes'])}</td>"
        f"<td class=num>{format_bytes(r.get('recompute_bytes', 0))}</td></tr>"
        for r in w.by_module[:60]
    )
    return (
        f'<section class="what-if" id="what-if"><h2>What if the budget were {format_bytes(w.budget_bytes)}'
        f" (device {w.device}): {verdict}</h2><pre>{html.escape(summary(w))}</pre>"
        + (
            "<table class=what-if-modules><thead><tr><th>module</th><th class=num>keep</th>"
            "<th class=num>offload</th><th class=num>recompute</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>"
            if rows
            else ""
        )
        + "</section>"
    )


def _peak_tables(rep: Report, d: DeviceReport) -> str:
    parts = [_owners_section(d, rule_note(rep.meta)), "<h3>Live at the peak</h3>"]
    if d.peak_by_category:
        parts.append(
            "<table class=peak-categories><thead><tr><th>category</th><th class=num>bytes</th>"
            "<th class=num>share</th></tr></thead><tbody>"
        )
        total = sum(d.peak_by_category.values()) or 1
        for k, v in d.peak_by_category.items():
            parts.append(
                f"<tr><td>{html.escape(k)}</td><td class=num>{format_bytes(v)}</td>"
                f"<td class=num>{v / total * 100:.1f}%</td></tr>"
            )
        parts.append("</tbody></table>")
    parts.append(
        f'<input class="filter" id="filter-{d.device}" placeholder="filter blocks (category, file, op)">'
    )
    parts.append(
        "<table class=peak><thead><tr><th class=num>size</th><th>category</th><th>module</th>"
        "<th>phase</th><th>address</th><th>allocated</th><th>stack</th></tr></thead><tbody>"
    )
    for b in d.peak_blocks:
        frames = b["frames"]
        if frames:
            top = html.escape(f"{frames[0][2]} ({os.path.basename(frames[0][0])}:{frames[0][1]})")
            body = html.escape("\n".join(f"{fn}:{line} {name}" for fn, line, name in frames))
            stack = f"<details><summary>{top}</summary><pre>{body}</pre></details>"
        else:
            stack = "—"
        when = "before the trace" if b["alloc_s"] is None else _at(rep, b["alloc_s"])[4:]
        parts.append(
            f"<tr><td class=num>{format_bytes(b['size'])}</td><td>{html.escape(b['category'])}</td>"
            f"<td>{html.escape(b.get('module', ''))}</td><td>{html.escape(b.get('phase', ''))}</td>"
            f"<td>0x{b['address']:x}</td><td>{when}</td><td>{stack}</td></tr>"
        )
    parts.append("</tbody></table>")
    if d.peak_other_blocks:
        parts.append(
            f"<p class=meta>and {d.peak_other_blocks} smaller blocks "
            f"totalling {format_bytes(d.peak_other_bytes)}</p>"
        )
    return "".join(parts)


def write_report(trace: Trace | Report, path: str | os.PathLike, source: str = "", width: int = 1000) -> Path:
    """Writes the HTML report of `trace` (or of an already computed Report) to `path`."""
    rep = trace if isinstance(trace, Report) else analyze(trace, width=width, source=source)
    return write_bytes(path, render(rep).encode("utf-8"))


def write_report_files(
    trace_path: str | os.PathLike, html_path: str | os.PathLike | None = None, png: bool = True
) -> dict[str, Any]:
    """Loads a trace file and writes its HTML report (default: beside it, .html) and PNG (.png)."""
    from .loader import load
    from .png_report import write_png

    trace_path = Path(trace_path)
    html_path = check_output(html_path or trace_path.with_suffix(".html"), inputs=[trace_path])
    png_path = check_output(html_path.with_suffix(".png"), inputs=[trace_path]) if png else None
    rep = analyze(load(trace_path), source=trace_path.name)
    out: dict[str, Any] = {"report": rep, "html": write_report(rep, html_path)}
    if png_path is not None:
        out["png"] = write_png(rep, png_path)
    return out
