"""fork() while other threads use the allocator: the child inherits the memory of every lock, and a lock
held by a thread that does not exist in the child would stay locked forever. supermem takes its locks
around fork (pthread_atfork), so the child's allocator, trace ring and device are usable."""

import os
import subprocess
import sys
import textwrap

import pytest

if not hasattr(os, "fork"):
    pytest.skip("no fork on this platform", allow_module_level=True)


CHILD_TIMEOUT_S = 10


def test_children_forked_while_a_thread_hammers_the_allocator_can_malloc():
    # In a child interpreter: a hang (the bug) is then killed by our timeout, not pytest's.
    code = f"""
        import os, threading, time
        from supermem.allocator import CachingAllocator, SimulatedDevice
        a = CachingAllocator(SimulatedDevice(256 << 20), trace_capacity=64)
        dev = a.device
        stop = False
        def hammer():
            n = 0
            while not stop:
                ptrs = [a.malloc(s) for s in (512, 4096, 1 << 20, 3 << 20)]
                a.record_stream(ptrs[0], 7)
                for p in ptrs:
                    a.free(p)
                n += 1
                if n % 16 == 0:
                    a.empty_cache()  # segment frees: the device's own lock too
                    a.drain_trace()
        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for t in threads:
            t.start()
        hung = 0
        for i in range(48):
            time.sleep(0.002)
            pid = os.fork()
            if pid == 0:  # child: only this thread exists now
                p = a.malloc(1 << 20)
                a.free(p)
                a.empty_cache()
                a.drain_trace()
                _ = dev.used_bytes
                a.check()
                os._exit(0)
            deadline = time.monotonic() + {CHILD_TIMEOUT_S}
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    assert os.waitstatus_to_exitcode(status) == 0, (i, status)
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    hung += 1
                    break
                time.sleep(0.005)
        stop = True
        for t in threads:
            t.join()
        a.check()
        print("hung", hung)
    """
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, (p.stdout, p.stderr[-3000:])
    assert p.stdout.split() == ["hung", "0"], p.stdout
