"""The validation's calibration of the emulated cluster, and the cluster the simulator is then told about."""

from __future__ import annotations

import sys

__all__ = ["calibrate", "emulated_cluster", "for_hosts", "probe_links", "stream_efficiency"]


def calibrate(args) -> dict:
    """Microbenchmarks on the emulated cluster, for each even rank count of the grid (hosts of one rank; 2 where
    none is even): unshaped, the transport's own costs; at each bandwidth, the share of the line rate the ring's
    payload gets (headers, acknowledgements, the gaps between ring steps), the share a chain of streams gets
    (stream_efficiency: the pipelines'), and the CPU a byte costs at that rate, for the record: 4.2 ns at
    1 Gbit/s against 1.2 unshaped on this VM, most of it the waits polled while the link drains. The simulator
    charges the unshaped figure: the polled part is a share of the cores while waiting, not a cost per byte
    (charged per byte at 4.2 ns, 4 ranks' rings came within 3.5 % but 8 ranks on the same 2 cores read 35-81 %
    slow).

    The smallest count's figures are the document's top level (what any row falls back to); each count's own
    are under "hosts" (emulated_cluster takes them by a row's host count): on this VM's 2 cores the ring's
    payload got 0.96 of 1 Gbit/s between 4 emulated hosts and 0.93 between 8 (2026-12-05)."""
    from mpicomm.emulation import tcp_wmem_max

    counts = sorted({r for r in args.ranks if r % 2 == 0}) or [2]
    per = {n: _calibrate_hosts(args, n) for n in counts}
    # The machine's socket buffers go with its figures: the eager links' send buffer (emulated_cluster).
    return {**per[counts[0]], "tcp_wmem_max": tcp_wmem_max(),
            "hosts": {str(n): {k: v for k, v in c.items() if k != "raw"} for n, c in per.items()}}


def probe_links(hosts: int, bandwidth: str | None, timeout: float, burst: int | None = None) -> dict:
    """The transport probe's row (jobs.sim.worker transport) across `hosts` emulated hosts, one rank each, whose
    links run at `bandwidth` (None: unshaped) with a token bucket of `burst` bytes (None: the default)."""
    from jobs.common.cluster_sweep import rows_from
    from mpicomm.emulation import EmulatedCluster

    cmd = [sys.executable, "-m", "jobs.sim.worker", "transport"]
    with EmulatedCluster(hosts, bandwidth, burst=burst) as cluster:
        return rows_from(cluster.run(cmd, np=hosts, timeout=timeout, capture=True))[0]


def _calibrate_hosts(args, hosts: int) -> dict:
    from mpicomm.emulation import parse_bandwidth

    found = {}
    links = list(dict.fromkeys(args.bandwidths if args.carry_at is None else [args.carry_at]))
    for bw in ["none", *links]:
        print(f"# calibrating: {hosts} emulated hosts, {bw} ...", flush=True)
        found[bw] = probe_links(hosts, None if bw == "none" else bw, args.timeout)
    t = found["none"]
    efficiency = {bw: min(1.0, found[bw]["ring_rate"] * 8 / parse_bandwidth(bw)) for bw in links}
    return {"transport": {"rate": t["rate"], "cpu_per_byte": t["cpu_per_byte"], "latency": t["latency"],
                          "efficiency": 0.94}, "efficiency": efficiency, "stream_efficiency": stream_efficiency(found),
            "cpu_per_byte": {bw: found[bw]["cpu_per_byte"] for bw in links}, "raw": found}


def stream_efficiency(found: dict) -> dict:
    """{bandwidth: share of the line rate} that a stream of messages from each host to the next got (the transport
    probe's chain_rate: a pipeline's stages sending on; older calibrations: pairs of hosts exchanging, the probe's
    rate), where the ring's steps, waiting on each other, can get less (8 emulated hosts at 250 Mbit/s with the old
    64 KiB bucket: pairs 0.86, the ring 0.71-0.74, a pipeline's stream between two stages 0.96 in its timeline)."""
    from mpicomm.emulation import parse_bandwidth

    return {bw: min(1.0, f.get("chain_rate", f["rate"]) * 8 / parse_bandwidth(bw))
            for bw, f in found.items() if bw != "none"}


def for_hosts(cal: dict, hosts: int) -> dict:
    """The calibration taken between `hosts` emulated hosts, where it was; else the document's top level."""
    return cal.get("hosts", {}).get(str(hosts), cal)


def emulated_cluster(ranks: int, bandwidth: str, cal: dict, cores: float, nodes: int | None = None,
                     device: str = "cpu", streams: bool = False):
    """The emulated cluster as runtime.sim sees it: `nodes` hosts (default: one a rank) sharing this machine's
    cores, their transport as calibrated between that many hosts (else the calibration's top level), the socket
    send buffer of eager links as calibrated, the links' token bucket (tc tbf's burst); device gpu: the compute
    runs on an accelerator of each rank's (emulated compute), not on them. streams: the links' share of the line
    rate as a chain of streams got it (stream_efficiency: a pipeline's), not as the ring did, where calibrated."""
    from mpicomm.emulation import eager_send_buffer, link_burst, parse_bandwidth
    from runtime.sim import Cluster

    nodes = nodes or ranks
    wmem = cal.get("tcp_wmem_max")  # where the calibration was taken; older ones: this machine's
    top, cal = cal, for_hosts(cal, nodes)
    t = cal["transport"]
    bps = parse_bandwidth(bandwidth)
    efficiency = cal.get("efficiency", {}).get(bandwidth, t["efficiency"])
    if streams:  # older calibrations have the probe's rates at their top level's host count only
        same = cal is top or str(top.get("raw", {}).get("none", {}).get("ranks")) == str(nodes)
        found = cal.get("stream_efficiency") or (stream_efficiency(top["raw"]) if same and "raw" in top else {})
        efficiency = found.get(bandwidth, efficiency)
    return Cluster(nodes=nodes, ranks_per_node=ranks // nodes, bandwidth=bps if bps else 100e9, latency=t["latency"],
                   efficiency=efficiency, transport_rate=t["rate"],
                   cpu_per_byte=t["cpu_per_byte"], send_buffer=eager_send_buffer(bps, wmem),
                   burst=link_burst(bps) if bps else 0.0, shared_cores=cores, device=device)
