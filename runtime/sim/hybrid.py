"""Poseidon's hybrid communication as an event schedule: the cost model's sufficient-factor layers, the rest wfbp."""

from __future__ import annotations

from types import SimpleNamespace

from runtime.hybrid.cost_model import Links, plan

from .dataparallel import WFBP_FUSE_BYTES, BucketSchedule, Run


def hybcomm_plan(run: Run, force: str = "auto") -> list:
    """runtime.hybrid.cost_model's choice per Linear layer of the profile, told this cluster's links."""
    c, p = run.cluster, run.profile
    layers = [SimpleNamespace(name=l.name, M=l.linear[0], N=l.linear[1], has_bias=l.linear[3])
              for l in p.layers if l.linear]
    rows = {l.name: l.linear[2] for l in p.layers if l.linear}
    links = Links(inter_bps=c.bandwidth, intra_bps=c.intra_bandwidth, gflops=p.gflops)
    return plan(layers, rows, c.ranks, c.ranks_per_node, links, itemsize=p.itemsize, force=force)


class HybcommSchedule(BucketSchedule):
    """Each layer the plan sends by sufficient factors: an allgather of them once its backward is done,
    then the rebuild (2·P·K·M·N flop) before the optimizer; every other gradient through wfbp buckets."""

    sends_back = False  # runtime.hybrid's dense wfbp returns its averages at the update, as allreduce does
    fuse_default = WFBP_FUSE_BYTES  # HybCommOptions' fuse_bytes

    def __init__(self, run: Run, **options):
        costs = hybcomm_plan(run, options.get("force", "auto"))
        names = {c.name: c for c in costs if c.choice == "sfb"}
        self.sfb = {i: names[l.name] for i, l in enumerate(run.profile.layers) if l.name in names}
        super().__init__(run, **options, skip=frozenset(self.sfb))
        self.unstaged = frozenset(self.sfb)  # their factors go to the host, not their gradients
        self.plan = {c.name: c.choice for c in costs}

    def grad_ready(self, i: int, step: int) -> None:
        if i in self.sfb:
            self.pending.append(self.run.stream.submit(self._factors(self.sfb[i])))
        super().grad_ready(i, step)

    def _factors(self, cost):
        c = self.run.cluster
        if c.ranks == 1:
            return
        yield self.run.engine.timeout((c.ranks - 1) * c.latency)
        nic = cost.sfb_link_bytes if c.nodes > 1 else 0.0
        shm = 0.0 if c.nodes > 1 else cost.sfb_link_bytes
        yield self.run.engine.start(self.run.host.transfer(f"factors {cost.name}", nic, shm))

    def finish(self, step: int):
        from runtime.hybrid.cost_model import rebuild_flop

        flop = sum(rebuild_flop(c.M, c.N, c.K, c.P, c.bias) for c in self.sfb.values())
        if self.pending:
            yield from self.wait(self.pending)
            self.pending = []
        yield from self.back()
        if flop:
            yield self.run.compute("sufficient-factor rebuild", flop / (self.run.profile.gflops * 1e9))
        self._left = []
        yield self.run.compute("optimizer", self.p.optimizer_s)
