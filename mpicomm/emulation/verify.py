"""Measure every link of an emulated cluster (TCP stream and MPI ping-pong) against its configured rate."""

from __future__ import annotations

import json
import subprocess
import sys

from . import netns
from .cluster import EmulatedCluster
from .netns import EmulationError

PROBE_PORT = 5917
TOLERANCE = 0.10


def stream(cluster: EmulatedCluster, src: int, dst: int, seconds: float = 1.5) -> float:
    """bits/s of one TCP stream from host src to host dst, as counted by the receiver."""
    py = sys.executable
    server = subprocess.Popen(
        netns.in_ns(netns.host_ns(dst), py, "-m", "mpicomm.emulation.probe", "serve",
                    "--bind", netns.host_addr(dst), "--port", str(PROBE_PORT), "--wait", str(seconds + 20)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        server.stderr.readline()  # "ready": listening, so the sender's first connect succeeds
        cluster.exec_on(src, [py, "-m", "mpicomm.emulation.probe", "send", "--to", netns.host_addr(dst),
                              "--port", str(PROBE_PORT), "--seconds", str(seconds)],
                        timeout=seconds + 30, capture=True)
        out, err = server.communicate(timeout=seconds + 30)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    if server.returncode:
        raise EmulationError(f"stream probe h{src}->h{dst} failed: {err.strip()}")
    return json.loads(out.strip().splitlines()[-1])["bps"]


def pingpong(cluster: EmulatedCluster, size: int, reps: int, timeout: float = 300) -> list[dict]:
    """One-way MPI rates over links h0-h1, h1-h2, ... (one rank per host)."""
    proc = cluster.run([sys.executable, "-m", "mpicomm.emulation.pingpong", "--size", str(size),
                        "--reps", str(reps)], ranks_per_host=1, timeout=timeout, capture=True)
    if proc.returncode:
        raise EmulationError(f"MPI ping-pong failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pingpong_size(bps: int | None) -> int:
    """~50 ms of traffic per message: long enough to hide latency, short enough to be quick."""
    if bps is None:
        return 64 << 20
    return int(min(64 << 20, max(1 << 20, bps / 8 * 0.05)))


def verify(cluster: EmulatedCluster, seconds: float = 1.5, reps: int = 5) -> list[dict]:
    """A row per link: configured rate, stream and MPI measurements, and whether each is within 10 %."""
    if cluster.hosts < 2:
        raise EmulationError("verification needs at least 2 hosts")
    links = [(i, (i + 1) % cluster.hosts) for i in range(cluster.hosts if cluster.hosts > 2 else 1)]
    mpi = {(r["src"], r["dst"]): r["bps"] for r in pingpong(cluster, pingpong_size(cluster.bps), reps)}
    rows = []
    for a, b in links:
        row = dict(link=f"h{a}->h{b}", configured_bps=cluster.bps, stream_bps=stream(cluster, a, b, seconds),
                   mpi_bps=mpi.get((a, b)))
        for kind in ("stream", "mpi"):
            got = row[f"{kind}_bps"]
            row[f"{kind}_ok"] = (cluster.bps is None or got is None
                                 or abs(got - cluster.bps) <= TOLERANCE * cluster.bps)
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    def rate(bps):
        return "-" if bps is None else f"{bps / 1e6:9.1f}"
    lines = [f"{'link':<10}{'configured Mbit/s':>19}{'stream Mbit/s':>15}{'MPI Mbit/s':>12}  within 10%"]
    for r in rows:
        ok = "yes" if r["stream_ok"] and r["mpi_ok"] else "NO"
        lines.append(f"{r['link']:<10}{rate(r['configured_bps']):>19}{rate(r['stream_bps']):>15}"
                     f"{rate(r['mpi_bps']):>12}  {ok}")
    return "\n".join(lines)

