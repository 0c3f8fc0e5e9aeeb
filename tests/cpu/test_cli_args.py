"""Every count and duration the CLI takes is checked by argparse: 0, negative, non-numeric and inf give
one usage line (exit 2), never a traceback from deep inside a run."""

import pytest

from supermem import cli

CASES = [
    ["demo", "--steps"],
    ["bench", "alloc", "--repeats"],
    ["bench", "alloc", "--timeout"],
    ["bench", "alloc", "--rounds"],
    ["bench", "alloc", "--inner"],
    ["bench", "trace", "--rounds"],
    ["bench", "trace", "--steps"],
    ["top", "--interval"],
    ["bench", "train", "--steps"],
    ["report", "x.smtrace", "--width"],
    ["report", "x.smtrace", "--max-blocks"],
]


@pytest.mark.parametrize("argv", CASES, ids=lambda a: " ".join(a))
@pytest.mark.parametrize("value", ["0", "-1", "x", "inf"])
def test_bad_counts_are_usage_errors(argv, value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-1]}:" in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_warmup_may_be_zero_but_not_negative(value, capsys):
    assert cli.build_parser().parse_args(["bench", "train", "--warmup", "0"]).warmup == 0
    with pytest.raises(SystemExit):
        cli.main(["bench", "train", "--warmup", value])
    assert "argument --warmup:" in capsys.readouterr().err


def test_good_values_parse():
    args = cli.build_parser().parse_args(["bench", "alloc", "--repeats", "3", "--timeout", "0.5"])
    assert (args.repeats, args.timeout) == (3, 0.5)
