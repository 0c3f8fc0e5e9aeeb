"""Byte sizes (supermem.units) and the strict SUPERMEM_CONF parser (supermem.config)."""

import re

import pytest

from supermem import config
from supermem.errors import ConfigError
from supermem.units import format_bytes, parse_bytes

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (12345, 12345),
        ("0", 0),
        ("1048576", MiB),
        ("64KiB", 64 * KiB),
        ("64kib", 64 * KiB),
        ("64K", 64 * KiB),
        ("1.5GiB", 3 * GiB // 2),
        (" 12 GiB ", 12 * GiB),
        ("8g", 8 * GiB),
        ("2TiB", 2 * TiB),
        ("512MB", 512 * 1000**2),
        ("3kb", 3000),
        ("7b", 7),
    ],
)
def test_parse_bytes_accepts_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("60%", 600), ("100%", 1000), ("0.5%", 5), (0.25, 250), (1.0, 1000), ("12KiB", 12 * KiB)],
)
def test_parse_bytes_resolves_fractions_against_the_total(value, expected):
    assert parse_bytes(value, total_bytes=1000) == expected


@pytest.mark.parametrize(
    ("value", "total", "message"),
    [
        (-1, None, ">= 0"),
        (True, None, "expected a size"),
        ("", None, "is not a size"),
        ("GiB", None, "is not a size"),
        ("-1", None, "is not a size"),
        ("1e3", None, "is not a size"),
        ("12 parsecs", None, "is not a size"),
        ("1..5GiB", None, "is not a size"),
        ("50%", None, "needs a known device capacity"),
        ("0%", 1000, r"must be in \(0, 100\]"),
        ("101%", 1000, r"must be in \(0, 100\]"),
        ("abc%", 1000, r"must be in \(0, 100\]"),
        (1.5, 1000, r"fraction in \(0, 1\]"),
        (0.0, 1000, r"fraction in \(0, 1\]"),
        (0.5, None, r"fraction in \(0, 1\]"),
    ],
)
def test_parse_bytes_rejects_bad_forms(value, total, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(value, total_bytes=total)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (KiB, "1.00 KiB"),
        (3 * GiB // 2, "1.50 GiB"),
        (5 * TiB, "5.00 TiB"),
    ],
)
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


@pytest.mark.parametrize("n", [1, 511, 4096, 3 * MiB + 17, 40 * GiB])
def test_format_then_parse_is_close(n):
    assert abs(parse_bytes(format_bytes(n).replace(" bytes", "")) - n) <= n * 0.005


def test_parse_conf_good_strings():
    assert config.parse_conf("") == {}
    assert config.parse_conf(" , ,") == {}
    assert config.parse_conf("limit:12GiB,pool:lru") == {"limit": "12GiB", "pool": "lru"}
    assert config.parse_conf(" limit : 80% , debug:2 ") == {"limit": "80%", "debug": 2}
    assert config.parse_conf("limit:0.8,passthrough:on,trace:4096") == {
        "limit": 0.8,
        "passthrough": True,
        "trace": 4096,
    }
    assert config.parse_conf("allocator:NATIVE,passthrough:0") == {
        "allocator": "native",
        "passthrough": False,
    }
    assert config.parse_conf("oom_snapshot:/tmp/a:b.pickle") == {"oom_snapshot": "/tmp/a:b.pickle"}


BAD_VALUES = {
    "allocator": "cub",
    "limit": "lots",
    "passthrough": "maybe",
    "trace": "-1",
    "debug": "3",
    "pool": "fifo",
    "stream": "activations",
    "budget": "1.5",
    "host_limit": "150%",
    "control": "sometimes",
    "graphs": "often",
    "expandable_segments": "expandable",
}


def test_every_option_has_a_bad_value_case():
    untested = {o.name for o in config.OPTIONS} - set(BAD_VALUES) - {"oom_snapshot"}  # any path goes
    assert not untested


@pytest.mark.parametrize("key", list(BAD_VALUES))
def test_bad_value_names_the_key_and_the_allowed_values(key):
    option = next(o for o in config.OPTIONS if o.name == key)
    with pytest.raises(ConfigError) as info:
        config.parse_conf(f"{key}:{BAD_VALUES[key]}")
    message = str(info.value)
    assert repr(key) in message
    assert option.allowed in message


@pytest.mark.parametrize(("text", "key"), [("limt:12GiB", "limt"), (":12GiB", ""), ("Pool:lru", "Pool")])
def test_unknown_key_lists_the_known_ones(text, key):
    with pytest.raises(ConfigError) as info:
        config.parse_conf(text)
    message = str(info.value)
    assert repr(key) in message
    assert all(o.name in message for o in config.OPTIONS)


