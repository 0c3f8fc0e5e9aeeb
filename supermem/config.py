"""supermem's options: one table, parsed strictly from SUPERMEM_CONF ("key:value,key:value", the
syntax of PYTORCH_ALLOC_CONF) and settable with `supermem.options(...)`. The README's option list is
generated from this table (`python -m supermem.config --markdown`)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .policies import POLICIES, live_names
from .units import parse_bytes


def _size_or_fraction(text: Any) -> int | float | str:
    """Kept as given ("12GiB", "80%", 0.8) and resolved against the card when the device is known."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value: int | float | str = text
    else:
        text = str(text).strip()
        try:
            value = float(text) if "." in text and text.replace(".", "", 1).isdigit() else text
        except ValueError:
            value = text
    parse_bytes(value, total_bytes=1 << 40)  # validates; raises ValueError with the accepted forms
    return value


def _limit(text: Any) -> int | float | str:
    """A size or fraction of more than 0 bytes: the allocator reads a limit of 0 as none, so `limit:0`
    would silently be no cap at all where it seems to allow nothing."""
    value = _size_or_fraction(text)
    if parse_bytes(value, total_bytes=1 << 40) == 0:
        raise ValueError(f"{text!r} is 0 bytes, which no allocation fits; for no limit, leave the option out")
    return value


def _bool(text: Any) -> bool:
    if isinstance(text, bool):
        return text
    t = str(text).strip().lower()
    if t in ("1", "true", "on", "yes"):
        return True
    if t in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{text!r} is not a boolean: use true/false, on/off or 1/0")


def _int_range(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(text: Any) -> int:
        t = str(text).strip()
        if not re.fullmatch(r"[+-]?[0-9]+", t):  # int() would also take "1_000" and non-ASCII digits
            raise ValueError(f"{text!r} is not an integer")
        v = int(t)
        if not lo <= v <= hi:
            raise ValueError(f"{v} is out of range [{lo}, {hi}]")
        return v

    return parse


def _choice(*names: str) -> Callable[[Any], str]:
    def parse(text: Any) -> str:
        t = str(text).strip().lower()
        if t not in names:
            raise ValueError(f"{text!r} is not one of {', '.join(names)}")
        return t

    return parse


def _path(text: Any) -> str:
    t = str(text).strip()
    if not t:
        raise ValueError("an empty path")
    return t


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[Any], Any]
    default: Any
    allowed: str  # the accepted values, in words
    doc: str


OPTIONS: tuple[Option, ...] = (
    Option(
        "allocator",
        _choice("supermem", "native"),
        "supermem",
        "supermem | native",
        "Which CUDA allocator serves PyTorch. `native` keeps PyTorch's and uses only the pool.",
    ),
    Option(
        "limit",
        _limit,
        None,
        "bytes > 0, 12GiB, 80% or 0.8",
        "Hard cap on reserved GPU memory; allocations beyond it raise torch.OutOfMemoryError.",
    ),
    Option(
        "passthrough",
        _bool,
        False,
        "true | false",
        "No caching: every tensor gets its own cudaMalloc, freed at once (for compute-sanitizer).",
    ),
    Option(
        "expandable_segments",
        _bool,
        False,
        "true | false",
        "Grow each stream's segment in a reserved virtual address range, mapping 2 MiB pages on demand, "
        "moving the pages of free holes to where a tensor needs them instead of growing past the allocated "
        "peak, and unmapping free ones when memory runs short (PyTorch's key): far less memory reserved but "
        "unallocated when tensor sizes change from step to step (1.019x the allocated peak on a "
        "variable-length Llama run, against 1.077x for PyTorch's own). Off by default: under a pool, "
        "which holds memory at its budget, moving pages costs steps time (docs/allocator.md).",
    ),
    Option(
        "trace",
        _int_range(0, 1 << 30),
        0,
        "0 .. 2^30 events",
        "Size of the allocator's event ring buffer (0: no tracing).",
    ),
    Option(
        "debug",
        _int_range(0, 2),
        0,
        "0 | 1 | 2",
        "Invariant checks: 1 after every slow-path call, 2 after every call (slow).",
    ),
    Option(
        "pool",
        _choice("off", *live_names()),  # the one policy registry
        "off",
        " | ".join(["off", *live_names()]),
        "Tensor pool policy for tensors autograd saves for backward ("
        + "; ".join(f"`{n}`: {POLICIES[n].doc}" for n in live_names())
        + ").",
    ),
    Option(
        "budget",
        _size_or_fraction,
        None,
        "bytes, 8GiB, 60% or 0.6",
        "Device bytes the pool may keep resident; beyond it, the policy offloads to pinned host memory "
        "(0: every saved tensor it can move leaves the device).",
    ),
    Option(
        "host_limit",
        _size_or_fraction,
        "50%",
        "bytes, 32GiB or a percentage of host RAM",
        "Pinned host memory for offloaded tensors and streamed weights (one host pool per device, shared "
        "by both).",
    ),
    Option(
        "graphs",
        _bool,
        True,
        "true | false",
        "On CUDA, the backward of block calls a plan runs light (rebuilt in backward) replays a CUDA graph "
        "where at least 16 modules of one structure run light; `false` keeps them eager.",
    ),
    Option(
        "stream",
        _choice("off", "weights"),
        "off",
        "off | weights",
        "`weights`: the model (the first outermost module called with parameters on the GPU) keeps its "
        "parameters, gradients and optimizer state in pinned host memory; each module's weights are "
        "fetched just in time (supermem.stream).",
    ),
    Option(
        "oom_snapshot",
        _path,
        None,
        "a file path",
        "When an OOM is raised, write a trace there (and an HTML report beside it).",
    ),
    Option(
        "control",
        _bool,
        True,
        "true | false",
        "Serve `supermem top` on a unix socket in a private per-user directory (no network port); "
        "where that is unsafe or impossible, one warning and the program runs on without it.",
    ),
)
_BY_NAME = {o.name: o for o in OPTIONS}

