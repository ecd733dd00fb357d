"""Benchmark: mpicomm's ring collectives against the MPI library's native ones, nccl-tests style.

    mpiexec -n 4 mpitrain bench collectives --json results/collectives.json
    mpiexec -n 4 mpitrain bench collectives --crossover results/crossover.json
    MPITRAIN_RING_LATENCY_BYTES=results/crossover.json mpitrain train ...   # Ring uses it
    mpiexec -n 4 mpitrain bench collectives --ops allreduce --ranks-per-node 2 \
        --impls ring-only,doubling,hierarchical,auto --choose results/allreduce.json
    MPITRAIN_ALLREDUCE_TABLE=results/allreduce.json mpitrain train ...      # auto follows it on that layout

For each op and message size, one row per implementation with
op, impl, bytes, ranks, time_s, algbw_gbps, busbw_gbps. `bytes` is the whole
buffer as nccl-tests counts it (allreduce/broadcast: the buffer; reduce_scatter:
the input; allgather: the output). busbw = algbw x factor, the factor being
2(P-1)/P for allreduce, (P-1)/P for reduce_scatter and allgather, 1 for broadcast.
Implementations: ring (mpicomm's Ring as used: MPI's collective below its
crossover, `--latency-bytes`), ring-only (the ring at every size), native
(the MPI library's blocking collective), gloo (torch.distributed), and for
allreduce mpicomm.Collectives' algorithms: doubling (recursive doubling),
rabenseifner (recursive halving, then doubling), hierarchical (node reduce-scatter, cross-node allreduce, node allgather) and
auto (the choice by size and layout; `--choose` writes a measured table of the
best per size, which auto then follows). They are
timed in rounds, the order rotated every round and reversed every other, so
that neither drifting load (a shared machine) nor what ran just before can
favour one; time_s is the median over rounds of the slowest rank's mean per
call. auto is also judged against the fastest algorithm round by round (the
median of the paired ratios, with its order-statistic CI). The crossover per
op is the smallest size from which ring-only beats native at every larger
size measured.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from jobs.bench.collectives_report import (OPS, auto_against_fastest, choice_summary, choose, crossover, format_table,
                                          plot, summary)
from jobs.common.compute import REAL_CPU, where_and_how, where_and_how_line
from jobs.common.inputs import InputError, JobParser, at_least, comma_list, output_file, parse, positive_finite
from jobs.common.outputs import write_results, write_together
from jobs.common.report import parse_size as _parse_size
from jobs.common.report import run_metadata, write_document

IMPLS = ("ring", "ring-only", "native", "gloo", "doubling", "rabenseifner", "hierarchical", "hierarchical-messages",
         "hierarchical-window", "auto")
# mpicomm.Collectives, allreduce only; "-messages", "-window": the hierarchy's node steps as messages or through the
# shared window, whatever MPI's single-copy path (without either: the window where there is none)
ALGORITHM_IMPLS = ("doubling", "rabenseifner", "hierarchical", "hierarchical-messages", "hierarchical-window", "auto")
MPICOMM_IMPLS = ("ring", "ring-only", *ALGORITHM_IMPLS)  # those --chunk-bytes and --no-validate apply to
GLOO_OPS = ("allreduce", "allgather", "broadcast")  # gloo has no CPU reduce_scatter
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"


def parse_size(text: str) -> int:
    return _parse_size(text, binary=True)


def parse_bytes(text: str) -> int:
    """A size that may be 0."""
    if text.strip() == "0":
        return 0
    try:
        return parse_size(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (0 for none)") from None


def bus_factor(op: str, ranks: int) -> float:
    if op == "allreduce":
        return 2 * (ranks - 1) / ranks
    if op in ("reduce_scatter", "allgather"):
        return (ranks - 1) / ranks
    return 1.0


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.collectives", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"comma-separated message sizes in bytes, K/M/G suffixes (default {DEFAULT_SIZES})")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)} (default all)")
    p.add_argument("--impls", default="ring,ring-only,native",
                   help="comma-separated subset of ring (mpicomm, with its latency path), ring-only (no latency "
                        "path), native (MPI), gloo (torch.distributed), and for allreduce doubling, rabenseifner, "
                        "hierarchical, hierarchical-messages, hierarchical-window (its node steps as messages or "
                        "through a shared window; plain: the window where MPI has no single copy), auto; default "
                        "ring,ring-only,native")
    p.add_argument("--iters", type=int, default=0,
                   help="timed iterations per row and round (default: as many as fit ~1 GiB of traffic over "
                        "the rounds, at least 3 per round, at most 100 in all)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per size, implementations in a rotated order each round, reversed every other; medians "
                        "(default 3; 95 %% CIs from 6)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per row (default 1)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "int32"),
                   help="the buffers' element type (default float32)")
    p.add_argument("--chunk-bytes", type=parse_size, default=None,
                   help="pipelining chunk of mpicomm's impls (all but native and gloo; default: mpicomm's)")
    p.add_argument("--no-validate", action="store_true",
                   help="skip the cross-rank fingerprint check of mpicomm's impls (all but native and gloo)")
    p.add_argument("--latency-bytes", type=parse_bytes, default=None,
                   help="the ring impl's crossover: below it MPI's collective (default: mpicomm's, or "
                        "$MPITRAIN_RING_LATENCY_BYTES; 0 = the ring everywhere)")
    p.add_argument("--crossover", metavar="PATH",
                   help="write the measured crossover per op here (JSON); point $MPITRAIN_RING_LATENCY_BYTES "
                        "at it and Ring uses it (needs the ring-only and native impls)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="emulate nodes of this many consecutive ranks for the topology-aware impls "
                        "(default: the hosts MPI reports)")
    p.add_argument("--choose", metavar="PATH",
                   help="write the fastest allreduce algorithm per size here (JSON, for this layout); point "
                        "$MPITRAIN_ALLREDUCE_TABLE at it and auto follows it (needs ring-only and doubling)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="per-host link rate (Gbit/s) for the bandwidth bound (default: the emulated cluster's, "
                        "else none)")
    p.add_argument("--json", metavar="PATH", help="write the rows (and run metadata) here")
    p.add_argument("--plot", metavar="PNG", help="busbw-vs-size plot (default: the JSON path with .png)")
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    args.sizes = comma_list("--sizes", args.sizes, parse=parse_size, unique=True)
    args.ops = comma_list("--ops", args.ops, OPS)
    args.impls = comma_list("--impls", args.impls, IMPLS)
    at_least(args, 0, "iters", "warmup")
    at_least(args, 1, "rounds")
    positive_finite(args, "link_gbps")  # inf made every bound 0 s and each row "inf x bound"
    # Settings of impls not run were accepted, and the header still named them, as if they had applied.
    if args.latency_bytes is not None and "ring" not in args.impls:
        raise InputError("--latency-bytes", "is the ring impl's crossover: add ring to --impls")
    if not set(args.impls) & set(MPICOMM_IMPLS):
        for given, opt in ((args.chunk_bytes is not None, "--chunk-bytes"), (args.no_validate, "--no-validate")):
            if given:
                raise InputError(opt, f"applies to mpicomm's impls ({', '.join(MPICOMM_IMPLS)}), none in --impls")
    if args.crossover and not {"ring-only", "native"} <= set(args.impls):
        raise InputError("--crossover", "needs the ring-only and native impls in --impls")
    if args.choose and not ({"ring-only", "doubling"} <= set(args.impls) and "allreduce" in args.ops):
        raise InputError("--choose", "needs the allreduce op and the ring-only and doubling impls")
    if args.ranks_per_node is not None:
        at_least(args, 1, "ranks_per_node")
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot", "crossover", "choose")


class Case:
    """Buffers and the implementations of one (op, size); `rings`: the Ring each ring impl runs on."""

    def __init__(self, op, nbytes, dtype, rings, comm):
        P, r = comm.Get_size(), comm.Get_rank()
        itemsize = np.dtype(dtype).itemsize
        n = max(P, nbytes // itemsize)
        per = n // P
        self.op, self.comm, self.rings = op, comm, rings
        self.nbytes = n * itemsize
        rng = np.random.default_rng(r)
        if op == "allreduce":
            self.src, self.dst = rng.random(n).astype(dtype), np.empty(n, dtype)
        elif op == "reduce_scatter":
            n = per * P  # native Reduce_scatter_block wants equal blocks
            self.nbytes = n * itemsize
            self.src, self.dst = rng.random(n).astype(dtype), np.empty(per, dtype)
        elif op == "allgather":
            self.nbytes = per * P * itemsize
            self.src, self.dst = rng.random(per).astype(dtype), np.empty(per * P, dtype)
        else:
            self.src = self.dst = rng.random(n).astype(dtype)

    def run(self, impl: str) -> None:
        c, s, d = self.comm, self.src, self.dst
        if impl == "gloo":
            self._gloo()
            return
        if impl == "native":
            if self.op == "allreduce":
                c.Allreduce(s, d)
            elif self.op == "reduce_scatter":
                c.Reduce_scatter_block(s, d)
            elif self.op == "allgather":
                c.Allgather(s, d)
            else:
                c.Bcast(d, root=0)
            return
        ring = self.rings[impl]
        if self.op == "allreduce":
            ring.allreduce(s, d).wait()
        elif self.op == "reduce_scatter":
            ring.reduce_scatter(s, d).wait()
        elif self.op == "allgather":
            ring.allgather(s, d).wait()
        else:
            ring.broadcast(d, root=0).wait()


    def _gloo(self) -> None:
        import torch
        import torch.distributed as dist

        s, d = torch.from_numpy(self.src), torch.from_numpy(self.dst)  # views: no copies
        if self.op == "allreduce":
            d.copy_(s)  # out of place, like the other two implementations
            dist.all_reduce(d)
        elif self.op == "allgather":
            dist.all_gather(list(d.chunk(self.comm.Get_size())), s)
        else:
            dist.broadcast(d, src=0)


def time_case(case: Case, impl: str, iters: int, warmup: int) -> float:
    """Slowest rank's mean seconds per call, each call started together after a barrier."""
    from mpi4py import MPI

    comm = case.comm
    for _ in range(warmup):
        case.run(impl)
    total = 0.0
    for _ in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        case.run(impl)
        total += time.perf_counter() - t0
    worst = np.empty(1)
    comm.Allreduce(np.array([total / iters]), worst, op=MPI.MAX)
    return float(worst[0])


