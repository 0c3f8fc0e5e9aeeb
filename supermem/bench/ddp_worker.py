"""One rank of a data-parallel GPT training run, launched by torchrun: the worker of
`supermem bench train --ddp N` and of tests/gpu/test_distributed_gpu.py (and, with --device cpu, of the
gloo tests).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m supermem.bench.ddp_worker OUT_DIR
        [--wrap ddp|fsdp] [--steps 20] [--layers 24 --dim 1024 --heads 16 --vocab 50304 --batch 8 --seq 1024]
        [--oom-rank R] [--device cuda|cpu]

An unchanged training script: supermem, when on, is switched on by SUPERMEM / SUPERMEM_CONF in the
environment, as a user would. Deterministic settings (docs/design.md#determinism) so that runs can be
compared bit for bit. Each rank writes OUT_DIR/rank{R}.json: the loss of every step, step times, peak
allocated bytes, a hash of its parameters (its shard under FSDP2), the allocator that served it, the
pool's counters, and with --oom-rank R how an allocation larger than the card failed on rank R.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="supermem.bench.ddp_worker")
    p.add_argument("out_dir")
    p.add_argument("--wrap", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the step time")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--oom-rank", type=int, default=-1)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from supermem.bench.models import GPT, loss_fn

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)  # before any CUDA tensor: the pool and budget follow this device
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same initial weights on every rank
    with device:
        model = GPT(layers=args.layers, d=args.dim, heads=args.heads, vocab=args.vocab, ctx=args.seq)
    if args.wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: torch.nn.Module = DistributedDataParallel(model, device_ids=[local] if cuda else None)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)  # in place: the same object, its class now also an FSDPModule
        wrapped = model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    losses, times_s, oom = [], [], None
    for step in range(args.steps):
        if step == 2 and rank == args.oom_rank:
            oom = _provoke_oom(torch, device)
        x, y = (t.to(device) for t in _tokens(torch, gen, args))
        _sync(torch, cuda)
        t0 = time.perf_counter()
        with sdpa_kernel(SDPBackend.MATH), torch.autocast(device.type, torch.bfloat16, enabled=cuda):
            loss = loss_fn(wrapped(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(torch, cuda)
        times_s.append(time.perf_counter() - t0)
        losses.append(float(loss.detach().float().cpu()))
    timed = times_s[args.warmup :] or times_s
    out = {
        "rank": rank,
        "world_size": world,
        "wrap": args.wrap,
        "losses": losses,
        "step_s": statistics.median(timed),
        "params_sha256": _params_hash(model),
        "oom": oom,
        "pool": _pool_stats(),
        "supermem_conf": os.environ.get("SUPERMEM_CONF", ""),
    }
    if cuda:
        out.update(
            device=local,
            backend=torch.cuda.get_allocator_backend(),
            peak_alloc_bytes=torch.cuda.max_memory_allocated(device),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
            total_bytes=torch.cuda.get_device_properties(device).total_memory,
        )
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


def _tokens(torch, gen, args):
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _sync(torch, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _provoke_oom(torch, device) -> dict:
    """Asks for more than the card holds, outside any collective (the other ranks go on): what came back."""
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 1 << 60
    try:
        torch.empty(int(total * 1.5), dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError as e:
        return {"type": "OutOfMemoryError", "message": str(e)[:300]}
    except Exception as e:  # noqa: BLE001  (the test reports what it was instead)
        return {"type": type(e).__name__, "message": str(e)[:300]}
    return {"type": None, "message": "the allocation succeeded"}


def _params_hash(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2: this rank's shard
        h.update(t.float().cpu().numpy().tobytes())
    return h.hexdigest()


def _pool_stats() -> dict | None:
    if "supermem" not in sys.modules:
        return None
    from supermem.tensor_pool import global_pool

    pool = global_pool()
    if pool is None:
        return None
    s = pool.stats()
    return {k: v for k, v in s.items() if isinstance(v, (int, float, str)) or v is None}


if __name__ == "__main__":
    sys.exit(main())
