"""`supermem report TRACE -o report.html`: the HTML report (and a PNG beside it) of a .smtrace file or a
PyTorch snapshot pickle, plus a text summary on stdout."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..cli_args import positive_int
from ..units import parse_bytes
from .analysis import analyze, summary_text
from .loader import load_for_cli as load
from .output import OutputError, check_output, same_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "trace",
        nargs="+",
        help="a .smtrace file or a PyTorch memory snapshot pickle; several: one per rank, side by side",
    )
    p.add_argument("-o", "--output", help="HTML file to write (default: the first TRACE with .html)")
    p.add_argument("--png", help="PNG file to write (default: the HTML's name with .png)")
    p.add_argument("--no-png", action="store_true", help="do not write a PNG")
    p.add_argument(
        "--width", type=positive_int, default=1000, help="points per plotted series (default 1000)"
    )
    p.add_argument(
        "--max-blocks", type=positive_int, default=500, help="blocks listed at the peak (default 500)"
    )
    p.add_argument(
        "--budget",
        type=_budget,
        help="what the pool would do at this many device bytes (8GiB): the floor, keep/offload/recompute "
        "per module, the predicted peak and step time, whether it fits",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no summary on stdout")


def _budget(text: str) -> int:
    try:
        n = parse_bytes(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"not a number of bytes: {text!r} ({e})") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {text!r}")
    return n


def main(args: argparse.Namespace) -> int:
    from .png_report import write_png
    from .report_html import write_report

    t0 = time.perf_counter()
    sources = [Path(t) for t in args.trace]
    src = sources[0]
    # Both outputs are checked before the work, so a bad --png does not leave a lone HTML behind.
    html_path = check_output(args.output or src.with_suffix(".html"), inputs=sources)
    png_path = None
    if not args.no_png:
        png_path = check_output(args.png or html_path.with_suffix(".png"), inputs=sources)
        if same_file(png_path, html_path):
            raise OutputError(f"{png_path}: is the same file as the HTML output; give --png another name")
    if len(sources) == 1:
        trace, name = load(src), src.name
    else:
        trace, name = _merged(sources), ", ".join(s.name for s in sources)
    rep = analyze(trace, width=max(10, args.width), max_blocks=max(0, args.max_blocks), source=name)
    whatif_text = ""
    if args.budget is not None:
        from .whatif import summary, what_if

        rep.what_if = [what_if(trace, args.budget, d.device) for d in rep.devices]
        whatif_text = "\n".join(summary(w) for w in rep.what_if)
    write_report(rep, html_path)
    written = [str(html_path)]
    if png_path is not None:
        write_png(rep, png_path)
        written.append(str(png_path))
    if whatif_text:  # asked for: printed also with -q
        print(whatif_text)
    if not args.quiet:
        print(summary_text(rep))
        print(f"wrote {', '.join(written)} in {time.perf_counter() - t0:.2f} s")
    return 0


def _merged(sources: list[Path]):
    from ..errors import UsageError
    from .format import TraceFormatError
    from .ranks import merge_ranks

    try:
        return merge_ranks([load(s) for s in sources], [s.name for s in sources])
    except TraceFormatError as e:
        raise UsageError(str(e)) from None
