"""The pools' section of the control server: what `supermem top` shows of every live pool."""

from __future__ import annotations

import weakref
from typing import Any

_live_pools: weakref.WeakSet[Any] = weakref.WeakSet()


def serve_to_top(pool: Any) -> None:
    """Lists the pool in the control server's "pool" section (what `supermem top` shows)."""
    from .. import config, control

    _live_pools.add(pool)
    if config.current().control:
        control.start_server()
        control.register_provider("pool", top_view)


def top_view() -> dict[str, Any]:
    entries: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    host = host_limit = d2h = h2d = 0
    plans = []
    for p in list(_live_pools):
        s = p.stats()
        if s["plan"] is not None:
            plans.append(s["plan"])
        for state, n in s["entries_by_state"].items():
            entries[state] = entries.get(state, 0) + n
            nbytes[state] = nbytes.get(state, 0) + s[f"{state}_bytes"]
        d2h += s["d2h_gbps"] * 1e9
        h2d += s["h2d_gbps"] * 1e9
    for h in {id(p.host.pool): p.host.pool for p in list(_live_pools)}.values():  # shared: once each
        host, host_limit = host + h.reserved_bytes, host_limit + h.limit_bytes
    link = {"d2h_bytes_per_s": d2h, "h2d_bytes_per_s": h2d}
    return {
        "entries_by_state": entries,
        "bytes_by_state": nbytes,
        "host_bytes": host,
        "host_limit_bytes": host_limit,
        "link": link,
        "plans": plans,  # each planned pool's predictions beside its last step's measurements
    }
