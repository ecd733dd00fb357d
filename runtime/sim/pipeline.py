"""The pipeline as an event schedule: stages on their own hosts running runtime.pipeline's 1F1B order."""

# Stages are not alike, so each gets a host of its own (a Host per stage, one
# engine): stage k runs the ops of runtime.pipeline.schedule in order; a
# forward waits for the previous stage's activation, a backward for the next
# stage's gradient, and each result is sent on (non-blocking, once its host has
# copied it out and posted it: a measured run's send times, drawn, where given)
# over the two hosts' links, queued behind what its host sent before (its interface's
# queue is first in, first out) and, after an idle moment, partly passed at
# once by the link's token bucket (Cluster.burst, an emulated link's); a stage
# waiting for one sees it at its next poll (noticed: mpicomm.stall's). The
# split is runtime.pipeline.partition's (PipeDream's dynamic programme over the
# profile's layers). "flush" drains every step
# (PipeDream-Flush) and accumulates its micro-batches' gradients; the
# asynchronous modes (vanilla, stash, spectrain) never drain, so step t's
# forwards follow straight on from step t-1's, and update after each
# micro-batch, with the passes of their weight versions. With
# more ranks than stages each stage is data-parallel over its replicas: an
# allreduce of the stage's gradients among them before each update (flush:
# after its step; the asynchronous modes: after every micro-batch).

from __future__ import annotations

import random

from mpicomm.stall import MAX_SLEEP, MIN_SLEEP, SPIN_SECONDS
from runtime.pipeline import schedule as order
from runtime.pipeline.partition import LayerProfile, best_balance
from runtime.pipeline.versions import version_difference

from .cluster import Cluster, Host
from .collectives import allreduce
from .engine import Activity, Engine, Event
from .profile import Profile

MODES = ("flush", "vanilla", "stash", "spectrain")
SEEDS = 8  # runs a measured spread of send times is averaged over where a row gives one (jobs.sim.modelled)


def stage_split(profile: Profile, stages: int, bandwidth: float, scale: float) -> list[range]:
    """Layer ranges per stage: the partitioner's balance over the profile's layers (a micro-batch's times)."""
    layers = [LayerProfile(l.name, (l.fwd_s + l.bwd_s) * scale, int(l.act_bytes * scale), l.elements * 4, l.elements)
              for l in profile.layers]
    return _ranges(best_balance(layers, stages, bandwidth))


def _ranges(counts: list[int]) -> list[range]:
    out, a = [], 0
    for n in counts:
        out.append(range(a, a + n))
        a += n
    return out


def noticed(waited: float) -> float:
    """When a wait of mpicomm.stall.wait_until notices what arrived `waited` seconds after it began: at once while
    it spins (SPIN_SECONDS of yielding polls), then at its next poll, the sleeps between them doubling from
    MIN_SLEEP to MAX_SLEEP (a message that lands in a 1 ms sleep is seen up to 1 ms late)."""
    if waited <= SPIN_SECONDS:
        return waited
    poll, sleep = SPIN_SECONDS, MIN_SLEEP
    while poll < waited:
        poll += sleep
        sleep = min(MAX_SLEEP, 2 * sleep)
    return poll


def default_stages(profile: Profile, cluster: Cluster) -> int:
    """Up to 4 stages (fewer for a short model or few ranks), dividing the ranks."""
    for s in range(min(4, len(profile.layers), cluster.ranks), 1, -1):
        if cluster.ranks % s == 0:
            return s
    raise ValueError(f"no pipeline of 2 or more stages fits {cluster.ranks} ranks and {len(profile.layers)} layers")


def simulate_pipeline(profile: Profile, cluster: Cluster, microbatches: int, mode: str = "flush", steps: int = 6,
                      stages: int | None = None, balance: list[int] | None = None, per_microbatch: bool = False,
                      send_host: list | None = None, op_host: list | None = None,
                      seeds: int = 1) -> tuple[float, list[range]]:
    """Mean step time after the first two steps, and the split.

    `stages` stages (default_stages) of ranks / stages replicas each, every rank of a stage on its own
    node (a node's link shared by its ranks, its cores too); each replica runs the profile's batch per
    step, each micro-batch 1/microbatches of it (compute scaled linearly), or, per_microbatch, each
    micro-batch the profile's batch as it was profiled: a GPU's time for a small batch is not in
    proportion (a fully connected layer's weights are read whatever the batch). balance: the profile's
    layers per stage (a measured run's split), instead of the partitioner's; it sets the stages.

    send_host: per stage, {"act": q, "grad": q}: the seconds each send holds the stage's host (its copy out,
    the Isend), as equally spaced quantiles of a measured run's (runtime.pipeline.Pipeline.send_times); each
    send draws one and leaves after it. A pipeline that never drains is a loop of such waits, and a spread
    moves it off the one phase a fixed schedule locks into: the step is then the mean of `seeds` runs, each
    with its own draws.

    op_host: per stage, {"F": q, "B": q, "U": q}: the host seconds of each forward, backward and update beyond
    the emulated device's sleeps, as quantiles of a measured run's (runtime.pipeline.Pipeline.op_times). An
    emulated device's work costs the host nothing, so an op takes the longer of its modelled device time and
    its host's own work, drawn: a stage of one small layer is its host's Python, not its device's time.
    """
    if seeds < 1:
        raise ValueError(f"seeds must be 1 or more, got {seeds}")
    runs = [_simulate(profile, cluster, microbatches, mode, steps, stages, balance, per_microbatch, send_host,
                      op_host, random.Random(seed))
            for seed in range(seeds if send_host or op_host else 1)]  # nothing drawn: one run
    return sum(t for t, _ in runs) / len(runs), runs[0][1]


