r"""Benchmark: the emulated links themselves, at each rate and token bucket (as root).

    mpitrain bench links --hosts 8 --bandwidths 100mbit,250mbit --bursts default,65536,70000 --rounds 2 \
        --json benchmarks/cluster/links-buckets.json

For every round and every (bandwidth, bucket), an emulated cluster of --hosts hosts comes up with that
link (`mpitrain cluster up --bandwidth B --burst N`; "default": netns.link_burst's) and runs the simulator's
transport probe (jobs.sim.worker transport, the validation's calibration): the share of the line rate that
pairs of hosts exchanging, the ring allreduce and a chain of streams from each host to the next get, the
share a host's two streams out get when the chain runs both ways (two-way: a middle host's acknowledgements
then queue behind the data coming in from both neighbours, as in a pipeline's 1F1B), and a small message's
one-way latency. The configurations are interleaved, in reverse order every other round, so
that a change in the machine's load moves all alike. Prints a table of medians with each round's figure;
writes the rows to --json and a PNG of the ring's and the chain's shares (and the latency) per
configuration, the machine in the table's and the figure's title and the JSON's meta. No model compute: links
and MPI alone. The rounds so far are kept beside --json (PATH.partial.json) while it runs; a probe that fails
(a timeout, a worker's error) ends it with one error line, the rounds measured written (meta: incomplete,
failed_runs) and exit 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from jobs.common.inputs import InputError, JobParser, add_run_arguments, between, bench_outputs, comma_list, parse
from jobs.common.cluster_sweep import exit_status, incomplete_meta, keep_partial
from jobs.common.outputs import write_results
from jobs.common.report import machine, machine_line, run_metadata, save_figure

__all__ = ["main", "markdown", "summarise"]

SHARES = (("pair", "rate"), ("ring", "ring_rate"), ("chain", "chain_rate"), ("two_way", "chain2_rate"))


def streams_out(name: str, hosts: int) -> int:
    """A host's streams out that a probe's figure (one stream's rate) stands for: a two-way chain's middle hosts
    send two (with 2 hosts there is no middle: one); every other probe's, one."""
    return min(2, hosts - 1) if name == "two_way" else 1


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.links", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--hosts", type=int, default=8, help="emulated hosts, one rank each (default 8)")
    p.add_argument("--bandwidths", default="100mbit,250mbit,1gbit", help="link rates (default %(default)s)")
    p.add_argument("--bursts", default="default", help="token buckets in bytes, or default (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over every configuration (default 2)")
    add_run_arguments(p)
    return parse(p, argv, check_args)


def check_args(args) -> None:
    from mpicomm.emulation import EmulationError, parse_bandwidth
    from mpicomm.emulation.netns import MAX_HOSTS

    if args.local:
        raise InputError("--local", "the links are what this benchmark measures: it needs the emulated cluster")
    bench_outputs(args)
    between(args, 2, MAX_HOSTS, "hosts")
    between(args, 1, 100, "rounds")
    args.bandwidths = comma_list("--bandwidths", args.bandwidths)
    for bw in args.bandwidths:
        try:
            if parse_bandwidth(bw) is None:
                raise InputError("--bandwidths", "none has no token bucket: give link rates")
        except EmulationError as exc:
            raise InputError("--bandwidths", str(exc)) from None

    def burst(text: str):
        if text == "default":
            return None
        if not text.isdigit() or int(text) < 1500:
            raise ValueError("a bucket is default or a whole number of bytes >= the MTU (1500)")
        return int(text)
    args.bursts = comma_list("--bursts", args.bursts, parse=burst)


def measure(hosts: int, bandwidth: str, burst: int | None, timeout: float) -> dict:
    """One configuration's probe (the validation's calibration's, jobs.sim.calibration.probe_links), as shares."""
    from jobs.sim.calibration import probe_links
    from mpicomm.emulation import link_burst, parse_bandwidth

    row = probe_links(hosts, bandwidth, timeout, burst)
    bps = parse_bandwidth(bandwidth)
    bytes_per_s = bps / 8
    return {"bandwidth": bandwidth, "burst": "default" if burst is None else burst,
            "burst_bytes": link_burst(bps) if burst is None else burst,
            **{name: streams_out(name, hosts) * row[key] / bytes_per_s for name, key in SHARES},
            "latency_s": row["latency"]}


