"""Show how MPI sees this allocation: nodes, ranks per node, node/cross groups, thread level, MPI library, copies.

    mpiexec -n 4 mpitrain topology [--json PATH] [--expect-nodes N]

Rank 0 prints one line per node; --expect-nodes makes the job fail (exit 1)
when the detected node count differs, which is how batch-system tests check
that a two-node allocation really is seen as two nodes.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from jobs.common.inputs import JobParser, at_least, output_file, parse
from jobs.common.outputs import write_together


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.topology", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write the layout as JSON (rank 0)")
    p.add_argument("--expect-nodes", type=int, metavar="N", help="exit 1 unless exactly N nodes are seen")
    p.add_argument("--ranks-per-node", type=int, metavar="K", help="emulate nodes of K consecutive ranks")
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    at_least(args, 1, "expect_nodes", "ranks_per_node")
    output_file(args, "json")


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    from mpi4py import MPI  # here, not at import: importing a job must not start MPI

    from mpicomm import Topology, TopologyError
    from mpicomm.single_copy import single_copy

    try:
        topo = Topology(ranks_per_node=args.ranks_per_node)
    except TopologyError as exc:
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    with topo:
        hosts = topo.world.allgather(socket.gethostname())  # once, at start-up: pickling is fine here
        layout = dict(ranks=topo.size, nodes=topo.num_nodes, ranks_per_node=topo.local_size,
                      emulated=topo.emulated, node_ranks=topo.nodes,
                      hostnames=[sorted({hosts[r] for r in node}) for node in topo.nodes],
                      thread_level=MPI.Query_thread(),
                      mpi=" ".join(MPI.Get_library_version().split()[:3]))
        layout["single_copy"], why = single_copy(MPI.Get_library_version())
        if topo.rank == 0:
            print(f"{layout['mpi']}: {topo.size} ranks on {topo.num_nodes} node(s)"
                  f"{' (emulated)' if topo.emulated else ''}, thread level {layout['thread_level']}")
            for i, (node, names) in enumerate(zip(topo.nodes, layout["hostnames"])):
                print(f"  node {i}: ranks {node} on host {','.join(names)}")
            one = layout["single_copy"]
            if one is not None and topo.local_size > 1:
                print(f"  large messages inside a node: {'one copy' if one else 'through MPICH cells'}"
                      f" ({why}){'' if one else '; p3 and the hierarchical allreduce take shared windows'}")
        if args.json:
            def write_layout():
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                with open(args.json, "w") as f:
                    json.dump(layout, f, indent=1)
            write_together(topo.world, "--json", args.json, write_layout, here=topo.rank == 0)
        ok = args.expect_nodes is None or topo.num_nodes == args.expect_nodes
        if not ok and topo.rank == 0:
            print(f"error: expected {args.expect_nodes} nodes, MPI sees {topo.num_nodes}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before MPI starts
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
