"""PyTorch's `torch.backends` entry point: runs at the end of `import torch`, before user code.
It does nothing unless SUPERMEM (not "0"), SUPERMEM_CONF or SUPERMEM_TRACE_CHILD (a rank under
`supermem trace -- torchrun`) is set, and never initialises CUDA."""

import os
import sys
from typing import NoReturn


def wanted(environ: dict | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get("SUPERMEM", "0") not in ("", "0") or bool(env.get("SUPERMEM_CONF"))


def hook() -> None:
    if os.environ.get("SUPERMEM_TRACE_CHILD"):  # a rank under `supermem trace -- torchrun ...`
        _trace_rank()
    if not wanted():
        return
    from .activate import install_from_env
    from .errors import ConfigError

    try:
        install_from_env()
    except ConfigError as e:
        stop_at_activation(bad_conf_message(e))


def bad_conf_message(e: Exception) -> str:
    return f"supermem: bad SUPERMEM_CONF ({os.environ.get('SUPERMEM_CONF', '')!r}): ConfigError: {e}"


def stop_at_activation(message: str) -> None:
    """A bad SUPERMEM_CONF stops the process where supermem would have acted on it: at CUDA's
    initialisation (the allocator swap) or at the first tensor saved for backward (the pool), with the
    one line and exit 2. A process that does neither (a tool or a data worker that imports torch, a CPU
    job without autograd) runs on: every child of a job inherits the variable, and most never use CUDA.
    supermem's API (install, pool, options) still raises ConfigError at once: config.current() parses
    the variable again."""

    from . import torch_private as tp
    from .log import logger

    def stop(*_: object) -> NoReturn:
        print(message, file=sys.stderr)
        # SystemExit: no traceback, and it passes through torch's `except Exception` around queued
        # CUDA calls (and autograd's around hooks) where any other error would be rewrapped.
        raise SystemExit(2)

    logger.info("%s; the process stops at CUDA's initialisation or its first backward", message)
    tp.cuda_lazy_call(stop)  # (runs inside torch.cuda's initialisation, after cuInit)
    tp.push_saved_hooks_importing(stop, stop)


def _trace_rank() -> None:
    try:
        from .trace.run_script import start_from_env

        start_from_env(install=not wanted())  # with SUPERMEM=1 the hook below installs
    except Exception as e:  # noqa: BLE001  (the program runs on, untraced, rather than not at all)
        from .log import logger

        logger.error("supermem trace: error: cannot record this rank: %s: %s", type(e).__name__, e)
