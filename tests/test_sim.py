"""runtime.sim: the fluid engine's sharing, byte counts against the formulas, each schedule against its reasoning."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from runtime.sim import Cluster, Layer, Profile, ProfileError, UnknownStrategyError, simulate
from runtime.sim.cluster import ClusterError, Host
from runtime.sim.collectives import allreduce, choose, queued_allreduce, small_allreduce
from runtime.sim.dataparallel import BucketSchedule, DdpSchedule, Run, train
from runtime.sim.engine import Activity, Engine, Pool, Resource, SimulationError
from runtime.sim.measure import measure


def toy(n=8, fwd=0.01, bwd=0.02, params=1_000_000, opt=0.0, other=0.0, linear=False) -> Profile:
    layers = tuple(Layer(f"l{i}", fwd, bwd, (params, 1000), 4 * params // 100,
                         (1000, 1000, 16, True) if linear else None) for i in range(n))
    return Profile("toy", 16, "cpu", layers, step_s=n * (fwd + bwd) + opt + other, optimizer_s=opt, other_s=other)


def fast_net(nodes, rpn=1, bw=1e9, latency=0.0, **kw) -> Cluster:
    return Cluster(nodes=nodes, ranks_per_node=rpn, bandwidth=bw, latency=latency, efficiency=1.0, **kw)


# -- the engine -------------------------------------------------------------------------------------

def test_two_flows_share_a_link_equally_then_the_survivor_takes_it_all():
    e = Engine()
    link = Resource("link", 100.0)
    a, b = Activity("a", 100, uses=[(link, 1)]), Activity("b", 200, uses=[(link, 1)])
    done = {}
    for x in (a, b):
        e.start(x).then(lambda _, x=x: done.setdefault(x.name, e.now))
    e.run()
    assert done["a"] == pytest.approx(2.0) and done["b"] == pytest.approx(3.0)


def test_max_min_fairness_gives_the_unconstrained_flow_what_the_bottlenecked_one_cannot_use():
    e = Engine()
    l1, l2 = Resource("l1", 100.0), Resource("l2", 30.0)
    a, b = Activity("a", 1e9, uses=[(l1, 1)]), Activity("b", 1e9, uses=[(l1, 1), (l2, 1)])
    e.start(a), e.start(b)
    e.run(until=1.0)
    assert b.rate == pytest.approx(30.0) and a.rate == pytest.approx(70.0)


def test_an_oversubscribed_pool_slows_everything_on_it_in_proportion():
    e = Engine()
    cores, link = Pool("cores", 1.0), Resource("link", 100.0)
    work = Activity("compute", 1.0, loads=[(cores, 1.0)], cap=1.0)
    copy = Activity("copy", 1e9, uses=[(link, 1)], loads=[(cores, 0.005)])  # 100 B/s x 0.005 = 0.5 core
    e.start(work)
    e.start(copy)
    e.run(until=0.5)
    assert work.rate == pytest.approx(1 / 1.5) and copy.rate == pytest.approx(100 / 1.5)


def test_processes_wait_on_events_and_lists_of_them():
    e = Engine()
    log = []

    def proc():
        yield e.timeout(1.0)
        log.append(e.now)
        yield [e.timeout(2.0), e.timeout(0.5)]
        log.append(e.now)
        return "done"

    finished = e.process(proc())
    e.run()
    assert log == [1.0, 3.0] and finished.value == "done"


def test_a_process_yielding_something_else_is_an_error():
    e = Engine()
    with pytest.raises(SimulationError, match="not an Event"):
        e.process(x for x in [42])


# -- collectives ------------------------------------------------------------------------------------

@pytest.mark.parametrize("nodes,rpn", [(4, 1), (16, 8), (2, 4), (1, 4)])
def test_ring_allreduce_time_is_the_bandwidth_and_latency_bound(nodes, rpn):
    c = Cluster(nodes=nodes, ranks_per_node=rpn, bandwidth=8e9, latency=1e-5, efficiency=1.0, intra_bandwidth=800e9)
    e = Engine()
    host = Host(e, c)
    nbytes = 64 << 20
    e.process(allreduce(host, nbytes, algorithm="ring"))
    P = c.ranks
    per_rank = 2 * (P - 1) / P * nbytes
    wire = per_rank / 1e9 if nodes > 1 else (rpn - 1) * per_rank / (rpn * 100e9)  # each rank its own copy path
    assert e.run() == pytest.approx(2 * (P - 1) * 1e-5 + wire, rel=1e-9)


def test_doubling_allreduce_is_log2_steps_of_the_whole_buffer():
    c = Cluster(nodes=8, ranks_per_node=1, bandwidth=8e9, latency=1e-5, efficiency=1.0)
    e = Engine()
    e.process(allreduce(Host(e, c), 1 << 20, algorithm="doubling"))
    assert e.run() == pytest.approx(3 * 1e-5 + 3 * (1 << 20) / 1e9, rel=1e-9)


def test_hierarchical_allreduce_crosses_the_link_with_2_n_minus_1_over_n_of_the_data():
    c = Cluster(nodes=4, ranks_per_node=2, bandwidth=8e9, latency=1e-5, efficiency=1.0, intra_bandwidth=80e9)
    e = Engine()
    nbytes = 64 << 20
    assert choose(c, nbytes, "hierarchical") == "hierarchical" and choose(c, nbytes) == "hierarchical"
    e.process(allreduce(Host(e, c), nbytes, algorithm="hierarchical"))
    node = (1e-5 + nbytes / (80e9 / 8 * 2))  # L - 1 = 1 step of the host's ranks' B/L each, in shared memory
    cross = 2 * 3 * 1e-5 + 2 * 3 / 4 * nbytes / 1e9  # L rings of B/L at once on one link
    # In staggered pieces (mpicomm.hierarchical.pieces): the link's bytes at least, the three phases in turn at most.
    assert 2 * 3 / 4 * nbytes / 1e9 <= e.run() <= 2 * node + cross + 1e-9
    # A flat ring pays 2(P-1) = 14 latencies and 2(P-1)/P of the bytes on the link: slower here.
    e2 = Engine()
    e2.process(allreduce(Host(e2, c), nbytes, algorithm="ring"))
    assert e2.run() > e.run()


def test_the_simulated_choice_is_the_runtimes():
    """Small buckets take recursive doubling at scale, large ones the hierarchy: the runtime's Chooser decides."""
    big = Cluster(nodes=128, ranks_per_node=8, bandwidth=25e9)
    assert choose(big, 4 << 10) == "doubling" and choose(big, 64 << 20) == "hierarchical"
    assert choose(Cluster(nodes=1, ranks_per_node=4), 64 << 20) in ("ring", "rabenseifner")  # one level
    with pytest.raises(UnknownStrategyError, match="algorithm must be one of"):
        simulate(toy(), fast_net(4), "wfbp@tree")


