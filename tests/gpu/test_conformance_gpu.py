"""The conformance suite against a real GPU (CudaDevice(0)); skipped without one."""

import pytest
import torch
from alloc_spec import PAGE, GiB
from conformance import AllocatorConformance, Target

import supermem._C

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and supermem._C.has_cuda and supermem._C.cuda_device_count() > 0):
    pytest.skip("needs a CUDA GPU and a CUDA build of supermem", allow_module_level=True)

from supermem.allocator import CachingAllocator, CudaDevice  # noqa: E402  (exists only in CUDA builds)


class _RawDeviceBytes:
    """Device memory at a raw address, as an object torch.as_tensor can wrap without copying."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
        }


class CudaMemory:
    """Reads and writes GPU memory at raw addresses through torch (copies are synchronous)."""

    def _view(self, address: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_RawDeviceBytes(address, nbytes), device="cuda")

    def write(self, address: int, data: bytes) -> None:
        self._view(address, len(data)).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        torch.cuda.synchronize()

    def read(self, address: int, nbytes: int) -> bytes:
        return bytes(self._view(address, nbytes).cpu().tolist())


CONFIGS = {
    "default": {},
    "passthrough": {"passthrough": True},
    "limited": {"limit_bytes": 2 * GiB},
    "debug2": {"debug": 2},
    "expandable": {"expandable_segments": True},
    "expandable-limited": {"expandable_segments": True, "limit_bytes": 2 * GiB},
}


@pytest.fixture(params=list(CONFIGS), scope="module")
def target(request) -> Target:
    options = CONFIGS[request.param]
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    device = CudaDevice(0)
    expandable = options.get("expandable_segments", False)
    if expandable and device.page_bytes != PAGE:  # the spec's sizes are whole 2 MiB pages
        pytest.skip(f"this GPU's virtual memory page is {device.page_bytes} bytes, not {PAGE}")
    return Target(
        name=f"cuda-{request.param}",
        make=lambda: CachingAllocator(device, **options),
        memory=CudaMemory(),
        streams=(streams[0].cuda_stream, streams[1].cuda_stream),
        passthrough=options.get("passthrough", False),
        expandable=expandable,
        limit_bytes=options.get("limit_bytes"),
        keep=[streams, device],
    )


class TestCudaDevice(AllocatorConformance):
    pass
