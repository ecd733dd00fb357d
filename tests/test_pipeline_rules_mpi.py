"""Pipeline rules on 4 ranks: the per-micro-batch learning rate, the divergence stop, the gathered model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_everywhere
from test_agreement_mpi import raised_everywhere
from test_pipeline_mpi import LR, build, data, reference, sgd
from mpicomm import Topology
from runtime.pipeline import Pipeline, load_stages

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

M = 4  # micro-batches per step


def needs_four(world):
    if world.Get_size() != 4:
        pytest.skip("4 ranks")


def split(world, size):
    """World cut into communicators of `size` consecutive ranks; this rank's."""
    return world.Split(world.Get_rank() // size, world.Get_rank())


def sgd_per_micro_batch(steps_data, rate):
    """One process: one momentum-SGD update per micro-batch at `rate`, on the replicas' micro-batches together."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=rate, momentum=0.9)
    for parts in steps_data:
        for m in range(M):
            x = torch.cat([p[0].chunk(M)[m] for p in parts])
            y = torch.cat([p[1].chunk(M)[m] for p in parts])
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model


def error(pipe, ref) -> float:
    return max((p - q).abs().max().item() for p, q in zip(pipe.module.parameters(), ref.parameters()))


@pytest.mark.parametrize("mode", ["vanilla", "stash", "spectrain", "flush"])
def test_one_stage_updates_per_micro_batch_at_lr_over_m_and_flush_per_step_at_lr(world, mode):
    """One stage (no staleness): an asynchronous mode is plain momentum SGD on micro-batches at lr / M, exactly."""
    comm = split(world, 1)
    # One rank is one node, whatever MPITRAIN_RANKS_PER_NODE says for the world (make test's emulated nodes).
    topology = Topology(comm, ranks_per_node=1)
    steps = data(6, 8)
    pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=[7], microbatches=M, mode=mode,
                    topology=topology, say=None)
    for parts in steps:
        pipe.train_step(*parts[0])
    if mode == "flush":  # one update per step at lr: one process on the whole batches
        err = error(pipe, reference(steps))
        ok = err < 1e-6
    else:
        ref = sgd_per_micro_batch(steps, LR / M)
        err = error(pipe, ref)
        ok = all(torch.equal(p, q) for p, q in zip(pipe.module.parameters(), ref.parameters()))
        # ...and not the configured rate per micro-batch, which the engine used to apply.
        ok = ok and error(pipe, sgd_per_micro_batch(steps, LR)) > 1e-3
    updates = pipe.stats()["updates"]
    lr_kept = all(g["lr"] == LR for g in pipe.optimizer.param_groups)  # the caller's rate is left as set
    pipe.close()
    topology.free()
    comm.Free()
    assert_everywhere(world, ok and lr_kept and updates == (6 if mode == "flush" else 6 * M),
                      f"{mode}: off by {err:.3g}, {updates} updates, lr kept {lr_kept}")


@pytest.mark.parametrize("data_parallel", ["allreduce", "wfbp"])
def test_replicas_average_each_micro_batch_then_apply_lr_over_m(world, data_parallel):
    needs_four(world)
    comm = split(world, 2)  # two pipelines of 1 stage x 2 replicas
    steps = data(4, 8, replicas=2)
    pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=[7], replicas=2, microbatches=M, mode="vanilla",
                    comm=comm, say=None, data_parallel=data_parallel)
    for parts in steps:
        pipe.train_step(*parts[pipe.replica])
    err = error(pipe, sgd_per_micro_batch(steps, LR / M))
    pipe.close()
    comm.Free()
    assert_everywhere(world, err < 1e-6, f"off by {err:.3g}")


def with_nan(x, row):
    x = x.clone()
    x[row] = float("nan")
    return x


@pytest.mark.parametrize("mode", ["flush", "spectrain"])
def test_a_non_finite_loss_stops_every_rank_naming_the_step_and_the_loss(world, mode):
    """A NaN reaches the loss at step 3, micro-batch 2: every rank raises before that gradient is applied."""
    needs_four(world)
    pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=[2, 2, 2, 1], microbatches=M, mode=mode,
                    say=None)
    steps = data(5, 8)
    finite = []

    def run():
        for t, parts in enumerate(steps):
            x, y = parts[0]
            pipe.train_step(with_nan(x, 5) if t == 2 else x, y)  # rows 4-5: micro-batch 2
            finite.append(all(bool(torch.isfinite(p).all()) for p in pipe.module.parameters()))
    raised_everywhere(world, run, "DivergenceError", r"training diverged at step 3 \(micro-batch 2\): loss nan "
                                                     r"is not finite \(stage 3, replica 0, rank 3\)")
    assert_everywhere(world, all(finite) and all(bool(torch.isfinite(p).all()) for p in pipe.module.parameters()),
                      "a non-finite gradient was applied")


def test_an_exploding_loss_stops_every_rank_even_where_no_gradient_comes_back(world):
    """Stages 0-1 have nothing to train and never wait for the last one: the barrier after the run hears it."""
    needs_four(world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.ReLU(), nn.Linear(12, 8), nn.Linear(8, 5))
    huge = lambda ps: torch.optim.SGD(ps, lr=1e4, momentum=0.9)  # noqa: E731
    pipe = Pipeline(model, huge, loss_fn=F.cross_entropy, balance=[1, 1, 1, 1], microbatches=M, mode="vanilla",
                    say=None)

    def run():
        for parts in data(8, 8):
            pipe.train_step(*parts[0])
        pipe.drain()
        pipe.barrier()
    raised_everywhere(world, run, "DivergenceError", r"training diverged at step \d+ \(micro-batch \d\): loss \S+ "
                                                     r"is (not finite|over 100 x the first micro-batch's)")


def test_gather_state_dict_assembles_the_stages_on_one_rank(world):
    """2 stages x 2 replicas: rank 0 gets every stage's weights under the model's own keys; load_stages agrees."""
    needs_four(world)
    steps = data(5, 8, replicas=2)
    model = build()
    pipe = Pipeline(model, sgd, loss_fn=F.cross_entropy, balance=[3, 4], replicas=2, microbatches=M, mode="stash",
                    say=None)
    for parts in steps:
        pipe.train_step(*parts[pipe.replica])
    gathered = pipe.gather_state_dict(root=0)
    got_none = gathered is None
    mine = pipe.state_dict()  # this stage's: module keys "j.name" for the model's layer a + j
    states = world.gather((pipe.replica, mine), root=0)
    gathered = world.bcast(gathered, root=0)
    a = pipe.layer_range.start
    ok = sorted(gathered) == sorted(build().state_dict()) and (got_none == (world.Get_rank() != 0)) and all(
        torch.equal(gathered[f"{a + int(k.split('.')[0])}.{k.split('.', 1)[1]}"], v) for k, v in mine["module"].items())
    if world.Get_rank() == 0:
        rebuilt = build(seed=1)  # other initial weights, all replaced by the stages' (the checkpoints' way)
        load_stages(rebuilt, [state for replica, state in states if replica == 0])
        ok = ok and all(torch.equal(gathered[k], v) for k, v in rebuilt.state_dict().items())
        ok = ok and all(torch.equal(gathered[k], v) for k, v in model.state_dict().items())  # root's model too
    pipe.close()
    assert_everywhere(world, ok, f"stage {pipe.stage} replica {pipe.replica}: gathered weights differ")


def test_gather_state_dict_with_a_bad_root_fails_on_every_rank(world):
    needs_four(world)
    pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=[2, 2, 2, 1], microbatches=2, say=None)
    raised_everywhere(world, lambda: pipe.gather_state_dict(root=world.Get_size()), "PipelineError",
                      "root must be a rank of the pipeline's 4 ranks")