def test_cluster_refuses_nonsense():
    with pytest.raises(ClusterError, match="nodes"):
        Cluster(nodes=0)
    with pytest.raises(ClusterError, match="oversubscription"):
        Cluster(nodes=2, oversubscription=0.5)
    with pytest.raises(ClusterError, match="device"):
        Cluster(nodes=2, device="tpu")


# -- schedules --------------------------------------------------------------------------------------

def test_compute_alone_is_the_profiled_step():
    p = toy(opt=0.05, other=0.01)
    assert simulate(p, fast_net(4), "compute").t_iter_s == pytest.approx(p.compute_s)


def test_allreduce_adds_the_whole_exchange_after_backward():
    p, c = toy(), fast_net(4, latency=1e-4)
    exchange = 2 * 3 * 1e-4 + 2 * 3 / 4 * p.grad_bytes / (1e9 / 8)
    agreement = 2 * 1e-4  # the step's agreement first: recursive doubling's 2 rounds, nothing on the link yet
    assert simulate(p, c, "allreduce@ring").t_iter_s == pytest.approx(p.compute_s + agreement + exchange, rel=1e-9)
    assert simulate(p, c, "allreduce").t_iter_s <= simulate(p, c, "allreduce@ring").t_iter_s + 1e-9  # auto: no worse


def test_wait_free_strategies_hide_communication_behind_backward():
    p, c = toy(), fast_net(4, bw=10e9)
    t = {s: simulate(p, c, s).t_iter_s for s in ("compute", "allreduce", "wfbp", "ddp", "p3")}
    exchange = t["allreduce"] - t["compute"]
    for s in ("wfbp", "ddp", "p3"):
        assert max(t["compute"], exchange) - 1e-9 <= t[s] < t["allreduce"], (s, t)


def test_p3_gates_each_layer_and_beats_wfbp_when_the_link_is_the_limit():
    # All gradients in the first layers: wfbp's FIFO finishes them last, p3 sends them first so that the
    # next forward can start while the rest still travels.
    layers = tuple(Layer(f"l{i}", 0.02, 0.04, (4_000_000 if i < 2 else 1000,)) for i in range(8))
    p = Profile("front-heavy", 16, "cpu", layers, step_s=0.48, optimizer_s=0.0, other_s=0.0)
    c = fast_net(4, bw=2e9)
    assert simulate(p, c, "p3").t_iter_s < simulate(p, c, "wfbp").t_iter_s


