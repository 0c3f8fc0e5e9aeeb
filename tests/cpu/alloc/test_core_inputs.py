"""Bad input to the C++ core gives a clear Python error and leaves the allocator as it was: constructor
arguments of every class in supermem.allocator / supermem._C, huge sizes, failed trace-ring resizes,
and exceptions a pressure handler or OOM observer must not swallow (KeyboardInterrupt, SystemExit).

Anything that used to segfault runs in a child process, so a crash fails the test instead of pytest."""

import subprocess
import sys
import textwrap

import pytest
from alloc_spec import MiB

from supermem import _C
from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.errors import OutOfMemoryError, UsageError


def run_child(code: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter; returns the finished process (a crash shows as rc < 0)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout_s
    )


# ---------------------------------------------------------------- trace ring resizes (issue 8.4)


@pytest.mark.parametrize("capacity", [10**11, 2**62, 2**63 - 1])
def test_failed_trace_ring_resize_raises_and_leaves_the_ring_as_it_was(capacity):
    p = run_child(f"""
        from supermem.allocator import CachingAllocator, SimulatedDevice
        a = CachingAllocator(SimulatedDevice(64 << 20), trace_capacity=4)
        a.malloc(1000)
        try:
            a.trace_capacity = {capacity}
        except (ValueError, MemoryError) as e:
            assert "{capacity}" in str(e), e
            print("raised", type(e).__name__)
        assert a.trace_capacity == 4, a.trace_capacity
        for _ in range(100):  # wraps the old ring many times: out-of-bounds writes would crash here
            a.free(a.malloc(1000))
        events = a.drain_trace()
        assert len(events) == 4 and a.trace_dropped > 0, (events, a.trace_dropped)
        a.check()
        print("ok")
    """)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert p.stdout.split() == ["raised", p.stdout.split()[1], "ok"]


@pytest.mark.parametrize("capacity", [10**11, 2**62])
def test_allocator_with_an_impossible_trace_capacity_is_refused(capacity):
    with pytest.raises((ValueError, MemoryError), match=str(capacity)):
        CachingAllocator(SimulatedDevice(MiB), trace_capacity=capacity)


def test_trace_recording_with_an_impossible_capacity_raises_clearly():
    p = run_child("""
        import supermem
        from supermem.allocator import CachingAllocator, SimulatedDevice
        a = CachingAllocator(SimulatedDevice(64 << 20))
        try:
            with supermem.trace(allocators=[(0, a)], capacity_events=10**11):
                pass
        except (ValueError, MemoryError) as e:
            assert "100000000000" in str(e), e
        for _ in range(50):
            a.free(a.malloc(1000))
        a.check()
        print("ok")
    """)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stdout, p.stderr)


# ---------------------------------------------------------------- constructor arguments (issue 8.5)


def test_allocator_without_a_device_is_refused_in_a_child():
    p = run_child("""
        from supermem import _C
        from supermem.allocator import CachingAllocator
        for make in (lambda: CachingAllocator(None), lambda: _C.CachingAllocator(None)):
            try:
                make().malloc(1)
            except TypeError as e:
                assert "device" in str(e) and "None" in str(e), e
            else:
                raise AssertionError("accepted None")
        print("ok")
    """)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stdout, p.stderr)


BAD_ALLOCATOR_ARGS = [
    (dict(source="sim"), TypeError, "device"),
    (dict(source=object()), TypeError, "device"),
    (dict(limit_bytes=-1), ValueError, ">= 0"),
    (dict(limit_bytes=2**64), ValueError, "limit_bytes"),
    (dict(limit_bytes=2**63), ValueError, "limit_bytes"),
    (dict(limit_bytes=10**400), ValueError, "limit_bytes"),
    (dict(debug=99), ValueError, "debug"),
    (dict(debug=-1), ValueError, "debug"),
    (dict(debug=2**40), ValueError, "debug"),
    (dict(debug="1"), TypeError, "debug"),
    (dict(passthrough="yes"), TypeError, "passthrough"),
    (dict(passthrough=2), TypeError, "passthrough"),
    (dict(trace_capacity=-1), ValueError, "trace_capacity"),
    (dict(trace_capacity=1.5), TypeError, "trace_capacity"),
    (dict(trace_capacity=2**64), ValueError, "trace_capacity"),
    (dict(trace_capacity=True), TypeError, "trace_capacity"),
    (dict(segment_bytes=2**64), ValueError, "segment_bytes"),
    (dict(segment_bytes=-5), ValueError, ">= 0"),
]


@pytest.mark.parametrize(("kwargs", "error", "words"), BAD_ALLOCATOR_ARGS, ids=lambda x: repr(x)[:40])
def test_bad_allocator_arguments_give_clear_errors(kwargs, error, words):
    kwargs = dict(kwargs)
    source = kwargs.pop("source", SimulatedDevice(MiB))
    with pytest.raises(error, match=words) as info:
        CachingAllocator(source, **kwargs)
    assert "incompatible" not in str(info.value)  # not pybind's overload listing


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(limit_bytes=-1), "limit_bytes"),
        (dict(limit_bytes=2**64), "limit_bytes"),
        (dict(debug=7), "debug"),
        (dict(trace_capacity=2**64), "trace_capacity"),
        (dict(segment_bytes=-1), "segment_bytes"),
    ],
)
def test_the_raw_binding_checks_its_arguments_too(kwargs, words):
    with pytest.raises(ValueError, match=words):
        _C.CachingAllocator(_C.SimDevice(MiB), **kwargs)


