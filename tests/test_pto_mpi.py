"""PTO's sharded update equals an unsharded optimizer step: parameters, schedulers, state, checkpoints, n < P."""

from __future__ import annotations

import io
import math

import pytest
import torch

from conftest import assert_everywhere
from mpicomm import Ring, block_counts
from runtime.pto import ShardedUpdate

# The user's optimizer is never stepped itself (PTO steps a private one), which its scheduler notices.
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")]

# 2311 elements (prime, so no P > 1 divides it), a 1-element and a 0-dim parameter, and one
# large enough for the vectorised kernel bodies, which shard boundaries cut at odd places.
SHAPES = [(7, 3), (1,), (37,), (), (5, 5, 3), (128,), (2,), (33, 62)]
STEPS = 10

OPTIMIZERS = {
    "sgd-momentum-wd-nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True)),
    "sgd-momentum-dampening": (torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.1)),
    "sgd-plain": (torch.optim.SGD, dict(lr=0.05)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adam-amsgrad-wd": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-2, amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}
# Interleaved groups (weights vs the rest, as with "no decay on biases") need gathered leaves,
# here listed out of parameter order too; contiguous ones are views of the shard.
LAYOUTS = {"interleaved": lambda n: (list(range(0, n, 2)), list(range(1, n, 2))[::-1]),
           "contiguous": lambda n: (list(range(3)), list(range(3, n)))}


def make_params(shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def make_optimizer(name, params, layout="interleaved"):
    cls, kw = OPTIMIZERS[name]
    first, second = LAYOUTS[layout](len(params))
    # The second group differs in lr (and weight decay where used) so hyper-parameters must follow groups.
    other = dict(lr=kw["lr"] * 0.3)
    if kw.get("weight_decay"):
        other["weight_decay"] = 0.0
    return cls([dict(params=[params[i] for i in first]), dict(params=[params[i] for i in second], **other)], **kw)


def grads(step, shapes=SHAPES, seed=99):
    """The averaged gradients of one step: deterministic, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(s, generator=g) for s in shapes]


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def max_rel(a, b) -> float:
    a, b = flat(a), flat(b)
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max()) if a.numel() else 0.0


def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)


def set_grads(params, gs):
    for p, g in zip(params, gs):
        p.grad = g


def run_reference(name, layout="interleaved", steps=range(STEPS), shapes=SHAPES, none_grad=False):
    """The unsharded optimizer; none_grad: parameter 1's gradient is zero at step 3 (run_pto passes None)."""
    params = make_params(shapes)
    opt = make_optimizer(name, params, layout)
    sched = scheduler(opt)
    for t in steps:
        gs = grads(t, shapes)
        if none_grad and t == 3:
            gs[1].zero_()
        set_grads(params, gs)
        opt.step()
        sched.step()
    return params, opt


def run_pto(world, name, layout="interleaved", steps=range(STEPS), shapes=SHAPES, via_shard=False,
            none_grad=False):
    params = make_params(shapes)
    opt = make_optimizer(name, params, layout)
    sched = scheduler(opt)  # changes opt's lr; PTO must pick it up though opt itself never steps
    pto = ShardedUpdate(opt, params, world)
    start, stop = pto.shard
    for t in steps:
        gs = grads(t, shapes)
        if via_shard:
            pto.step(flat(gs)[start:stop])
        else:
            set_grads(params, gs)
            if none_grad and t == 3:
                params[1].grad = None
            pto.step()
        sched.step()
    return params, opt, pto, sched


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_matches_unsharded_with_scheduler(world, name, layout):
    ref, ref_opt = run_reference(name, layout, none_grad=True)
    got, opt, pto, _ = run_pto(world, name, layout, none_grad=True)
    start, stop = pto.shard
    rel = max_rel(got, ref)
    assert_everywhere(world, rel <= 1e-6, f"{name} {layout}: max relative difference {rel:.3g}")
    assert_everywhere(world, [g["lr"] for g in pto._opt.param_groups] == [g["lr"] for g in ref_opt.param_groups],
                      "the scheduler's lr did not reach the shard optimizer")
    assert_everywhere(world, sum(leaf.numel() for leaf in pto._leaves) == stop - start, "shard not covered")
    pto.close()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bit_exact(world, name):
    """Same kernels on the same values: not just close but identical (only FMA use that differs
    between a kernel's vector body and its scalar tail could break this on some CPU)."""
    ref, _ = run_reference(name)
    got, _, pto, _ = run_pto(world, name)
    exact = all(torch.equal(a, b) for a, b in zip(got, ref))
    assert_everywhere(world, exact, f"{name}: max relative difference {max_rel(got, ref):.3g}")
    pto.close()


@pytest.mark.parametrize("name", ["sgd-momentum-wd-nesterov", "adam"])
def test_grad_shard_equals_grad_path(world, name):
    a, _, pa, _ = run_pto(world, name)
    b, _, pb, _ = run_pto(world, name, via_shard=True)
    assert_everywhere(world, all(torch.equal(x, y) for x, y in zip(a, b)), "grad_shard path differs")
    pa.close()
    pb.close()


def test_grad_shard_from_reduce_scatter(world):
    """Per-rank gradients: a reduce-scatter's block fed to step(grad_shard) equals the allreduced p.grad."""
    P, r = world.Get_size(), world.Get_rank()
    results = []
    # The ring everywhere (as the runtime uses it): its reduce-scatter and allreduce add in the same
    # order; MPI's own collectives, the latency path, need not (1.6e-6 apart after 4 Adam steps).
    with Ring(world, latency_bytes=0) as ring:
        for via_shard in (False, True):
            params = make_params()
            opt = make_optimizer("adam", params)
            pto = ShardedUpdate(opt, params, world)
            start, stop = pto.shard
            for t in range(4):
                local = flat(grads(t, seed=r + 1))
                if via_shard:
                    block = torch.empty(stop - start)
                    ring.reduce_scatter(local, block).wait()
                    pto.step(block.div_(P))
                else:
                    ring.allreduce(local).wait()
                    set_grads(params, [g.view(p.shape) for g, p in
                                       zip(local.div_(P).split([p.numel() for p in params]), params)])
                    pto.step()
            results.append(params)
            pto.close()
    rel = max_rel(results[1], results[0])
    assert_everywhere(world, rel <= 1e-6, f"reduce-scatter path differs by {rel:.3g}")


def state_equal(a: dict, b: dict):
    """(ok, message) comparing two optimizer state_dicts (state and param_groups)."""
    if a["param_groups"] != b["param_groups"]:
        return False, f"param_groups differ: {a['param_groups']} vs {b['param_groups']}"
    if sorted(a["state"]) != sorted(b["state"]):
        return False, f"state for params {sorted(a['state'])} vs {sorted(b['state'])}"
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        if list(sa) != list(sb):
            return False, f"param {i}: keys {list(sa)} vs {list(sb)}"
        for k in sa:
            x, y = sa[k], sb[k]
            if torch.is_tensor(x):
                if x.shape != y.shape or x.dtype != y.dtype:
                    return False, f"param {i} {k}: {x.shape} {x.dtype} vs {y.shape} {y.dtype}"
                if not torch.equal(x, y):
                    return False, f"param {i} {k}: values differ by up to {float((x - y).abs().max()):.3g}"
            elif x != y:
                return False, f"param {i} {k}: {x} vs {y}"
    return True, ""


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_consolidate_into_equals_unsharded_state(world, name):
    _, ref_opt = run_reference(name)
    _, opt, pto, _ = run_pto(world, name)
    assert_everywhere(world, not opt.state, "the user's optimizer should hold no state before consolidating")
    pto.consolidate_into(opt)
    ok, msg = state_equal(opt.state_dict(), ref_opt.state_dict())
    assert_everywhere(world, ok, f"{name}: {msg}")
    pto.close()


@pytest.mark.parametrize("name", ["sgd-momentum-wd-nesterov", "adam-amsgrad-wd", "adamw"])
def test_load_from_then_continue_equals_uninterrupted(world, name):
    ref, _ = run_reference(name)
    # First half, then a checkpoint as train.py would write it.
    params, opt, pto, sched = run_pto(world, name, steps=range(5))
    pto.consolidate_into(opt)
    buf = io.BytesIO()
    torch.save(dict(model=[p.detach().clone() for p in params], optimizer=opt.state_dict(),
                    scheduler=sched.state_dict()), buf)
    pto.close()
    # Resume into fresh objects: the initial values are overwritten by the checkpoint.
    buf.seek(0)
    ckpt = torch.load(buf)
    params = make_params(seed=5)
    with torch.no_grad():
        for p, v in zip(params, ckpt["model"]):
            p.copy_(v)
    opt = make_optimizer(name, params)
    opt.load_state_dict(ckpt["optimizer"])
    sched = scheduler(opt)
    sched.load_state_dict(ckpt["scheduler"])
    pto = ShardedUpdate(opt, params, world)
    pto.load_from(opt)
    opt.state.clear()  # the shard holds the state now; PTO must not read it from here
    for t in range(5, STEPS):
        set_grads(params, grads(t))
        pto.step()
        sched.step()
    exact = all(torch.equal(a, b) for a, b in zip(params, ref))
    rel = max_rel(params, ref)
    assert_everywhere(world, rel <= 1e-6, f"{name}: resumed run differs by {rel:.3g}")
    assert_everywhere(world, exact, f"{name}: resumed run not bit-exact ({rel:.3g})")
    pto.close()


@pytest.mark.parametrize("name", ["sgd-momentum-wd-nesterov", "adam"])
@pytest.mark.parametrize("shapes", [[(1,)], [(), (1,)]], ids=["n1", "n2"])
def test_fewer_elements_than_ranks(world, name, shapes):
    ref, ref_opt = run_reference(name, shapes=shapes)
    got, opt, pto, _ = run_pto(world, name, shapes=shapes)
    start, stop = pto.shard
    n = sum(math.prod(s) for s in shapes)
    expected = block_counts(n, world.Get_size())[world.Get_rank()]
    assert_everywhere(world, stop - start == expected, f"shard {pto.shard}, expected {expected} elements")
    assert_everywhere(world, all(torch.equal(a, b) for a, b in zip(got, ref)), f"{name}: {max_rel(got, ref):.3g}")
    pto.consolidate_into(opt)
    ok, msg = state_equal(opt.state_dict(), ref_opt.state_dict())
    assert_everywhere(world, ok, msg)
    # And back: the reloaded shard takes one more step like the reference.
    pto.load_from(opt)
    gs = grads(STEPS, shapes)
    pto.step(flat(gs)[start:stop])
    set_grads(ref, gs)
    ref_opt.step()
    assert_everywhere(world, all(torch.equal(a, b) for a, b in zip(got, ref)), f"{name} after load_from")
    pto.close()


def test_param_not_in_optimizer_is_an_error(world):
    params = make_params()
    extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not in ShardedUpdate's params"):
        ShardedUpdate(torch.optim.SGD(params + [extra], lr=0.1), params, world)
    with pytest.raises(ValueError, match="in no param group"):
        ShardedUpdate(torch.optim.SGD(params[1:], lr=0.1), params, world)
    with pytest.raises(ValueError, match="appears twice"):
        ShardedUpdate(torch.optim.SGD(params, lr=0.1), params + params[:1], world)


def test_mixed_dtypes_and_bad_grad_shard_are_errors(world):
    params = make_params()
    mixed = params + [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    with pytest.raises(TypeError, match="one dtype"):
        ShardedUpdate(torch.optim.SGD(mixed, lr=0.1), mixed, world)
    with ShardedUpdate(torch.optim.SGD(params, lr=0.1), params, world) as pto:
        start, stop = pto.shard
        with pytest.raises(ValueError, match="grad_shard has"):
            pto.step(torch.zeros(stop - start + 1))
        with pytest.raises(ValueError, match="param groups changed"):
            pto.optimizer.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(2))]))
            pto.step()


def test_parameters_changed_between_steps_are_picked_up(world):
    """In-place edits are seen through the version counter; .data writes need refresh()."""
    runs = []
    for sharded in (False, True):
        params = make_params()
        opt = make_optimizer("adam", params)
        pto = ShardedUpdate(opt, params, world) if sharded else None
        for t in range(6):
            set_grads(params, grads(t))
            if sharded:
                pto.step()
            else:
                opt.step()
            if t == 1:
                with torch.no_grad():
                    params[-1].mul_(0.5)
            if t == 3:
                params[2].data.copy_(torch.arange(37.0))
                if sharded:
                    pto.refresh()
        runs.append(params)
        if pto:
            pto.close()
    assert_everywhere(world, all(torch.equal(a, b) for a, b in zip(*runs)), f"{max_rel(runs[1], runs[0]):.3g}")
