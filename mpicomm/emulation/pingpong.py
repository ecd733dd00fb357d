"""MPI ping-pong over each link of the emulated cluster: rank i and rank i+1 (one rank per host)."""

#     python -m jobs.cluster run -- python -m mpicomm.emulation.pingpong --size 8M --reps 5
#
# Rank 0 prints one JSON line: [{"src": i, "dst": j, "bytes": S, "rtt_s": ..., "bps": ...}, ...],
# bps being the one-way rate 2*S*reps*8/elapsed.

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpicomm.emulation.pingpong")
    p.add_argument("--size", type=int, default=8 << 20, help="message bytes")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    P, r = comm.Get_size(), comm.Get_rank()
    buf = np.zeros(args.size, dtype=np.uint8)
    results = []
    pairs = [(i, (i + 1) % P) for i in range(P if P > 2 else 1)] if P > 1 else []
    for a, b in pairs:
        comm.Barrier()
        elapsed = 0.0
        if r in (a, b):
            peer = b if r == a else a
            for rep in range(args.reps + 1):  # the first round trip warms the connection up
                t0 = MPI.Wtime()
                if r == a:
                    comm.Send(buf, peer, 1)
                    comm.Recv(buf, peer, 2)
                else:
                    comm.Recv(buf, peer, 1)
                    comm.Send(buf, peer, 2)
                if rep:
                    elapsed += MPI.Wtime() - t0
        t = np.array([elapsed if r == a else 0.0])
        comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
        results.append(dict(src=a, dst=b, bytes=args.size, rtt_s=t[0] / args.reps,
                            bps=2 * args.size * args.reps * 8 / t[0]))
    if r == 0:
        print(json.dumps(results), flush=True)
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
