"""Every count and duration the CLI takes is checked by argparse: 0, negative, non-numeric and inf give
one usage line (exit 2), never a traceback from deep inside a run."""

import pytest
import torch

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


# Values argparse refuses: lists, sizes and SUPERMEM_CONF strings, each checked where it is parsed,
# also when no row of this run would use it (bench alloc's --conf on a CPU runs no supermem row).
BAD_VALUES = [
    (["bench", "train", "--budgets", "abc"], "argument --budgets: 'abc' is not a number"),
    (["bench", "train", "--budgets", "-1"], "argument --budgets: must be > 0, got -1"),
    (["bench", "train", "--budgets", "0.5,nan"], "argument --budgets: must be > 0, got nan"),
    (["bench", "train", "--budgets", ","], "argument --budgets: give one or more"),
    (["bench", "train", "--ddp", "0"], "argument --ddp: must be >= 1, got 0"),
    (["bench", "alloc", "--device", "cpu", "--conf", "bogus:1"], "unknown supermem option 'bogus'"),
    (["bench", "alloc", "--conf", "limit:lots"], "argument --conf: bad value for supermem option 'limit'"),
    (["run", "--conf", "bogus:1", "x.py"], "unknown supermem option 'bogus'"),
    (["bench", "relu", "--sizes", "16,0"], "argument --sizes: must be >= 1, got 0"),
    (["bench", "depth", "--cap", "0"], "argument --cap: must be > 0 bytes, got 0"),
    (["replay", "x.smtrace", "--capacity", "1GiB", "--link-gbps", "-1"], "argument --link-gbps:"),
    (["top", "0"], "argument pid: must be >= 1, got 0"),
]


@pytest.mark.parametrize(
    "argv, message", BAD_VALUES, ids=lambda a: " ".join(a) if isinstance(a, list) else ""
)
def test_bad_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


# Names a run knows only with its other arguments (--modes depends on the device and the budgets): a
# UsageError, one line, before anything runs.
BAD_NAMES = [
    (["bench", "train", "--device", "cpu", "--modes", "bogus"], "--modes: unknown 'bogus'; known: native"),
    (["bench", "train", "--device", "cpu", "--modes", "supermem"], "--modes: 'supermem' does not run on"),
    (["bench", "depth", "--device", "cpu", "--configs", "native,nope"], "--configs: unknown 'nope'"),
]


@pytest.mark.parametrize("argv, message", BAD_NAMES, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_bad_names_are_one_line_before_anything_runs(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"supermem {argv[0]}: error: {message}"), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a PyTorch without CUDA, or no GPU")
@pytest.mark.parametrize("argv", [["demo"], ["bench", "alloc"], ["bench", "relu"], ["bench", "train"]])
def test_device_cuda_without_cuda_is_one_line(argv, capsys):
    assert cli.main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda:" in err and "use --device cpu" in err, err


def test_good_lists_parse():
    args = cli.build_parser().parse_args(["bench", "train", "--budgets", "0.5, 0.25", "--modes", "pool,"])
    assert (args.budgets, args.modes, args.ddp) == ([0.5, 0.25], ["pool"], None)
    args = cli.build_parser().parse_args(["bench", "train"])
    assert (args.budgets, args.modes) == ([1.0, 0.75, 0.6, 0.5], [])
