"""Pipeline engine on 4 ranks: flush equals one process; stash, vanilla and spectrain use the weights their mode says."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

from conftest import assert_everywhere
from runtime.pipeline import Pipeline, version_difference

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

LR, MOMENTUM = 0.05, 0.9


def build(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 12), nn.Tanh(),
                         nn.Linear(12, 5))


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def data(steps, batch, replicas=1, seed=1):
    """Per step, per replica, (x, y); the one-process reference trains on the replicas' batches concatenated."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g))
             for _ in range(replicas)] for _ in range(steps)]


def reference(steps_data):
    model = build()
    opt = sgd(model.parameters())
    for parts in steps_data:
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def stage_error(pipe, ref) -> float:
    a = sum(pipe.balance[:pipe.stage])
    mine = [p.detach() for p in pipe.module.parameters()]
    theirs = [p.detach() for p in nn.Sequential(*list(ref)[a:a + pipe.balance[pipe.stage]]).parameters()]
    return max([(p - q).abs().max().item() for p, q in zip(mine, theirs)] + [0.0])


def sub_world(world, size):
    """The first `size` ranks in a communicator of their own (None on the others)."""
    comm = world.Split(0 if world.Get_rank() < size else MPI.UNDEFINED, world.Get_rank())
    return None if comm == MPI.COMM_NULL else comm


@pytest.mark.parametrize("stages,replicas,balance", [(2, 1, [4, 3]), (3, 1, [3, 2, 2]), (4, 1, [2, 2, 2, 1]),
                                                     (2, 2, [3, 4])])
def test_flush_equals_one_process_after_20_steps(world, stages, replicas, balance):
    if world.Get_size() < stages * replicas:
        pytest.skip(f"needs {stages * replicas} ranks")
    comm = sub_world(world, stages * replicas)
    err = 0.0
    if comm is not None:
        steps = data(20, 8, replicas)
        from mpicomm import Topology

        # 3 of 4 ranks cannot form equal nodes under the 2-node layouts: one emulated node per rank.
        topo = Topology(comm, ranks_per_node=1 if comm.Get_size() == 3 else None)
        pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=balance, microbatches=4, mode="flush",
                        replicas=replicas, topology=topo)
        for parts in steps:
            x, y = parts[pipe.layout.replica]
            pipe.train_step(x, y)
        err = stage_error(pipe, reference(steps))
        pipe.close()
        topo.free()
        comm.Free()
    assert_everywhere(world, err < 1e-5, f"flush {stages}x{replicas}: max difference {err:.3g} from one process")


def run_logged(world, mode, variant="paper", steps=4, microbatches=4):
    pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=[2, 2, 2, 1], microbatches=microbatches,
                    mode=mode, spectrain_variant=variant, record_versions=True)
    for parts in data(steps, 8):
        pipe.train_step(*parts[0])
    pipe.drain()
    log = pipe.version_log
    return pipe, {(e["op"], e["micro"]): e for e in log}


def same(a, b) -> bool:
    return a is not None and b is not None and torch.equal(a, b)


def needs_four(world):
    if world.Get_size() != 4:
        pytest.skip("the version tests cut the model into 4 stages")


def test_stash_backward_uses_the_weights_its_forward_used(world):
    needs_four(world)
    pipe, log = run_logged(world, "stash")
    problems, updated_between = [], 0
    for (op, i), b in log.items():
        if op != "B":
            continue
        f = log[("F", i)]
        for j, used in enumerate(b["used"]):
            if used is not None and not same(used, f["used"][j]):
                problems.append(f"micro-batch {i} param {j}")
        updated_between += b["updates"] > f["updates"]
    w = pipe.stages - pipe.stage - 1
    # Stages with micro-batches in flight really had updates between forward and backward.
    ok = not problems and (updated_between > 0) == (w > 0)
    pipe.close()
    assert_everywhere(world, ok, f"stage {pipe.stage}: {problems[:3]}, {updated_between} updated between")


def test_vanilla_backward_sees_live_weights_and_staleness_follows_the_schedule(world):
    needs_four(world)
    pipe, log = run_logged(world, "vanilla")
    w = pipe.stages - pipe.stage - 1
    problems = []
    for (op, i), b in log.items():
        if op != "B":
            continue
        f = log[("F", i)]
        # 1F1B: between a micro-batch's forward and backward the stage applies min(i, w) updates.
        if b["updates"] - f["updates"] != min(i, w):
            problems.append(f"micro-batch {i}: {b['updates'] - f['updates']} updates between, schedule says "
                            f"{min(i, w)}")
        for j, used in enumerate(b["used"]):
            if used is not None and not same(used, b["live"][j]):
                problems.append(f"micro-batch {i} param {j} not the live weights")
    pipe.close()
    assert_everywhere(world, not problems, f"stage {pipe.stage}: {problems[:3]}")


