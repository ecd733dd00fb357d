"""A cluster on one machine: hosts in network namespaces with shaped links, and MPI jobs across them.

    mpitrain cluster up --hosts 4 --bandwidth 1gbit [--ranks-per-host 2] [--congestion-control cubic] [--verify]
    mpitrain cluster run [-n N] -- mpitrain bench collectives --sizes 64M
    mpitrain cluster status | verify | down
    mpitrain cluster exec 2 -- ip addr          # a plain command on host h2
    mpitrain cluster run --local -n 4 -- CMD    # no root: same job, unshaped, on this host

Needs root (ip netns, tc). Hosts h0..hN-1 get 10.213.0.1..N on a bridge in its
own namespace; each direction of each host's link is shaped with tbf. The root
namespace's interfaces are never touched. Errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from jobs.common.inputs import (InputError, JobParser, at_least, between, congestion_control_name, parse, positive,
                                runnable)


MTU = 1500  # the hosts' veths'; tbf stalls on a smaller bucket, so netns.tbf_args raises one to it


def parse_args(argv):
    p = JobParser(prog="python -m jobs.cluster", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="create the hosts and links")
    up.add_argument("--hosts", type=int, default=4, help="number of hosts (1..64, default 4)")
    up.add_argument("--bandwidth", default="1gbit", help="per-host link rate each way: 100mbit, 2.5gbit, none ...")
    up.add_argument("--ranks-per-host", type=int, default=1, help="MPI ranks per host for `run` (default 1)")
    up.add_argument("--netmod", choices=("ucx", "ofi"), help="MPICH network module (default: MPICH's choice)")
    up.add_argument("--burst", type=int, metavar="BYTES",
                    help="the links' token bucket, >= the MTU (1500) (default ~2 ms of traffic, at least 72 KiB: "
                         "a whole GSO packet)")
    up.add_argument("--congestion-control", metavar="NAME",
                    help="the hosts' TCP congestion control, cubic say (default: this machine's)")
    up.add_argument("--verify", action="store_true", help="measure every link after bringing it up")
    up.add_argument("--force", action="store_true", help="remove leftovers of a crashed run first")
    sub.add_parser("down", help="remove the hosts, links and every process in them")
    st = sub.add_parser("status", help="what is up, processes per host, bytes through each link")
    st.add_argument("--json", action="store_true")
    sub.add_parser("verify", help="measure every link (TCP stream and MPI ping-pong) vs configured")
    run = sub.add_parser("run", help="run an MPI job across the hosts: run [-n N] -- CMD ...")
    run.add_argument("-n", "--np", type=int, help="ranks (default hosts x ranks-per-host)")
    run.add_argument("--timeout", type=float, help="kill the job after this many seconds")
    run.add_argument("--local", action="store_true", help="no cluster: run on this host, unshaped")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    ex = sub.add_parser("exec", help="run a plain command on one host: exec HOST -- CMD ...")
    ex.add_argument("host", type=int)
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    return parse(p, argv, check_args)


def check_args(args) -> None:
    if args.action in ("run", "exec"):
        args.cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not args.cmd:
            raise InputError(args.action, "needs a command after --")
        runnable(args.action, args.cmd)  # same file system and PATH inside the hosts' namespaces
    if args.action == "run":
        at_least(args, 1, "np")
        positive(args, "timeout")
    if args.action == "exec" and args.host < 0:
        raise InputError("exec HOST", f"must be >= 0, got {args.host}")
    if args.action != "up":
        return
    at_least(args, 1, "ranks_per_host")
    if args.burst is not None and args.burst < MTU:  # the link would get max(MTU, burst), not what `up` reports
        raise InputError("--burst", f"{args.burst}: a bucket is a whole number of bytes >= the MTU ({MTU})")
    # Last: the cluster's own limits, from mpicomm (which imports torch and starts MPI).
    from mpicomm.emulation import EmulationError, parse_bandwidth
    from mpicomm.emulation.netns import MAX_HOSTS

    between(args, 1, MAX_HOSTS, "hosts")
    try:
        parse_bandwidth(args.bandwidth)
    except EmulationError as exc:
        raise InputError("--bandwidth", str(exc)) from None
    congestion_control_name(args)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpicomm.emulation import EmulatedCluster, EmulationError, run_local
    from mpicomm.emulation.verify import format_rows, verify

    try:
        if args.action == "up":
            if args.force:
                EmulatedCluster.down()
            cluster = EmulatedCluster(args.hosts, args.bandwidth, args.ranks_per_host, args.netmod, args.burst,
                                      args.congestion_control).up()
            bucket = f", a {cluster.burst}-byte bucket" if cluster.burst else ""
            print(f"up: {cluster.hosts} hosts (h0..h{cluster.hosts - 1}, 10.213.0.1..{cluster.hosts}) at "
                  f"{cluster.bandwidth} each way{bucket}, {cluster.ranks_per_host} rank(s) per host, "
                  f"TCP {cluster.congestion_control_in_effect or 'unknown'}")
            return _verify(cluster, verify, format_rows) if args.verify else 0
        if args.action == "down":
            removed = EmulatedCluster.down()
            if not removed:
                raise EmulationError("no emulated cluster is up (nothing to remove)")
            print(f"down: removed {' '.join(removed)}")
            return 0
        if args.action == "run" and args.local:
            return run_local(args.cmd, args.np or 4, args.timeout).returncode
        cluster = EmulatedCluster.current()
        if args.action == "status":
            st = cluster.status()
            if args.json:
                print(json.dumps(st, indent=1))
            else:
                bucket = f", a {st['burst_bytes']}-byte bucket" if st.get("burst_bytes") else ""
                print(f"{st['hosts']} hosts at {st['bandwidth']}{bucket}, {st['ranks_per_host']} rank(s) per host, "
                      f"TCP {st['congestion_control'] or 'unknown'}")
                for i in range(st["hosts"]):
                    ns, link = f"mpt-h{i}", st["link_bytes"][i]
                    traffic = f", sent {link['up']} B, received {link['down']} B" if link else ""
                    print(f"  h{i}: {st['processes'].get(ns, 0)} process(es){traffic}")
            return 0
        if args.action == "verify":
            return _verify(cluster, verify, format_rows)
        if args.action == "run":
            return cluster.run(args.cmd, np=args.np, timeout=args.timeout).returncode
        return cluster.exec_on(args.host, args.cmd).returncode
    except EmulationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _verify(cluster, verify, format_rows) -> int:
    rows = verify(cluster)
    print(format_rows(rows))
    ok = all(r["stream_ok"] and r["mpi_ok"] for r in rows)
    if not ok:
        print("warning: some links are more than 10 % off their configured rate", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
