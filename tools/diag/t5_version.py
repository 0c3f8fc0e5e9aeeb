"""GPU diagnosis: the corpus' T5 (tests/corpus.py, real size) under lru raised autograd's in-place error
for an int64 (512, 512) saved tensor (its watcher read version 0, saved at 1) with SUPERMEM=1 on an
H200. Prints how a version watcher behaves on this torch, then trains T5 under a pool and, for every
watcher made, where and how (the tensor's version then, the watcher's, grad and inference mode).
    SUPERMEM=1 python3 tools/diag/t5_version.py [policy] [share]"""

import sys
import traceback
import warnings

import torch

sys.path.insert(0, "tests")
from corpus import build_and_train  # noqa: E402

from supermem.tensor_pool import Pool  # noqa: E402
from supermem.tensor_pool import entry as E  # noqa: E402

warnings.simplefilter("ignore")
for dev in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
    t = torch.zeros(4, dtype=torch.int64, device=dev)
    t += 1
    w = E.version_watcher(t)
    t += 1
    print(f"{dev}: tensor version {t._version}, watcher {w._version} (shares: {t._version == w._version})")

made = []
_watch = E.Entry.watch_version


def watch_version(self):
    had = self.watch is None and self.tensor is not None
    before = self.tensor._version if had else None
    _watch(self)
    if had and self.dtype == torch.int64:
        made.append(
            (
                self.shape,
                self.made_by,
                self.version,
                before,
                self.watch._version,
                torch.is_grad_enabled(),
                torch.is_inference_mode_enabled(),
                "".join(traceback.format_stack(limit=12)[:-1]),
            )
        )


E.Entry.watch_version = watch_version
policy = sys.argv[1] if len(sys.argv) > 1 else "lru"
share = float(sys.argv[2]) if len(sys.argv) > 2 else 0.6
torch.cuda.reset_peak_memory_stats()
build_and_train("t5", "real", None, steps=1, device="cuda")
peak = torch.cuda.max_memory_allocated()
try:
    build_and_train("t5", "real", Pool(budget=int(share * peak), policy=policy), steps=3, device="cuda")
    print("trained")
except RuntimeError as e:
    print("RAISED", str(e)[:300])
for shape, by, saved, before, watched, grad, inference, stack in made:
    print(
        f"watcher of {tuple(shape)} by {by}: saved v{saved}, tensor v{before}, watcher v{watched}, "
        f"grad={grad}, inference={inference}"
    )
    if saved != watched:
        print(stack)
