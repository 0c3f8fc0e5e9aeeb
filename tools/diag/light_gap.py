"""GPU diagnosis of a pooled model's gradients against native's, beside torch.utils.checkpoint wrapped
around chosen module classes (reentrant or not): which parameters' gradients differ per step, the
last-run ones first (backward order), and which stay equal.
    python3 tools/diag/light_gap.py MODEL SIZE STEPS variant...
variant: native | pool:SHARE[:nographs][:light=Class,Class] | ckpt-r:Class,Class | ckpt-n:Class,Class"""

import functools
import sys

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, "tests")
from corpus import CASES  # noqa: E402

from supermem.tensor_pool import Pool  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def det():
    b = torch.backends
    b.cudnn.deterministic, b.cudnn.benchmark = True, False
    b.cudnn.allow_tf32 = b.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def wrap(model, classes, reentrant):
    n = 0
    for m in model.modules():
        if type(m).__name__ in classes:
            m.forward = functools.partial(checkpoint, m.forward, use_reentrant=reentrant)
            n += 1
    return n


def only_light(pool, classes):
    """Light calls for modules of `classes` alone: the others' uses read None (not light-ready)."""
    regions = pool.regions
    pre = regions._pre_call

    def pre_call(module, args, kwargs, p):
        if type(module).__name__ not in classes:
            regions.uses[module] = None
        return pre(module, args, kwargs, p)

    regions._pre_call = pre_call


def train(name, size, steps, variant, peak=None, probe=None):
    torch.manual_seed(0)
    model, batch, loss_of = CASES[name](size)
    model = model.to(DEV).train()
    pool, note = probe, ""
    if variant.startswith("ckpt-"):
        note = f"{wrap(model, variant.split(':')[1].split(','), variant[5] == 'r')} wrapped"
    elif variant.startswith("pool:"):
        _, share, *rest = variant.split(":")
        pool = Pool(budget=int(float(share) * peak), policy="planned", graphs="nographs" not in rest, min_bytes=0)
        for r in rest:
            if r.startswith("light="):
                only_light(pool, r[6:].split(","))
    inputs = batch(torch.Generator().manual_seed(1)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(2)
    out = []
    names = [n for n, _ in model.named_parameters()]
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with pool if pool is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = loss_of(model, inputs)
            loss.backward()
        out.append((loss.item(), [(n, p.grad.clone()) for n, p in zip(names, model.parameters()) if p.grad is not None]))
        opt.step()
    if pool is not None:
        st = pool.stats()
        note = " ".join(f"{k}={st[k]}" for k in ("light_calls", "graph_replays", "bypassed_calls", "recomputes"))
    return out, note


def main():
    name, size, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    det()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        if DEV == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ref, _ = train(name, size, steps, "native")
        if DEV == "cuda":
            peak = torch.cuda.max_memory_allocated()
        else:  # (on a CPU the pool's own count of the saved bytes it holds)
            probe = Pool(policy="lru", min_bytes=0)
            train(name, size, 2, "probe", probe=probe)
            peak = probe.stats()["peak_resident_bytes"]
        for v in sys.argv[4:]:
            got, note = train(name, size, steps, v, peak)
            print(f"== {name} {size} {v}: {note}", flush=True)
            for k, ((la, ga), (lb, gb)) in enumerate(zip(ref, got)):
                gb = dict(gb)
                bad = [n for n, g in ga if not torch.equal(g, gb.get(n, torch.empty(0, device=g.device)))]
                good = [n for n, _ in ga if n not in bad]
                loss = "==" if la == lb else f"{la!r} vs {lb!r}"
                print(f"  step {k}: loss {loss}; {len(bad)}/{len(ga)} differ; last-run differing {bad[::-1][:4]}")
                if bad and good:
                    print(f"     equal: {good[::-1][:14]}")


main()
