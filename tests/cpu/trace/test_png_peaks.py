"""The PNG plot keeps narrow peaks: with more time bins than pixel columns, a column shows its tallest bin."""

from supermem.trace.analysis import DeviceReport, Report
from supermem.trace.png import hex_color
from supermem.trace.png_report import LEFT, PLOT_H, RIGHT, TOP, WIDTH, render
from supermem.trace.svg_plot import color_of


def report_with_one_bin_spike(n: int, spike_at: int) -> Report:
    base, spike = 1 << 30, 16 << 30
    unknown = [base] * n
    unknown[spike_at] = spike
    d = DeviceReport(
        device=0, name="test", total_bytes=80 << 30, limit_bytes=0, num_events=n,
        by_category={"unknown": unknown}, active=list(unknown), reserved=[spike] * n, reserved_known=True,
        peak_bytes=spike, peak_time_s=None, peak_reserved_bytes=spike, reserved_at_peak_bytes=spike,
        max_idle_reserved_bytes=0, peak_by_category={"unknown": spike}, peak_blocks=[], peak_other_blocks=0,
        peak_other_bytes=0, peak_num_blocks=0, ooms=[], pool_bytes={}, pool_counts={}, copy_rate={},
        dropped_events=0,
    )  # fmt: skip
    return Report("t", {}, 0, 1.0, n, 1.0 / n, n, devices=[d])


def tallest_column_top(canvas) -> int:
    """Smallest y (highest point) of the "unknown" area's color inside the plot area."""
    area = bytes(hex_color(color_of("unknown", 0)))
    y0, y1 = 30 + TOP, 30 + TOP + PLOT_H
    top = y1
    for x in range(LEFT + 1, WIDTH - RIGHT):
        for y in range(y0, y1):
            i = 3 * (y * canvas.width + x)
            if canvas.pixels[i : i + 3] == area:
                top = min(top, y)
                break
    return top


def test_a_one_bin_spike_is_drawn_wherever_it_falls():
    n = 1000  # more bins than the plot's columns
    tops = [tallest_column_top(render(report_with_one_bin_spike(n, at))) for at in (41, 42, 43, 500, 999)]
    # Every placement reaches the same height: the spike (16 GiB, near the top of the plot).
    assert len(set(tops)) == 1 and tops[0] < 30 + TOP + PLOT_H // 4, tops
