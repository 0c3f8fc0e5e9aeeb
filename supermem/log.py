"""supermem's logger, `logging.getLogger("supermem")`, and SUPERMEM_LOG.

Without SUPERMEM_LOG the logger is left to the application: warnings and errors reach its handlers (or,
where it configured none, stderr through logging's last resort), info and debug are dropped. With
SUPERMEM_LOG=debug|info|warning|error, supermem's records from that level up go to stderr through a
handler of its own, and not again through the application's.

Messages start with "supermem: " so that they say where they come from under logging's last resort too,
which prints the bare message. Fatal messages (a bad SUPERMEM_CONF at activation, CLI errors) are printed,
not logged: the process ends, and they must show whatever the application did to logging.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path

ENV = "SUPERMEM_LOG"
LEVELS = ("debug", "info", "warning", "error")

logger = logging.getLogger("supermem")


class _Handler(logging.StreamHandler):
    """SUPERMEM_LOG's handler: a class of its own, so that configure() removes it and no other."""


def configure(environ: dict[str, str] | os._Environ[str] | None = None) -> None:
    """Applies SUPERMEM_LOG (done once at import; tests call it again with their own environment)."""
    env = os.environ if environ is None else environ
    for handler in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    wanted = env.get(ENV, "").strip().lower()
    if not wanted:
        return
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    if wanted in LEVELS:
        logger.setLevel(wanted.upper())
    else:
        logger.setLevel(logging.WARNING)
        logger.warning(
            "supermem: %s=%r is not one of %s; logging warnings and errors", ENV, wanted, ", ".join(LEVELS)
        )


_PACKAGE = str(Path(__file__).resolve().parent) + os.sep
# Passed through on the way to the user's line: supermem, contextlib (which runs `with supermem.trace(...)`
# blocks) and torch, whose modules and autograd call the pool's hooks from inside the user's forward.
_PASSED_THROUGH = (_PACKAGE, contextlib.__file__)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn pointing at the user's line: the stacklevel of the first caller outside supermem
    (and _PASSED_THROUGH), however deep inside supermem the warning is raised."""
    passed: tuple[str, ...] = _PASSED_THROUGH
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if torch_file:
        passed += (os.path.dirname(torch_file) + os.sep,)
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(passed):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


configure()
