"""Treatments: what happens to a saved tensor that leaves the device, one small class a file.

A treatment releases an entry's device memory (`leave`), brings it back (`come_back`, then `ready`
before compute uses it), hears when the entry is back by any way (`arrived`: a region's replay too),
says what the entry costs while away (`device_bytes`, `host_bytes`) and what leaving costs
(`choices`, in estimated exposed seconds, for the policy), frees its payload when the entry dies
(`forget`) and checks its own invariant (`check`). The pool's core only moves entries between states
and keeps the byte counters. A new treatment is a class in a file of its own, registered (`register`,
below for the built-in ones), and named in `Pool(treatments=...)`; its `kind` says how the planner and
the policies price it (Treatment), so nothing else changes (tests/cpu/pool/stash_treatment.py is one).
"""

from __future__ import annotations

from .base import TREATMENTS, Treatment, checked_treatments, make_treatments, register, treatment_names
from .compress import ROOMS, Compress
from .offload import Offload, link_rate
from .recompute import Recompute

# The registry: each treatment is a class in its own file, registered here.
register(Offload)
register(Recompute)
register(Compress)

__all__ = [
    "Compress",
    "Offload",
    "ROOMS",
    "Recompute",
    "TREATMENTS",
    "Treatment",
    "checked_treatments",
    "link_rate",
    "make_treatments",
    "register",
    "treatment_names",
]
