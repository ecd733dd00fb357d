"""Pipeline stages through the host-staged transport on 4 ranks: forced on the CPU here, on CUDA stages on a GPU box."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_everywhere
from test_agreement_mpi import raised_everywhere
from test_pipeline_mpi import build, data, reference, sgd, sub_world
from runtime.pipeline import Pipeline
from runtime.pipeline.staging import StagedLink

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
GPU = [pytest.mark.gpu, needs_cuda]


def needs_four(world):
    if world.Get_size() != 4:
        pytest.skip("4 stages")


def stage_error(pipe, ref) -> float:
    """Largest difference between this stage's parameters (wherever they are) and the reference's."""
    a = sum(pipe.balance[:pipe.stage])
    theirs = nn.Sequential(*list(ref)[a:a + pipe.balance[pipe.stage]]).parameters()
    return max([(p.detach().cpu() - q.detach()).abs().max().item() for p, q in zip(pipe.module.parameters(), theirs)]
               + [0.0])


def flush_against_one_process(world, stages, replicas, balance, **kw) -> tuple[bool, str]:
    """20 flush steps on stages x replicas ranks against one process: (every check passed here, what was seen).

    A rank outside the run (the world is larger) passes: it has nothing to check."""
    comm = sub_world(world, stages * replicas)
    device = torch.device(kw.get("device", "cpu")).type
    ok, seen = True, "not in the run"
    if comm is not None:
        from mpicomm import Topology

        steps = data(20, 8, replicas)
        topo = Topology(comm, ranks_per_node=1 if comm.Get_size() == 3 else None)
        pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=balance, microbatches=4, mode="flush",
                        replicas=replicas, topology=topo, **kw)
        for parts in steps:
            x, y = parts[pipe.layout.replica]
            pipe.train_step(x, y)
        err = stage_error(pipe, reference(steps))
        link = pipe.link
        # Staged: MPI reads and writes host buffers of their own, the stage computes on device buffers.
        hosts = {t.data_ptr() for t in link._acts + link._grads}
        devices = {t.data_ptr() for box in link._in.values() for t in box.device}
        on = {p.device.type for p in pipe.params}
        # The host waited for the device only to read the losses: once per micro-batch, on the last stage.
        waits = pipe.stats()["host_waits"]
        ok = isinstance(link, StagedLink) and not hosts & devices and err < 1e-5 and on == {device} and \
            waits == (20 * 4 if pipe.last else 0)
        seen = f"error {err:.3g}, link {type(link).__name__}, parameters on {on}, {link.host_buffers} host buffers, " \
               f"{waits} host waits"
        pipe.close()
        topo.free()
        comm.Free()
    return ok, seen


@pytest.mark.parametrize("stages,replicas,balance", [(2, 1, [4, 3]), (4, 1, [2, 2, 2, 1]), (2, 2, [3, 4])])
def test_staged_flush_equals_one_process_after_20_steps(world, stages, replicas, balance):
    if world.Get_size() < stages * replicas:
        pytest.skip(f"needs {stages * replicas} ranks")
    ok, seen = flush_against_one_process(world, stages, replicas, balance, staging=True)
    assert_everywhere(world, ok, f"staged flush {stages}x{replicas}: {seen}")


def run(world, mode, device="cpu", staging=None, steps=4):
    """A 4-stage run of `mode`; (the stage's parameters after a drain, its stats, evaluation, held weight copies)."""
    pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=[2, 2, 2, 1], microbatches=4, mode=mode,
                    device=device, staging=staging)
    for parts in data(steps, 8):
        pipe.train_step(*parts[0])
    (x, y), = data(1, 40, seed=7)[0]
    scores = pipe.evaluate(x, y, batch_size=16)  # 16, 16 and 8: a batch of another size at the end
    held = [t.device.type for row in pipe.versions._stash for t in row if t is not None] + \
        [t.device.type for t in pipe.versions._spare if t is not None]
    params = [p.detach().cpu().clone() for p in pipe.params]
    stats = pipe.stats()
    pipe.close()
    return params, stats, scores, held


