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


def test_a_warning_from_a_hook_torch_calls_points_at_the_users_line():
    """The pool's warnings are raised in its saved-tensor hooks, which torch's modules and autograd
    call from inside the user's forward: past torch's frames too, the user's line."""
    import torch
    import torch.nn as nn

    from supermem.tensor_pool import Pool

    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in "abcd"])
    x = torch.randn(32, 64)
    pool = Pool(budget=1 << 10, policy="planned", min_bytes=0)  # below any plan: the planner says so
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with pool:
                lines.append(inspect.currentframe().f_lineno + 1)
                loss = model(x).square().mean()
                loss.backward()
    said = [w for w in caught if "no plan keeps this step" in str(w.message)]
    assert said and all((w.filename, w.lineno) == (__file__, lines[0]) for w in said), [
        (w.filename, w.lineno) for w in said
    ]


# What may write to stderr itself: the command line's own output (its progress and results), and the
# fatal message of a bad SUPERMEM_CONF at activation (log.py: printed, not logged)
SPEAKS_FOR_ITSELF = ("cli.py", "cli_", "run_script.py", "bench/", "_autoload.py")


def test_the_library_speaks_through_its_logger_and_log_warn():
    """No warnings.warn but log.warn's (it points at the user's line), no print to stderr outside the
    command line's own files: a message from the pool, the trace or the allocator goes through
    logging.getLogger("supermem") or log.warn, where the application's logging settings apply."""
    root = Path(supermem.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        if rel != "log.py" and "warnings.warn(" in text:
            found.append(f"{rel}: warnings.warn")
        if "file=sys.stderr" in text and not any(s in rel for s in SPEAKS_FOR_ITSELF):
            found.append(f"{rel}: print to stderr")
    assert found == []
