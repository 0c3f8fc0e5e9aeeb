"""`supermem bench train`'s compression rows: ResNet only, the same budgets as the other pool rows, and
the worker side builds a pool that compresses (run in-process on CPU with the quick ResNet)."""

from supermem.bench import train


def test_compress_rows_are_resnet_only_at_each_budget():
    rows = {m.name: m for m in train.modes("cuda", [0.75, 0.5])}
    for b in ("75%", "50%"):
        m = rows[f"cost_aware+compress {b}"]
        plain = rows[f"cost_aware {b}"]
        assert m.budget == plain.budget and m.saver == plain.saver == "pool"
        assert m.options["policy"] == "cost_aware" and "compress" in m.options["treatments"]
        assert train.runs_on(m, "resnet") and not train.runs_on(m, "gpt")
        assert train.runs_on(plain, "gpt") and train.runs_on(plain, "resnet")
    assert not any("compress" in name for name in (m.name for m in train.modes("cpu", [0.5])))


def test_worker_pool_with_compression_compresses_the_resnet():
    spec = {
        "preset": "resnet-quick",
        "device": "cpu",
        "saver": "pool",
        "steps": 2,
        "warmup": 1,
        "budget_bytes": 0,
        "policy": "cost_aware",
        "treatments": ["compress"],  # alone: on CPU a host copy is cheaper than the reference packer
    }
    row = train.measure(spec)
    assert row["pool"]["compressions"] > 0 and row["pool"]["compressed_bytes_per_step"] > 0, row["pool"]
    plain = train.measure({k: v for k, v in spec.items() if k != "treatments"})
    assert "compressions" not in plain["pool"]
    assert plain["loss"] == row["loss"]  # lossless: the same training
