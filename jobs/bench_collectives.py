"""Benchmark: mpicomm's ring collectives against the MPI library's native ones, nccl-tests style.

    mpiexec -n 4 python -m jobs.bench_collectives --json results/collectives.json

For each op and message size, one row per implementation with
op, impl, bytes, ranks, time_s, algbw_gbps, busbw_gbps. `bytes` is the whole
buffer as nccl-tests counts it (allreduce/broadcast: the buffer; reduce_scatter:
the input; allgather: the output). busbw = algbw x factor, the factor being
2(P-1)/P for allreduce, (P-1)/P for reduce_scatter and allgather, 1 for broadcast.
time_s is the slowest rank's mean over the timed iterations.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from jobs.inputs import JobParser, at_least, comma_list, output_file, parse, positive
from jobs.outputs import write_results
from jobs.report import parse_size as _parse_size, run_metadata, save_figure

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast")
IMPLS = ("ring", "native", "gloo")
GLOO_OPS = ("allreduce", "allgather", "broadcast")  # gloo has no CPU reduce_scatter
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"
def parse_size(text: str) -> int:
    return _parse_size(text, binary=True)


def bus_factor(op: str, ranks: int) -> float:
    if op == "allreduce":
        return 2 * (ranks - 1) / ranks
    if op in ("reduce_scatter", "allgather"):
        return (ranks - 1) / ranks
    return 1.0


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench_collectives", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"comma-separated message sizes in bytes, K/M/G suffixes (default {DEFAULT_SIZES})")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--impls", default="ring,native",
                   help="comma-separated subset of ring (mpicomm), native (MPI), gloo (torch.distributed)")
    p.add_argument("--iters", type=int, default=0,
                   help="timed iterations per row (default: as many as fit ~1 GiB of traffic, 3 to 100)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per row (default 1)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "int32"))
    p.add_argument("--chunk-bytes", type=parse_size, default=None,
                   help="ring pipelining chunk (default: mpicomm's)")
    p.add_argument("--no-validate", action="store_true", help="skip the ring's cross-rank fingerprint check")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="per-host link rate (Gbit/s) for the bandwidth bound; default: the emulated cluster's")
    p.add_argument("--json", metavar="PATH", help="write the rows (and run metadata) here")
    p.add_argument("--plot", metavar="PNG", help="busbw-vs-size plot (default: the JSON path with .png)")
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    args.sizes = comma_list("--sizes", args.sizes, parse=parse_size)
    args.ops = comma_list("--ops", args.ops, OPS)
    args.impls = comma_list("--impls", args.impls, IMPLS)
    at_least(args, 0, "iters", "warmup")
    positive(args, "link_gbps")
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot")


class Case:
    """Buffers and the two implementations of one (op, size)."""

    def __init__(self, op, nbytes, dtype, ring, comm):
        P, r = comm.Get_size(), comm.Get_rank()
        itemsize = np.dtype(dtype).itemsize
        n = max(P, nbytes // itemsize)
        per = n // P
        self.op, self.comm, self.ring = op, comm, ring
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
        if self.op == "allreduce":
            self.ring.allreduce(s, d).wait()
        elif self.op == "reduce_scatter":
            self.ring.reduce_scatter(s, d).wait()
        elif self.op == "allgather":
            self.ring.allgather(s, d).wait()
        else:
            self.ring.broadcast(d, root=0).wait()


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


def auto_iters(nbytes: int) -> int:
    return int(min(100, max(3, (1 << 30) // nbytes)))


def format_table(rows) -> str:
    head = (f"{'op':<15}{'impl':<8}{'bytes':>12}{'ranks':>6}{'time_ms':>11}{'algbw_GB/s':>12}{'busbw_GB/s':>12}"
            f"{'x bound':>9}")
    lines = [head, "-" * len(head)]
    lines += [f"{r['op']:<15}{r['impl']:<8}{r['bytes']:>12}{r['ranks']:>6}{r['time_s'] * 1e3:>11.3f}"
              f"{r['algbw_gbps']:>12.3f}{r['busbw_gbps']:>12.3f}"
              f"{(format(r['time_s'] / r['bound_s'], '9.2f') if r.get('bound_s') else ''):>9}" for r in rows]
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows}, key=OPS.index)
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for impl, style in (("ring", "o-"), ("native", "s--"), ("gloo", "^:")):
            pts = sorted((r["bytes"], r["busbw_gbps"]) for r in rows if r["op"] == op and r["impl"] == impl)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    save_figure(fig, path)


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    from mpi4py import MPI  # here, not at import: importing a job must not start MPI

    from mpicomm import Ring
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
    ring = Ring(comm, validate=not args.no_validate, chunk_bytes=chunk)
    bench_comm = comm.Dup()
    rows = []
    say(f"# {MPI.Get_library_version().splitlines()[0].strip()}, {P} ranks, dtype {args.dtype}, "
        f"ring chunk {chunk} B, validate {'off' if args.no_validate else 'on'}, network {network['kind']}"
        + (f", link {link_bps / 1e9:g} Gbit/s" if link_bps else ""))
    say(format_table([]).splitlines()[0], flush=True)
    for op in args.ops:
        for nbytes in args.sizes:
            case = Case(op, nbytes, np.dtype(args.dtype), ring, bench_comm)
            iters = args.iters or auto_iters(case.nbytes)
            for impl in args.impls:
                if impl == "gloo" and op not in GLOO_OPS:
                    continue
                t = time_case(case, impl, iters, args.warmup)
                algbw = case.nbytes / t / 1e9
                row = dict(op=op, impl=impl, bytes=case.nbytes, ranks=P, time_s=t, algbw_gbps=algbw,
                           busbw_gbps=algbw * bus_factor(op, P), iters=iters)
                if link_bps:
                    # Bandwidth bound with one rank per host: every rank moves busbw-worth of bytes over
                    # its own link, e.g. 2(P-1)/P * S for a ring allreduce.
                    row["bound_s"] = bus_factor(op, P) * case.nbytes * 8 / link_bps
                rows.append(row)
                say(format_table([row]).splitlines()[2], flush=True)
            del case
    ring.free()
    bench_comm.Free()
    if "gloo" in args.impls:
        from mpicomm.torchdist import shutdown_gloo

        shutdown_gloo(comm)
    if rank == 0:
        _summary(rows, say)
    meta = run_metadata("jobs.bench_collectives", argv, mpi=MPI.Get_library_version().splitlines()[0].strip(),
                        ranks=P, dtype=args.dtype, chunk_bytes=chunk, validate=not args.no_validate,
                        network=network, link_bps=link_bps)
    title = f"busbw vs size, {P} ranks, {' '.join(meta['mpi'].split())}"
    write_results(comm, args, meta, rows, lambda path: plot(rows, path, title), say)
    return 0


def describe_network() -> dict:
    """Where this run's traffic went: the emulated cluster's links, or unshaped on one host."""
    if os.environ.get("MPITRAIN_CLUSTER_IFACE"):
        from mpicomm.emulation import read_state

        state = read_state() or {}
        return dict(kind="emulated-cluster", hosts=state.get("hosts"), bandwidth_bps=state.get("bandwidth_bps"))
    return dict(kind="unshaped-local" if os.environ.get("MPITRAIN_UNSHAPED") else "local")


def _summary(rows, say) -> None:
    """Ring-vs-native busbw ratio per op at each size that has both."""
    by = {(r["op"], r["bytes"], r["impl"]): r for r in rows}
    pairs = [(op, b) for (op, b, impl) in by if impl == "ring" and (op, b, "native") in by]
    if pairs:
        say("\nring / native busbw:")
        for op, b in pairs:
            n = by[(op, b, "native")]["busbw_gbps"]
            ratio = by[(op, b, "ring")]["busbw_gbps"] / n if n else float("nan")
            say(f"  {op:<15}{b:>12}  {ratio:5.2f}x")


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before MPI starts
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
