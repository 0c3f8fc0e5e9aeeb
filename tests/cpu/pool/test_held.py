"""State a call takes beside its values (a KV cache, a user object): frozen at the call, each replay
runs on a fresh copy of it as the call saw it, the live object untouched; what cannot be copied, or a
replay that reads values the state holds, keeps the call from being replayed. Training stays bitwise
plain PyTorch's throughout."""

import functools
import warnings

import pytest
import torch
import torch.nn as nn
from corpus import build_and_train
from small_models import same, train_steps

from supermem.policies import live_names
from supermem.tensor_pool import Pool, region
from supermem.tensor_pool.held import CannotFreeze, freeze, freeze_call, held_state


class CacheLayer:
    def __init__(self):
        self.keys = None


class Cache:
    """A Hugging Face DynamicCache in miniature: each layer appends its keys and attends over them all."""

    def __init__(self, layers):
        self.layers = [CacheLayer() for _ in range(layers)]
        self.updates = 0

    def update(self, i, k):
        layer = self.layers[i]
        layer.keys = k if layer.keys is None else torch.cat([layer.keys, k])
        self.updates += 1
        return layer.keys


class Block(nn.Module):
    def __init__(self, i, d=32):
        super().__init__()
        self.i, self.k, self.fc = i, nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, cache):
        k = cache.update(self.i, self.k(x))  # a replay appending to the live cache: twice the keys
        return x + self.fc(torch.tanh(torch.softmax(x @ k.T / 8, -1) @ k))


class Decoder(nn.Module):
    def __init__(self, layers=6, block=Block):
        super().__init__()
        self.blocks = nn.ModuleList(block(i) for i in range(layers))
        self.caches = []

    def forward(self, x):
        cache = Cache(len(self.blocks))
        for b in self.blocks:
            x = b(x, cache)
        self.caches.append(cache)
        return x


def train(pool=None, steps=4, build=Decoder):
    """small_models.train_steps' results, and the model it trained."""
    made = []

    def built():
        made.append(build())
        return made[-1]

    out = train_steps(built, lambda g: (torch.randn(16, 32, generator=g), None), pool, steps)
    return out, made[-1]


def slow_link(pool):
    """Copies priced as over a slow link: the policies recompute what they can."""
    pool.treatments["offload"].link_bytes_per_s = 1e3
    return pool


