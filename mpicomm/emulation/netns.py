"""Hosts as Linux network namespaces on a bridge, with tbf-shaped links; never touches the root namespace."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

PREFIX = "mpt-"
BRIDGE_NS = PREFIX + "br"
SUBNET = "10.213.0"  # private, and it exists only inside our namespaces
IFACE = "eth0"
MAX_HOSTS = 64
CC_SYSCTL = "/proc/sys/net/ipv4/tcp_congestion_control"  # per namespace; a new one takes the root namespace's
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


class EmulationError(RuntimeError):
    """Building, using or removing the emulated cluster failed; the message says what to do."""


def host_ns(i: int) -> str:
    return f"{PREFIX}h{i}"


def host_addr(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def parse_bandwidth(text: str) -> int | None:
    """'100mbit', '2.5gbit', '1g', '500M' -> bits per second; 'none'/'unshaped' -> None."""
    t = str(text).strip().lower()
    if t in ("none", "unshaped", "unlimited"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(?:bit|bps|b)?(?:/s)?", t)
    if not m:
        raise EmulationError(f"cannot parse bandwidth {text!r} (examples: 100mbit, 1gbit, 2.5gbit, 10gbit, none)")
    bps = int(float(m.group(1)) * _UNITS[m.group(2)])
    if not 10**5 <= bps <= 10**11:
        raise EmulationError(f"bandwidth {text!r} is outside 100kbit..100gbit")
    return bps


def format_bandwidth(bps: int | None) -> str:
    if bps is None:
        return "unshaped"
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps}bit"


def run(cmd: list[str], timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise EmulationError(f"timed out after {timeout}s: {' '.join(cmd)}") from None
    except FileNotFoundError:
        raise EmulationError(f"{cmd[0]} not found: install iproute2") from None
    if check and proc.returncode:
        raise EmulationError(f"{' '.join(cmd)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def in_ns(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def congestion_control(ns: str | None = None) -> str | None:
    """The TCP congestion control that new connections take in namespace `ns` (None: this process's); None where
    it cannot be read."""
    if ns is None:
        try:
            with open(CC_SYSCTL) as f:
                return f.read().strip() or None
        except OSError:
            return None
    proc = run(in_ns(ns, "cat", CC_SYSCTL), check=False)
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def check_congestion_control(name) -> None:
    """An error unless `name` can name a kernel congestion control (whether the kernel has it, it says later)."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_]{1,15}", name):
        raise EmulationError(f"congestion control must be a kernel algorithm's name (cubic, bbr, reno ...), "
                             f"got {name!r}")


def set_congestion_control(ns: str, name: str) -> None:
    """New TCP connections in `ns` use `name`. The kernel lets a namespace other than the root one take only the
    algorithms the root namespace allows (net.ipv4.tcp_allowed_congestion_control), which this module never
    changes: the error says how."""
    proc = run(in_ns(ns, "sh", "-c", f'printf %s "$1" > {CC_SYSCTL}', "sh", name), check=False)
    if proc.returncode:
        allowed = " ".join(kernel_congestion_controls("allowed")) or "none"
        raise EmulationError(
            f"TCP congestion control {name!r} cannot be set in the emulated hosts: the kernel has "
            f"{' '.join(kernel_congestion_controls('available')) or 'none'}, and lets namespaces take {allowed}; "
            f"allow it first (as root: sysctl -w net.ipv4.tcp_allowed_congestion_control=\"{allowed} {name}\", "
            f"after `modprobe tcp_{name}` if the kernel does not have it)")


def kernel_congestion_controls(kind: str = "allowed") -> list[str]:
    """The congestion controls the kernel has ("available") or lets namespaces take ("allowed"), as the root
    namespace lists them; [] where unreadable."""
    try:
        with open(f"/proc/sys/net/ipv4/tcp_{kind}_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


def our_namespaces() -> list[str]:
    out = run(["ip", "netns", "list"]).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith(PREFIX))


def why_not() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return ("the emulated cluster needs root (network namespaces and tc); fallback: run the job "
                "unshaped on this host with `python -m jobs.cluster run --local -- CMD` (results marked unshaped)")
    path = os.environ.get("PATH", "").split(":") + ["/usr/sbin", "/sbin"]
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if not any(os.access(os.path.join(d, tool), os.X_OK) for d in path):
            return f"{tool} not found: install {package}"
    return None