# PyTorch's own allocator options (PYTORCH_ALLOC_CONF, formerly PYTORCH_CUDA_ALLOC_CONF; torch 2.13's
# c10/core/AllocatorConfig.h and c10/cuda/CUDAAllocatorConfig.h). Two mean the same under supermem and are
# aliases; expandable_segments is supermem's option of the same name; the rest set up the allocator that
# supermem's replaces, and have no supermem equivalent.
TORCH_ALIASES = {"per_process_memory_fraction": "limit", "backend": "allocator"}
TORCH_SAME_NAME = ("expandable_segments",)
TORCH_ONLY = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "release_lock_on_cudamalloc",
    "graph_capture_record_stream_reuse",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
)


def _torch_fraction(text: Any) -> float:
    """per_process_memory_fraction's value as PyTorch takes it: a fraction of the card in (0, 1]."""
    try:
        f = float(str(text).strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not 0 < f <= 1:
        raise ValueError(f"{f} is not a fraction in (0, 1]")
    return f


def _torch_backend(text: Any) -> str:
    if str(text).strip() != "native":
        raise ValueError(
            f"{text!r}: only PyTorch's `native` backend has a supermem equivalent (allocator:native)"
        )
    return "native"


_TORCH_VALUE = {"per_process_memory_fraction": _torch_fraction, "backend": _torch_backend}


def from_torch_name(name: str, value: Any) -> tuple[str, Any]:
    """(supermem's key, the value in its terms) for a key that may be PyTorch's name of a supermem option;
    ConfigError for PyTorch's allocator options that have none."""
    if name in TORCH_ALIASES:
        try:
            return TORCH_ALIASES[name], _TORCH_VALUE[name](value)
        except ValueError as e:
            raise ConfigError(f"bad value for PyTorch's allocator option {name!r}: {e}") from None
    if name in TORCH_ONLY:
        raise ConfigError(
            f"{name!r} is an option of PyTorch's own allocator, which supermem's replaces; supermem has no "
            f"equivalent (its options: {', '.join(_BY_NAME)}; PyTorch's {', '.join(TORCH_ALIASES)} are taken "
            f"as supermem's {', '.join(TORCH_ALIASES.values())})"
        )
    return name, value


def parse_option(name: str, value: Any) -> Any:
    """The parsed value of one option; ConfigError names the key and the allowed values."""
    opt = _BY_NAME.get(name)
    if opt is None:
        from_torch_name(name, value)  # PyTorch's names: a message that says what to use instead
        raise ConfigError(f"unknown supermem option {name!r}; known options: {', '.join(_BY_NAME)}")
    if value is None:
        return None
    try:
        return opt.parse(value)
    except ValueError as e:
        raise ConfigError(f"bad value for supermem option {name!r}: {e} (allowed: {opt.allowed})") from None


def parse_conf(text: str) -> dict[str, Any]:
    """Parses "key:value,key:value" strictly (spaces ignored, an empty string is no options). PyTorch's
    names of supermem's options are taken as those (per_process_memory_fraction:0.8 is limit:0.8)."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition(":")
        if not sep or not value.strip():
            raise ConfigError(f"SUPERMEM_CONF item {item!r} is not key:value (e.g. limit:12GiB,pool:lru)")
        key, parsed = from_torch_name(key.strip(), value.strip())
        if key in out:
            raise ConfigError(f"supermem option {key!r} is given twice")
        out[key] = parse_option(key, parsed)
    return out


def merge_conf(base: str, override: str) -> str:
    """`base` with the items of `override` replacing those of the same key ("limit:2GiB,trace:64" and
    "limit:1GiB" -> "limit:1GiB,trace:64"): each key once. Both are validated first."""
    parse_conf(base), parse_conf(override)
    items = {}
    for text in (base, override):
        for item in filter(None, (part.strip() for part in text.split(","))):
            items[TORCH_ALIASES.get(key := item.partition(":")[0].strip(), key)] = item
    return ",".join(items.values())


class Config:
    """The options in force: defaults, then SUPERMEM_CONF, then `options(...)` overrides."""

    def __init__(self, values: dict[str, Any] | None = None):
        self._values = {o.name: o.default for o in OPTIONS}
        self._values.update(values or {})

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def set(self, **values: Any) -> None:
        """Sets every value, or none when one is bad (ConfigError). PyTorch's names of supermem's options
        are taken as those."""
        parsed = {}
        for name, value in values.items():
            key, value = from_torch_name(name, value)
            if key in parsed:
                raise ConfigError(f"supermem option {key!r} is given twice")
            parsed[key] = parse_option(key, value)
        self._values.update(parsed)


TORCH_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # PyTorch reads the first one set


def torch_alloc_conf(environ: os._Environ | dict | None = None) -> tuple[str, dict[str, str]]:
    """(the variable, its "key:value" items) of PyTorch's allocator options in the environment; ("", {})
    when none is set. Lists in brackets (roundup_power2_divisions:[256:1,>:2]) stay one item."""
    env = os.environ if environ is None else environ
    var = next((v for v in TORCH_CONF_VARS if env.get(v, "").strip()), "")
    items: dict[str, str] = {}
    for item in re.split(r",(?![^\[]*\])", env.get(var, "")) if var else ():
        key, _, value = item.partition(":")
        if key.strip():
            items[key.strip()] = value.strip()
    return var, items


def honour_torch_alloc_conf(cfg: Config, environ: os._Environ | dict | None = None) -> str | None:
    """Once supermem's allocator replaces PyTorch's, PyTorch's allocator options apply no more. Those that
    mean a supermem option (per_process_memory_fraction: limit; expandable_segments, the same name) set it
    where the user's supermem options
    leave it at its default; the message returned names what is taken and what is ignored, or is None
    when there is nothing to say."""
    var, items = torch_alloc_conf(environ)
    taken, ignored = [], []
    for key, value in items.items():
        name = key if key in TORCH_SAME_NAME else TORCH_ALIASES.get(key)
        if name is None or name == "allocator":  # (backend: supermem's allocator is the one asked for)
            ignored.append(key)
            continue
        try:
            _, parsed = from_torch_name(key, value)
            parsed = parse_option(name, parsed) if key in TORCH_SAME_NAME else parsed
        except ConfigError:
            ignored.append(f"{key} (bad value {value!r})")
            continue
        if getattr(cfg, name) == _BY_NAME[name].default:
            cfg.set(**{name: parsed})
            taken.append(f"{key}:{value} as {name}:{parsed}")
        else:
            ignored.append(f"{key} (supermem's {name} is set)")
    if not taken and not ignored:
        return None
    said = [f"supermem: {var} configures PyTorch's own allocator, which supermem's replaces in this process"]
    if taken:
        said.append(f"taken: {', '.join(taken)}")
    if ignored:
        said.append(f"ignored: {', '.join(ignored)}")
    return "; ".join(said)


def from_env(environ: os._Environ | dict | None = None) -> Config:
    env = os.environ if environ is None else environ
    return Config(parse_conf(env.get("SUPERMEM_CONF", "")))


_current: Config | None = None


def current() -> Config:
    """The process's options (read from the environment on first use)."""
    global _current
    if _current is None:
        _current = from_env()
    return _current


@contextlib.contextmanager
def options(**values: Any) -> Iterator[Config]:
    """Overrides options for the `with` block: `with supermem.options(pool="lru", budget="8GiB"):`."""
    cfg = current()
    saved = cfg.as_dict()
    cfg.set(**values)
    try:
        yield cfg
    finally:
        cfg._values = saved


def markdown_table() -> str:
    rows = ["| option | values | default | what it does |", "| --- | --- | --- | --- |"]
    for o in OPTIONS:
        default = "—" if o.default is None else f"`{o.default}`"
        allowed = o.allowed.replace("|", "\\|")  # a bare | would split the cell
        rows.append(f"| `{o.name}` | {allowed} | {default} | {o.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(markdown_table())