@pytest.mark.parametrize("mode", ["vanilla", "stash", "spectrain"])
def test_staged_asynchronous_modes_equal_the_unstaged_ones_bit_for_bit(world, mode):
    """The same schedule, weights and messages: staging on the CPU only adds exact copies."""
    needs_four(world)
    plain, plain_stats, plain_scores, _ = run(world, mode)
    staged, stats, scores, _ = run(world, mode, staging=True)
    same = all(torch.equal(a, b) for a, b in zip(plain, staged))
    counts = (stats["bytes_sent"], stats["messages_sent"]) == (plain_stats["bytes_sent"], plain_stats["messages_sent"])
    assert_everywhere(world, same and counts and scores == plain_scores,
                      f"stage {stats['stage']}: weights equal {same}, counts {stats} vs {plain_stats}, "
                      f"evaluation {scores} vs {plain_scores}")


def test_stash_keeps_copies_only_where_a_backward_reads_weights(world):
    """Stage 0's Linear gets the data, which needs no gradient: autograd saves its input, not its weight, so the
    stage keeps no copy though 4 micro-batches are in flight; the last stage has one in flight; 1 and 2 keep."""
    needs_four(world)
    _, stats, _, held = run(world, "stash", staging=True)
    stage = stats["stage"]
    want = {0: 0, 1: 3, 2: 2, 3: 0}[stage]  # micro-batches in flight: one copy of the Linear's weight each
    assert_everywhere(world, len(held) == want, f"stage {stage}: {len(held)} weight copies, {want} expected")


@pytest.mark.parametrize("mode", ["vanilla", "flush"])
def test_the_host_waits_for_the_device_only_to_read_losses(world, mode):
    """Staged sends are posted by the link's thread as their copies complete, never waited for at a step's end; the
    last stage reads each micro-batch's loss once its backward is queued (before its gradient leaves)."""
    needs_four(world)
    pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=[2, 2, 2, 1], microbatches=4, mode=mode,
                    staging=True)
    losses = [pipe.train_step(*parts[0]) for parts in data(3, 8)]
    waits, threaded = pipe.stats()["host_waits"], pipe.link._poster is not None
    pipe.close()
    want = 3 * 4 if pipe.last else 0
    ok = waits == want and threaded and all((v is not None) == pipe.last for v in losses)
    assert_everywhere(world, ok, f"{mode}, stage {pipe.stage}: {waits} host waits in 3 steps ({want} expected), "
                                 f"sends posted by a thread: {threaded}, losses {losses}")


def test_the_staging_environment_variable_forces_it(world, monkeypatch):
    needs_four(world)
    monkeypatch.setenv("MPITRAIN_STAGING", "force")
    pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=[2, 2, 2, 1], microbatches=2)
    pipe.train_step(*data(1, 8)[0][0])
    kind = type(pipe.link).__name__
    pipe.close()
    assert_everywhere(world, kind == "StagedLink", f"link {kind}")


class ToMeta(nn.Module):
    def forward(self, x):
        return x.to("meta")


def test_a_stage_whose_output_leaves_its_device_is_named_on_every_rank(world):
    needs_four(world)
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(12, 8), ToMeta(), nn.Linear(8, 8), nn.Linear(8, 5)), sgd,
                    loss_fn=F.cross_entropy, balance=[1, 1, 1, 1], microbatches=2, staging=True)
    raised_everywhere(world, lambda: pipe.train_step(*data(1, 8)[0][0]), "PipelineShapeError",
                      "stage 1 runs on cpu but its layers return a tensor on meta")
    pipe.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine where torch sees no CUDA device")
def test_device_cuda_without_a_gpu_stops_every_rank_with_the_reason(world):
    raised_everywhere(world, lambda: Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=[7], device="cuda"),
                      "PipelineError", "device='cuda', but torch sees no CUDA device")


# -- on a GPU box: 4 ranks sharing one GPU (or one each) ---------------------------------------------

