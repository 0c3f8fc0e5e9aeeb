"""Trains a small model a few steps with deterministic settings and saves what a user would compare:
the loss of every step, the last step's gradients and the final weights (the golden test's subject).

    python golden_train.py gpt|resnet OUT.pt [--conf CONF] [--steps N]

--conf swaps supermem's allocator in first (`supermem.install(CONF)`; "" for the defaults); without
it the run is native. Prints one `@@JSON {...}` line: which allocator served the run, and its peaks.
The determinism settings are those docs/design.md#determinism gives as bitwise reproducible run to run.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model", choices=("gpt", "resnet"))
    p.add_argument("out")
    p.add_argument("--conf", default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cuda", help="cpu: to try this script without a GPU")
    args = p.parse_args()
    if args.conf is not None:
        import supermem

        supermem.install(args.conf or None)

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from supermem.bench.models import PRESETS, loss_fn

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    preset = PRESETS[f"{args.model}-golden"]
    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:
        model = preset.build()
    if args.model == "gpt":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    saved, losses = {}, []
    for step in range(args.steps):
        x, y = preset.batch(device, gen)
        with sdpa_kernel(SDPBackend.MATH), torch.autocast(device.type, torch.bfloat16, enabled=preset.bf16):
            loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.detach().float().cpu())
        if step == args.steps - 1:
            saved.update({f"grad.{n}": q.grad.detach().cpu() for n, q in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    saved.update({f"param.{n}": q.detach().cpu() for n, q in model.named_parameters()})
    saved.update({f"buffer.{n}": b.detach().cpu() for n, b in model.named_buffers()})
    saved["loss"] = torch.stack(losses)
    torch.save(saved, args.out)

    meta = {"losses": [float(v) for v in losses]}
    if device.type == "cuda":
        meta.update(
            backend=torch.cuda.get_allocator_backend(),
            peak_alloc_bytes=torch.cuda.max_memory_allocated(),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(),
        )
    if args.conf is not None:
        import supermem

        stats = supermem.device_allocator(0).stats()
        meta.update(
            supermem_num_allocs=stats["num_allocs"], supermem_alloc_retries=stats["num_alloc_retries"]
        )
    print("@@JSON " + json.dumps(meta), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
