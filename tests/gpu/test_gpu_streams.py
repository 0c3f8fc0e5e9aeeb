"""Streams and devices under supermem: a block is never handed out while another stream may still use
it (Tensor.record_stream, frees with work pending), threads with their own streams, pinned async
copies, and a second GPU (skipped with one).

torch.cuda._sleep keeps a stream busy for SLEEP_CYCLES (tens of ms), wide enough that an early reuse
lands before the pending work and changes what it reads or writes.
"""

import random
import threading
import traceback

import torch
from gpu_child import MiB, Skip, assert_cookie, cookie, device_allocator
from gpu_harness import check_tests, needs_cuda

pytestmark = needs_cuda

SLEEP_CYCLES = 100_000_000
N = 64 * MiB


def _full(nbytes: int, value: int) -> torch.Tensor:
    return torch.full((nbytes,), value, dtype=torch.uint8, device="cuda")


def check_record_stream_delays_reuse():
    side = torch.cuda.Stream()
    reused = 0
    for round_ in range(5):
        x = _full(N, 1)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            y = x.clone()  # reads x after the sleep
        x.record_stream(side)
        x_ptr = x.data_ptr()
        del x
        z = _full(N, 2)  # on the current stream: must not land in x's block before the clone ran
        reused += z.data_ptr() == x_ptr
        torch.cuda.synchronize()
        assert bool((y == 1).all()), f"round {round_}: the side stream read a reused block"
        del y, z
    return {"rounds_where_x_block_was_reused_at_once": reused}


def check_free_with_pending_work_is_not_given_to_another_stream():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        x = torch.empty(N, dtype=torch.uint8, device="cuda")  # belongs to the side stream
        x.fill_(5)  # queued behind the sleep
    del x  # freed with the fill still pending on the side stream
    z = _full(N, 9)  # the current stream is idle: if z got x's block, the late fill overwrites it
    torch.cuda.synchronize()
    assert bool((z == 9).all()), "a block freed on a busy stream was handed to another stream at once"


def check_threads_with_their_own_streams():
    errors: list[str] = []

    def worker(tid: int) -> None:
        try:
            rng = random.Random(tid)
            with torch.cuda.stream(torch.cuda.Stream()):
                live = []
                for i in range(300):
                    key = tid * 1000 + i
                    live.append(
                        (
                            key,
                            cookie(
                                torch.empty(int(2 ** rng.uniform(4, 24)), dtype=torch.uint8, device="cuda"),
                                key,
                            ),
                        )
                    )
                    if len(live) > 20:
                        k, t = live.pop(rng.randrange(len(live)))
                        assert_cookie(t, k, f"thread {tid} tensor {k}")
                for k, t in live:
                    assert_cookie(t, k, f"thread {tid} tensor {k}")
        except BaseException:  # noqa: BLE001
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def check_pinned_async_copies_on_a_side_stream():
    host = torch.arange(N // 4, dtype=torch.int32).pin_memory()
    back = torch.empty_like(host).pin_memory()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        d = torch.empty(host.shape, dtype=host.dtype, device="cuda")
        d.copy_(host, non_blocking=True)
        d.add_(1)
        back.copy_(d, non_blocking=True)
    side.synchronize()
    assert torch.equal(back, host + 1)


def check_second_device():
    if torch.cuda.device_count() < 2:
        raise Skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    torch.cuda.set_device(0)
    before = torch.cuda.memory_allocated(1)
    x = cookie(torch.empty(N, dtype=torch.uint8, device="cuda:1"), 7)  # current device is 0
    assert torch.cuda.memory_allocated(1) >= before + N
    assert torch.cuda.memory_allocated(1) == device_allocator(1).stats()["allocated_bytes"]
    assert_cookie(x.to("cuda:0"), 7, "a peer copy")
    with torch.cuda.device(1):
        y = cookie(torch.empty(N, dtype=torch.uint8, device="cuda:0"), 8)  # current device is 1
    del x  # freed while the current device is 0
    with torch.cuda.device(1):
        assert_cookie(y, 8)
        del y  # a device-0 tensor freed while the current device is 1
    assert torch.cuda.memory_allocated(1) == before
    device_allocator(1).check()


def check_invariants_hold():
    device_allocator().check()


test_streams = check_tests(__name__)