def auto_iters(nbytes: int, rounds: int) -> int:
    """Per round: ~1 GiB of traffic over all rounds, at most 100 calls in all, at least 3 per round."""
    return int(max(3, min(100, (1 << 30) // nbytes) // rounds))


def round_order(items: list, rnd: int) -> list:
    """The contenders' order in round `rnd`: rotated, and reversed every other round, so that each one runs at
    every position and after both its neighbours in turn. A rotation alone keeps the cyclic order: auto always
    ran right after the hierarchical row, and read 1.07-1.11x it at 64 KiB on 4 hosts x 2 where, run with it
    alone or in the reversed order, it read 0.93-1.04x (benchmarks/topology.md)."""
    base = items if rnd % 2 == 0 else items[::-1]
    k = (rnd // 2) % len(items)
    return base[k:] + base[:k]


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    from mpi4py import MPI  # here, not at import: importing a job must not start MPI

    from mpicomm import Collectives, Ring, Topology
    from mpicomm.algorithms import CostModel
    from mpicomm.ring import DEFAULT_CHUNK_BYTES

    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    if P == 1:
        say("note: 1 rank: nothing crosses a link; run under `mpiexec -n 4` for meaningful figures")
    network = describe_network()
    link_bps = args.link_gbps * 1e9 if args.link_gbps else network.get("bandwidth_bps")
    if "gloo" in args.impls:
        from mpicomm.torchdist import init_gloo

        init_gloo(comm)
    chunk = args.chunk_bytes or DEFAULT_CHUNK_BYTES
    validate = not args.no_validate
    rings = {}
    if "ring" in args.impls:
        rings["ring"] = Ring(comm, validate=validate, chunk_bytes=chunk, latency_bytes=args.latency_bytes)
    if "ring-only" in args.impls:
        rings["ring-only"] = Ring(comm, validate=validate, chunk_bytes=chunk, latency_bytes=0)
    latency = rings["ring"].latency_bytes if "ring" in rings else None
    topo = Topology(comm, ranks_per_node=args.ranks_per_node)
    for impl in ALGORITHM_IMPLS:
        if impl in args.impls:
            # As the dense strategies build them: auto and the hierarchy's cross-node step choose by the cost
            # model told the measured link (auto: or a table).
            algorithm, _, how = impl.partition("-")
            rings[impl] = Collectives(topo, algorithm=algorithm, validate=validate, chunk_bytes=chunk,
                                      model=CostModel.for_algorithm(topo, algorithm),
                                      node_window={"messages": False, "window": True}.get(how, "auto"))
    bench_comm = comm.Dup()
    rows = []
    mpicomm_runs = bool(set(args.impls) & set(MPICOMM_IMPLS))  # the header names only settings that applied
    labels = where_and_how(REAL_CPU)  # no model: the buffers are host memory, each call MPI's or mpicomm's
    say(f"# {where_and_how_line(labels)}")
    say(f"# {MPI.Get_library_version().splitlines()[0].strip()}, {P} ranks, dtype {args.dtype}, "
        + (f"mpicomm chunk {chunk} B, validate {'on' if validate else 'off'}, " if mpicomm_runs else "")
        + f"network {network['kind']}"
        + (f", link {link_bps / 1e9:g} Gbit/s" if link_bps else "")
        + (f", ring latency path below {_crossovers(latency, args.ops)}" if latency else "")
        + f", {args.rounds} rounds, {topo.num_nodes} node(s) x {topo.local_size}")
    auto_how = rings["auto"].chooser.describe() if "auto" in rings else None  # what auto's choices came from
    if auto_how:
        say(f"# {auto_how}")
    say(format_table([]).splitlines()[0], flush=True)
    for op in args.ops:
        impls = [i for i in args.impls if (i != "gloo" or op in GLOO_OPS)
                 and (i not in ALGORITHM_IMPLS or op == "allreduce")]
        for k, nbytes in enumerate(args.sizes):
            case = Case(op, nbytes, np.dtype(args.dtype), rings, bench_comm)
            iters = args.iters or auto_iters(case.nbytes, args.rounds)
            times = {impl: [] for impl in impls}
            native_calls = 0
            for rnd in range(args.rounds):
                for impl in round_order(impls, rnd + k):
                    before = rings[impl].native.posted if impl == "ring" else 0
                    times[impl].append(time_case(case, impl, iters, args.warmup))
                    if impl == "ring":
                        native_calls += rings[impl].native.posted - before
            for impl in impls:
                t = float(np.median(times[impl]))
                algbw = case.nbytes / t / 1e9
                row = dict(op=op, impl=impl, bytes=case.nbytes, ranks=P, time_s=t, algbw_gbps=algbw,
                           busbw_gbps=algbw * bus_factor(op, P), iters=iters, rounds=args.rounds,
                           round_times_s=times[impl])
                if impl == "ring":  # which path the ring impl took (every rank took the same)
                    row["path"] = "latency" if native_calls else "ring"
                if impl in ALGORITHM_IMPLS:
                    row["path"] = rings[impl].algorithm_for(case.nbytes)
                    if row["path"] == "hierarchical" and topo.num_nodes > 1:  # its cross-node step's algorithm
                        row["across"] = rings[impl].across_for(case.nbytes)
                if link_bps:
                    # Bandwidth bound: every node moves busbw-worth of bytes over its own link, e.g.
                    # 2(N-1)/N * S for an allreduce over N nodes (one rank a host: N = P).
                    nodes = topo.num_nodes if topo.num_nodes > 1 else P
                    row["bound_s"] = bus_factor(op, nodes) * case.nbytes * 8 / link_bps
                rows.append(row)
                say(format_table([row]).splitlines()[2], flush=True)
            del case
    for ring in rings.values():
        ring.free()
    layout = dict(ranks=P, nodes=topo.num_nodes, per_node=topo.local_size)
    topo.free()
    bench_comm.Free()
    if "gloo" in args.impls:
        from mpicomm.torchdist import shutdown_gloo

        shutdown_gloo(comm)
    measured = {op: crossover(rows, op) for op in args.ops} if {"ring-only", "native"} <= set(args.impls) else {}
    chosen = choose(rows) if {"ring-only", "doubling"} <= set(args.impls) and "allreduce" in args.ops else None
    against = auto_against_fastest(rows)
    for r in rows:
        if r["impl"] == "auto" and r["bytes"] in against:
            r["vs_fastest"] = against[r["bytes"]]
    if rank == 0:
        summary(rows, measured, args.sizes, say)
        if chosen:
            choice_summary(rows, chosen, against, say)
    meta = run_metadata("jobs.bench.collectives", argv, mpi=MPI.Get_library_version().splitlines()[0].strip(),
                        ranks=P, dtype=args.dtype, **labels,
                        chunk_bytes=chunk if mpicomm_runs else None, validate=validate if mpicomm_runs else None,
                        network=network, link_bps=link_bps, latency_bytes=latency, rounds=args.rounds,
                        layout=layout, auto=auto_how)
    title = (f"busbw vs size, {P} ranks, {' '.join(meta['mpi'].split())}\n"
             f"{where_and_how_line(meta)}")
    write_results(comm, args, meta, rows, lambda path: plot(rows, path, title), say)
    if args.crossover:
        table = {op: (b if b is not None else 2 * max(args.sizes)) for op, b in measured.items()}
        doc = dict(latency_bytes=table, meta=meta, note="below latency_bytes[op] a Ring takes MPI's collective; "
                   "an op whose ring never won up to the largest size measured gets twice that size")
        write_together(comm, "--crossover", args.crossover,
                       lambda: write_document(args.crossover, doc, say),
                       here=rank == 0)
    if args.choose:
        doc = dict(layout=layout, allreduce=chosen, meta=meta,
                   note="auto takes allreduce[i][1] below allreduce[i][0] bytes (null: every larger size), "
                        "on this layout only")
        write_together(comm, "--choose", args.choose, lambda: write_document(args.choose, doc, say),
                       here=rank == 0)
    return 0


def _crossovers(latency: dict, ops) -> str:
    return ", ".join(f"{op} {latency[op]} B" for op in ops)


def describe_network() -> dict:
    """Where this run's traffic went: the emulated cluster's links, or unshaped on one host."""
    if os.environ.get("MPITRAIN_CLUSTER_IFACE"):
        from mpicomm.emulation import read_state

        state = read_state() or {}
        return dict(kind="emulated-cluster", hosts=state.get("hosts"), bandwidth_bps=state.get("bandwidth_bps"),
                    burst_bytes=state.get("burst_bytes"),
                    congestion_control=state.get("congestion_control_in_effect"))
    return dict(kind="unshaped-local" if os.environ.get("MPITRAIN_UNSHAPED") else "local")




if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before MPI starts
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