def summarise(runs: list[dict]) -> list[dict]:
    """One row per (bandwidth, bucket), in first-seen order: each figure's median and its rounds' values."""
    rows = []
    for key in dict.fromkeys((r["bandwidth"], r["burst"]) for r in runs):
        mine = [r for r in runs if (r["bandwidth"], r["burst"]) == key]
        row = {"bandwidth": key[0], "burst": key[1], "burst_bytes": mine[0]["burst_bytes"], "rounds": len(mine)}
        for name in [n for n, _ in SHARES] + ["latency_s"]:
            row[name] = statistics.median(r[name] for r in mine)
            row[f"{name}_rounds"] = [r[name] for r in mine]
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| link | bucket, bytes | pairs ÷ rate | ring ÷ rate | chain ÷ rate | two-way chain ÷ rate | latency, us "
            "| rounds (ring) |\n|---|---:|---:|---:|---:|---:|---:|---|")
    body = [f"| {r['bandwidth']} | {r['burst_bytes']}{' (default)' if r['burst'] == 'default' else ''} | "
            f"{r['pair']:.3f} | {r['ring']:.3f} | {r['chain']:.3f} | {r['two_way']:.3f} | {r['latency_s'] * 1e6:.0f} | "
            f"{', '.join(f'{v:.3f}' for v in r['ring_rounds'])} |" for r in rows]
    return "\n".join([head, *body])


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['bandwidth']}\n{r['burst_bytes']} B" for r in rows]
    x = range(len(rows))
    fig, (share, lat) = plt.subplots(1, 2, figsize=(max(7.0, 1.6 * len(rows)), 3.8))
    width = 0.8 / len(SHARES)
    for i, (name, _) in enumerate(SHARES):
        share.bar([j + (i - (len(SHARES) - 1) / 2) * width for j in x], [r[name] for r in rows], width=width,
                  label=name.replace("_", "-"))
    share.set_ylabel("share of the line rate")
    share.set_ylim(0, 1.05)
    lat.bar(list(x), [r["latency_s"] * 1e6 for r in rows])
    lat.set_ylabel("small message latency, us")
    for ax in (share, lat):
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    share.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    from mpicomm.emulation import EmulationError

    args = parse_args(argv)
    configs = [(bw, b) for bw in args.bandwidths for b in args.bursts]
    runs, failed = [], []
    try:
        for rnd in range(args.rounds):
            for bw, b in configs if rnd % 2 == 0 else configs[::-1]:
                run = f"round {rnd + 1}/{args.rounds}: {args.hosts} hosts at {bw}, bucket {b or 'default'}"
                print(f"# {run} ...", flush=True)
                runs.append(measure(args.hosts, bw, b, args.timeout))
                keep_partial(args, runs)  # a kill from outside loses only the probe it was in
    except (EmulationError, RuntimeError) as exc:  # a timeout, a worker's error: the rounds so far are kept
        print(f"error: {exc}", file=sys.stderr)
        failed = [dict(run=run, error=str(exc).strip()[-500:])]
    finally:
        keep_partial(args, None)
    if not runs:
        return 1
    rows = summarise(runs)
    title = "\n".join(filter(None, [
        f"INCOMPLETE: {failed[0]['run']} failed" if failed else "",
        f"emulated links, {args.hosts} hosts, no model compute, medians of {args.rounds} rounds",
        machine_line(machine())]))
    print(f"\n{title}\n" + markdown(rows))
    meta = run_metadata("jobs.bench.links", argv, hosts=args.hosts, compute="none (links and MPI alone)",
                        machine=machine(), **incomplete_meta(failed))
    write_results(None, args, meta, rows, lambda path: plot(rows, path, title))
    return exit_status(failed)


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
