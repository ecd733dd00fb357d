"""--carry-at RATE: a bandwidth run on links of RATE with emulated compute slowed alike, reported at the bandwidth.

A step's time is its compute and its communication (and how they overlap). Links B/RATE times slower
and compute B/RATE times slower stretch the whole step by B/RATE, so the figures at B are the
stretched run's times divided by B/RATE: rates the shaper and the host cannot reach (10 Gbit/s on a
small machine, whose CPUs move bytes no faster than a few Gbit/s) are measured at one they can.
What does not stretch: the host's own work per step (Python, autograd, copies into buffers) and
fixed latencies, which the stretched run shrinks B/RATE-fold when reported at B; and what is tuned
from the link measured at start-up (p3's auto slice and credit) is tuned for RATE.
"""

from __future__ import annotations

from jobs.common.inputs import InputError


def add_carry_argument(p) -> None:
    p.add_argument("--carry-at", metavar="RATE",
                   help="emulated compute only: run every --bandwidths B on links of RATE with the compute scaled by "
                        "B/RATE (--compute-scale times that), and report the figures at B (times divided by B/RATE, "
                        "samples/s multiplied): e.g. --bandwidths 10gbit --carry-at 1gbit")


def check_carry(args) -> None:
    """--carry-at needs emulated compute and shaped links of a rate; args.carry_at_bps set (None without it).

    After cluster_bench_outputs, which made args.bandwidths a list.
    """
    args.carry_at_bps = None
    if args.carry_at is None:
        return
    if args.compute == "real":
        raise InputError("--carry-at", "scales the compute with the links: it needs --compute emulated:DEVICE")
    if args.local:
        raise InputError("--carry-at", "--local runs unshaped, with no links to carry at: drop one of them")
    from mpicomm.emulation import EmulationError, parse_bandwidth

    try:
        args.carry_at_bps = parse_bandwidth(args.carry_at)
    except EmulationError as exc:
        raise InputError("--carry-at", str(exc)) from None
    if args.carry_at_bps is None:
        raise InputError("--carry-at", f"{args.carry_at!r}: give a rate (examples: 1gbit, 2.5gbit)")
    unshaped = [bw for bw in args.bandwidths if parse_bandwidth(bw) is None]
    if unshaped:
        raise InputError("--carry-at", f"--bandwidths {unshaped[0]} is unshaped: no compute scale carries it")


def factor(args, bandwidth: str) -> float:
    """How many times faster the asked bandwidth is than the links it runs on (1 without --carry-at)."""
    if getattr(args, "carry_at_bps", None) is None:
        return 1.0
    from mpicomm.emulation import parse_bandwidth

    return parse_bandwidth(bandwidth) / args.carry_at_bps


def links(args, bandwidth: str) -> str:
    """The rate the links are shaped to for an asked bandwidth."""
    return bandwidth if getattr(args, "carry_at_bps", None) is None else args.carry_at


def carried_at(args, bandwidth: str) -> str | None:
    """`1 Gbit/s links, compute x10` (the scale over --compute-scale): how a row was measured; None if as asked."""
    if getattr(args, "carry_at_bps", None) is None:
        return None
    return f"{rate_text(args.carry_at_bps)} links, compute x{factor(args, bandwidth):g}"


def rate_text(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def title_line(args) -> str:
    """The table's line for a carried sweep; "" otherwise."""
    if getattr(args, "carry_at_bps", None) is None:
        return ""
    return (f"carried at {rate_text(args.carry_at_bps)} links: each bandwidth B ran on them with the compute scaled by "
            f"B / {rate_text(args.carry_at_bps)}; times divided and samples/s multiplied by that factor (reported at "
            "B), CPU-seconds per step and bytes as measured")


def scaled(value, fn):
    """fn of a figure, or of each in a list or dict of them (CIs, rounds, parts); None stays None."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: scaled(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scaled(v, fn) for v in value]
    return fn(value)


def report_at(args, rows: list[dict], bandwidth: str, times: tuple[str, ...], rates: tuple[str, ...]) -> None:
    """Rows of a carried run as at `bandwidth`, in place: `times` keys divided, `rates` keys multiplied by the
    factor; carried_at, carry_factor and carried_links added (None, 1 and the bandwidth when not carried)."""
    f = factor(args, bandwidth)
    for row in rows:
        for key in times:
            row[key] = scaled(row.get(key), lambda t: t / f)
        for key in rates:
            row[key] = scaled(row.get(key), lambda r: r * f)
        row.update(carried_at=carried_at(args, bandwidth), carry_factor=f, carried_links=links(args, bandwidth))