@pytest.mark.parametrize("text", ["limit", "limit:", "limit: ", "pool:lru,pool=lru"])
def test_item_that_is_not_key_value_is_refused(text):
    with pytest.raises(ConfigError, match="is not key:value"):
        config.parse_conf(text)


def test_key_given_twice_is_refused():
    with pytest.raises(ConfigError, match="'limit' is given twice"):
        config.parse_conf("limit:1GiB,pool:lru,limit:2GiB")


def test_config_errors_are_value_errors():
    assert issubclass(ConfigError, ValueError)


def test_env_and_options_override():
    cfg = config.from_env({"SUPERMEM_CONF": "pool:lru,budget:8GiB"})
    assert cfg.pool == "lru" and cfg.budget == "8GiB" and cfg.debug == 0
    cfg.set(debug="1")
    assert cfg.debug == 1
    with pytest.raises(ConfigError, match="'debug'"):
        cfg.set(debug="9")
    assert cfg.debug == 1


@pytest.mark.parametrize("text, graphs", [("", True), (",graphs:false", False), (",graphs:1", True)])
def test_the_env_pool_takes_graphs(monkeypatch, text, graphs):
    from supermem import tensor_pool

    monkeypatch.setattr(tensor_pool.factory, "_global", {})
    monkeypatch.setattr(tensor_pool.factory, "_pools", {})
    cfg = config.from_env({"SUPERMEM_CONF": f"pool:planned,budget:64MiB{text}"})
    assert tensor_pool.env_pool(cfg).graphs is graphs


def test_options_context_restores_and_rejects_bad_values(monkeypatch):
    monkeypatch.setattr(config, "_current", config.Config())
    with config.options(pool="lru", budget="60%") as cfg:
        assert cfg.pool == "lru" and cfg.budget == "60%"
    assert config.current().pool == "off" and config.current().budget is None
    with pytest.raises(ConfigError, match="'pool'"), config.options(pool="mru"):
        pass
    assert config.current().pool == "off"


# ---------------------------------------------------------------- issue 8.15: numbers and all-or-nothing

HUGE = "9" * 400


@pytest.mark.parametrize(
    "value",
    [HUGE, HUGE + "GiB", "1" + "0" * 300 + ".5TiB", f"{HUGE}.0", 2**63, 10**400, "8388608TiB", str(2**63)],
)
def test_sizes_beyond_2_63_are_value_errors_naming_the_value(value):
    with pytest.raises(ValueError, match="too large") as e:
        parse_bytes(value)
    assert str(value)[:12] in str(e.value)
    assert type(e.value) is not OverflowError


def test_the_largest_size_and_exact_decimals_are_kept():
    assert parse_bytes(str(2**63 - 1)) == 2**63 - 1
    assert parse_bytes(2**63 - 1) == 2**63 - 1
    assert parse_bytes("0.1KiB") == 102  # exact decimal, floored: float would give the same here...
    assert parse_bytes("4503599627370497.5") == 4503599627370497  # ...but not here (2**52 + 1.5)