def test_ddp_buckets_are_torchs():
    from torch import distributed as dist

    from runtime.workloads.models import build_model

    model = build_model("vgg19")
    layers = []
    for name, m in model.named_modules():
        own = [q.numel() for q in m.parameters(recurse=False)]
        if own:
            layers.append(Layer(name, 0.0, 0.0, tuple(own)))
    p = Profile("vgg19", 16, "cpu", tuple(layers), step_s=0.0, optimizer_s=0.0, other_s=0.0)
    mine = [size for size, _ in DdpSchedule(Run(p, fast_net(2))).buckets]
    params = list(model.parameters())[::-1]  # backward's order, as the reducer rebuilds its buckets
    idx, _ = dist._compute_bucket_assignment_by_size(params, [1 << 20, 25 << 20], [False] * len(params))
    assert mine == [sum(params[i].numel() * 4 for i in b) for b in idx]


def test_sparse_and_hierarchical_topk_move_less_than_allreduce_on_slow_links():
    p, c = toy(), fast_net(16, rpn=4, bw=1e9)
    t = {s: simulate(p, c, s).t_iter_s for s in ("allreduce", "topk", "hier-topk")}
    assert t["hier-topk"] < t["topk"] < t["allreduce"]


def test_hybcomm_follows_the_cost_model_and_forced_paths_differ():
    p, c = toy(linear=True), fast_net(8, bw=1e9)
    auto = simulate(p, c, "hybcomm")
    assert set(auto.details["plan"].values()) <= {"sfb", "ps"}
    assert simulate(p, c, "hybcomm-sfb").details["plan"] == {l.name: "sfb" for l in p.layers}
    assert simulate(p, c, "hybcomm-ps").t_iter_s != simulate(p, c, "hybcomm-sfb").t_iter_s


def test_staged_strategies_copy_the_gradients_to_the_host_and_back():
    import dataclasses

    c = fast_net(4, bw=1e9)
    p = toy(n=8, params=1_000_000)
    gpu = dataclasses.replace(p, device="cuda", copy_gbs=1.0)
    layer_s = p.layers[0].elements * 4 / 1e9  # 4 MB a layer at 1 GB/s
    plain, staged = simulate(p, c, "allreduce").t_iter_s, simulate(gpu, c, "allreduce").t_iter_s
    # The copies to the host hide behind the backward but the last layer's; the averages come back after.
    assert staged - plain == pytest.approx(layer_s + 8 * layer_s, rel=0.01)
    assert simulate(gpu, c, "ddp").t_iter_s == pytest.approx(simulate(p, c, "ddp").t_iter_s)  # gloo's own


def test_wfbp_and_p3_send_each_average_back_as_it_completes_and_expose_only_the_last():
    """runtime.device's averaged(): wfbp's buckets and p3's layers go back to the device on the second copy
    engine as their exchange completes, so only the last one's copy is left after the exchange; allreduce's
    single exchange still copies everything back at the end (hybcomm's dense wfbp too, as the runtime does)."""
    c = fast_net(4, bw=10e9)
    p = toy(n=8, params=1_000_000)
    gpu = dataclasses.replace(p, device="cuda", copy_gbs=1.0)
    layer_s = p.layers[0].elements * 4 / 1e9  # 4 MB a layer (a bucket each) at 1 GB/s
    for strategy in ("wfbp", "p3"):
        extra = simulate(gpu, c, strategy).t_iter_s - simulate(p, c, strategy).t_iter_s
        assert extra < 3 * layer_s, (strategy, extra / layer_s)
    extra = simulate(gpu, c, "allreduce").t_iter_s - simulate(p, c, "allreduce").t_iter_s
    assert extra == pytest.approx(9 * layer_s, rel=0.01)


