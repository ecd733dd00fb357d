"""What a Horovod or DDP user expects: accumulation, synchronize() and clipping, hooks, communicators, state."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from dp_helpers import Branchy, batches, close, local, max_diff, sgd, wrap
from runtime import CompressionState, allreduce_hook, bf16_compress_hook, fp16_compress_hook

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

STRATEGIES = ["allreduce", "wfbp", "p3", "allreduce+pto", "p3+pto", "topk"]
STEPS = 8


def split(name):
    base, _, pto = name.partition("+")
    kw = {"slice_size": 7} if base == "p3" else {}
    if base == "topk":
        kw["sparse_options"] = {"density": 1.0, "momentum_correction": False}
    if pto:
        kw["pto"] = True
    return base, kw


def make():
    torch.manual_seed(7)
    return Branchy()


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def reference(world, X, Y, micro=1, clip=None):
    """One process: every rank's micro-batches, losses averaged over ranks, summed over micro-batches."""
    model, P = make(), world.Get_size()
    opt = sgd(model)
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            xs, ys = X[step * micro + m], Y[step * micro + m]
            loss = sum(nn.functional.cross_entropy(model(local(xs, q)), local(ys, q)) for q in range(P)) / P
            loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return params(model)


@pytest.mark.parametrize("way", ["backward_passes_per_step", "no_sync"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_accumulation_equals_one_process(world, strategy, way):
    X, Y = batches(world.Get_size(), steps=STEPS * 3)
    want = reference(world, X, Y, micro=3)
    model, r = make(), world.Get_rank()
    base, kw = split(strategy)
    if way == "backward_passes_per_step":
        kw["backward_passes_per_step"] = 3
    dopt = wrap(sgd(model), model, base, **kw)
    for step in range(STEPS):
        dopt.zero_grad()
        for m in range(3):
            xs, ys = X[step * 3 + m], Y[step * 3 + m]
            loss = nn.functional.cross_entropy(model(local(xs, r)), local(ys, r))
            if way == "no_sync" and m < 2:
                with dopt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        dopt.step()
    dopt.close()
    got = params(model)
    assert_everywhere(world, close(got, want), f"{strategy} {way}: max difference {max_diff(got, want):.3g}")


def test_too_many_backward_passes_are_named(world):
    model = make()
    dopt = wrap(sgd(model), model, "wfbp")
    X, Y = batches(world.Get_size(), steps=2)
    r = world.Get_rank()
    nn.functional.cross_entropy(model(local(X[0], r)), local(Y[0], r)).backward()
    with pytest.raises(RuntimeError, match="became ready 2 times in one step"):
        nn.functional.cross_entropy(model(local(X[1], r)), local(Y[1], r)).backward()
    dopt.close()  # after the error: releases without communicating


@pytest.mark.parametrize("strategy", ["wfbp", "p3"])
def test_the_wrapped_optimizers_own_step_is_refused_before_it_updates(world, strategy):
    """A loop calling step() on the optimizer it wrapped would update with this rank's own gradients: refused, the
    message naming the wrapper, nothing updated; the wrapper's step() goes on; after close() it steps as torch's."""
    model, r = make(), world.Get_rank()
    opt = sgd(model)
    dopt = wrap(opt, model, strategy)
    X, Y = batches(world.Get_size(), steps=1)
    before = params(model)
    dopt.zero_grad()
    nn.functional.cross_entropy(model(local(X[0], r)), local(Y[0], r)).backward()
    with pytest.raises(RuntimeError, match=r"step\(\) was called on the SGD that DistributedOptimizer wraps"):
        opt.step()
    untouched = all(torch.equal(a, b) for a, b in zip(params(model), before))
    dopt.step()
    dopt.close()
    opt.step()  # its own again
    assert_everywhere(world, untouched, "the refused step() updated the parameters")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_synchronize_then_clip_then_step(world, strategy):
    """Horovod's synchronize(): averaged gradients in .grad before step(), here clipped by global norm."""
    X, Y = batches(world.Get_size(), steps=STEPS)
    want = reference(world, X, Y, clip=0.3)
    model, r = make(), world.Get_rank()
    base, kw = split(strategy)
    dopt = wrap(sgd(model), model, base, **kw)
    clipped = 0
    for step in range(STEPS):
        dopt.zero_grad()
        nn.functional.cross_entropy(model(local(X[step], r)), local(Y[step], r)).backward()
        dopt.synchronize()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        clipped += float(norm) > 0.3
        with dopt.skip_synchronize():
            dopt.step()
    dopt.close()
    got = params(model)
    assert_everywhere(world, clipped > 0, "the clipping never applied: the test cannot fail")
    assert_everywhere(world, close(got, want), f"{strategy}: max difference {max_diff(got, want):.3g}")


def train_with_hook(world, strategy, hook, state):
    X, Y = batches(world.Get_size(), steps=STEPS)
    model, r = make(), world.Get_rank()
    dopt = wrap(sgd(model), model, strategy, **({"fuse_bytes": 300} if strategy == "wfbp" else {}))
    if hook is not None:
        dopt.register_comm_hook(state, hook)
    for step in range(STEPS):
        dopt.zero_grad()
        nn.functional.cross_entropy(model(local(X[step], r)), local(Y[step], r)).backward()
        dopt.step()
    dopt.close()
    return params(model)


@pytest.mark.parametrize("strategy", ["allreduce", "wfbp"])
def test_comm_hooks(world, strategy):
    X, Y = batches(world.Get_size(), steps=STEPS)
    want = reference(world, X, Y)
    calls = []

    def counting_hook(state, bucket):
        state.append((bucket.index, bucket.buffer().numel(), len(bucket.parameters())))
        return allreduce_hook(None, bucket)

    exact = train_with_hook(world, strategy, counting_hook, calls)
    buckets = {c[0] for c in calls}
    ok = close(exact, want) and len(calls) == STEPS * len(buckets) and sum(c[1] for c in calls if c[0] in buckets) > 0
    assert_everywhere(world, ok, f"{strategy}: plain hook differs ({max_diff(exact, want):.3g}) or calls {calls[:4]}")
    for hook in (fp16_compress_hook, bf16_compress_hook):
        got = train_with_hook(world, strategy, hook, CompressionState())
        diff = max_diff(got, want)
        mine = torch.cat([p.reshape(-1) for p in got])
        first = mine.clone()
        world.Bcast(first.numpy(), root=0)
        # Compressed: close to the exact result but not equal to it, and the same on every rank.
        ok = 0 < diff < 2e-2 and torch.equal(mine, first)
        assert_everywhere(world, ok, f"{strategy} {hook.__name__}: difference {diff:.3g}")


def test_hooks_are_refused_by_unbucketed_strategies(world):
    model = make()
    dopt = wrap(sgd(model), model, "p3")
    with pytest.raises(ValueError, match="allreduce and wfbp"):
        dopt.register_comm_hook(CompressionState(), fp16_compress_hook)
    dopt.close()


def test_an_existing_communicator(world):
    """Two halves of the world train two models side by side, each on its own communicator."""
    P, r = world.Get_size(), world.Get_rank()
    if P < 2:
        pytest.skip("needs 2 ranks")
    half = world.Split(r % 2, r)
    X, Y = batches(half.Get_size(), steps=STEPS, seed=100 + r % 2)
    want = reference(half, X, Y)
    model = make()
    dopt = wrap(sgd(model), model, "p3", comm=half, slice_size=7)
    for step in range(STEPS):
        dopt.zero_grad()
        nn.functional.cross_entropy(model(local(X[step], half.Get_rank())), local(Y[step], half.Get_rank())).backward()
        dopt.step()
    dopt.close()
    got = params(model)
    half.Free()
    assert_everywhere(world, close(got, want), f"half {r % 2}: max difference {max_diff(got, want):.3g}")


def test_model_state_dict_is_never_stale_under_p3(world):
    X, Y = batches(world.Get_size(), steps=3)
    model, r = make(), world.Get_rank()
    dopt = wrap(sgd(model), model, "p3", slice_size=7)
    for step in range(3):
        dopt.zero_grad()
        nn.functional.cross_entropy(model(local(X[step], r)), local(Y[step], r)).backward()
        dopt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}  # p3 still owes the last update here
    dopt.synchronize()
    after = model.state_dict()
    dopt.close()
    want = reference_steps(world, X, Y, 3)
    ok = all(torch.equal(before[k], after[k]) for k in after) and close(list(after.values()), want)
    assert_everywhere(world, ok, "model.state_dict() right after step() lacked the owed update")


def reference_steps(world, X, Y, steps):
    model, P = make(), world.Get_size()
    opt = sgd(model)
    for step in range(steps):
        opt.zero_grad()
        (sum(nn.functional.cross_entropy(model(local(X[step], q)), local(Y[step], q)) for q in range(P)) / P).backward()
        opt.step()
    return [v for v in model.state_dict().values()]


def test_strategy_state_in_state_dict(world):
    model = make()
    dopt = wrap(sgd(model), model, "topk", sparse_options={"density": 0.1})
    X, Y = batches(world.Get_size(), steps=2)
    r = world.Get_rank()
    for step in range(2):
        dopt.zero_grad()
        nn.functional.cross_entropy(model(local(X[step], r)), local(Y[step], r)).backward()
        dopt.step()
    state = dopt.state_dict()
    dopt.close()
    local_state = state["strategy_local"]
    ok = state["steps"] == 2 and state["strategy_shared"] == {"steps": 2} and state["strategy"] == "topk"
    if r == 0:
        ok = ok and len(local_state) == world.Get_size() and all("residuals" in s and "velocity" in s
                                                                  for s in local_state)
    else:
        ok = ok and local_state is None
    assert_everywhere(world, ok, f"state: {sorted(state)}")


def test_lbfgs_style_closure_is_refused(world):
    model = make()
    dopt = wrap(sgd(model), model, "allreduce")
    with pytest.raises(ValueError, match="closure"):
        dopt.step(lambda: 0.0)
    dopt.close()


@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3"])
def test_gradients_set_by_hand_are_averaged(world, strategy):
    """A .grad assigned without backward (a custom gradient) counts, as it would for torch's optimizer."""
    r, P = world.Get_rank(), world.Get_size()
    model = make()
    dopt = wrap(torch.optim.SGD(model.parameters(), lr=1.0), model, strategy)
    before = params(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(r))
    dopt.step()
    dopt.synchronize()
    dopt.close()
    mean = (P - 1) / 2
    ok = all(torch.allclose(a, b - mean) for a, b in zip(params(model), before))
    assert_everywhere(world, ok, "hand-set gradients were not averaged and applied")


@pytest.mark.parametrize("strategy", ["wfbp", "p3"])
def test_what_a_loop_sets_in_grad_after_the_last_step_survives_close(world, strategy):
    """A .grad set to None, or to the loop's own tensor, after the last step: wfbp leaves both as they are; p3,
    whose .grad were placeholders then, applies its updates at close() and leaves the same values in the views."""
    model, r = make(), world.Get_rank()
    dopt = wrap(sgd(model), model, strategy)
    X, Y = batches(world.Get_size(), steps=1)
    nn.functional.cross_entropy(model(local(X[0], r)), local(Y[0], r)).backward()
    dopt.step()
    ps = list(model.parameters())
    mine = torch.full_like(ps[1], 3.0)
    ps[0].grad, ps[1].grad = None, mine
    dopt.close()
    if strategy == "p3":
        ok = not ps[0].grad.any() and torch.equal(ps[1].grad, mine) and not any(p.grad.is_sparse for p in ps)
    else:
        ok = ps[0].grad is None and ps[1].grad is mine
    assert_everywhere(world, ok, f"{strategy}: after close() .grad is {[type(p.grad).__name__ for p in ps[:2]]}")
