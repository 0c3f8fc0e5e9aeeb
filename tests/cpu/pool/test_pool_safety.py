"""The pool's safety net on CPU: in-place changes to saved tensors raise as in plain PyTorch (at any
budget), entering a pool is re-entrant and per-thread, tensors the pool cannot move pass through."""

import gc
import threading
import weakref

import pytest
import torch
import torch.nn as nn
from pool_policies import policy  # noqa: F401  (autouse: every test under every live policy)

from supermem.errors import ConfigError
from supermem.tensor_pool import Pool

BUDGETS = [0, "64KiB", "1GiB"]


def modified_after_save(x):
    a = x * 2
    b = a * a  # saves a (twice)
    a.add_(1)  # changes a saved tensor: backward must refuse
    return b.sum()


def plain_error(fn, x):
    with pytest.raises(RuntimeError) as info:
        fn(x).backward()
    return str(info.value)


def _global_module_hooks():
    m = torch.nn.modules.module
    return len(m._global_forward_pre_hooks) + len(m._global_forward_hooks)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("when", ["dropped", "raised", "dropped after training"])
def test_a_forward_whose_backward_never_comes_leaves_nothing_behind(budget, when):
    """A forward under the pool whose backward never runs (an evaluation with grad on, an exception
    before backward): once its output is dropped, its saved tensors, the pool and the pool's global
    module hooks go too. They all stayed while the pool kept saved tensors with their grad_fn: an
    output its own op saves (tanh's, relu's) holds that op's node, which holds the saved tensor, a
    cycle through autograd's C++ that the garbage collector cannot see."""
    gc.collect()
    hooks = _global_module_hooks()
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    outputs = []
    model[1].register_forward_hook(lambda m, i, o: outputs.append(weakref.ref(o)))
    x = torch.randn(32, 64, requires_grad=True)
    pool = Pool(budget=budget, min_bytes=0)
    if when.startswith("dropped"):
        for _ in range(3 if when == "dropped after training" else 0):  # a plan running, where policies plan
            with pool:
                model(x).sum().backward()
        outputs.clear()
        with pool:
            y = model(x)
        del y
    else:
        with pytest.raises(ValueError), pool:
            model(x)
            raise ValueError("before backward")
    freed = weakref.ref(pool)
    del pool
    gc.collect()
    assert outputs and outputs[0]() is None, "tanh's output, saved for backward, outlived the forward"
    assert freed() is None, "the pool outlived the forward it saved for"
    assert _global_module_hooks() == hooks


def _module_hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("steps", [0, 3])  # dies profiling its first step (global hooks), or with regions
@pytest.mark.parametrize("traced", [False, True])  # collected while dynamo traces
def test_a_pool_that_dies_in_a_reference_cycle_takes_its_module_hooks_along(monkeypatch, steps, traced):
    """The garbage collector clears the weak reference each of torch's hook handles keeps to its
    dict when the handle dies in a cycle, so removing the pool's hooks through their handles did
    nothing: a pool collected in a cycle (a model holding the pool that holds its modules) left its
    global hooks on every module call in the process, or its region hooks on the model. A collection
    can also run while dynamo traces, whose guards read those dicts: a pool collected then leaves its
    hooks on, and each takes itself off at its next call outside a trace."""
    from supermem.tensor_pool import regions

    gc.collect()
    hooks = _global_module_hooks()
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    x = torch.randn(32, 64, requires_grad=True)
    pool = Pool(budget="64KiB", min_bytes=0)
    for _ in range(steps):
        with pool:
            model(x).sum().backward()
    with pool:
        model(x)
    blocks = list(model)
    model.pool = pool  # the cycle: model -> pool -> its regions -> the model's modules
    freed = weakref.ref(pool)
    del pool, model
    if traced:
        monkeypatch.setattr(regions, "_tracing", lambda: True)
    gc.collect()
    monkeypatch.undo()
    assert freed() is None
    again = nn.Sequential(*blocks)
    again(x).sum().backward()  # its blocks train as ever (and a left hook's next call is here)
    assert _global_module_hooks() == hooks
    assert _module_hooks(again) == 0


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("size", [8, 256])  # below and above the pool's 64 KiB budget
def test_inplace_change_after_save_raises_like_pytorch(budget, size):
    x = torch.randn(size, size, requires_grad=True)
    ref = plain_error(modified_after_save, x)
    assert "modified by an inplace operation" in ref
    pool = Pool(budget=budget, host_limit="64MiB", min_bytes=1024)  # the policy fixture's default
    with pool, pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        modified_after_save(x).backward()
    assert "is at version 1; expected version 0 instead" in str(info.value)
    assert "is at version 1; expected version 0 instead" in ref


