"""Every strategy on an emulated model: the accelerator's work inside it is waited as modelled, and steps complete."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from conftest import assert_everywhere
from mpicomm import Topology
from runtime import DistributedOptimizer, HybCommOptions, TopkOptions
from runtime.emulate import active, emulate, emulate_optimizer, emulated_loss
from runtime.emulate.accelerator import deactivate
from runtime.emulate.pattern import fixed
from runtime.emulate.nodes import Pass
from runtime.hybrid.cost_model import emulated_gflops
from runtime.workloads.models import build_model, model_input

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

STEPS, BATCH = 5, 16
# Every run: the layers, the optimizer's update and zero_grad on the device.
DEVICE_WORK = {"layers", "optimizer", "zero_grad"}
# Dense strategies: each gradient to the host for MPI, its average back (EmulatedStaging).
STAGED = {"d2h", "h2d"}
# Top-k: the selection, the pairs' copies, the dense passes over the gradient a GPU makes and the sum of the
# pairs (runtime.sparse).
SPARSE = {"select", "d2h", "h2d", "memset", "average", "finite check", "sparse sum"}


def agree(ok: bool, message: str = "") -> None:
    assert_everywhere(MPI.COMM_WORLD, ok, message)


@pytest.fixture
def fresh():
    """One emulated accelerator per process: each test starts and ends without one."""
    deactivate()
    yield
    deactivate()


def emulated_model(name="mlp"):
    torch.manual_seed(0)
    model = build_model(name)
    (x,), y = model_input(name, BATCH)
    emulate(model, "v100", (x,))
    return model, x, y


def train(strategy, pto=False, topology=None, name="mlp", zero=None):
    """STEPS steps of an emulated model under DistributedOptimizer; returns (model, optimizer wrapper, accelerator).
    zero(model, dopt): the loop's zeroing (default: the wrapper's)."""
    model, x, y = emulated_model(name)
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    dopt = DistributedOptimizer(opt, model, strategy, pto=pto, topology=topology)
    try:
        dopt.passes = []  # whether each step's backward was one node (nodes.Pass)
        for _ in range(STEPS):
            dopt.zero_grad() if zero is None else zero(model, dopt)
            out = model(x)
            dopt.passes.append(isinstance(out.grad_fn, Pass._backward_cls))
            emulated_loss(out, y).backward()
            dopt.step()
        dopt.synchronize()
    finally:
        dopt.close()
    return model, dopt, active()


def check(model, acc, kinds, real=()):
    bad = [n for n, p in model.named_parameters() if p.grad is None or not bool(torch.isfinite(p.grad).all())]
    agree(not bad, f"gradients missing or not finite: {bad}")
    missing = set(kinds) - {k for k, s in acc.seconds.items() if s > 0}
    agree(not missing, f"no modelled time for {sorted(missing)}: {dict(acc.seconds)}")
    d = acc.describe()
    agree(set(kinds) <= set(d["emulated"]) and set(real) <= set(d["real"]), f"describe(): {d}")
    agree(all(bool(torch.isfinite(p).all()) for p in model.parameters()), "parameters stay finite")


@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "p3"])
def test_dense(fresh, strategy):
    model, dopt, acc = train(strategy)
    check(model, acc, DEVICE_WORK | STAGED)
    # Its hooks read when each gradient is ready (EmulatedStaging), so the backward runs ahead as one node,
    # except under p3, whose forward gate hooks the modules.
    agree(dopt.passes == [strategy != "p3"] * STEPS, f"{strategy}: the backward was one node: {dopt.passes}")
    # Every rank's fixed gradient is the same, so the average of the last step is that gradient: it landed
    # once per step over the marked buffers (runtime.emulate.landing), never on top of the last step's.
    off = [n for n, p in model.named_parameters() if not torch.allclose(p.grad, fixed(p), rtol=1e-5)]
    agree(not off, f"averaged gradients are not the emulated ones: {off}")
    agree("select" not in acc.seconds and "rebuild" not in acc.seconds, f"{dict(acc.seconds)}")
    # The rank's compute is the emulated device's: wfbp's progress thread drives MPI while training waits for it.
    agree(strategy != "wfbp" or dopt.strategy.progress.drive, "wfbp's progress thread does not drive")


def test_p3_under_a_loop_zeroing_through_the_model_in_place(fresh):
    """model.zero_grad(set_to_none=False) zeroes the placeholders p3 parks in .grad after each step, not the
    averages: the gradients still land once a step over zeroed buffers, and no placeholder is left in .grad."""
    model, _, acc = train("p3", zero=lambda model, dopt: model.zero_grad(set_to_none=False))
    check(model, acc, (DEVICE_WORK - {"zero_grad"}) | STAGED)  # the wrapper's memset is not the loop's
    off = [n for n, p in model.named_parameters() if p.grad.is_sparse or not torch.allclose(p.grad, fixed(p), rtol=1e-5)]
    agree(not off, f"averaged gradients are not the emulated ones: {off}")


def test_p3_updates_layer_by_layer_at_their_size(fresh):
    """p3 steps the optimizer per layer (ParamUpdater): each call waits for its own parameters, not the model's."""
    model, _, acc = train("p3")
    sizes = [p.numel() for p in model.parameters()]
    whole = acc.model.optimizer_s(sum(sizes), len(sizes), 1)
    # Layer by layer when the averages arrive apart, in one call when they arrive together (timing decides).
    agree(acc.calls["optimizer"] >= STEPS, f"{acc.calls['optimizer']} optimizer calls in {STEPS} steps")
    # Per layer, the kernels' launches add up; a step waiting the whole model's time per layer would be 3x.
    agree(acc.seconds["optimizer"] < 2 * STEPS * whole + 1e-3, f"{acc.seconds['optimizer']} s")


