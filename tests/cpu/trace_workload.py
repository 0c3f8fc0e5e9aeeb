"""A training-like workload on a simulated device, for the trace tool's tests.

Parameters, gradients and optimizer state are real torch CPU tensors whose storage is memory the
simulated allocator handed out (torch.frombuffer over the block's address), held by a real nn.Module
and torch.optim.SGD: so attribution by nn.Module/Optimizer can be checked on a CPU-only machine.
Activations and temporaries are raw blocks; the "pool" announces some activations through
supermem.events (as the real pool does) and pushes others into the allocator's ring (push_trace).

The workload keeps its own ledger of what it allocated, by role, to check the trace against.
"""

from __future__ import annotations

import ctypes
import random
from dataclasses import dataclass, field

import torch

from supermem import events
from supermem.allocator import CachingAllocator, SimulatedDevice


def sim_tensor(alloc: CachingAllocator, numel: int) -> tuple[torch.Tensor, int]:
    """A float32 CPU tensor of `numel` elements living in a block of `alloc`, and that block's address."""
    nbytes = numel * 4
    addr = alloc.malloc(nbytes)
    buf = (ctypes.c_char * nbytes).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.float32, count=numel), addr


# The category the trace tool should give each role: pool events name activations; what is only pushed
# into the ring (push_trace has no category) and temporaries stay unknown.
EXPECTED_CATEGORY = {
    "parameter": "parameter",
    "gradient": "gradient",
    "optimizer_state": "optimizer_state",
    "activation": "activation",
    "activation_pushed": "unknown",
    "temporary": "unknown",
}


@dataclass
class Ledger:
    """Every block the workload allocated, in order: (address, rounded size, role)."""

    allocations: list[tuple[int, int, str]] = field(default_factory=list)
    steps: int = 0
    pool_events: int = 0  # emitted through supermem.events
    pushed_events: int = 0  # pushed into the allocator ring
    peak_live_bytes: int = 0  # computed here, independently of the trace tool
    live_at_peak: dict[int, tuple[int, str]] = field(default_factory=dict)  # address -> (size, role)


class SimModel(torch.nn.Module):
    def __init__(self, alloc: CachingAllocator, widths: list[int]):
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(sim_tensor(alloc, w)[0]) for w in widths])


class Workload:
    """`steps` training steps of `layers` layers on `alloc`: forward keeps an activation per layer and
    frees a temporary, backward frees activations in reverse, making gradients; the optimizer step
    makes momentum buffers once; zero_grad frees the gradients (set_to_none)."""

    def __init__(self, alloc: CachingAllocator, layers: int = 12, seed: int = 0, device: int = 0):
        self.alloc = alloc
        self.rng = random.Random(seed)
        self.ledger = Ledger()
        self.device = device
        self.widths = [self.rng.choice([1 << 12, 1 << 14, 3 << 16]) for _ in range(layers)]
        self.act_bytes = [self.rng.choice([256 << 10, 3 << 20, 12 << 20]) for _ in range(layers)]
        self.live: dict[int, tuple[int, str]] = {}
        self.model = SimModel(alloc, self.widths)
        for p in self.model.parameters():
            addr = p.untyped_storage().data_ptr()
            self._track(addr, "parameter")
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self._grads: list[int] = []

    def _track(self, addr: int, role: str) -> None:
        size = self.alloc.allocation_size(addr)
        self.live[addr] = (size, role)
        self.ledger.allocations.append((addr, size, role))
        total = sum(s for s, _ in self.live.values())
        if total > self.ledger.peak_live_bytes:
            self.ledger.peak_live_bytes = total
            self.ledger.live_at_peak = dict(self.live)

    def _malloc(self, nbytes: int, role: str) -> int:
        addr = self.alloc.malloc(nbytes)
        self._track(addr, role)
        return addr

    def _free(self, addr: int) -> None:
        self.alloc.free(addr)
        del self.live[addr]

    def step(self) -> None:
        acts = []
        for i, nbytes in enumerate(self.act_bytes):
            role = ("activation", "activation_pushed", "temporary")[i % 3]
            a = self._malloc(nbytes, role)
            acts.append(a)
            size = self.live[a][0]
            if i % 3 == 0:  # the pool offloads it and says so
                events.emit("offload", size, a, self.device, i + 1, "activation", "d2h")
                self.ledger.pool_events += 1
            elif i % 3 == 1:  # a pool event pushed into the allocator ring (no category there)
                self.alloc.push_trace("offload", a, size, 0, i + 1)
                self.ledger.pushed_events += 1
            self._free(self._malloc(nbytes // 2 + 512, "temporary"))
        for i, (a, p) in enumerate(zip(reversed(acts), reversed(list(self.model.parameters())), strict=True)):
            if (len(acts) - 1 - i) % 3 == 0:
                events.emit("prefetch", self.live[a][0], a, self.device, len(acts) - i, "activation", "h2d")
                self.ledger.pool_events += 1
            g, gaddr = sim_tensor(self.alloc, p.numel())
            self._track(gaddr, "gradient")
            p.grad = g
            self._grads.append(gaddr)
            self._free(a)
        if not self.opt.state:  # momentum buffers made once, in simulated memory
            for p in self.model.parameters():
                buf, baddr = sim_tensor(self.alloc, p.numel())
                buf.zero_()
                self._track(baddr, "optimizer_state")
                self.opt.state[p]["momentum_buffer"] = buf
        self.opt.step()
        for p in self.model.parameters():  # zero_grad(set_to_none=True), freeing the blocks
            p.grad = None
        for gaddr in self._grads:
            self._free(gaddr)
        self._grads.clear()
        self.ledger.steps += 1

    def run(self, steps: int) -> Ledger:
        for _ in range(steps):
            self.step()
        return self.ledger


def make_allocator(capacity: str = "16GiB", limit: str | None = None) -> CachingAllocator:
    return CachingAllocator(SimulatedDevice(capacity), limit)
