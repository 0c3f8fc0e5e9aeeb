"""Host seconds of each kind of rebuild, for the planner's prices (Profile's host_s).

A rebuild (a region's replay, an op's, a weight's cast) or a pressure call can run inside another
one: an outer rebuild's own seconds leave out its inner ones'. Where the host is the slower side, a
rebuild costs the step its own host seconds.
"""

from __future__ import annotations

import collections
import time

SAMPLES = 64  # the last rebuilds of each kind kept


class RebuildTimes:
    """Per kind of rebuild (its recipe's class name): the host seconds of its last runs, its own."""

    def __init__(self) -> None:
        self.samples: dict[str, collections.deque[float]] = {}
        self.frames: list[float] = []  # per rebuild or pressure call running: its inner ones' seconds

    def frame_end(self, t0: float, kind: str | None = None) -> None:
        """A rebuild or pressure call that began at `t0` ended: its seconds count as its outer one's
        inner time; a rebuild's own seconds are a sample of its kind's host cost."""
        s = time.perf_counter() - t0
        inner = self.frames.pop()
        if self.frames:
            self.frames[-1] += s
        if kind is not None:
            self.samples.setdefault(kind, collections.deque(maxlen=SAMPLES)).append(s - inner)

    def cost_s(self, kind: str) -> float:
        """Host seconds of one rebuild of `kind`: the least of the last ones (0 before one ran). The
        least, as for device seconds: a first call of a shape pays one-time costs (GPT-24's first
        block replay on an H100: 123 ms, 84 of them cuDNN building its attention plan; the next: 2)."""
        samples = self.samples.get(kind)
        return min(samples) if samples else 0.0