def draw(quantiles: list[float], rng: random.Random) -> float:
    """One draw from a distribution given by equally spaced quantiles (its minimum to its maximum), linear between
    them."""
    if len(quantiles) == 1:
        return quantiles[0]
    u = rng.random() * (len(quantiles) - 1)
    i = int(u)
    return quantiles[i] + (quantiles[i + 1] - quantiles[i]) * (u - i)


def _simulate(profile: Profile, cluster: Cluster, microbatches: int, mode: str, steps: int, stages: int | None,
              balance: list[int] | None, per_microbatch: bool, send_host: list | None, op_host: list | None,
              rng: random.Random) -> tuple[float, list[range]]:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if balance is not None:
        if sum(balance) != len(profile.layers) or min(balance) < 1 or (stages and stages != len(balance)):
            raise ValueError(f"balance {list(balance)}: needs {stages or 'the'} stages' layer counts, each 1 or more, "
                             f"adding up to the profile's {len(profile.layers)} layers")
        stages = len(balance)
    S = stages or default_stages(profile, cluster)
    if not 2 <= S <= len(profile.layers) or cluster.ranks % S:
        raise ValueError(f"{S} stages: need 2 to {len(profile.layers)} (the layers), dividing {cluster.ranks} ranks")
    replicas = cluster.ranks // S
    scale = 1.0 if per_microbatch else 1.0 / microbatches
    rpn = cluster.ranks_per_node
    one_rank = cluster.with_(nodes=replicas, ranks_per_node=1, bandwidth=cluster.bandwidth / rpn,
                             cores_per_host=cluster.host_cores / rpn, shared_cores=None)
    split = stage_split(profile, S, one_rank.bandwidth, scale) if balance is None else _ranges(balance)
    engine = Engine()
    hosts = [Host(engine, one_rank, f"stage {k}") for k in range(S)]
    fwd = [sum(profile.layers[i].fwd_s for i in r) * scale for r in split]
    bwd = [sum(profile.layers[i].bwd_s for i in r) * scale for r in split]
    act = [profile.layers[r[-1]].act_bytes * scale for r in split]
    share = [sum(profile.layers[i].elements for i in r) / sum(l.elements for l in profile.layers) for r in split]
    rate = profile.memory_gbs * 1e9
    # The rest of the step (the loss) with the last stage's forward; zero_grad's memset of every gradient, in
    # the rest, is each stage's own where the memory's rate is known (below, with each update).
    fwd[-1] += max(0.0, profile.other_s - (profile.grad_bytes / rate if rate else 0.0)) * scale
    # Flush accumulates its micro-batches' gradients: each backward after a step's first adds to them on the
    # device (a pass reading both and writing one); the asynchronous modes update after every micro-batch.
    accumulate = [3 * profile.grad_bytes * f / rate if rate and mode == "flush" else 0.0 for f in share]
    # The asynchronous modes update after every micro-batch's backward, and keep weight versions
    # (runtime.pipeline.versions), each a pass over the stage's weights at the memory's rate: stash copies them
    # at a forward where micro-batches are in flight behind it (2 passes); spectrain predicts them ahead
    # (forward 7 passes, backward 3) where its version difference is not zero.
    weights = [profile.grad_bytes * f / rate if rate else 0.0 for f in share]
    fwd_versions, bwd_versions = [0.0] * S, [0.0] * S
    for k in range(S):
        if mode == "stash" and order.warmup(k, S) > 0:
            fwd_versions[k] = 2 * weights[k]
        elif mode == "spectrain":
            ahead, behind = version_difference(k, S)
            fwd_versions[k], bwd_versions[k] = 7 * weights[k] * (ahead > 0), 3 * weights[k] * (behind > 0)
    per_micro = mode != "flush"
    arrived: dict = {}  # (kind, stage, micro-batch) -> Event
    ends = [[] for _ in range(S)]

    def event(key) -> Event:
        return arrived.setdefault(key, Event())

    # A host's messages leave in the order it sent them, to either neighbour: its interface's queue (tc tbf's) is
    # first in, first out, and each message is queued whole (a socket buffer holds it). A message that follows an
    # idle moment on that queue passes up to the link's token bucket at once (Cluster.burst).
    queue = [None] * S  # per host: the last message's Event (done once it has left)
    idle_from = [0.0] * S  # per host: when its link last went idle
    left = [cluster.burst] * S  # per host: the tokens its bucket held then
    fill = cluster.bandwidth / 8  # the bucket's refill, bytes a second (the shaped rate)

    def send(kind: str, src: int, dst: int, mb: int, nbytes: float) -> None:
        a, b = hosts[src], hosts[dst]
        loads = ((a.cores, cluster.cpu_per_byte / 2), (b.cores, cluster.cpu_per_byte / 2)) if cluster.cpu_per_byte else ()
        before, done = queue[src], Event()
        queue[src] = done

        def go():
            yield engine.timeout(cluster.latency)
            if before is not None:
                yield before
            tokens = min(cluster.burst, left[src] + (engine.now - idle_from[src]) * fill)
            free = min(tokens, nbytes)
            act_ = Activity(f"{kind} {mb} {src}->{dst}", nbytes - free, uses=((a.out, 1.0), (b.into, 1.0)),
                            loads=loads, cap=cluster.transport_rate)
            yield engine.start(act_)
            idle_from[src], left[src] = engine.now, tokens - free
            done.succeed()
            event((kind, dst, mb)).succeed()

        engine.process(go())

    def host_send(k: int, direction: str):
        """The stage's host busy with a send (a measured run's time, drawn), before the message leaves."""
        q = (send_host[k] or {}).get(direction) if send_host and k < len(send_host) else None
        if q:
            yield engine.timeout(draw(q, rng))

    def busy(k: int, kind: str, device_s: float) -> float:
        """An op's time: its modelled device time, or its host's own work (drawn) where that is longer."""
        q = (op_host[k] or {}).get(kind) if op_host and k < len(op_host) else None
        return max(device_s, draw(q, rng)) if q else device_s

    def arrival(key):
        """Wait for a message as the runtime's wait_until does: noticed at its first poll after it arrived."""
        start = engine.now
        yield event(key)
        late = noticed(engine.now - start) - (engine.now - start)
        if late > 0:
            yield engine.timeout(late)

    def stage(k: int):
        h = hosts[k]  # its link carries the stage's messages and its replicas' allreduce alike
        for t in range(steps):
            M = microbatches
            base = t * M if mode == "flush" else 0
            ops = list(order.step_ops(k, S, t * M, M, base))
            if mode == "flush":
                ops += list(order.drain_ops(k, S, (t + 1) * M, base))
            for op, mb in ops:
                if op == order.FORWARD:
                    if k > 0:
                        yield from arrival(("act", k, mb))
                    f_s = busy(k, "F", fwd[k] + fwd_versions[k])
                    yield engine.start(h.compute(f"F{mb}", f_s, profile.cores_per_rank))
                    if k < S - 1:
                        yield from host_send(k, "act")
                        send("act", k, k + 1, mb, act[k])
                else:
                    if k < S - 1:
                        yield from arrival(("grad", k, mb))
                    extra = (accumulate[k] if mb != t * M else 0.0) + bwd_versions[k]
                    yield engine.start(h.compute(f"B{mb}", busy(k, "B", bwd[k] + extra), profile.cores_per_rank))
                    if k > 0:
                        yield from host_send(k, "grad")
                        send("grad", k, k - 1, mb, act[k - 1])
                    if per_micro:  # and zero_grad's memset of the stage's gradients before the next backward
                        if replicas > 1:  # each update averages the micro-batch's gradients (runtime.pipeline.
                            # stage_optimizer: one backward pass a step of its DistributedOptimizer)
                            yield engine.process(allreduce(h, profile.grad_bytes * share[k]))
                        u_s = busy(k, "U", profile.optimizer_s * share[k] + weights[k])
                        yield engine.start(h.compute("update", u_s, profile.cores_per_rank))
            if replicas > 1 and not per_micro:  # the stage's gradients, averaged over its replicas (one per node)
                # by the runtime's DistributedOptimizer over the replica group: mpicomm.Collectives, its algorithm
                # the auto choice
                yield engine.process(allreduce(h, profile.grad_bytes * share[k]))
            if not per_micro:
                u_s = busy(k, "U", profile.optimizer_s * share[k] + weights[k])
                yield engine.start(h.compute("optimizer", u_s, profile.cores_per_rank))
            ends[k].append(engine.now)

    for k in range(S):
        engine.process(stage(k))
    engine.run()
    step_ends = [max(e[t] for e in ends) for t in range(steps)]
    skip = 2 if steps > 3 else 0
    t_iter = (step_ends[-1] - step_ends[skip - 1]) / (steps - skip) if skip else step_ends[-1] / steps
    return t_iter, split
