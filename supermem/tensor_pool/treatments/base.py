"""The treatment seam: what a treatment is (Treatment) and the registry the pool finds them in
(TREATMENTS: by name for options; a treatment's `kind` says which of the planner's and policies'
ways it takes)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...errors import ConfigError
from ...policies import Choice
from ..entry import Entry, State
from ..port import PoolPort


class Treatment:
    """One way a saved tensor leaves the device. What it can do is declared here, and the pool, the
    policies and the plan dispatch on that, never on a name:
    - `kind`: the way it takes, as the planner and the policies know them: "offload" (the bytes cross
      the link and come back: the plan prices them at `rate(pool)`, after `probe(pool)`), "recompute" (the
      entry is rebuilt from its recipe: the plan prices the recipe) or "compress" (a smaller payload
      stays on the device: `price(pool)`). A policy uses the kinds it names (Policy.kinds).
    - `rebuilds`: it brings an entry back by running its recipe (the pool times that as a rebuild,
      and a region's replay may bring its entries back instead).
    - `prefetch`: the pool may bring entries back ahead of use (worth it for copies)."""

    name = "base"
    kind = "offload"
    rebuilds = False
    prefetch = False
    # the trace's actions for an entry leaving and coming back by this treatment, which the pool emits
    # (supermem.events); None: the treatment emits its own (Offload's copies carry their addresses)
    events: tuple[str, str] | None = None

    @classmethod
    def from_spec(cls, arg: str) -> Treatment:
        """The treatment named `name:arg` in Pool(treatments=...); ValueError for an arg it does not take."""
        raise ValueError(f"{cls.name} takes no ':' option")

    @classmethod
    def specs(cls) -> list[str]:
        """The spellings Pool(treatments=...) takes for it (for the error naming the known ones)."""
        return [cls.name]

    def applies(self, e: Entry) -> bool:
        return True

    def takes(self, e: Entry) -> bool:
        """Whether a plan's choice of this treatment for `e` can be carried out now (its recipe ready,
        for a rebuild, is the plan runner's to wait for)."""
        return True

    def choices(self, pool: PoolPort, resident: Iterable[Entry]) -> list[Choice]:
        """Ways this treatment can free device bytes now, priced for the policy."""
        raise NotImplementedError

    def leave(self, pool: PoolPort, e: Entry) -> bool:
        """Starts taking a resident entry off the device (the device tensor is still set: the pool
        drops it after); sets its state to leaving or away. False: it cannot (the entry stays)."""
        raise NotImplementedError

    def come_back(self, pool: PoolPort, e: Entry) -> None:
        """Starts bringing the entry back; ends with `pool.arrived(e, tensor, event)`."""
        raise NotImplementedError

    def ready(self, pool: PoolPort, e: Entry) -> None:
        """Makes a returning entry usable on the current stream."""
        e.event = None
        e.state = State.RESIDENT

    def arrived(self, pool: PoolPort, e: Entry) -> None:
        """The entry is back on the device, by this treatment or another way (a region's replay
        rebuilds every dropped entry of its call): drop what need not be kept."""

    def settle(self, pool: PoolPort, wait: bool = False) -> None:
        """Finishes what finished in the background (all of it, waiting, with `wait`): frees what
        the entries it holds no longer need. The pool calls it before it measures device memory."""

    def device_bytes(self, e: Entry) -> int:
        """Device bytes the entry still takes while away (a compressed payload; 0 when none)."""
        return 0

    def host_bytes(self, e: Entry) -> int:
        return 0

    def forget(self, pool: PoolPort, e: Entry) -> None:
        """The entry died or leaves by another treatment: free this treatment's payload."""
        e.payload = None

    def check(self, pool: PoolPort, e: Entry) -> None:
        """This treatment's invariant for an entry it holds; AssertionError if off."""


TREATMENTS: dict[str, type[Treatment]] = {}  # name -> class: the registry (treatments/__init__.py)


def register(cls: type[Treatment]) -> type[Treatment]:
    """Adds a treatment class to the registry under its name: Pool(treatments=(name, ...)) makes it."""
    if TREATMENTS.get(cls.name, cls) is not cls:
        raise ValueError(f"a treatment named {cls.name!r} is registered already")
    TREATMENTS[cls.name] = cls
    return cls


def treatment_names(spec: Any) -> tuple:
    """("offload", "compress") from that, a list, or "offload,compress" (objects pass through)."""
    if isinstance(spec, str):
        return tuple(name.strip() for name in spec.split(",") if name.strip())
    try:
        return tuple(spec)
    except TypeError:
        raise ConfigError(
            f"bad pool option treatments={spec!r}: give names, e.g. ('offload', 'recompute', 'compress')"
        ) from None


def checked_treatments(spec: Any) -> tuple[Treatment, ...]:
    """The treatments `spec` names (as treatment_names takes them) or holds; ConfigError for a bad one."""
    names = treatment_names(spec)
    try:
        return make_treatments(names)
    except ValueError as e:
        raise ConfigError(f"bad pool option treatments={names!r}: {e}") from None


def make_treatments(spec: Iterable[str | Treatment]) -> tuple[Treatment, ...]:
    """Treatments from names ("offload", "recompute", "compress", "compress:full": `name:option`, see
    the treatment's from_spec) or objects; ValueError naming the known ones for an unknown name."""
    out = []
    for t in spec:
        if isinstance(t, Treatment):
            out.append(t)
            continue
        name, colon, arg = t.partition(":") if isinstance(t, str) else (t, "", "")
        cls = TREATMENTS.get(name)
        try:
            if cls is None:
                raise ValueError
            out.append(cls.from_spec(arg) if colon else cls())
        except ValueError:
            known = [s for c in TREATMENTS.values() for s in c.specs()]
            raise ValueError(f"unknown treatment {t!r}; known: {', '.join(known)}") from None
    return tuple(out)
