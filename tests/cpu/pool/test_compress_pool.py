"""The Compress treatment in the tensor pool on CPU: ReLU outputs saved for backward are kept packed
(bitmap + nonzeros, supermem.compress) and unpacked when backward needs them. Training is bitwise plain
PyTorch's, the pool's device bytes count the packed payloads, only ReLU-made tensors are compressed,
and cost_aware weighs compression against offload and recompute by measured cost."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from small_models import ResNet, same, train_steps

from supermem.bench.models import ResNet as BottleneckResNet
from supermem.compress import Packed
from supermem.policies import make_policy
from supermem.tensor_pool import Pool
from supermem.tensor_pool.entry import State
from supermem.tensor_pool.profile import Profile
from supermem.tensor_pool.treatments import Compress, Offload, Recompute, make_treatments


def relu_mlp(d=64, layers=4):
    """Linear + ReLU layers, with one GELU layer: its output is not a ReLU's and stays uncompressed."""
    mods = [nn.Linear(d, d), nn.GELU()]
    for _ in range(layers):
        mods += [nn.Linear(d, d), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(d, d))


def relu_blocks(d=64, blocks=4):
    """Blocks whose ReLU output is needed in backward after the block's last output (the Tanh's)."""
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.Tanh()) for _ in range(blocks)]
    )


def images(g):
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)


CASES = {
    "resnet": (lambda: ResNet(blocks=3), images),
    "bottleneck": (lambda: BottleneckResNet((1, 1), width=4, classes=10), images),
    "mlp": (relu_mlp, lambda g: (torch.randn(32, 64, generator=g), None)),
    "blocks": (relu_blocks, lambda g: (torch.randn(32, 64, generator=g), None)),
}


def train(case, pool=None, steps=3, during=None):
    build, batch = CASES[case]
    return train_steps(build, batch, pool, steps, during=during)


def live_entries(pool):
    return [e for r in pool.ledger.entries.values() if (e := r()) is not None]


def compress_all(pool):
    """Compresses every entry compression applies to; returns the treatment."""
    c = pool.treatments["compress"]
    for e in live_entries(pool):
        if c.applies(e):
            pool.leave(e, c)
    return c


def forced(budget=0, room="guess"):
    """A pool whose only way to free device bytes is compression."""
    return Pool(budget=budget, policy="cost_aware", host_limit="64MiB", treatments=(Compress(room=room),))


def packed_bytes(t):
    """The format's size, from the tensor itself: bitmap in 32-bit words, the nonzeros, int64 offsets
    per 2048 elements plus one."""
    n = t.numel()
    nnz = int((t.reshape(-1).view(torch.int32) != 0).sum())
    return 4 * math.ceil(n / 32) + nnz * t.element_size() + 8 * (math.ceil(n / 2048) + 1)