def test_staged_allreduce_in_pieces_exposes_only_the_last_pieces_copy_back():
    """runtime.dense.allreduce's staged pieces (about 32 MiB of whole parameters, cut by its own `pieces`):
    each piece's averages go back as it completes, so after the exchange only the last piece's are left."""
    from runtime.dense.allreduce import AllreduceSync, pieces

    assert pieces([3, 3, 3, 1], 4) == [[0, 1], [2, 3]] and pieces([5], 4) == [[0]] and pieces([1, 1], 4) == [[0, 1]]
    c = fast_net(4, bw=10e9)
    p = toy(n=8, bwd=0.05, params=AllreduceSync.piece_bytes // 4 + 1)  # a piece a layer, copied in 34 ms
    gpu = dataclasses.replace(p, device="cuda", copy_gbs=1.0)
    layer_s = p.layers[0].elements * 4 / 1e9
    extra = simulate(gpu, c, "allreduce").t_iter_s - simulate(p, c, "allreduce").t_iter_s
    # The last layer's copy to the host (the rest hide behind backward) and the last piece's back; 8 pieces pay
    # 7 more rings' latencies than one.
    assert extra == pytest.approx(2 * layer_s, rel=0.02)


def test_a_driving_progress_thread_takes_its_cores_only_while_the_training_thread_waits():
    c = fast_net(2, comm_cores=0.25, cores_per_host=1.0)
    host = Host(Engine(), c)
    host.polling(True)
    assert host.cores.reserved == 0.25  # polls while anything is pending (p3's thread, a CPU rank's)
    host.drives = True
    host.polling(True)
    assert host.cores.reserved == 0.0  # backs off while the training thread computes
    host.waiting(True)
    assert host.cores.reserved == 0.25
    host.polling(False)
    assert host.cores.reserved == 0.0
    # wfbp's thread drives where compute is off the cores; DDP's gloo worker and p3's thread do not.
    drives = {(s, device): cls(Run(toy(), fast_net(2, device=device))).run.host.drives
              for s, cls in (("wfbp", BucketSchedule), ("ddp", DdpSchedule)) for device in ("gpu", "cpu")}
    assert drives == {("wfbp", "gpu"): True, ("wfbp", "cpu"): False, ("ddp", "gpu"): False, ("ddp", "cpu"): False}
    # So the buckets exchanged during the backward lose nothing to the polling, the last ones after it do (their
    # copies outlast the backward by more than the step's agreement, during which the thread does not drive).
    p, net = toy(n=8, params=100_000), fast_net(4, bw=10e9, cpu_per_byte=1e-8, cores_per_host=0.1)

    def step(comm_cores: float, drives: bool) -> float:
        run = Run(p, dataclasses.replace(net, comm_cores=comm_cores))
        schedule = BucketSchedule(run)
        run.host.drives = drives
        ends = train(run, schedule, 5)
        return ends[-1] - ends[-2]
    assert step(0.0, True) < step(0.25, True) < step(0.25, False)


def _finished(c: Cluster, collective, bulk_bytes: float) -> float:
    """When `collective(host)` ends, started beside a bulk transfer of `bulk_bytes` already on the link."""
    engine = Engine()
    host = Host(engine, c)
    if bulk_bytes:
        engine.start(host.transfer("bulk", bulk_bytes))
    end = []
    engine.process(collective(host)).then(lambda _: end.append(engine.now))
    engine.run()
    return end[0]


def test_a_small_collective_queues_behind_the_bytes_on_the_link_not_beside_them():
    """The step's agreement and each step of the buffers' allreduce wait for what is on the host's link already
    (one TCP connection per peer, a first-in first-out interface queue): no fair share of it."""
    c, bulk, n = fast_net(4, latency=1e-4), 1e6, 100_000  # 1 Gbit/s: the bulk transfer takes 8 ms
    assert _finished(c, small_allreduce, 0) == pytest.approx(2 * 1e-4)  # recursive doubling's 2 rounds
    assert _finished(c, small_allreduce, bulk) == pytest.approx(bulk / (1e9 / 8) + 2 * 1e-4)
    buffers = lambda host: queued_allreduce(host, n, "module buffers")  # noqa: E731
    idle = 4 * 1e-4 + 2 * 3 / 4 * n / (1e9 / 8)  # Rabenseifner's 4 steps, 2(P-1)/P of the buffer
    assert _finished(c, buffers, 0) == pytest.approx(idle)
    assert _finished(c, buffers, bulk) == pytest.approx(bulk / (1e9 / 8) + idle)
    # One node: nothing crosses a link, nothing queues behind it.
    assert _finished(fast_net(1, rpn=4, latency=1e-4), small_allreduce, 0) == pytest.approx(2 * 1e-4)
    # Every DistributedOptimizer strategy agrees each step; torch DDP does not.
    assert BucketSchedule(Run(toy(), c)).agree() is not None
    assert DdpSchedule(Run(toy(), c)).agree() is None


def test_module_buffers_cost_each_strategy_their_average_and_ddp_its_broadcast():
    """runtime.model_buffers averages the floating-point buffers (float64) after each step, waited before the
    next forward; torch DDP broadcasts rank 0's (float32) before each forward; the plain step does neither."""
    n, latency = 1_000_000, 1e-4
    bare, c = toy(opt=0.01, other=0.01), fast_net(4, latency=latency)
    p = dataclasses.replace(bare, buffer_elements=n)
    average = 2 * 2 * latency + 2 * 3 / 4 * 8 * n / (1e9 / 8)  # Rabenseifner's allreduce of the float64 staging vector
    broadcast = 2 * (latency + 4 * n / (1e9 / 8))  # gloo's binomial tree: log2(4) steps of the whole buffer
    assert simulate(p, c, "compute").t_iter_s == pytest.approx(simulate(bare, c, "compute").t_iter_s)
    assert simulate(p, c, "allreduce@ring").t_iter_s == pytest.approx(
        simulate(bare, c, "allreduce@ring").t_iter_s + average, rel=1e-9)
    assert simulate(p, c, "ddp").t_iter_s == pytest.approx(simulate(bare, c, "ddp").t_iter_s + broadcast, rel=1e-6)
    for s in ("wfbp", "p3", "topk", "hier-topk", "hybcomm"):
        assert simulate(p, c, s).t_iter_s > simulate(bare, c, s).t_iter_s, s
    one = Cluster(nodes=1, ranks_per_node=1)  # one rank: nothing to average
    assert simulate(p, one, "allreduce").t_iter_s == pytest.approx(simulate(bare, one, "allreduce").t_iter_s)


def test_profiles_count_the_floating_point_buffers_and_old_files_read_as_none(tmp_path):
    from runtime.emulate.sim_profile import modelled_profile

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 10))
    x = torch.zeros(4, 3, 8, 8)
    assert modelled_profile(model, "v100", (x,), "bn").buffer_elements == 16  # mean and var; not the step count
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = measure(model, (x,), torch.zeros(4, dtype=torch.long), torch.nn.functional.cross_entropy, opt, steps=1,
                warmup=1, name="bn", sparse_density=None, gflops=False)
    assert p.buffer_elements == 16
    old = p.to_json()
    del old["buffer_elements"]  # a profile written before the field
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert Profile.load(str(path)).buffer_elements == 0


