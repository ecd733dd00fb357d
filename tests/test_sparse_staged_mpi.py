"""topk / hier-topk on gradients that live apart from MPI's host memory (staged): same results as in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_everywhere
from mpicomm import Topology
from mpicomm.sparse_allreduce import SparseAllreduce
from runtime.grad_buffers import GradientBuffers
from runtime.options import TopkOptions
from runtime.sparse import HierTopkSync, TopkSync
from runtime.sparse.error_feedback import ErrorFeedback
from runtime.sparse.mstopk import MSTopK
from runtime.sparse.selection import k_for_density
from runtime.strategy import StrategyContext

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")

SHAPES = [((300, 300), torch.float32), ((300,), torch.float32), ((10, 300), torch.float32),
          ((50,), torch.float64)]  # two dtypes: two flat buffers, two exchanges per step
STRATEGIES = {"topk": TopkSync, "hier-topk": HierTopkSync}


def rpn(world) -> int:
    """Two ranks per node where the world divides: the hierarchical exchange has both kinds of step."""
    return 2 if world.Get_size() % 2 == 0 else 1


def gradient(world, step, n, dtype):
    g = torch.Generator().manual_seed(1000 * world.Get_rank() + step)
    return (torch.randn(n, generator=g, dtype=torch.float64) ** 3).to(dtype)  # heavy-tailed, like gradients


def drive(world, strategy, device, staged, steps=10, momentum=0.9, lr=0.01, **options):
    """Run the strategy as DistributedOptimizer does, on gradients of our making; the parameters after SGD."""
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) for shape, dtype in SHAPES]
    names = [f"p{i}" for i in range(len(params))]
    buffers = GradientBuffers(params, names, staged=staged)
    with Topology(world, ranks_per_node=rpn(world)) as topo:
        ctx = StrategyContext(topo, params, names, buffers, TopkOptions(**options), momentum=momentum)
        sync = STRATEGIES[strategy](ctx)
        try:
            for step in range(steps):
                for b, flat in enumerate(buffers.device_flats):
                    flat.copy_(gradient(world, 100 * step + b, flat.numel(), flat.dtype))
                assert sync.local_problem() is None
                sync.finish([True] * len(params))
                sync.wait(range(len(params)))  # on_device: the average is in device_flats now
                with torch.no_grad():
                    for p, g in zip(params, buffers.grads):
                        p.add_(g, alpha=-lr)
            state = sync.state_dict()
        finally:
            sync.close()
    return [p.detach().cpu() for p in params], state


CASES = [dict(density=1.0), dict(density=0.1), dict(density=0.1, granularity="layer"),
         dict(density=0.05, warmup_steps=2, ramp_steps=3), dict(density=0.1, operator="exact", momentum_masking=False)]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_staged_cpu_gradients_give_what_in_place_gives(world, strategy, options):
    """Staged on a CPU (MPITRAIN_STAGING=force): the same code path as a GPU model's, bit for bit the same sums."""
    want, want_state = drive(world, strategy, "cpu", staged=False, **options)
    got, got_state = drive(world, strategy, "cpu", staged=True, **options)
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    moved = any(p.abs().sum() > 0 for p in got)
    residuals = want_state["local"]["residuals"]
    same_state = residuals.keys() == got_state["local"]["residuals"].keys() and all(
        torch.equal(residuals[k], got_state["local"]["residuals"][k]) for k in residuals)
    assert_everywhere(world, same and moved and same_state, f"{strategy} {options}: staged differs")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_staged_layers_cross_to_the_host_in_one_copy_per_buffer(world, strategy):
    """granularity="layer", staged: every layer of a buffer selected first, then one device -> host copy of all
    their pairs (hier-topk: and one of the dense buffer for the node reduce-scatter); on a GPU each such copy is a
    wait for the device, so one per layer would be one per layer."""
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape, dtype in SHAPES]
    names = [f"p{i}" for i in range(len(params))]
    buffers = GradientBuffers(params, names, staged=True)
    steps = 3
    with Topology(world, ranks_per_node=rpn(world)) as topo:
        sync = STRATEGIES[strategy](StrategyContext(topo, params, names, buffers,
                                                    TopkOptions(density=0.1, granularity="layer")))
        try:
            for step in range(steps):
                for b, flat in enumerate(buffers.device_flats):
                    flat.copy_(gradient(world, 100 * step + b, flat.numel(), flat.dtype))
                sync.finish([True] * len(params))
                sync.wait(range(len(params)))
        finally:
            sync.close()
        per_buffer = 2 if strategy == "hier-topk" and topo.local_size > 1 else 1
        want = steps * len(buffers.flats) * per_buffer
    got = sync.sparse.copies_to_host
    assert_everywhere(world, got == want, f"{strategy}: {got} copies to the host in {steps} steps, want {want}")