@pytest.mark.parametrize("room", ["guess", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_forced_compression_trains_bitwise_like_plain_pytorch(case, room):
    ref = train(case)
    pool = forced(room=room)
    away = []

    def count(pool):
        away.append(sum(e.state is State.AWAY for e in live_entries(pool)))

    got = train(case, pool, during=count)
    assert same(ref, got)
    s = pool.stats()
    assert all(n > 0 for n in away), away  # every step kept ReLU outputs packed through backward
    assert s["compressions"] > 0 and s["decompressions"] + s["room_misses"] == s["compressions"], s
    assert 0 < s["compressed_payload_bytes"] < s["compressed_bytes"], s
    assert s["tracked_bytes"] == 0 and pool.ledger.device_bytes == 0


def test_the_budget_counts_the_packed_bytes():
    """While away, a compressed entry takes its payload's bytes on the device (as the format says,
    from the saved tensor's own nonzeros, with the values room its pack was given: at least them),
    and the pool's device bytes are the resident tensors plus the payloads: less than the tensors."""
    pool = forced()
    originals = {}
    leave = pool.treatments["compress"].leave

    def remember(p, e):
        originals[e.seq] = e.tensor.detach().clone()
        return leave(p, e)

    pool.treatments["compress"].leave = remember
    seen = {}

    def measure(p):
        tensors = device = 0
        for e in live_entries(p):
            tensors += e.nbytes
            if e.state is State.AWAY:
                orig = originals[e.seq]
                p_ = e.payload.packed if hasattr(e.payload, "original") else e.payload
                room = p_.values.numel()
                nnz = int((orig.reshape(-1).view(torch.int32) != 0).sum())
                expect = packed_bytes(orig) + (room - nnz) * orig.element_size()
                assert room >= nnz and e.treatment.device_bytes(e) == expect
                device += expect
            else:
                device += e.nbytes
        seen["counter"], seen["expect"], seen["tensors"] = p.ledger.device_bytes, device, tensors

    train("resnet", pool, steps=1, during=measure)
    assert originals
    assert seen["counter"] == seen["expect"] < seen["tensors"], seen


def test_a_budget_that_fits_only_compressed_is_kept():
    """A budget between the packed and the plain size of the saved tensors: compression alone keeps
    the pool's device bytes under it after the forward."""
    plain = Pool(budget="1GiB", policy="cost_aware", host_limit="64MiB")
    sizes = {}

    def total(p):
        sizes["plain"] = p.ledger.device_bytes

    train("mlp", plain, steps=1, during=total)
    budget = int(sizes["plain"] * 0.8)
    pool = forced(budget)

    def under(p):
        sizes["compressed"] = p.ledger.device_bytes

    train("mlp", pool, steps=2, during=under)
    assert sizes["compressed"] <= budget < sizes["plain"], sizes


def test_only_relu_outputs_are_compressed():
    """The GELU's output and the input stay resident; every ReLU output is packed."""
    pool = forced()
    kinds = {}

    def look(p):
        for e in live_entries(p):
            kinds.setdefault(e.state.value, set()).add(e.shape)

    compressed_sources = []
    real_leave = pool.treatments["compress"].leave

    def leave(p, e):
        compressed_sources.append(e.made_by)
        return real_leave(p, e)

    pool.treatments["compress"].leave = leave
    train("mlp", pool, steps=1, during=look)
    assert compressed_sources and set(compressed_sources) == {"ReluBackward0"}
    resident = [e for e in live_entries(pool) if e.state is State.RESIDENT]
    assert not resident  # all dead after backward
    s = pool.stats()
    assert s["compressions"] == 4  # the four ReLU outputs, each saved by its ReLU and the next Linear


def test_inplace_change_of_a_compressed_tensor_raises_like_pytorch():
    torch.manual_seed(0)
    lin, x = nn.Linear(64, 64), torch.randn(16, 64)

    def run(change):
        y = F.relu(lin(x))
        z = (y * 2).sum()
        if change:
            y.add_(1)
        z.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        run(True)
    pool = forced()
    with pool:
        run(False)
    assert pool.stats()["compressions"] > 0
    with pool, pytest.raises(RuntimeError, match="modified by an inplace operation") as got:
        run(True)
    assert "is at version 1; expected version 0" in str(got.value)
    assert "is at version 1; expected version 0" in str(plain.value)


def test_check_walks_the_compress_invariant():
    pool = forced()

    def corrupt(p):
        away = [e for e in live_entries(p) if e.state is State.AWAY]
        e = away[0]
        payload, e.payload = e.payload, None
        with pytest.raises(AssertionError, match="packed"):
            p.check()
        e.payload = payload
        p.check()

    train("mlp", pool, steps=1, during=corrupt)


@pytest.mark.parametrize("budget", [0, "16KiB", "1GiB"])
@pytest.mark.parametrize("case", ["resnet", "bottleneck"])
def test_cost_aware_with_all_three_treatments_is_bitwise(case, budget):
    ref = train(case)
    pool = Pool(
        budget=budget,
        policy="cost_aware",
        host_limit="64MiB",
        treatments=(Offload(), Recompute(), Compress(room="guess")),
    )
    pool.treatments["offload"].link_bytes_per_s = 1e3  # copies priced dear: compress or recompute
    got = train(case, pool, steps=3)
    assert same(ref, got)
    s = pool.stats()
    if budget == "1GiB":
        assert s.get("compressions", 0) == 0 and s["dropped"] == 0 and s["offloads"] == 0
    else:
        assert s["compressions"] > 0, s


def test_a_replayed_region_frees_the_payloads_of_its_compressed_entries():
    """A region replay rebuilds every dropped entry of its call, compressed ones included: their packed
    payloads must go then (held on the device, they would be memory the pool no longer counts)."""
    compress = Compress(room="guess")
    for timing in compress._timing.values():  # priced as measured and cheap: the relu outputs compress
        timing.s_per_byte, timing._runs = 1e-15, 1 << 30  # first, their region's other entries drop
    pool = Pool(budget=0, policy="cost_aware", host_limit="64MiB", treatments=(Recompute(), compress))
    stale, unpack = [], pool.unpack

    def checked(packed):
        t = unpack(packed)
        stale.extend(e for e in live_entries(pool) if e.state is State.RESIDENT and e.payload is not None)
        return t

    pool.unpack = checked
    train("blocks", pool, steps=3)
    s = pool.stats()
    assert s["compressions"] > 0 and s["recomputes"] > 0, s
    assert s["decompressions"] < s["compressions"]  # some came back by a replay
    assert not stale, stale


def test_compression_is_priced_from_measured_pack_and_unpack_times():
    """Before any use the price is an estimate; after the first uses it is the measured seconds per
    byte of pack plus unpack, so a choice's cost grows with the tensor's bytes."""
    c = Compress(room="guess")
    pool = Pool(budget=0, policy="cost_aware", host_limit="64MiB", treatments=(c,))
    assert not c.measured()
    train("mlp", pool, steps=1)
    assert c.measured()
    seen = {}

    def price(p):
        resident = [e for e in live_entries(p) if e.state is State.RESIDENT]
        seen["choices"] = c.choices(p, resident)

    pool2 = Pool(budget="1GiB", policy="cost_aware", host_limit="64MiB", treatments=(c,))
    train("mlp", pool2, steps=1, during=price)
    choices = seen["choices"]
    assert len(choices) == 4
    per_byte = {ch.cost_s / ch.target.nbytes for ch in choices}
    assert max(per_byte) == pytest.approx(min(per_byte))
    assert all(0 < ch.nbytes < ch.target.nbytes for ch in choices)


def test_cost_aware_offers_compression_lru_does_not():
    assert "compress" in make_policy("cost_aware").kinds
    assert "compress" not in make_policy("lru").kinds
    pool = Pool(budget=0, policy="lru", host_limit="64MiB", treatments=(Offload(), Compress(room="guess")))
    train("mlp", pool, steps=1)
    assert pool.stats().get("compressions", 0) == 0 and pool.stats()["offloads"] > 0


def test_supermem_pool_takes_treatment_names_and_reuses_its_pool():
    """supermem.pool(...) wraps every step: treatments by name give the same Pool each time (objects
    made per call would make a new Pool per step); an unknown name is a clear error."""
    import supermem
    from supermem.errors import ConfigError

    a = supermem.pool(budget=0, policy="cost_aware", treatments=("offload", "recompute", "compress"))
    b = supermem.pool(budget=0, policy="cost_aware", treatments=["offload", "recompute", "compress"])
    assert a is b and set(a.treatments) == {"offload", "recompute", "compress"}
    assert isinstance(a.treatments["compress"], Compress)
    with pytest.raises(ConfigError, match=r"unknown treatment 'zip'.*known: offload, recompute, compress"):
        supermem.pool(budget=0, treatments=("offload", "zip"))


def test_with_compression_the_only_way_out_every_relu_output_is_compressed():
    build, batch = CASES["resnet"]
    torch.manual_seed(0)
    model = build()
    x, _ = batch(torch.Generator().manual_seed(1))
    relu_outputs = {}

    def pack(t):
        if type(t.grad_fn).__name__ == "ReluBackward0":
            relu_outputs[id(t)] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    pool = forced()
    train("resnet", pool, steps=1)
    s = pool.stats()
    assert s["compressions"] - s["room_misses"] == len(relu_outputs)  # a miss is packed again later


def test_treatment_names_as_one_string_and_bad_values():
    import supermem
    from supermem.errors import ConfigError

    a = supermem.pool(budget=0, policy="cost_aware", treatments="offload, compress")
    assert set(a.treatments) == {"offload", "compress"}
    assert supermem.pool(budget=0, policy="cost_aware", treatments=("offload", "compress")) is a
    with pytest.raises(ConfigError, match="treatments=3: give names"):
        supermem.pool(budget=0, treatments=3)


def test_pool_class_takes_treatment_names_too():
    """supermem.Pool (not only supermem.pool) takes the names the README gives: they once reached it
    as strings and failed with "'str' object has no attribute 'name'"."""
    from supermem.errors import ConfigError

    pool = Pool(budget=0, policy="cost_aware", treatments=["offload", "recompute", "compress:full"])
    assert set(pool.treatments) == {"offload", "recompute", "compress"}
    assert pool.treatments["compress"].room == "full"
    assert set(Pool(budget=0, treatments="recompute, compress").treatments) == {"recompute", "compress"}
    mixed = Pool(budget=0, treatments=(Offload(), "compress")).treatments
    assert isinstance(mixed["offload"], Offload) and isinstance(mixed["compress"], Compress)
    with pytest.raises(ConfigError, match=r"unknown treatment 'zip'.*known: offload, recompute, compress"):
        Pool(budget=0, treatments=["offload", "zip"])
    with pytest.raises(ConfigError, match="treatments=3: give names"):
        Pool(budget=0, treatments=3)
    assert set(Pool(budget=0, treatments=()).treatments) == {"offload", "recompute"}  # (none given: default)


def pressure_inside_packs(monkeypatch, pool, times=1):
    """Makes the first `times` packs call the pool's pressure handler, as an allocation of the payload
    would on a GPU whose memory is full; returns the list of what those calls freed."""
    from supermem.tensor_pool.treatments import compress as treatments

    freed = []
    pack = treatments.relu_pack

    def pack_under_pressure(t, **kw):
        if len(freed) < times:
            freed.append(pool.on_pressure(1 << 30))
        return pack(t, **kw)

    monkeypatch.setattr(treatments, "relu_pack", pack_under_pressure)
    return freed


def test_pressure_inside_a_pack_frees_by_other_treatments(monkeypatch):
    """A pack allocates its payload; on a GPU that allocation can call the pool's pressure handler
    from inside the pack. There compression is not offered (it would pack again from inside a pack)
    and the entry being packed is not taken (it would be offloaded from under the pack); the handler
    frees by the other treatments."""
    pool = Pool(
        budget=None,
        policy="cost_aware",
        host_limit="64MiB",
        treatments=(Offload(), Compress(room="guess")),
    )
    freed = pressure_inside_packs(monkeypatch, pool)
    ref = train("mlp", steps=1)
    seen = {}

    def compress_one(p):
        e = next(e for e in live_entries(p) if p.treatments["compress"].applies(e))
        seen["left"] = p.leave(e, p.treatments["compress"])
        seen["entry"] = e

    got = train("mlp", pool, steps=1, during=compress_one)
    assert same(ref, got)
    s = pool.stats()
    assert freed and freed[0] > 0 and s["offloads"] > 0, (freed, s)  # the nested call offloaded others
    assert seen["left"] and seen["entry"].treatment.name == "compress"
    assert s["compressions"] == 1, s


def test_pressure_nested_in_a_pressure_call_keeps_the_accounting(monkeypatch):
    pool = Pool(
        budget=None,
        policy="cost_aware",
        host_limit="64MiB",
        treatments=(Offload(), Compress(room="guess")),
    )
    pool.treatments["offload"].link_bytes_per_s = 1e3  # copies priced dear: compression ranks first
    freed = pressure_inside_packs(monkeypatch, pool)
    ref = train("mlp", steps=1)
    got = train("mlp", pool, steps=1, during=lambda p: p.on_pressure(1 << 30))
    assert same(ref, got)
    assert freed and pool.stats()["compressions"] > 0


def test_fitting_the_budget_counts_a_compressed_entry_as_freeing_only_what_packing_saves():
    """One `Budget.fit` call ends under its target when compressing every ReLU output reaches it: a
    compressed entry frees its tensor's bytes less its packed payload (from the format's size), not
    the whole tensor (counting the whole tensor stops the call about halfway)."""
    pool = Pool(budget=None, policy="cost_aware", host_limit="64MiB", treatments=(Compress(room="guess"),))
    seen = {}

    def fit_once(p):
        compress = p.treatments["compress"]
        saving = sum(e.nbytes - packed_bytes(e.tensor) for e in live_entries(p) if compress.applies(e))
        before = p.budget.used_bytes()
        p.budget_bytes = before - saving + 1  # reachable only by compressing every one of them
        p.budget.fit()
        seen.update(before=before, after=p.budget.used_bytes(), target=p.budget.target(), saving=saving)
        p.budget_bytes = None

    train("resnet", pool, steps=1, during=fit_once)
    assert seen["saving"] > 0 and pool.stats()["compressions"] > 0
    assert seen["after"] <= seen["target"] < seen["before"], seen


def record_rooms(monkeypatch):
    """The values room of every pack the pool makes (None: an exact pack, which syncs on a GPU)."""
    from supermem.tensor_pool.treatments import compress as treatments

    rooms = []
    pack = treatments.relu_pack

    def recorded(t, **kw):
        rooms.append(kw.get("capacity"))
        return pack(t, **kw)

    monkeypatch.setattr(treatments, "relu_pack", recorded)
    return rooms


def test_by_default_every_pack_is_exact(monkeypatch):
    """Guessed rooms keep each original until its count is back, which lifted the forward's peak on an
    H100 (tests/gpu/test_compress_pool_gpu.py): by name or by default, Compress packs exactly."""
    ref = train("resnet")
    rooms = record_rooms(monkeypatch)
    pool = Pool(budget=0, policy="cost_aware", host_limit="64MiB", treatments=make_treatments(["compress"]))
    assert same(ref, train("resnet", pool, steps=3))
    assert rooms and all(r is None for r in rooms), rooms
    assert pool.stats()["compressions"] == len(rooms)


def test_after_the_first_step_packs_guess_their_room_and_never_wait(monkeypatch):
    """The first pack of each tensor size sizes its values exactly (a host sync on a GPU); later ones
    get room for the densest share seen at that size, and from the next step on, for the same
    tensor's count last step, plus a margin: nothing waits. The count comes back later; the entries
    settle and training stays bitwise."""
    ref = train("resnet")
    pool = forced()
    rooms = record_rooms(monkeypatch)
    per_step, misses = [], []

    def count(p):
        per_step.append(len(rooms))
        misses.append(p.stats().get("room_misses", 0))

    got = train("resnet", pool, steps=3, during=count)
    assert same(ref, got)
    first, later = rooms[: per_step[0]], rooms[per_step[0] :]
    assert first and 0 < first.count(None) < len(first), first  # one per size, at most
    assert later and all(r is not None for r in later), later
    s = pool.stats()
    assert s["decompressions"] + s["room_misses"] == s["compressions"], s
    assert s.get("room_misses", 0) == misses[1], misses  # rooms from the same tensor's count: none short


def test_a_room_too_small_brings_the_kept_original_back(monkeypatch):
    """When the guessed room is short (the tensor got denser), the entry is resident again with its
    original, kept until the count was known: nothing is lost, nothing waits, and it may be packed
    again later, with room for the count it learned."""
    from supermem.tensor_pool.treatments import compress as treatments

    monkeypatch.setattr(treatments, "ROOM_MARGIN", 0.5)
    monkeypatch.setattr(treatments, "ROOM_SLACK", 0)
    monkeypatch.setattr(treatments, "ROOM_NEW_SLACK", -0.2)
    ref = train("resnet")
    pool = forced()
    got = train("resnet", pool, steps=3)
    assert same(ref, got)
    s = pool.stats()
    assert s["room_misses"] > 0 and s["compressions"] > s["room_misses"], s


def test_settling_lets_the_originals_go_and_keeps_the_accounting():
    """Once a guessed pack's count is known, the entry holds only its packed payload (the original
    goes) and the pool's device bytes still add up (Pool.check) before and after."""
    from supermem.tensor_pool.treatments.compress import _Unsettled

    pool = Pool(budget=None, policy="cost_aware", host_limit="64MiB", treatments=(Compress(room="guess"),))
    seen = []

    def compress_all_then_settle(p):
        c = compress_all(p)
        unsettled = [e for e in live_entries(p) if isinstance(e.payload, _Unsettled)]
        p.check()
        c.settle(p)
        p.check()
        seen.append((len(unsettled), [e for e in unsettled if not isinstance(e.payload, Packed)]))

    got = train("mlp", pool, steps=2, during=compress_all_then_settle)
    assert same(train("mlp", steps=2), got)
    assert seen[1][0] > 0, seen  # the second step's packs guessed their room
    assert not seen[0][1] and not seen[1][1], seen


@pytest.mark.parametrize("case", ["resnet", "bottleneck", "mlp"])
def test_full_room_packs_drop_the_original_at_once_and_trim_once_their_count_is_back(case):
    """Compress(room="full"): a pack gets room for every element, so it waits for nothing and never
    misses; the original goes at once (the entry holds no tensor). Once the count is back (settle), the
    values move into a buffer of their exact size and the pool's device bytes drop by the room
    (Pool.check adds them up before and after). Training is bitwise."""
    from supermem.tensor_pool.treatments.compress import _Unsettled

    pool = Pool(budget="1GiB", policy="cost_aware", host_limit="64MiB", treatments=(Compress(room="full"),))
    seen = []  # per step: (unsettled packs, the pool's device bytes, the same after settle)

    def settle_between(p):
        compress_all(p)
        packs = [e for e in live_entries(p) if isinstance(e.payload, _Unsettled)]
        assert all(e.tensor is None and e.payload.original is None for e in packs), packs
        assert all(e.payload.packed.values.numel() == e.payload.packed.numel for e in packs)
        before = p.ledger.device_bytes
        p.check()
        p.treatments["compress"].settle(p)
        p.check()
        whole = [e.payload for e in packs]
        assert all(isinstance(w, Packed) and w.values.numel() == w.host_nnz for w in whole), whole
        seen.append((len(packs), before, p.ledger.device_bytes))

    got = train(case, pool, during=settle_between)
    assert same(train(case), got)
    assert all(n > 0 and after < before for n, before, after in seen), seen
    s = pool.stats()
    assert s["compressions"] > 0 and s["decompressions"] == s["compressions"] and not s.get("room_misses")
    assert 0 < s["compressed_payload_bytes"] < s["compressed_bytes"], s


def test_a_trim_whose_allocation_comes_to_the_pressure_handler_settles_nothing_twice(monkeypatch):
    """Trimming a full-room pack allocates its exact buffer; on a GPU that allocation may come to the
    pressure handler, which settles packs (waiting): the nested call must leave the pack being trimmed
    (and the others) to the call in progress, or it is trimmed twice and counted twice."""
    from supermem.tensor_pool.treatments import compress as treatments

    pool = Pool(budget="1GiB", policy="cost_aware", host_limit="64MiB", treatments=(Compress(room="full"),))
    c = pool.treatments["compress"]
    real = treatments.trimmed
    nested = []

    def trimmed_under_pressure(packed, nnz):
        nested.append(1)
        c.settle(pool, wait=True)  # what Budget.fit does first (Pool.settle)
        return real(packed, nnz)

    monkeypatch.setattr(treatments, "trimmed", trimmed_under_pressure)

    def pack_and_settle(p):
        compress_all(p)
        c.settle(p)
        p.check()

    got = train("resnet", pool, during=pack_and_settle)
    assert same(train("resnet"), got) and nested
    assert pool.ledger.device_bytes == 0


def test_a_trim_with_no_room_for_its_copy_keeps_the_full_room(monkeypatch):
    """Out of memory for the exact buffer, a full-room pack stays whole in its room (it holds every
    nonzero): nothing raises from settle, training stays bitwise, the accounting holds."""
    from supermem.tensor_pool.treatments import compress as treatments

    def no_room(packed, nnz):
        raise torch.OutOfMemoryError("no room for the trim")

    monkeypatch.setattr(treatments, "trimmed", no_room)
    pool = forced(room="full")
    got = train("resnet", pool, during=lambda p: p.check())
    assert same(train("resnet"), got)
    s = pool.stats()
    assert s["compressions"] > 0 and s["decompressions"] == s["compressions"], s
    assert pool.ledger.device_bytes == 0


def test_compress_room_must_be_a_known_mode_by_argument_or_name():
    from supermem.errors import UsageError

    with pytest.raises(UsageError, match="room must be one of exact, guess, full"):
        Compress(room="guessed")
    assert [t.room for t in make_treatments(["compress", "compress:full"])] == ["exact", "full"]
    with pytest.raises(ValueError, match="known: offload, recompute, compress, compress:exact"):
        make_treatments(["compress:fast"])


def test_a_choice_frees_what_the_payload_will_not_take():
    """Once a saved tensor was packed, compressing it again is offered as freeing its bytes less the
    payload it will take: the bitmap, room for last step's nonzeros plus the margin, the offsets
    (counted here from the tensor itself, per place in the step)."""
    from supermem.tensor_pool.treatments import compress as treatments

    c = Compress(room="guess")
    nnz_by_ordinal, offered = {}, {}

    def count(p):
        for e in live_entries(p):
            if e.tensor is not None:
                nnz_by_ordinal[e.ordinal] = int((e.tensor.reshape(-1).view(torch.int32) != 0).sum())

    train("resnet", Pool(budget="1GiB", policy="cost_aware", treatments=(c,)), steps=1, during=count)
    pool = Pool(budget=0, policy="cost_aware", treatments=(c,))
    train("resnet", pool, steps=1)  # packs every ReLU output once: their counts are known

    def price(p):
        resident = [e for e in live_entries(p) if e.state is State.RESIDENT]
        offered.update({ch.target.ordinal: (ch.nbytes, ch.target) for ch in c.choices(p, resident)})

    train("resnet", Pool(budget="1GiB", policy="cost_aware", treatments=(c,)), steps=1, during=price)
    assert offered
    for ordinal, (freed, e) in offered.items():
        n = e.extent
        room = int(nnz_by_ordinal[ordinal] * treatments.ROOM_MARGIN + n * treatments.ROOM_SLACK)
        payload = 4 * math.ceil(n / 32) + min(room, n) * 4 + 8 * (math.ceil(n / 2048) + 1)
        assert freed == e.nbytes - payload, (ordinal, freed, e.nbytes, payload)


@pytest.mark.parametrize("case", ["resnet", "bottleneck"])
def test_cost_aware_keeps_choosing_compression_in_steady_state_bitwise(case):
    """Where compression pays (here: measured cheap, as the kernels are on a GPU; copies dear), cost_aware
    with all three treatments compresses every step, also after the warm-up steps (stats reset, as
    `supermem bench train` does), and training is bitwise plain PyTorch's. (On CPU the torch reference
    packs slower than a region replays: measured as it is, cost_aware rightly recomputes instead.)"""
    ref = train(case, steps=5)
    compress = Compress(room="guess")
    for timing in compress._timing.values():
        timing.s_per_byte, timing._runs = 1e-15, 1 << 30
    pool = Pool(
        budget=0, policy="cost_aware", host_limit="64MiB", treatments=(Offload(), Recompute(), compress)
    )
    pool.treatments["offload"].link_bytes_per_s = 1e3  # copies priced dear: compress or recompute
    per_step = []

    def count(p):
        per_step.append(p.stats()["compressions"])  # packed so far: this step's forward is done
        p.reset_stats()  # as the bench does after its warm-up: each step counts on its own

    got = train(case, pool, steps=5, during=count)
    assert same(ref, got)
    assert all(n > 0 for n in per_step), per_step
    s = pool.stats()  # the last backward: the packs of the last step came back
    assert s["decompressions"] > 0 and s["compressed_bytes"] == 0, s


@pytest.mark.parametrize("how", ["fit", "pressure"])
def test_the_pool_settles_kept_originals_before_it_measures(how):
    """Fitting the budget and the pressure handler first let every guessed pack whose count is known
    drop its kept original (on a GPU the allocator counts it until then), even when nothing else
    needs to leave."""
    from supermem.tensor_pool.treatments.compress import _Unsettled

    pool = Pool(budget=None, policy="cost_aware", host_limit="64MiB", treatments=(Compress(room="guess"),))
    seen = []

    def leave_then_measure(p):
        compress_all(p)
        kept = [e for e in live_entries(p) if isinstance(e.payload, _Unsettled)]
        if how == "fit":
            p.budget_bytes = 1 << 40  # nothing over it: fitting measures and returns
            p.budget.fit()
            p.budget_bytes = None
        else:
            p.on_pressure(0)
        seen.append((len(kept), sum(isinstance(e.payload, _Unsettled) for e in kept)))
        p.check()

    train("mlp", pool, steps=2, during=leave_then_measure)
    assert seen[1][0] > 0 and seen[1][1] == 0, seen


def test_a_kept_tensor_saved_after_the_last_pack_lets_it_settle():
    """The last packs of a forward keep their originals until their count is known. The tensors saved
    after them (the head and the loss: small, kept where they are) still let finished packs settle,
    so the originals do not stay through the step's peak, which comes at the loss."""
    from supermem.tensor_pool.treatments.compress import _Unsettled

    pool = Pool(budget=None, policy="cost_aware", host_limit="64MiB", treatments=(Compress(room="guess"),))
    pool.min_bytes = 1 << 12  # the last Linear's input (32 x 64 fp32, 8 KiB) is an entry; smaller ones stay
    seen = []

    def leave_then_save_a_small_one(p):
        compress_all(p)
        kept = [e for e in live_entries(p) if isinstance(e.payload, _Unsettled)]
        with p:
            small = torch.ones(4, requires_grad=True)
            (small * torch.ones(4)).sum()  # saves a 16-byte tensor: kept, not an entry
        seen.append((len(kept), sum(isinstance(e.payload, _Unsettled) for e in kept)))

    got = train("mlp", pool, steps=2, during=leave_then_save_a_small_one)
    assert same(train("mlp", steps=2), got)
    assert seen[1][0] > 0 and seen[1][1] == 0, seen


@pytest.mark.parametrize(
    ("case", "share"), [("mlp", 0.85), ("blocks", 0.85), ("resnet", 0.85), ("bottleneck", 0.93)]
)
def test_the_planned_policy_compresses_relu_outputs_by_their_measured_cost(case, share):
    """planned with Compress as its only way to free bytes: the recorded step notes which saves a ReLU
    made and what their packs would hold, the plan compresses some of them (and nothing else), the
    step stays under the budget (packed payloads counted), and training is bitwise plain PyTorch's."""
    ref = train(case, steps=6)
    probe = Pool(budget="1GiB", policy="planned", treatments=(Compress(),))
    train(case, probe, steps=3)
    budget = int(probe.stats()["plan"]["untreated_peak_bytes"] * share)
    pool = Pool(budget=budget, policy="planned", host_limit="64MiB", treatments=(Compress(),))
    assert same(ref, train(case, pool, steps=6))
    s = pool.stats()
    plan = s["plan"]
    assert plan["compress"] > 0 and plan["recompute"] == plan["offload"] == 0, plan
    assert plan["feasible"] and plan["measured_peak_bytes"] <= budget, s
    assert s["compressions"] > 0, s


class DenseThenSparse(nn.Module):
    """ReLU outputs of very different densities: one after a shift up (almost all nonzero, as after a
    residual add), one after a shift down (mostly zeros)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 64)

    def forward(self, x):
        dense = torch.relu(self.a(x) + 3.0)
        sparse = torch.relu(self.b(dense) - 1.5)
        return self.c(sparse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_packs_price_is_the_exact_packs_size(dtype):
    """packed_nbytes_of counts what the pack keeps (every nonzero word: -0.0 and NaN too)."""
    from supermem.compress import packed_nbytes_of, relu_pack

    t = torch.relu(torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))).to(dtype)
    t.view(-1)[:4] = torch.tensor([-0.0, float("nan"), float("inf"), 0.0], dtype=dtype)
    assert packed_nbytes_of(t) == relu_pack(t).nbytes


def test_the_recorded_step_prices_each_relu_output_by_its_own_density(monkeypatch):
    """Each ReLU save's packed size in the profile is its own exact pack's (its nonzero words counted
    at the save), not one share packed so far for all: with that share, a plan packing the dense
    output expected to free more than it did, rose over its budget in its first step and was made
    again lower (a ResNet-152 at width 4 on this CPU: 7.6% over)."""
    import copy

    from supermem.policies import Planned

    profiles = []
    real = Planned.solve
    monkeypatch.setattr(
        Planned, "solve", lambda self, p, b: profiles.append(copy.deepcopy(p)) or real(self, p, b)
    )
    batch = lambda g: (torch.randn(128, 64, generator=g), None)  # noqa: E731
    ref = train_steps(DenseThenSparse, batch, steps=5)
    probe = Pool(budget="1GiB", policy="planned", treatments=(Compress(),))
    train_steps(DenseThenSparse, batch, probe, steps=3)
    shares = sorted(s.packed_bytes / s.nbytes for s in profiles[-1].saved if s.packed_bytes)
    assert len(shares) == 2 and shares[0] < 0.35 and shares[1] > 0.95, shares  # (the prior: 0.55 both)
    budget = int(probe.stats()["plan"]["untreated_peak_bytes"] * 0.9)
    pool = Pool(budget=budget, policy="planned", host_limit="64MiB", treatments=(Compress(),))
    assert same(ref, train_steps(DenseThenSparse, batch, pool, steps=5))
    s = pool.stats()
    assert s["plan"]["compress"] > 0 and s["plan"]["measured_peak_bytes"] <= budget, s
    assert s["replans"] == 0, s


def test_the_plan_prices_what_a_pack_waits_for_its_count_and_its_host_seconds(monkeypatch):
    """An exact pack on a GPU reads its nonzero count back (a host sync); the plan prices that wait
    (Profile.compress_wait_s, from Compress.price) per packed tensor, and the host seconds of packing
    (Profile.compress_host_s): where they are long, the plan rebuilds instead of packing."""
    import copy

    from supermem.policies import Planned
    from supermem.tensor_pool import planner

    profiles = []
    real = Planned.solve
    monkeypatch.setattr(
        Planned, "solve", lambda self, p, b: profiles.append(copy.deepcopy(p)) or real(self, p, b)
    )
    probe = Pool(budget="1GiB", policy="planned", treatments=(Compress(), Recompute()))
    train("bottleneck", probe, steps=3)
    p = profiles[-1]
    budget = int(probe.stats()["plan"]["untreated_peak_bytes"] * 0.85)
    p.compress_wait_s = 0.0
    assert planner.make_plan(p, budget).counts()["compress"] > 0
    p.compress_wait_s = 1.0
    plan = planner.make_plan(p, budget)
    assert plan.counts()["compress"] == 0 and plan.counts()["recompute"] > 0 and plan.feasible
    # The host seconds of a pack, its unpack and its trim (a GPU's: on CPU the price per byte is the
    # host's already, and they read 0) weigh the same way: a host-bound step pays them.
    assert probe.treatments["compress"].price(probe)[3] == 0.0
    p.compress_wait_s = 0.0
    p.compress_host_s = 1.0
    plan = planner.make_plan(p, budget)
    assert plan.counts()["compress"] == 0 and plan.counts()["recompute"] > 0 and plan.feasible


@pytest.mark.parametrize(
    ("packing", "plain", "chosen"),
    [
        ((True, 0.039), (True, 0.027), "plain"),  # ResNet-152 on an H100: the packing plan adds more
        ((True, 0.020), (True, 0.027), "packing"),
        ((True, 0.020), (False, 0.010), "packing"),  # the plan without packs does not fit
        ((False, 0.020), (True, 0.090), "plain"),
    ],
)
def test_a_plan_that_packs_competes_with_the_plan_without_packs(monkeypatch, packing, plain, chosen):
    """make_plan: where the greedy compresses, the greedy's plan without compression (the index's
    `packs` off) replaces it when that one fits and adds less. The greedy weighs a pack by what it
    frees now, not by the light call it breaks."""
    from supermem.tensor_pool import planner

    def greedy(p, budget, ix):
        feasible, added_s = packing if ix.packs else plain
        plan = planner.Plan((1, 2), budget, feasible=feasible, added_s=added_s)
        if ix.packs:
            plan.treatment[1] = "compress"
        return plan

    monkeypatch.setattr(planner.greedy, "_greedy", greedy)
    plan = planner.make_plan(Profile([], [], [], []), 10)
    assert plan.counts()["compress"] == (1 if chosen == "packing" else 0)
