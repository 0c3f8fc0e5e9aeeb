"""GPU diagnosis: a pooled Llama's light calls (module class, per-input uses, extra slots) and which
steps' gradients leave native's, with the light calls limited to some module classes from the
planned steps on. python3 tools/diag/light_uses.py SIZE SHARE [variant...]; variant: all | only=Class,Class
| summed (the per-use slots off: each input's gradient summed inside the call)"""

import collections
import sys
import warnings

import torch

from supermem.tensor_pool import Pool
from supermem.tensor_pool import light as L

warnings.simplefilter("ignore")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
seen: collections.Counter = collections.Counter()
_attach = L._Light.attach


def attach(self, tracker, module, args, kwargs, output, pool):
    if MODE == "summed":
        self.uses = None
    r = _attach(self, tracker, module, args, kwargs, output, pool)
    seen[(type(module).__name__, self.uses, tuple(self.extra))] += 1
    return r


L._Light.attach = attach
MODE = "all"


def run(pool, size, steps, only=None):
    import transformers as t

    torch.manual_seed(0)
    d, layers, seq, batch, vocab = (1024, 12, 1024, 4, 32768) if size == "real" else (256, 4, 256, 2, 2048)
    cfg = t.LlamaConfig(
        hidden_size=d,
        intermediate_size=d * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=d // 32,
        num_key_value_heads=d // 128,
        vocab_size=vocab,
        max_position_embeddings=2048,
    )
    m = t.LlamaForCausalLM(cfg).to(DEV).train()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(DEV)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    names = [n for n, _ in m.named_parameters()]
    out = []
    for k in range(steps):
        if only is not None and k == 2:
            regions, pre = pool.regions, pool.regions._pre_call

            def pre_call(module, args, kwargs, p, pre=pre, regions=regions):
                if type(module).__name__ not in only:
                    regions.refused.setdefault(module, "diag")
                return pre(module, args, kwargs, p)

            regions._pre_call = pre_call
        opt.zero_grad(set_to_none=True)
        with pool if pool is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
        out.append([(n, p.grad.clone()) for n, p in zip(names, m.parameters())])
        opt.step()
    return out


def main():
    global MODE
    size, share = sys.argv[1], float(sys.argv[2])
    b = torch.backends
    b.cudnn.deterministic, b.cudnn.benchmark = True, False
    b.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        if DEV == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ref = run(None, size, 4)
        peak = torch.cuda.max_memory_allocated() if DEV == "cuda" else None
        if peak is None:
            probe = Pool(policy="lru")
            run(probe, size, 2)
            peak = probe.stats()["peak_resident_bytes"]
        for v in sys.argv[3:] or ["all"]:
            MODE = v
            seen.clear()
            pool = Pool(budget=int(share * peak), policy="planned")
            only = v[5:].split(",") if v.startswith("only=") else None
            got = run(pool, size, 4, only)
            st = pool.stats()
            print(
                f"== {size} {share:.0%} {v}: light {st['light_calls']} bypassed {st['bypassed_calls']} "
                f"recomputes {st['recomputes']} misses {st['light_split_misses']}; {dict(seen)}",
                flush=True,
            )
            for k, (a, g) in enumerate(zip(ref, got)):
                bad = [n for (n, x), (_, y) in zip(a, g) if not torch.equal(x, y)]
                good = [n for n, _ in a if n not in bad]
                print(
                    f"  step {k}: {len(bad)}/{len(a)} differ; equal (last-run first) {good[::-1][:8]}",
                    flush=True,
                )


main()