@pytest.mark.parametrize("variant", ["paper", "once"])
def test_spectrain_predicts_by_the_formula(world, variant):
    needs_four(world)
    pipe, log = run_logged(world, "spectrain", variant)
    s_f, s_b = version_difference(pipe.stage, pipe.stages, variant)
    problems, predicted = [], 0
    for (op, i), e in log.items():
        for j, used in enumerate(e["used"]):
            if used is None:
                continue
            if op == "B" and variant == "once":
                want = log[("F", i)]["used"][j]
            else:
                # The rate of the update each micro-batch really applies: lr / microbatches.
                s = s_f if op == "F" else s_b
                want = e["live"][j] - s * (LR / pipe.microbatches) * e["velocity"][j]
                if e["lr"][j] != LR / pipe.microbatches:
                    problems.append(f"{op}{i} param {j}: predicted at rate {e['lr'][j]}")
            if not torch.allclose(used, want, atol=1e-7, rtol=0):
                problems.append(f"{op}{i} param {j}: off by {(used - want).abs().max().item():.3g}")
            predicted += bool(e["velocity"][j].abs().sum() > 0) and not torch.equal(used, e["live"][j])
    # Where the formula predicts ahead, the weights used really differ from the live ones.
    ok = not problems and (predicted > 0 or (s_f == 0 and s_b == 0))
    held = pipe.stats()["weight_copy_bytes"]
    pipe.close()
    assert_everywhere(world, ok, f"stage {pipe.stage} s=({s_f},{s_b}): {problems[:3]} predicted={predicted}")
    if variant == "paper":  # one spare buffer at most, never a copy per micro-batch in flight
        assert_everywhere(world, held <= sum(p.numel() * 4 for p in pipe.params), f"holds {held} bytes")


def test_asynchronous_steps_continue_the_steady_state_without_draining(world):
    """Step t's forwards are micro-batches tM..tM+M-1 on every stage; backwards run behind by the warm-up."""
    needs_four(world)
    pipe, log = run_logged(world, "vanilla", steps=3, microbatches=2)
    forwards = sorted(i for op, i in log if op == "F")
    backwards = sorted(i for op, i in log if op == "B")
    ok = forwards == list(range(6)) and backwards == list(range(6))
    pipe.close()
    assert_everywhere(world, ok, f"stage {pipe.stage}: F {forwards} B {backwards}")


@pytest.mark.parametrize("placement", ["within-node", "across-nodes"])
def test_placement_puts_stages_and_replicas_where_asked(world, placement):
    if world.Get_size() != 4:
        pytest.skip("2 stages x 2 replicas")
    from mpicomm import Topology

    topo = Topology()
    steps = data(3, 8, 2)
    pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=[3, 4], microbatches=2, mode="flush",
                    replicas=2, placement=placement, topology=topo)
    for parts in steps:
        pipe.train_step(*parts[pipe.layout.replica])
    err = stage_error(pipe, reference(steps))
    node_of = {r: n for n, ranks in enumerate(topo.nodes) for r in ranks}
    pipeline_nodes = {node_of[r] for r in pipe.layout.stage_ranks}
    pipe.close()
    ok = err < 1e-5
    if topo.num_nodes == 2 and topo.local_size == 2:  # 2 nodes x 2 ranks: the placement is visible
        ok = ok and len(pipeline_nodes) == (1 if placement == "within-node" else 2)
    topo.free()
    assert_everywhere(world, ok, f"{placement}: error {err:.3g}, pipeline on nodes {pipeline_nodes}")


def test_timeline_shows_forward_backward_and_sends(world):
    needs_four(world)
    from runtime.trace import Timeline

    tl = Timeline(world.Get_rank())
    pipe = Pipeline(build(), sgd, loss_fn=F.cross_entropy, balance=[2, 2, 2, 1], microbatches=4, mode="stash",
                    timeline=tl)
    for parts in data(2, 8):
        pipe.train_step(*parts[0])
    pipe.close()
    names = [e["name"] for e in tl.to_trace()["traceEvents"] if e.get("ph") in ("X", "i")]
    ok = "F0" in names and "B0" in names and (any(n.startswith("send act") for n in names) or pipe.last)
    assert_everywhere(world, ok, f"stage {pipe.stage} trace: {names[:12]}")


def test_no_gradient_goes_back_to_stages_with_nothing_to_train(world):
    needs_four(world)

    def leading_free(seed=0):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Flatten(), nn.ReLU(), nn.Linear(12, 8), nn.Linear(8, 5))

    steps = data(5, 8)
    pipe = Pipeline(leading_free(), sgd, loss_fn=F.cross_entropy, balance=[1, 1, 1, 1], microbatches=2, mode="flush")
    for parts in steps:
        pipe.train_step(*parts[0])
    ref = leading_free()
    opt = sgd(ref.parameters())
    for (x, y), in steps:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    err = max([(p - q).abs().max().item() for p, q in zip(pipe.module.parameters(), ref[pipe.stage].parameters())]
              + [0.0])
    sent = pipe.stats()["messages_sent"]
    pipe.close()
    # Stages 0-2 send one activation per micro-batch; stage 3 a gradient to stage 2 (which trains);
    # stage 2 sends none back, as nothing before it trains.
    assert_everywhere(world, err < 1e-5 and sent == 10, f"stage {pipe.stage}: error {err:.3g}, {sent} messages")