@pytest.mark.parametrize("budget", BUDGETS)
def test_inplace_on_a_leaf_input_saved_raises(budget):
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64)
    pool = Pool(budget=budget, host_limit="64MiB", min_bytes=0)
    with pool, pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y = (x @ w).sum()  # saves x (a leaf without grad) and w
        x.mul_(2)
        y.backward()


def test_reentering_a_pool_nests():
    pool = Pool(budget=0, host_limit="16MiB")
    x = torch.randn(128, 128, requires_grad=True)
    with pool:
        with pool:
            y = torch.tanh(x @ x).sum()
        z = torch.sin(x).sum()
        (y + z).backward()
    assert pool.stats()["packed"] >= 1
    with torch.no_grad():
        want = torch.autograd.functional.vjp(lambda v: torch.tanh(v @ v).sum() + torch.sin(v).sum(), x)[1]
    assert torch.allclose(x.grad, want, rtol=0, atol=1e-5)
    # Outside the pool again: nothing is packed.
    before = pool.stats()["packed"]
    torch.tanh(x @ x).sum().backward()
    assert pool.stats()["packed"] == before


def test_one_pool_from_two_threads():
    pool = Pool(budget=0, host_limit="64MiB")
    errors = []
    start = threading.Barrier(2)

    def work(seed):
        try:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(64, 64, generator=g, requires_grad=True)
            start.wait()
            for _ in range(20):
                with pool:
                    torch.tanh(x @ x).pow(2).sum().backward()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pool.check()


def test_watching_a_tensor_never_shows_another_thread_a_change():
    """The pool watches a dropped tensor's version from any thread (one thread's step drops another's
    tensors under a shared budget); the tensor's version must read unchanged all the while."""
    from supermem.tensor_pool.entry import version_watcher

    t = torch.randn(8, 8)
    reading, done, seen = threading.Event(), threading.Event(), set()

    def watch():
        reading.wait()
        for _ in range(2000):
            version_watcher(t)
        done.set()

    w = threading.Thread(target=watch)
    w.start()
    while not done.is_set():
        seen.add(t._version)
        reading.set()
    w.join()
    assert seen == {0}
    t.add_(1)
    assert version_watcher(t)._version == 1 and version_watcher(t).untyped_storage().nbytes() == 0


def test_a_tensor_watched_from_inside_an_op_keeps_its_version():
    """Under supermem's allocator the pool drops tensors from its pressure handler, which runs inside
    the op that allocates, below autograd's dispatch: the watcher made there must still share the
    saved tensor's version counter (a T5's int64 buckets, saved at version 1, read 0: autograd's
    in-place error mid-training on an H200)."""
    from supermem.tensor_pool.entry import version_watcher

    t = torch.zeros(4, dtype=torch.int64)
    t.add_(1)
    with torch._C._AutoDispatchBelowADInplaceOrView():  # where an op's kernel runs
        w = version_watcher(t)
    assert w._version == 1
    t.add_(1)
    assert w._version == 2


@pytest.mark.parametrize(
    "make",
    [
        lambda: (torch.randn(64, 64, requires_grad=True) * 1).to_sparse(),  # not a leaf: saved
        lambda: (torch.randn(64, 64, requires_grad=True) * 1).to_sparse_csr(),
    ],
    ids=["sparse_coo", "sparse_csr"],
)
def test_tensors_without_plain_storage_pass_through(make):
    pool = Pool(budget=0, host_limit="16MiB", min_bytes=0)
    s = make()
    d = torch.randn(64, 64, requires_grad=True)
    with pool:
        y = (torch.sparse.mm(s, d) if s.layout == torch.sparse_coo else s @ d).sum()
        y.backward()
    assert d.grad is not None
    pool.check()


def test_nested_tensor_passes_through():
    pool = Pool(budget=0, host_limit="16MiB", min_bytes=0)
    a = torch.randn(3, 8, requires_grad=True)
    b = torch.randn(5, 8, requires_grad=True)
    with pool:
        nt = torch.nested.as_nested_tensor([a, b])
        torch.nested.to_padded_tensor(nt * nt, 0.0).sum().backward()
    assert torch.equal(a.grad, 2 * a.detach()) and torch.equal(b.grad, 2 * b.detach())
    pool.check()


def test_fraction_budget_on_cpu_says_why():
    with pytest.raises(ConfigError, match="no device") as info:
        Pool(budget=0.5, device="cpu")
    assert "fraction in (0, 1]" not in str(info.value)
    with pytest.raises(ConfigError, match="no device"):
        Pool(budget="50%", device="cpu")