@pytest.mark.parametrize(("text", "expected"), [(".5GiB", GiB // 2), (".25", 0), ("1.GiB", GiB)])
def test_a_leading_or_trailing_point_is_a_number(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "conf", [f"limit:{HUGE}", f"budget:{HUGE}GiB", "limit:1e400", f"trace:{HUGE}", "host_limit:1e400%"]
)
def test_huge_values_in_supermem_conf_are_config_errors(conf):
    with pytest.raises(ConfigError, match=conf.partition(":")[0]):
        config.parse_conf(conf)


def test_a_huge_supermem_conf_stops_activation_with_a_message(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env["SUPERMEM_CONF"] = f"limit:{HUGE}GiB"
    code = "import torch; x = torch.ones(1, requires_grad=True); x * x"  # a saved tensor: where the pool acts
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "too large" in r.stderr, r.stderr


@pytest.mark.parametrize("text", ["1_000", "٢", " 1e3"])
def test_integer_options_take_plain_ascii_digits(text):
    with pytest.raises(ConfigError, match="'trace'"):
        config.parse_option("trace", text)


def test_set_options_and_install_apply_all_or_nothing(monkeypatch):
    monkeypatch.setattr(config, "_current", config.Config())
    cfg = config.current()
    before = cfg.as_dict()
    with pytest.raises(ConfigError, match="'debug'"):
        cfg.set(pool="lru", budget="1GiB", debug=99)
    assert cfg.as_dict() == before
    with pytest.raises(ConfigError, match="'budget'"), config.options(pool="lru", budget=HUGE):
        pass
    assert config.current().as_dict() == before
    import supermem

    with pytest.raises(ConfigError, match="'limit'"):
        supermem.install({"pool": "lru", "trace": 100, "limit": HUGE})
    with pytest.raises(ConfigError, match="'limit'"):
        supermem.install(f"pool:lru,trace:100,limit:{HUGE}")
    assert config.current().as_dict() == before


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ("limit:0", "is 0 bytes"),  # the allocator reads 0 as no limit
        ("limit:0GiB", "is 0 bytes"),
        ("limit:0.4B", "is 0 bytes"),
        ("limit:1e-300%", "nearly 0 bytes"),
        ("limit:0.000001", "nearly 0 bytes"),
        ("budget:1e-300%", "nearly 0 bytes"),
        ("budget:0.0000000001", "nearly 0 bytes"),
        ("host_limit:0.001%", "nearly 0 bytes"),
    ],
)
def test_a_limit_or_budget_of_nearly_nothing_is_refused_not_resolved_to_0_bytes(conf, message):
    with pytest.raises(ConfigError, match=message):
        config.parse_conf(conf)


def test_the_smallest_fraction_and_a_0_budget_are_taken():
    # budget:0 is documented: every saved tensor the pool can move leaves the device
    assert config.parse_conf("budget:0,limit:1") == {"budget": "0", "limit": "1"}
    assert parse_bytes("0.01%", total_bytes=10**6) == parse_bytes(0.0001, total_bytes=10**6) == 100
    assert "0:" in next(o for o in config.OPTIONS if o.name == "budget").doc


# ---------------------------------------------------------------- PyTorch's allocator option names


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("per_process_memory_fraction:0.5", {"limit": 0.5}),
        ("per_process_memory_fraction:1", {"limit": 1.0}),
        ("backend:native,pool:lru", {"allocator": "native", "pool": "lru"}),
    ],
)
def test_pytorchs_names_of_supermem_options_are_aliases(text, expected):
    assert config.parse_conf(text) == expected
    cfg = config.Config()
    cfg.set(**{k: v for k, _, v in (item.partition(":") for item in text.split(","))})
    assert {k: getattr(cfg, k) for k in expected} == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_split_size_mb:128", "'max_split_size_mb' is an option of PyTorch's own allocator"),
        ("max_split_size_mb:128", "supermem has no equivalent (its options: allocator, limit"),
        ("garbage_collection_threshold:0.6", "per_process_memory_fraction, backend are taken as supermem's"),
        ("backend:cudaMallocAsync", "only PyTorch's `native` backend has a supermem equivalent"),
        ("per_process_memory_fraction:1.5", "'per_process_memory_fraction': 1.5 is not a fraction in"),
        ("per_process_memory_fraction:0.5,limit:1GiB", "'limit' is given twice"),
    ],
)
def test_pytorchs_other_allocator_options_are_refused_saying_what_supermem_has(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.parse_conf(text)


def test_merge_conf_counts_an_alias_as_its_supermem_key():
    merged = config.merge_conf("per_process_memory_fraction:0.5,trace:4", "limit:1GiB")
    assert config.parse_conf(merged) == {"limit": "1GiB", "trace": 4}


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_pytorch_alloc_conf_takes_what_means_a_supermem_option_and_names_the_rest(var):
    conf = "expandable_segments:True,roundup_power2_divisions:[256:1,>:2],per_process_memory_fraction:0.5"
    cfg = config.Config()
    said = config.honour_torch_alloc_conf(cfg, {var: conf})
    assert cfg.limit == 0.5 and cfg.expandable_segments is True
    assert said == (
        f"supermem: {var} configures PyTorch's own allocator, which supermem's replaces in this process; "
        "taken: expandable_segments:True as expandable_segments:True, "
        "per_process_memory_fraction:0.5 as limit:0.5; ignored: roundup_power2_divisions"
    )


def test_pytorch_alloc_conf_does_not_override_supermems_own_option():
    cfg = config.Config({"limit": "2GiB"})
    said = config.honour_torch_alloc_conf(cfg, {"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.5"})
    assert (
        cfg.limit == "2GiB"
        and said is not None
        and "ignored: per_process_memory_fraction (supermem's limit is set)" in said
    )
    assert config.honour_torch_alloc_conf(config.Config(), {}) is None
    # PyTorch reads PYTORCH_ALLOC_CONF first, and so does supermem
    both = {
        "PYTORCH_ALLOC_CONF": "max_split_size_mb:64",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    assert config.torch_alloc_conf(both) == ("PYTORCH_ALLOC_CONF", {"max_split_size_mb": "64"})
