"""PyTorch's `torch.backends` entry point: runs at the end of `import torch`, before user code.
It does nothing unless SUPERMEM (not "0") or SUPERMEM_CONF is set, and never initialises CUDA."""

import os


def wanted(environ: dict | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get("SUPERMEM", "0") not in ("", "0") or bool(env.get("SUPERMEM_CONF"))


def hook() -> None:
    if wanted():
        from .activate import install_from_env

        install_from_env()