@pytest.mark.parametrize(
    ("capacity", "error"),
    [(-1, ValueError), (2**64, ValueError), (10**400, ValueError), (None, ValueError), (1.5, ValueError)],
)
def test_bad_simulated_device_capacity_gives_a_clear_error(capacity, error):
    with pytest.raises(error) as info:
        SimulatedDevice(capacity)
    assert "incompatible" not in str(info.value)


@pytest.mark.parametrize("capacity", [-1, 2**64])
def test_raw_simulated_device_checks_its_capacity(capacity):
    with pytest.raises(ValueError, match="capacity_bytes"):
        _C.SimDevice(capacity)


@pytest.mark.skipif(not _C.has_cuda, reason="no CUDA build")
@pytest.mark.parametrize("index", [-1, 2**40, 1000])
def test_bad_cuda_device_index_gives_a_clear_error(index):
    from supermem.allocator import CudaDevice

    with pytest.raises(ValueError, match="device"):
        CudaDevice(index)


# ---------------------------------------------------------------- huge numbers (issue 8.15)


@pytest.mark.parametrize("nbytes", [2**60 + 1, 2**63, 2**64, 2**64 + 1, 10**400])
def test_huge_malloc_is_the_usual_oom(nbytes):
    a = CachingAllocator(SimulatedDevice(MiB))
    with pytest.raises(OutOfMemoryError, match="more than 1EB"):
        a.malloc(nbytes)
    a.check()


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda a: a.malloc(1, 2**64), "stream"),
        (lambda a: a.malloc(1, -1), "stream"),
        (lambda a: a.free(2**64), "address"),
        (lambda a: a.free(-1), "address"),
        (lambda a: a.record_stream(2**64, 1), "address"),
        (lambda a: a.allocation_size(-1), "address"),
        (lambda a: setattr(a, "limit_bytes", 2**64), "limit_bytes"),
        (lambda a: setattr(a, "limit_bytes", 2**63), "limit_bytes"),
        (lambda a: setattr(a, "trace_capacity", 2**64), "trace_capacity"),
        (lambda a: setattr(a, "trace_capacity", -1), "trace_capacity"),
        (lambda a: a.push_trace("alloc", 0, 2**64), "size"),
    ],
)
def test_out_of_range_numbers_give_clear_errors(call, words):
    a = CachingAllocator(SimulatedDevice(MiB), limit_bytes=MiB // 2)
    with pytest.raises((ValueError, OverflowError), match=words) as info:
        call(a)
    assert "incompatible" not in str(info.value)
    assert a.limit_bytes == MiB // 2 and a.trace_capacity == 0  # nothing half-applied
    a.free(a.malloc(1000))
    a.check()


@pytest.mark.parametrize("nbytes", [True, False, 1.0])
def test_a_malloc_size_is_an_int_not_a_bool(nbytes):
    a = CachingAllocator(SimulatedDevice(MiB))
    with pytest.raises(TypeError, match="nbytes|integer"):
        a.malloc(nbytes)
    assert a.stats()["allocated_bytes"] == 0


# ---------------------------------------------------------------- pressure handlers (issue 8.15)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_pressure_handler_lets_interrupts_reach_the_caller_of_malloc(exc):
    a = CachingAllocator(SimulatedDevice(16 * MiB), limit_bytes=8 * MiB)
    held = a.malloc(6 * MiB)
    calls = []

    def handler(need):
        calls.append(need)
        raise exc()

    a.add_pressure_handler(handler)
    with pytest.raises(exc):
        a.malloc(6 * MiB)
    assert len(calls) == 1
    a.free(held)
    a.free(a.malloc(6 * MiB))  # the allocator is usable afterwards
    a.check()


def test_other_handler_errors_are_still_reported_not_raised(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    a = CachingAllocator(SimulatedDevice(16 * MiB), limit_bytes=8 * MiB)
    a.malloc(6 * MiB)
    a.add_pressure_handler(lambda need: 1 // 0)
    with pytest.raises(OutOfMemoryError):
        a.malloc(6 * MiB)
    assert [type(e) for e in seen] == [ZeroDivisionError]


# OOM observers (the OOM snapshot writer) run as the allocator raises: a failing observer must not hide
# the OOM, but Ctrl-C and sys.exit() in one are the user's, as in a pressure handler.
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_oom_observer_lets_interrupts_reach_the_caller_of_malloc(exc):
    a = CachingAllocator(SimulatedDevice(16 * MiB), limit_bytes=8 * MiB)
    held = a.malloc(6 * MiB)
    calls = []

    def observer(device, requested_bytes, message):
        calls.append(requested_bytes)
        raise exc()

    a._impl.add_oom_observer(observer)
    with pytest.raises(exc):
        a.malloc(6 * MiB)
    assert calls == [6 * MiB]
    a.free(held)
    a.free(a.malloc(6 * MiB))  # the allocator is usable afterwards
    a.check()


def test_other_oom_observer_errors_are_reported_and_the_oom_raised(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    a = CachingAllocator(SimulatedDevice(16 * MiB), limit_bytes=8 * MiB)
    a.malloc(6 * MiB)
    a._impl.add_oom_observer(lambda device, requested_bytes, message: 1 // 0)
    with pytest.raises(OutOfMemoryError):
        a.malloc(6 * MiB)
    assert [type(e) for e in seen] == [ZeroDivisionError]


def test_usage_error_is_a_value_error():
    assert issubclass(UsageError, ValueError)
