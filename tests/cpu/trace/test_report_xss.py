"""Names read from a file (categories, actions, device names, frames, argv, the file's own name) reach the
HTML report escaped only, and the page carries a Content-Security-Policy that allows no network and no
script but its own. Checked on the parsed HTML (html.parser) and, where Chromium is installed, in the
browser (the page's own script runs, the injected one does not)."""

import base64
import hashlib
import json
import pickle
import re
from html.parser import HTMLParser

import numpy as np
import pytest
from browser import dump_dom

from supermem import cli
from supermem.trace import format as fmt
from supermem.trace.table import ALLOC, FREE_COMPLETED, SEGMENT_ALLOC, Trace, empty_columns

PWN = "document.body.dataset.pwned=1"
PAYLOADS = [
    f'"><script>{PWN}</script>',
    f'" onmouseover="{PWN}" x="',
    f"'><img src=x onerror={PWN}>",
    f"</script><script>{PWN}</script>",
    "<!--<script>",
    "a b&c <svg onload=alert(1)>",
]
# every element a report has: an injected one shows up as a tag outside this set
REPORT_TAGS = {
    "html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "section", "table", "thead",
    "tbody", "tr", "td", "th", "pre", "details", "summary", "div", "span", "input", "svg", "line", "text",
    "polygon", "polyline", "path", "rect", "script",
}  # fmt: skip


class Doc(HTMLParser):
    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.tags, self.attrs, self.scripts, self.text = [], [], [], []
        self._script = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.extend((tag, k, v) for k, v in attrs)
        if tag == "script":
            self._script = (dict(attrs), [])

    def handle_endtag(self, tag):
        if tag == "script" and self._script:
            self.scripts.append((self._script[0], "".join(self._script[1])))
            self._script = None

    def handle_data(self, data):
        (self._script[1] if self._script else self.text).append(data)


def crafted_trace() -> Trace:
    t = Trace()
    for p in PAYLOADS:
        t.category_id(p)
        t.action_id(p)
    n = 4 * len(PAYLOADS) + 1
    c = empty_columns(n)
    c["time_ns"] = np.arange(n, dtype=np.int64) * 1000
    c["action"][0], c["size"][0], c["address"][0] = SEGMENT_ALLOC, 64 << 20, 1 << 30
    for i, p in enumerate(PAYLOADS):
        base = 1 + 4 * i
        addr = (1 << 30) + i * (1 << 20)
        rows = [(ALLOC, t.categories.index(p)), (t.actions.index(p), 0), (FREE_COMPLETED, 0)]
        for k, (a, cat) in enumerate(rows):
            c["action"][base + k], c["address"][base + k], c["size"][base + k] = a, addr, 1 << 20
            if cat:
                c["category"][base + k] = cat
        c["action"][base + 3], c["address"][base + 3], c["size"][base + 3] = ALLOC, addr, 1 << 19
        c["category"][base + 3] = t.categories.index(p)
        c["stack"][base + 3] = 0
    t.cols = c
    t.frames = [(p, 1, p) for p in PAYLOADS]
    t.stacks = [tuple(range(len(PAYLOADS)))]
    t.devices = [{"index": 0, "name": PAYLOADS[0], "total_bytes": 1 << 34, "limit_bytes": 0, "stats": {}}]
    t.devices[0]["segments"] = []
    t.meta = {"argv": PAYLOADS, "pid": 1}
    return t


def crafted_snapshot() -> dict:
    frames = [{"filename": p, "line": 3, "name": p} for p in PAYLOADS]
    entries = []
    for i, p in enumerate(PAYLOADS):
        addr = (1 << 30) + i * (1 << 20)
        common = {"addr": addr, "size": 1 << 20, "stream": 0, "frames": frames}
        entries.append({"action": "alloc", "time_us": 10 * i, "category": p, **common})
        entries.append({"action": p, "time_us": 10 * i + 1, **common})
    blocks = [
        {"size": 1 << 20, "state": "active_allocated", "frames": frames, "category": p} for p in PAYLOADS
    ]
    seg = {"device": 0, "address": 1 << 30, "total_size": len(PAYLOADS) << 20, "blocks": blocks}
    return {"segments": [seg], "device_traces": [entries]}


@pytest.fixture(scope="module", params=["smtrace", "pickle"])
def page(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("xss")
    src = tmp / f"{PAYLOADS[2]}.{request.param}"  # the file's name is shown too
    if request.param == "smtrace":
        fmt.write(crafted_trace(), src)
    else:
        src.write_bytes(pickle.dumps(crafted_snapshot()))
    out = tmp / "report.html"
    assert cli.main(["report", str(src), "-o", str(out), "-q"]) == 0
    return out


def test_nothing_from_the_file_becomes_markup(page):
    text = page.read_text()
    doc = Doc(text)
    assert set(doc.tags) <= REPORT_TAGS, set(doc.tags) - REPORT_TAGS
    assert not [a for a in doc.attrs if a[1].lower().startswith("on")], "an event handler attribute"
    assert not [a for a in doc.attrs if a[1].lower() in ("style", "src", "href", "srcdoc", "formaction")]
    assert doc.tags.count("script") == 2 and len(doc.scripts) == 2
    (data_attrs, data), (code_attrs, code) = doc.scripts
    assert data_attrs == {"id": "report-data", "type": "application/json"} and code_attrs == {}
    json.loads(data)  # the data block is intact JSON...
    assert "<" not in data and ">" not in data  # ...that no name can end or comment out
    assert PWN not in code
    shown = "".join(doc.text) + " ".join(str(v) for _, _, v in doc.attrs)
    for p in PAYLOADS:
        assert p in shown, p  # the names are displayed (as text), not dropped


def test_content_security_policy_allows_only_the_pages_own_code(page):
    text = page.read_text()
    doc = Doc(text)
    csp = [v for tag, k, v in doc.attrs if tag == "meta" and k == "content" and "default-src" in (v or "")]
    assert len(csp) == 1
    assert text.index("Content-Security-Policy") < text.index("<style")  # before anything it governs
    rules = dict((r.split()[0], r.split()[1:]) for r in csp[0].split(";") if r.strip())
    assert rules["default-src"] == ["'none'"]
    style = re.search(r"<style>(.*?)</style>", text, re.S).group(1)
    code = doc.scripts[1][1]

    def sha(s):
        return "'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"

    assert rules["script-src"] == [sha(code)]
    assert rules["style-src"] == [sha(style)]
    assert "'unsafe-inline'" not in csp[0] and "http" not in csp[0] and "*" not in csp[0]


def test_in_the_browser_the_report_script_runs_and_the_injected_ones_do_not(page):
    dom = dump_dom(page)
    assert 'data-ready="1"' in dom  # the page's own script passed the policy
    assert "data-pwned" not in dom