def tbf_args(bps: int, mtu: int = 1500, burst: int | None = None) -> list[str]:
    """tbf parameters for `bps`: the bucket holds ~2 ms of traffic, never less than a whole GSO packet (or `burst`
    bytes: link_burst).

    tbf stalls if burst < MTU, and a bucket much smaller than rate/HZ cannot
    reach the rate at all (10 Gbit/s needs ~2.5 MB); latency caps the queue.
    A full bucket lets its bytes through at the veth's speed: at 1 Gbit/s a
    message of up to ~250 kB that follows an idle moment crosses without
    paying the rate, which a NIC's serialisation would charge. A 16 kB bucket
    charges it, but TCP then moves 0.92 Gbit/s and MPI 0.68-0.76
    (benchmarks/topology.md): not the default.
    """
    burst = link_burst(bps, mtu) if burst is None else max(mtu, burst)
    return ["tbf", "rate", f"{bps}bit", "burst", str(burst), "latency", "50ms"]


# The least bucket that passes TCP's largest packet whole: a 64 KiB GSO packet as a qdisc counts it, every one of
# its ~45 segments' headers added (the kernel's qdisc_pkt_len_init), is ~68.5 kB.
GSO_BUCKET = 72 * 1024


def link_burst(bps: int, mtu: int = 1500) -> int:
    """The bytes an emulated link's token bucket holds by default (tbf_args): ~2 ms at the rate, at least
    GSO_BUCKET and an MTU.

    tbf cuts a packet larger than its bucket into segments. With a bucket of 64 KiB (the floor until 2026-12-05)
    or 67 kB the ring between 8 hosts got 0.57-0.63 of 250 Mbit/s and a small message 0.4-2 ms; with 70 kB, 0.90
    and 51 us (benchmarks/cluster.md)."""
    return max(GSO_BUCKET, mtu, int(bps) // 8 // 500)


def build(hosts: int, bps: int | None, burst: int | None = None, congestion_control: str | None = None) -> None:
    """Create the bridge namespace and `hosts` host namespaces, each joined by a shaped veth pair.

    Each host's eth0 egress is its upload; the bridge-side peer's egress is
    its download, so both directions are shaped without an ifb device. The
    hosts' TCP takes `congestion_control` (None: the root namespace's, which a
    new namespace inherits). On any failure everything made so far is removed
    again.
    """
    if not 1 <= hosts <= MAX_HOSTS:
        raise EmulationError(f"--hosts must be between 1 and {MAX_HOSTS}, got {hosts}")
    try:
        run(["ip", "netns", "add", BRIDGE_NS])
        run(["ip", "-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge"])
        run(["ip", "-n", BRIDGE_NS, "link", "set", "br0", "up"])
        for i in range(hosts):
            ns, port = host_ns(i), f"vh{i}"
            run(["ip", "netns", "add", ns])
            # Created inside the bridge namespace with the peer placed straight into the host:
            # no interface ever exists in the root namespace.
            run(["ip", "-n", BRIDGE_NS, "link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", ns])
            run(["ip", "-n", BRIDGE_NS, "link", "set", port, "master", "br0", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{host_addr(i)}/24", "dev", IFACE])
            run(["ip", "-n", ns, "link", "set", IFACE, "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if congestion_control is not None:
                set_congestion_control(ns, congestion_control)
            if bps is not None:
                run(in_ns(ns, "tc", "qdisc", "add", "dev", IFACE, "root", *tbf_args(bps, burst=burst)))
                run(in_ns(BRIDGE_NS, "tc", "qdisc", "add", "dev", port, "root", *tbf_args(bps, burst=burst)))
    except BaseException:
        teardown()
        raise


def processes_in(ns: str) -> list[int]:
    out = run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def teardown(grace_s: float = 3.0) -> list[str]:
    """Stop every process inside our namespaces and delete the namespaces; returns what was removed.

    Deleting a namespace deletes its veth ends (and so their qdiscs) with it.
    """
    names = our_namespaces()
    pids = {p for ns in names for p in processes_in(ns)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if os.path.exists(f"/proc/{p}")}
            time.sleep(0.05)
        if not pids:
            break
    for ns in names:
        run(["ip", "netns", "del", ns], check=False)
    left = our_namespaces()
    if left:
        raise EmulationError(f"could not delete namespaces {left}: remove them with `ip netns del`")
    return names


def qdisc_bytes(i: int) -> dict:
    """Bytes sent through host i's shaped upload and download so far (from `tc -s`)."""
    def sent(cmd):
        m = re.search(r"Sent (\d+) bytes", run(cmd, check=False).stdout)
        return int(m.group(1)) if m else 0
    return dict(up=sent(in_ns(host_ns(i), "tc", "-s", "qdisc", "show", "dev", IFACE)),
                down=sent(in_ns(BRIDGE_NS, "tc", "-s", "qdisc", "show", "dev", f"vh{i}")))