@pytest.mark.parametrize("policy", live_names())
@pytest.mark.parametrize("budget", [0, "4KiB"])
def test_a_layer_given_the_cache_is_replayed_on_the_cache_as_it_saw_it(policy, budget):
    ref, _ = train()
    pool = slow_link(Pool(budget=budget, policy=policy, min_bytes=0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got, model = train(pool)
    assert same(ref, got)
    assert not pool.regions.refused and not [w for w in seen if "recomputed as one call" in str(w.message)]
    if policy != "lru":  # (it only copies)
        assert set(pool.regions.modules) == set(model.blocks)
        assert pool.stats()["recomputes"] > 0  # the blocks were replayed
    for cache in model.caches:  # and no replay touched the live caches
        assert cache.updates == len(model.blocks)
        assert all(layer.keys.shape == (16, 32) for layer in cache.layers)


class Scale:
    def __init__(self):
        self.t = torch.full((16, 32), 0.5)  # (over held.SMALL: its shape alone is kept)


class ScaledBlock(Block):
    """Reads the values of a tensor its state object holds: a replay on the copy (shapes only) cannot."""

    def forward(self, x, state):
        return x + self.fc(torch.tanh(self.k(x) * state.t))


class Stateful(Decoder):
    """Its blocks are given one state object of the model's, at every call."""

    def __init__(self, block, state):
        super().__init__(block=block)
        self.state = state

    def forward(self, x):
        for b in self.blocks:
            x = b(x, self.state)
        return x


def Scaled():  # noqa: N802  (a model builder, as the classes beside it)
    return Stateful(ScaledBlock, Scale())


class Slotted:
    __slots__ = ("n",)

    def __init__(self):
        self.n = 1


class SlottedBlock(Block):
    def forward(self, x, state):
        return x + self.fc(torch.tanh(self.k(x) * state.n))


def WithSlots():  # noqa: N802
    return Stateful(SlottedBlock, Slotted())


@pytest.mark.parametrize(
    "build, why", [(Scaled, "its replay raised"), (WithSlots, "a Slotted has no plain __dict__")]
)
@pytest.mark.parametrize("policy", ["cost_aware", "planned"])
def test_a_call_whose_state_a_copy_cannot_stand_for_is_refused_and_trains_bitwise(
    build, why, policy, monkeypatch
):
    monkeypatch.setattr(region, "_WARNED", set())  # (each kind of module is named once a process)
    ref, _ = train(build=build)
    pool = Pool(budget=0, policy=policy, min_bytes=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got, model = train(pool, build=build)
    assert same(ref, got)
    refused = dict(pool.regions.refused)
    assert set(refused) == set(model.blocks), refused
    assert all(why in w for w in refused.values()), refused
    assert any("ScaledBlock" in str(w.message) or "SlottedBlock" in str(w.message) for w in seen)


def test_a_frozen_copy_has_the_calls_state_and_no_tie_to_the_live_one():
    cache = Cache(3)
    cache.update(0, torch.ones(64, 2))
    cache.me = cache  # a cycle
    cache.alias = cache.layers[0]  # one object held twice
    cache.table = {"n": 3, "dims": [4, 2]}
    frozen = freeze(cache)
    cache.update(1, torch.ones(64, 2))  # the live one moves on
    cache.update(0, torch.ones(64, 2))
    for copy in (frozen.thaw(), frozen.thaw()):
        assert copy is not cache and copy.me is copy and copy.alias is copy.layers[0]
        assert copy.updates == 1 and copy.layers[1].keys is None
        keys = copy.layers[0].keys
        assert keys.device.type == "meta" and keys.shape == (64, 2)  # its shape, not its memory
        assert copy.table == {"n": 3, "dims": [4, 2]} and copy.table is not cache.table
        copy.update(2, torch.ones(1, 2, device="meta"))  # a replay's changes stay in its copy
    assert cache.layers[2].keys is None and frozen.thaw().layers[2].keys is None
    assert frozen.tensors == 1


@pytest.mark.parametrize(
    "state, why",
    [
        (nn.Linear(2, 2), "it holds a module"),
        (Slotted(), "no plain __dict__"),
        (torch.Generator(), "no plain __dict__"),
        (functools.partial(print, 1), "a __new__ of its own"),
    ],
)
def test_state_that_cannot_be_copied_says_why(state, why):
    with pytest.raises(CannotFreeze, match=why):
        freeze(state)
    call, reason = freeze_call(((torch.ones(1),), {"state": state}))
    assert reason is not None and why in reason and call[1]["state"] is state
    assert held_state(call) == reason  # (what the trace and the profiling step ask, by type)


def test_held_state_finds_state_wherever_freeze_call_does():
    """held_state skips what needs no walk (tensors, values, a tuple of them: RoPE's cos and sin) and
    answers freeze_call's verdict where state sits inside a tuple, a list or a dict, or after a cache."""
    x, module = torch.ones(2), nn.Linear(2, 2)
    cache = Cache(2)
    for call in [
        ((x,), {"pos": (x, x), "mask": None}),
        ((x, (x, None)), {"flag": True}),
        ((x,), {"past_key_values": cache, "pos": (x, x)}),
        ((x, (x, module)), {}),
        ((x,), {"extra": [x, {"inner": module}]}),
        ((x,), {"past_key_values": cache, "hook": module}),
        ((module,), {}),
    ]:
        assert held_state(call) == freeze_call(call, copy=False)[1]
    assert held_state(((x, (x, module)), {})) is not None


def test_a_cache_is_state_that_can_be_frozen():
    cache = Cache(2)
    cache.update(0, torch.ones(64, 2))
    assert held_state(((torch.ones(1),), {"past_key_values": cache, "use_cache": True})) is None


def test_values_and_tensors_are_not_frozen():
    x = torch.ones(2)
    call = ((x, 3, "a"), {"mask": None, "shape": (1, 2), "dtype": torch.float32})
    assert freeze_call(call) == (call, None)


@pytest.mark.parametrize("treatments", [None, ["recompute"]])
@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2", "t5"])
def test_a_hugging_face_layer_keeps_its_cache_and_is_replayed_bitwise(name, treatments):
    """A decoder's training forward builds a KV cache (use_cache stays on): its layers are replayed
    on their copies of it, none refused, and training is plain PyTorch's bitwise (recompute alone:
    most blocks run light; T5's later blocks hand back the position bias they were given)."""
    ref = build_and_train(name, "tiny")
    probe = Pool(policy="lru", min_bytes=0)
    build_and_train(name, "tiny", probe, steps=2)
    budget = int(0.4 * probe.stats()["peak_resident_bytes"])
    pool = Pool(budget=budget, policy="planned", min_bytes=0, treatments=treatments)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = build_and_train(name, "tiny", pool)
    assert same(ref, got)
    layers = [m for m in pool.regions.refused if "Layer" in type(m).__name__ or "Block" in type(m).__name__]
    assert not layers, dict(pool.regions.refused)
    assert not [w for w in seen if "Cache" in str(w.message)]
    s = pool.stats()
    assert s["light_split_misses"] == 0, s
    if treatments:  # (with copies too, the plan may copy all on a loaded CPU)
        assert s["light_calls"] > 0 or name == "t5", s  # (T5's blocks hand back the position bias)
        assert s["recomputes"] + s["light_calls"] > 0, s


class BiasFirst(nn.Module):
    """Makes a bias from a parameter, as T5's first block makes the position bias."""

    def __init__(self, d=32):
        super().__init__()
        self.fc, self.table = nn.Linear(d, d), nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x):
        bias = self.table * 2
        return x + self.fc(torch.tanh(x + bias)), bias


class BiasNext(nn.Module):
    """Reads the bias and hands it back, as T5's later blocks do."""

    def __init__(self, d=32):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, bias):
        return x + self.fc2(torch.tanh(self.fc(x) + bias)) * bias, bias


class PassThrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = BiasFirst()
        self.blocks = nn.ModuleList(BiasNext() for _ in range(5))

    def forward(self, x):
        x, bias = self.first(x)
        for b in self.blocks:
            x, bias = b(x, bias)
        return x


@pytest.mark.parametrize("share", [0.6, 0.3])
def test_a_block_that_hands_back_an_input_trains_bitwise_when_recomputed(share):
    """Run light, such a block's node stood between the bias and the next blocks' uses: their
    gradients summed in another order than plain autograd's (T5: not bitwise from step 5)."""
    ref, _ = train(build=PassThrough)
    probe = Pool(policy="lru", min_bytes=0)
    train(probe, steps=1, build=PassThrough)
    budget = int(share * probe.stats()["peak_resident_bytes"])
    pool = Pool(budget=budget, policy="planned", min_bytes=0, treatments=["recompute"])
    got, model = train(pool, build=PassThrough)
    assert same(ref, got)
    assert pool.stats()["recomputes"] + pool.stats()["light_calls"] > 0
    assert pool.stats()["light_split_misses"] == 0


def test_a_small_tensor_in_the_state_keeps_its_values():
    """A sliding-window cache keeps its window as a one-element tensor and moves it to the device on
    its first update: a copy of it, not its shape alone (Mistral's layers were refused otherwise)."""
    state = CacheLayer()
    state.window = torch.tensor(16)
    state.scale = torch.ones(2, requires_grad=True)  # (a copy would cut its gradient: its shape alone)
    frozen = freeze(state)
    state.window.fill_(3)  # (the live one changes in place after the call)
    copy = frozen.thaw()
    assert copy.window.item() == 16 and copy.window is not frozen.thaw().window
    assert copy.scale.device.type == "meta" and copy.scale.shape == (2,)


class Memory:
    def __init__(self):
        self.mem = []


class Writer(nn.Module):
    """Puts a tensor into its state that the loss reads after the call: run light (grad off), it would
    stay there without a graph and its gradients would not come back."""

    def __init__(self, d=32):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, 4 * d), nn.Tanh(), nn.Linear(4 * d, d))
        self.m = nn.Linear(d, 4)

    def forward(self, x, state):
        y = self.f(x)
        state.mem.append(self.m(y))
        return x + y