@pytest.mark.parametrize("stages,replicas,balance", [(4, 1, [2, 2, 2, 1]), (2, 1, [4, 3])])
@pytest.mark.gpu
@needs_cuda
def test_cuda_flush_equals_one_process_after_20_steps(world, stages, replicas, balance):
    if world.Get_size() < stages * replicas:
        pytest.skip(f"needs {stages * replicas} ranks")
    ok, seen = flush_against_one_process(world, stages, replicas, balance, device="cuda")
    assert_everywhere(world, ok, f"cuda flush {stages}x{replicas}: {seen}")


@pytest.mark.parametrize("mode", ["stash", "spectrain"])
@pytest.mark.gpu
@needs_cuda
def test_cuda_asynchronous_modes_follow_the_cpu_run_and_keep_weight_versions_on_the_gpu(world, mode):
    needs_four(world)
    cpu, _, cpu_scores, cpu_held = run(world, mode)
    gpu, stats, scores, held = run(world, mode, device="cuda")
    err = max([(a - b).abs().max().item() for a, b in zip(cpu, gpu)] + [0.0])
    on_gpu = stats["device"].startswith("cuda") and all(d == "cuda" for d in held)
    close = abs(scores["loss"] - cpu_scores["loss"]) < 1e-4 and scores["count"] == cpu_scores["count"]
    # As many copies as on the CPU, where test_stash_keeps_copies_only_where_a_backward_reads_weights says which.
    keeps = len(held) == len(cpu_held) and (mode != "stash" or bool(held) == (stats["stage"] in (1, 2)))
    assert_everywhere(world, err < 1e-4 and on_gpu and close and keeps,
                      f"stage {stats['stage']}: max difference {err:.3g} from the CPU run, {stats['device']}, "
                      f"weight copies on {held}, evaluation {scores} vs {cpu_scores}")


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward keep the GPU busy (~10 ms each on a ~2 GHz GPU): the host runs ahead."""

    @staticmethod
    def forward(ctx, x):
        if x.is_cuda:
            torch.cuda._sleep(20_000_000)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if g.is_cuda:
            torch.cuda._sleep(20_000_000)
        return g


class Slow(nn.Module):
    def forward(self, x):
        return _Sleep.apply(x)


def slow_build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), Slow(), nn.Tanh(), nn.Linear(16, 16), Slow(), nn.ReLU(),
                         nn.Linear(16, 12), Slow(), nn.Tanh(), nn.Linear(12, 5), Slow())


@pytest.mark.gpu
@needs_cuda
def test_cuda_steps_return_before_their_last_sends_are_copied_and_the_sends_carry_the_right_data(world):
    """A step ends without waiting for its outbound copies (the link's thread posts them once done), so with slow
    kernels a stage that ends its step with a send returns while that copy still waits for the compute; the
    results still follow the CPU run's."""
    needs_four(world)

    def go(device):
        pipe = Pipeline(slow_build(), sgd, loss_fn=F.cross_entropy, balance=[3, 3, 3, 2], microbatches=4,
                        mode="vanilla", device=device, say=None)
        pending = []
        for parts in data(3, 8):
            pipe.train_step(*parts[0])
            if device == "cuda":
                pending.append(len(pipe.link._poster.queue))
        pipe.drain()
        params = [p.detach().cpu().clone() for p in pipe.params]
        waits = pipe.stats()["host_waits"]
        pipe.close()
        return params, pending, waits, pipe

    cpu, _, _, _ = go("cpu")
    gpu, pending, waits, pipe = go("cuda")
    err = max([(a - b).abs().max().item() for a, b in zip(cpu, gpu)] + [0.0])
    # Stages 1-3 end a step with a backward and its gradient's send; stage 0 with a backward (it sends none back).
    ahead = pipe.stage == 0 or any(pending)
    ok = err < 1e-5 and ahead and waits == (3 * 4 if pipe.last else 0)
    assert_everywhere(world, ok, f"stage {pipe.stage}: max difference {err:.3g} from the CPU run, sends still being "
                                 f"copied at each step's end {pending}, {waits} host waits")
