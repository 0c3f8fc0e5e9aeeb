"""GPU diagnosis: where a pooled third-party model's training leaves native's bits. Per step: loss
equal, which gradients differ (first names). python3 tools/diag/diag_light.py MODEL SHARE [variant...]"""

import sys
import warnings

import torch

sys.path.insert(0, "tests")
from corpus import CASES  # noqa: E402

from supermem.tensor_pool import Pool  # noqa: E402


def det():
    b = torch.backends
    b.cudnn.deterministic, b.cudnn.benchmark = True, False
    b.cudnn.allow_tf32 = b.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def train(name, pool, steps):
    torch.manual_seed(0)
    model, batch, loss_of = CASES[name]("real")
    model = model.cuda().train()
    inputs = batch(torch.Generator().manual_seed(1))
    inputs = inputs.cuda() if isinstance(inputs, torch.Tensor) else tuple(x.cuda() for x in inputs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(2)
    out = []
    names = [n for n, _ in model.named_parameters()]
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with pool if pool is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = loss_of(model, inputs)
            loss.backward()
        out.append(
            (loss.item(), {n: p.grad.cpu() for n, p in zip(names, model.parameters()) if p.grad is not None})
        )
        opt.step()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated()


def main():
    name, share = sys.argv[1], float(sys.argv[2])
    variants = sys.argv[3:] or ["default"]
    det()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        torch.cuda.reset_peak_memory_stats()
        ref, peak = train(name, None, 6)
        for v in variants:
            kw = dict(graphs=False) if v == "nographs" else {}
            if v.startswith("t:"):
                kw["treatments"] = v[2:]
            pool = Pool(budget=int(share * peak), policy="planned", **kw)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                got, _ = train(name, pool, 6)
            st = pool.stats()
            print(
                f"== {name} {share:.0%} {v}: "
                + " ".join(
                    f"{k}={st[k]}"
                    for k in (
                        "light_calls",
                        "graph_replays",
                        "bypassed_calls",
                        "recomputes",
                        "light_split_misses",
                    )
                )
            )
            for w in {str(w.message)[:160] for w in said}:
                print("   warn:", w)
            for k, ((la, ga), (lb, gb)) in enumerate(zip(ref, got)):
                bad = [n for n in ga if not torch.equal(ga[n], gb.get(n, torch.empty(0)))]
                loss = "==" if la == lb else f"{la!r} vs {lb!r}"
                print(f"  step {k}: loss {loss} grads differ {len(bad)}/{len(ga)} {bad[:6]}")
            del pool


main()
