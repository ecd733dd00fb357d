"""Which rank runs which stage of which replica, and the communicators between them."""

# World = stages x replicas. Ranks are taken in node order (the topology's
# nodes, then local rank). "within-node" fills a node with consecutive stages
# of one pipeline, so activations cross fast intra-node links and the
# replicas' gradient averaging crosses nodes; "across-nodes" puts a stage's
# replicas side by side, so each pipeline spans the nodes and the gradient
# averaging stays inside a node. With one rank per node both are the same.

from __future__ import annotations

from mpi4py import MPI

from mpicomm import Topology
from mpicomm.requests import drain_at_exit

PLACEMENTS = ("within-node", "across-nodes")


class PlacementError(ValueError):
    """The world cannot be laid out as asked (raised on every rank: the check is on values all ranks share)."""


class PipelineLayout:
    """This rank's stage and replica, `pipeline` (its replica's stages, rank = stage) and `replica_group` (its stage's replicas)."""

    def __init__(self, topology: Topology, stages: int, replicas: int, placement: str = "within-node"):
        if placement not in PLACEMENTS:
            raise PlacementError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        world = topology.world
        size = world.Get_size()
        if stages * replicas != size:
            raise PlacementError(f"{size} ranks cannot run {stages} stages x {replicas} replicas "
                                 f"(= {stages * replicas} ranks): start {stages * replicas} ranks, or choose "
                                 f"stages x replicas = {size}")
        order = [r for node in topology.nodes for r in node]
        position = order.index(topology.rank)
        if placement == "within-node":
            self.stage, self.replica = position % stages, position // stages
        else:
            self.stage, self.replica = position // replicas, position % replicas
        self.stages, self.replicas, self.placement = stages, replicas, placement
        self.world = world
        self.pipeline = drain_at_exit(world.Split(self.replica, self.stage))  # the stages' messages (StageLink)
        self.replica_group = world.Split(self.stage, self.replica)
        # Which world rank runs each stage of this replica (for messages and reports).
        self.stage_ranks = self.pipeline.allgather(topology.rank)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def free(self) -> None:
        for name in ("pipeline", "replica_group"):
            comm = getattr(self, name)
            if comm != MPI.COMM_NULL:
                comm.Free()
            setattr(self, name, MPI.COMM_NULL)
