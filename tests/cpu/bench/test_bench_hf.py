"""`supermem bench train --model hf-llama`: transformers' Llama beside HF's own checkpointing (non-reentrant
and reentrant) and the pool at a fraction of native's peak and at each checkpointing row's peak; the
mistakes (an HF row for another model, no transformers) are one line before anything runs."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from supermem import cli
from supermem.bench import train

ROWS = [
    "hf checkpoint",
    "hf checkpoint reentrant",
    "cost_aware hf ckpt peak",
    "planned hf ckpt reentrant peak",
]
ROWS.append("planned 50%")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_hf_llama_sweep_rows_print_with_natives_loss(tmp_path):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    cmd = [sys.executable, "-m", "supermem", "bench", "train", "--sweep", "--model", "hf-llama", "--quick"]
    cmd += ["--device", "cpu", "--repeats", "1", "--modes", ",".join(ROWS), "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)  # ~25 s: 6 processes
    assert r.returncode == 0, r.stdout + r.stderr
    by_name = {row["config"]: row for row in json.loads(out.read_text())["models"]["hf-llama"]}
    assert set(by_name) == {"native", *ROWS}
    native = by_name["native"]
    for name, row in by_name.items():
        assert "error" not in row, f"{name}: {row['error']}"
        assert row["peak_alloc_bytes"] > 0 and row["step_ms"] > 0
        # HF's checkpointing recomputes the same forward, the pool gives back what was saved: on CPU
        # (fp32, no autocast) the same loss, bitwise
        assert row["loss"] == native["loss"], name
    at_peak = {
        "cost_aware hf ckpt peak": "hf checkpoint",
        "planned hf ckpt reentrant peak": "hf checkpoint reentrant",
    }
    for name, of in at_peak.items():
        assert by_name[name]["budget_bytes"] == by_name[of]["peak_alloc_bytes"]
    assert by_name["planned 50%"]["budget_bytes"] == int(0.5 * native["peak_alloc_bytes"])
    assert native["preset"] in r.stdout and "sweep (baseline: native" in r.stdout
    targets = [line for line in r.stdout.splitlines() if line.startswith("target ")]
    pool_rows = [name for name, row in by_name.items() if row["allocator"] == "supermem"]  # in run order
    assert [t.split(": ")[0].split(" ", 2)[2] for t in targets] == pool_rows, r.stdout
    assert all(t.endswith((": met", ": MISSED")) and " vs " in t for t in targets), targets


# A row for the other kind of model, or an HF model without transformers: one line, exit 2.
BAD = [
    (
        ["--model", "gpt", "--modes", "hf checkpoint"],
        "--modes: 'hf checkpoint' runs only for --model hf-llama",
    ),
    (
        ["--model", "all", "--modes", "hf_checkpoint"],
        "--modes: 'hf_checkpoint' runs only for --model hf-llama",
    ),
    (
        ["--model", "hf-llama", "--modes", "checkpoint"],
        "--modes: 'checkpoint' runs only for --model gpt/resnet",
    ),
    (["--sweep", "--model", "hf-llama", "--modes", "cost_aware 90%"], "'cost_aware 90%' runs only for"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_a_row_for_another_model_is_one_line(argv, message, capsys):
    assert cli.main(["bench", "train", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_hf_llama_without_transformers_is_one_line(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else find_spec(name, *a)
    )
    assert cli.main(["bench", "train", "--device", "cpu", "--model", "hf-llama", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model hf-llama needs transformers" in err and "Traceback" not in err, (
        err
    )


def test_hf_checkpoint_refuses_a_model_that_is_not_hf():
    from supermem.bench.models import PRESETS

    with pytest.raises(ValueError, match="hf_checkpoint needs a Hugging Face model, not GPT"):
        train._prepare(PRESETS["gpt-quick"].build(), {"saver": "hf_checkpoint"})