@pytest.mark.parametrize("hierarchical", [False, True])
def test_staged_sparse_allreduce_equals_in_place(world, hierarchical):
    with Topology(world, ranks_per_node=rpn(world)) as topo:
        plain = SparseAllreduce(topo, hierarchical=hierarchical)
        staged = SparseAllreduce(topo, hierarchical=hierarchical, staged=True)
        ef_plain, ef_staged = ErrorFeedback(MSTopK()), ErrorFeedback(MSTopK())
        ok = True
        for step, n in enumerate((10_001, 10_001, 777)):  # a smaller call after larger ones reuses the buffers
            x = gradient(world, step, n, torch.float32)
            a = plain(x.clone(), lambda v: ef_plain.select("m", v, 0.02))
            b = staged(x.clone(), lambda v: ef_staged.select("m", v, 0.02), out=torch.empty(n))
            ok = ok and torch.equal(a, b) and torch.equal(plain.applied, staged.applied)
        plain.free(), staged.free()
    assert_everywhere(world, ok, "staged sparse allreduce differs")


@pytest.mark.parametrize("hierarchical", [False, True])
def test_staged_parts_equal_one_call_per_part(world, hierarchical):
    """Parts (layers) of one vector, tiny ones among them (shards of 0 or 1 entries on a node), exchanged in one
    staged call: bit for bit the sums of one host call per part, the same positions applied, the same residuals."""
    bounds = [0, 1, 4, 1004, 1005, 3005]
    parts = list(zip(bounds, bounds[1:]))
    k_of = lambda n: k_for_density(n, 0.05)
    with Topology(world, ranks_per_node=rpn(world)) as topo:
        plain = SparseAllreduce(topo, hierarchical=hierarchical)
        staged = SparseAllreduce(topo, hierarchical=hierarchical, staged=True)
        ef_plain, ef_staged = ErrorFeedback(MSTopK()), ErrorFeedback(MSTopK())
        ok = True
        for step in range(3):
            x = gradient(world, step, bounds[-1], torch.float32)
            want, applied = torch.empty_like(x), []
            for p, (a, z) in enumerate(parts):
                plain(x[a:z].clone(), lambda v, p=p: ef_plain.select(p, v, 0.05), out=want[a:z], k_of=k_of)
                applied.append(plain.applied + a)
            got = staged(x.clone(), lambda v, p: ef_staged.select(p, v, 0.05), out=torch.empty_like(x), k_of=k_of,
                         parts=parts)
            ok = ok and torch.equal(got, want) and torch.equal(staged.applied.sort().values,
                                                                torch.cat(applied).sort().values)
        residuals = [(ef_plain.residual(p), ef_staged.residual(p)) for p in range(len(parts))]
        # A part whose node shard here is empty selects nothing here: no residual either way.
        ok = ok and all(a is b is None or (a is not None and b is not None and torch.equal(a, b))
                        for a, b in residuals)
        copies = staged.copies_to_host
        plain.free(), staged.free()
    per_call = 2 if hierarchical and topo.local_size > 1 else 1
    assert_everywhere(world, ok and copies == 3 * per_call, f"staged parts differ from one call per part ({copies})")


# -- a CUDA model: 4 ranks may share one GPU ----------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("options", [dict(density=1.0), dict(density=0.01, operator="exact"),
                                     dict(density=1.0, warmup_steps=3)], ids=["all", "exact-0.01", "warmup"])
def test_cuda_model_gives_the_cpu_models_parameters(world, strategy, options):
    """Every entry sent (density 1), or the same entries picked (torch.topk on distinct values): same parameters."""
    got, _ = drive(world, strategy, "cuda", staged=True, **options)
    want, _ = drive(world, strategy, "cpu", staged=False, **options)
    ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, want))
    assert_everywhere(world, ok, f"{strategy} {options}: CUDA model differs from the CPU model")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_cuda_mstopk_at_one_percent_stays_close_to_the_cpu_model(world, strategy):
    """DeviceMSTopK and the NumPy MSTopK may pick different entries near the threshold: close, not equal."""
    got, state = drive(world, strategy, "cuda", staged=True, density=0.01)
    want, _ = drive(world, strategy, "cpu", staged=False, density=0.01)
    diff = sum(float((a.double() - b.double()).norm() ** 2) for a, b in zip(got, want)) ** 0.5
    size = sum(float(b.double().norm() ** 2) for b in want) ** 0.5
    on_cpu = all(v.device.type == "cpu" for v in state["local"]["residuals"].values())
    assert_everywhere(world, size > 0 and diff <= 0.1 * size and on_cpu, f"{strategy}: |diff| {diff} vs {size}")
