"""argparse types for the CLI's counts and durations: a 0 or negative value is a usage error that
argparse reports in one line (exit 2), not a ZeroDivisionError or IndexError deep in a run."""

from __future__ import annotations

import argparse
import math


def _number(kind: type, lo: float, inclusive: bool):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a{'n integer' if kind is int else ' number'}"
            ) from None
        if not math.isfinite(value) or value < lo or (value == lo and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {lo:g}, got {text}")
        return value

    return parse


positive_int = _number(int, 1, True)  # counts: steps, repeats, rounds, events
nonnegative_int = _number(int, 0, True)  # counts where 0 means "none": warm-up steps
positive_float = _number(float, 0, False)  # durations and rates: seconds, GB/s
