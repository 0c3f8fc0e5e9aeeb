"""The CUDA driver's virtual-memory calls one by one, per 2 MiB page, through ctypes on libcuda (no
supermem, no PyTorch): cuMemCreate, cuMemMap, cuMemSetAccess (once per run of pages), cuMemUnmap,
cuMemRelease; and a move that keeps the physical pages (unmap, map elsewhere, set access) against one that
gives them back and creates new ones. Medians of 5 rounds of N pages.

    python3 tools/diag/vm_calls.py [pages]     # default 256
"""

import ctypes
import statistics
import sys
import time

cu = ctypes.CDLL("libcuda.so.1")
u64, size_t = ctypes.c_uint64, ctypes.c_size_t


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def ok(r: int, what: str) -> None:
    if r:
        raise RuntimeError(f"{what}: CUresult {r}")


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    page = 2 << 20
    ok(cu.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
    ok(cu.cuCtxSetCurrent(ctx), "set current")
    prop = Prop(type=1, location=Location(type=1, id=0))  # pinned, on device 0
    access = Access(location=Location(type=1, id=0), flags=3)  # read/write
    base, other = u64(), u64()
    ok(cu.cuMemAddressReserve(ctypes.byref(base), size_t(n * page), size_t(page), u64(0), u64(0)), "reserve")
    ok(cu.cuMemAddressReserve(ctypes.byref(other), size_t(n * page), size_t(page), u64(0), u64(0)), "reserve")
    times: dict[str, list[float]] = {}
    handles = [u64() for _ in range(n)]

    def timed(name, fn):
        t = time.perf_counter()
        fn()
        times.setdefault(name, []).append((time.perf_counter() - t) / n * 1e6)

    def create():
        for h in handles:
            ok(cu.cuMemCreate(ctypes.byref(h), size_t(page), ctypes.byref(prop), u64(0)), "cuMemCreate")

    def map_at(va):
        for i, h in enumerate(handles):
            ok(cu.cuMemMap(u64(va.value + i * page), size_t(page), size_t(0), h, u64(0)), "cuMemMap")

    def set_access(va):
        ok(cu.cuMemSetAccess(va, size_t(n * page), ctypes.byref(access), size_t(1)), "cuMemSetAccess")

    def unmap_at(va):
        ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")  # (as before an allocator's unmap)
        for i in range(n):
            ok(cu.cuMemUnmap(u64(va.value + i * page), size_t(page)), "cuMemUnmap")

    def release():
        for h in handles:
            ok(cu.cuMemRelease(h), "cuMemRelease")

    def keep_move():  # the same pages mapped elsewhere: no create, no release
        map_at(other)
        set_access(other)
        unmap_at(other)

    for _ in range(6):
        timed("create", create)
        timed("map", lambda: map_at(base))
        timed("set access (one call)", lambda: set_access(base))
        timed("unmap", lambda: unmap_at(base))
        timed("move keeping pages (map+access+unmap)", keep_move)
        timed("release", release)
    for name, xs in times.items():
        print(f"{name:40s} {statistics.median(xs[1:]):7.1f} us a page")
    return 0


if __name__ == "__main__":
    sys.exit(main())