class Writers(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Writer() for _ in range(6))

    def forward(self, x):
        state = Memory()
        for b in self.blocks:
            x = b(x, state)
        return x + sum(m.square().mean() for m in state.mem)


class Chunked(Decoder):
    """One cache over two chunks: the second chunk's layers read the first's keys (the same kind of
    call, more held in its state): its replay on the copy would read a shape where keys were."""

    def forward(self, x):
        cache = Cache(len(self.blocks))
        outs = []
        for h in x.chunk(2):
            for b in self.blocks:
                h = b(h, cache)
            outs.append(h)
        return torch.cat(outs)


class WindowCache(Cache):
    """A sliding window cache (Mistral's): it keeps the last keys, a slice of what its layer read whole."""

    def update(self, i, k):
        layer = self.layers[i]
        full = k if layer.keys is None else torch.cat([layer.keys, k])
        layer.keys = full[-8:]
        self.updates += 1
        return full


class Windowed(Decoder):
    def forward(self, x):
        cache = WindowCache(len(self.blocks))
        for b in self.blocks:
            x = b(x, cache)
        return x


@pytest.mark.parametrize("share", [0.5, 0.4])  # (at 0.3 no plan fits: none runs light)
def test_state_the_call_keeps_but_nothing_reads_lets_it_run_light_and_train_bitwise(share):
    """The slice a sliding window keeps is read by no use, in the call or after it: the call runs light
    (a Mistral layer ran light in no step before), and trains bitwise."""
    ref, _ = train(steps=6, build=Windowed)
    full = Pool(budget="1GiB", policy="planned", min_bytes=0)
    train(full, steps=3, build=Windowed)
    budget = int(share * full.stats()["plan"]["measured_peak_bytes"])
    pool = Pool(budget=budget, policy="planned", min_bytes=0, treatments=["recompute"])
    got, _ = train(pool, steps=6, build=Windowed)
    assert same(ref, got)
    assert pool.stats()["light_calls"] > 0 and pool.stats()["light_split_misses"] == 0


