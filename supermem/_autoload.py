"""PyTorch's `torch.backends` entry point: runs at the end of `import torch`, before user code.
It does nothing unless SUPERMEM (not "0"), SUPERMEM_CONF or SUPERMEM_TRACE_CHILD (a rank under
`supermem trace -- torchrun`) is set, and never initialises CUDA."""

import os
import sys


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
        # A user mistake: stop with the message, not a traceback. SystemExit passes through torch's
        # `except Exception` around entry points, whichever version of torch this is.
        print(
            f"supermem: bad SUPERMEM_CONF ({os.environ.get('SUPERMEM_CONF', '')!r}): ConfigError: {e}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def _trace_rank() -> None:
    try:
        from .trace.run_script import start_from_env

        start_from_env(install=not wanted())  # with SUPERMEM=1 the hook below installs
    except Exception as e:  # noqa: BLE001  (the program runs on, untraced, rather than not at all)
        print(f"supermem trace: error: cannot record this rank: {type(e).__name__}: {e}", file=sys.stderr)
