"""Ctrl-C and sys.exit() inside a pressure handler or an OOM observer reach the code that allocated the
tensor (issue 8.15): torch.empty raises KeyboardInterrupt / SystemExit, not a RuntimeError or the OOM, and
the allocator stays usable."""

import pytest
from gpu_harness import NATIVE_DRY_RUN, needs_cuda, run_python

pytestmark = [*needs_cuda, pytest.mark.skipif(NATIVE_DRY_RUN, reason="pressure handlers are supermem's")]


@pytest.mark.parametrize("exc", ["KeyboardInterrupt", "SystemExit"])
def test_interrupt_in_a_pressure_handler_reaches_torch_empty(exc):
    r = run_python(
        f"""
        import torch, supermem
        from supermem import _C
        assert supermem.installed()
        calls = []
        def handler(need):
            calls.append(need)
            raise {exc}()
        _C.plugin_add_pressure_handler(handler)
        torch.cuda.set_per_process_memory_fraction(0.0)  # every new segment needs the handlers
        try:
            torch.empty(4096, dtype=torch.uint8, device="cuda")
            got = "no exception"
        except BaseException as e:
            got = type(e).__name__
        torch.cuda.set_per_process_memory_fraction(1.0)
        x = torch.ones(1024, device="cuda")
        emit(got=got, calls=len(calls), usable=float(x.sum()))
        """,
        env={"SUPERMEM": "1"},
    )
    assert r.rc == 0, r.describe()
    assert r.json() == {"got": exc, "calls": 1, "usable": 1024.0}


@pytest.mark.parametrize("exc", ["KeyboardInterrupt", "SystemExit"])
def test_interrupt_in_an_oom_observer_reaches_torch_empty(exc):
    """The same for an OOM observer (the OOM snapshot writer runs as one): the interrupt, not the OOM."""
    r = run_python(
        f"""
        import torch, supermem
        from supermem import _C
        assert supermem.installed()
        calls = []
        def observer(device, requested_bytes, message):
            calls.append(requested_bytes)
            raise {exc}()
        _C.plugin_add_oom_observer(observer)
        torch.cuda.set_per_process_memory_fraction(0.0)  # every new segment is an OOM
        try:
            torch.empty(4096, dtype=torch.uint8, device="cuda")
            got = "no exception"
        except BaseException as e:
            got = type(e).__name__
        torch.cuda.set_per_process_memory_fraction(1.0)
        x = torch.ones(1024, device="cuda")
        emit(got=got, calls=len(calls), usable=float(x.sum()))
        """,
        env={"SUPERMEM": "1"},
    )
    assert r.rc == 0, r.describe()
    assert r.json() == {"got": exc, "calls": 1, "usable": 1024.0}