def test_unknown_strategy_names_the_known_ones():
    with pytest.raises(UnknownStrategyError, match="allreduce"):
        simulate(toy(), fast_net(2), "gossip")


def test_a_thousand_ranks_simulate_quickly_and_finitely():
    p = toy(n=40)
    for s in ("allreduce", "wfbp", "ddp", "p3", "hybcomm", "topk", "hier-topk", "allreduce+pto"):
        r = simulate(p, Cluster(nodes=128, ranks_per_node=8, bandwidth=25e9), s)
        assert math.isfinite(r.t_iter_s) and r.t_iter_s >= p.compute_s * 0.99


# -- profiles ---------------------------------------------------------------------------------------

def test_measure_profiles_every_layer_of_a_real_model_and_round_trips(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = measure(model, (x,), y, torch.nn.functional.cross_entropy, opt, steps=2, warmup=1, name="mlp",
                sparse_density=0.1, gflops=False)
    assert [l.name for l in p.layers] == ["0", "2"]
    assert [l.params for l in p.layers] == [(2048, 64), (640, 10)]
    assert p.layers[0].act_bytes == 8 * 64 * 4  # the next layer's input: after the ReLU
    assert p.layers[0].linear == (32, 64, 8, True) and p.layers[1].linear == (64, 10, 8, True)
    assert all(l.fwd_s > 0 and l.bwd_s > 0 for l in p.layers) and p.select_s_per_element > 0
    path = tmp_path / "p.json"
    p.save(str(path))
    assert Profile.load(str(path)) == p


def test_a_file_that_is_not_a_profile_says_so(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ProfileError, match="not a mpitrain-profile"):
        Profile.load(str(path))


def test_one_rank_sends_nothing_and_every_exact_strategy_is_the_plain_step():
    p = toy(n=200, params=100_000)  # hundreds of p3 slices completing at once: no recursion
    one = Cluster(nodes=1, ranks_per_node=1)
    for s in ("allreduce", "wfbp", "ddp", "p3", "hybcomm", "allreduce+pto"):
        assert simulate(p, one, s).t_iter_s == pytest.approx(p.compute_s), s