def test_hybcomm_sufficient_factors(fresh):
    model, dopt, acc = train(HybCommOptions(force="sfb"))
    agree(all(c.choice == "sfb" for c in dopt.strategy.plan), dopt.strategy.plan_text())
    check(model, acc, DEVICE_WORK | STAGED | {"rebuild"})


def test_hybcomm_prices_the_rebuild_at_the_emulated_rate(fresh):
    model, dopt, acc = train(HybCommOptions())
    agree(dopt.strategy.links.gflops == emulated_gflops(acc), f"{dopt.strategy.links}")
    check(model, acc, DEVICE_WORK | STAGED)


def test_hybcomm_closed_lets_the_emulated_model_go(fresh):
    """After close, nothing keeps the model alive: the emulation held its last pass's graph, whose output
    tensors carried hybcomm's capture hooks (and, through them, the strategy and every parameter) past close;
    8 ranks of VGG19-22K then held two models each and were killed for memory."""
    import gc
    import weakref

    model, dopt, _ = train(HybCommOptions(force="sfb"))
    gone = weakref.ref(model)
    del model, dopt
    gc.collect()
    agree(gone() is None, "the model outlived its closed DistributedOptimizer")


@pytest.mark.parametrize("granularity", ["model", "layer"])
def test_topk(fresh, granularity):
    model, dopt, acc = train(TopkOptions(density=0.05, granularity=granularity))
    check(model, acc, DEVICE_WORK | SPARSE)
    # The wire carries what real top-k sends: k pairs per rank per exchange, at the values' width.
    n = sum(p.numel() for p in model.parameters())
    agree(dopt.strategy.traffic.intra + dopt.strategy.traffic.inter > 0, "pairs were sent")
    agree(not dopt.strategy.ef.residuals, "no error-feedback residuals are kept under emulation")
    # SGD's momentum went to the strategy (momentum correction), whose velocity a step under emulation never
    # reads: none is made (a model's worth of host memory a rank).
    agree(dopt.strategy.momentum == 0.9 and dopt.strategy.velocity is None, "no velocity is kept under emulation")
    agree(0 < dopt.strategy.sparse.pairs <= 4 * n, "every rank's pairs were gathered")
    # ... and not summed into the gradients, which keep their landed values: the next landing has nothing to write.
    agree(all(torch.equal(p.grad, fixed(p)) for p in model.parameters()), "the landed gradients were changed")


def test_hier_topk(fresh):
    topo = Topology(ranks_per_node=2)
    try:
        model, dopt, acc = train(TopkOptions(density=0.05, hierarchical=True), topology=topo)
    finally:
        topo.free()
    check(model, acc, DEVICE_WORK | SPARSE)


def test_allreduce_pto(fresh):
    model, dopt, acc = train("allreduce", pto=True)
    check(model, acc, DEVICE_WORK | {"h2d"})
    agree(not dopt.pto._opt.state, "the shard's optimizer never stepped for real")


def test_ddp_over_gloo(fresh):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mpicomm.torchdist import init_gloo, shutdown_gloo

    init_gloo()
    try:
        model, x, y = emulated_model("cnn")
        ddp = DDP(model)
        opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        for _ in range(STEPS):
            opt.zero_grad()
            out = ddp(x)
            # DDP's hooks are C++ that Python cannot see: its forward makes the backward go unit by unit
            # all the same, so that each bucket's all-reduce starts when its last gradient lands.
            agree(not isinstance(out.grad_fn, Pass._backward_cls), f"DDP's backward is one node: {out.grad_fn}")
            emulated_loss(out, y).backward()
            opt.step()
        agree(isinstance(model(x).grad_fn, Pass._backward_cls), "without DDP around it, the backward is not one node")
    finally:
        ddp = None  # dropped before the group, as shutdown_gloo asks
        shutdown_gloo()
    check(model, active(), DEVICE_WORK)
