"""supermem.log: the "supermem" logger under SUPERMEM_LOG, and warnings that point at the user's line."""

import inspect
import logging
import warnings
from pathlib import Path

import supermem
from supermem import log


def test_a_warning_raised_deep_inside_supermem_points_at_the_callers_line():
    # Three frames inside the package, as a warning from a pool or a trace is raised.
    fake = Path(supermem.__file__).parent / "deep_module.py"
    source = (
        "def a(warn):\n    b(warn)\ndef b(warn):\n    c(warn)\ndef c(warn):\n    warn('supermem: here')\n"
    )
    scope: dict = {}
    exec(compile(source, str(fake), "exec"), scope)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope["a"](log.warn)
        line = inspect.currentframe().f_lineno - 1  # the line above
    assert [(w.filename, w.lineno, str(w.message)) for w in caught] == [(__file__, line, "supermem: here")]


def test_supermem_log_sets_the_level_and_sends_supermem_records_to_stderr_once(capsys):
    logger = logging.getLogger("supermem")
    try:
        for env, shown in (
            ({}, []),
            ({"SUPERMEM_LOG": "info"}, ["supermem: info"]),
            ({"SUPERMEM_LOG": "DEBUG"}, ["supermem: debug", "supermem: info"]),
        ):
            log.configure(env)
            assert log.logger is logger
            logger.debug("supermem: debug")
            logger.info("supermem: info")
            assert capsys.readouterr().err.splitlines() == shown, env
    finally:
        log.configure({})