@pytest.mark.parametrize("build", [Writers, Chunked])
@pytest.mark.parametrize("share", [0.5, 0.3])
def test_state_read_after_the_call_keeps_it_from_running_light_and_trains_bitwise(build, share):
    ref, _ = train(steps=6, build=build)
    full = Pool(budget="1GiB", policy="planned", min_bytes=0)
    train(full, steps=3, build=build)
    budget = int(share * full.stats()["plan"]["measured_peak_bytes"])
    pool = Pool(budget=budget, policy="planned", min_bytes=0, treatments=["recompute"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the chunked layers are refused: their replay reads keys)
        got, model = train(pool, steps=6, build=build)
    assert same(ref, got)
    assert pool.stats()["light_calls"] == 0


def test_state_nested_too_deep_is_not_frozen():
    head = node = CacheLayer()
    for _ in range(500):
        node.keys = CacheLayer()
        node = node.keys
    with pytest.raises(CannotFreeze, match="nests over"):
        freeze(head)


def test_a_tensor_held_twice_thaws_once():
    state = CacheLayer()
    state.keys = torch.ones(64, 2)
    state.alias = state.keys
    state.small = torch.tensor(3)
    state.again = state.small
    copy = freeze(state).thaw()
    assert copy.alias is copy.keys and copy.again is copy.small
