"""Which allreduce algorithm a message takes: a name, or "auto" by size and layout (a measured table or a cost model)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from .doubling import doubling_steps
from .halving import halving_steps
from .hierarchical import pieces

__all__ = ["ALGORITHMS", "CHOICES", "ENV_ALGORITHM", "ENV_TABLE", "Layout", "Chooser", "CostModel", "read_table"]

ALGORITHMS = ("ring", "doubling", "rabenseifner", "hierarchical")
CHOICES = ("auto",) + ALGORITHMS
ENV_ALGORITHM = "MPITRAIN_ALLREDUCE"  # auto (default) or one of ALGORITHMS, for every rank alike
ENV_TABLE = "MPITRAIN_ALLREDUCE_TABLE"  # a JSON file `jobs.bench.collectives --choose` wrote


@dataclass(frozen=True)
class Layout:
    """P ranks on `nodes` nodes of `per_node` ranks each (mpicomm.Topology's)."""
    ranks: int
    nodes: int
    per_node: int

    @property
    def hierarchical(self) -> bool:
        """Both levels have more than one rank: otherwise the hierarchy is the flat ring."""
        return self.nodes > 1 and self.per_node > 1

    def describe(self) -> str:
        return f"{self.ranks} ranks = {self.nodes} nodes x {self.per_node}"


ENV_LINK = "MPITRAIN_LINK_BANDWIDTH"  # a node's link, e.g. 1gbit (hybcomm's cost model reads it too)
DEFAULT_LINK_BPS = 10e9
# A fused bucket (CostModel.fuse_size): 1 MiB up to 64 MiB (Horovod's fusion buffer), spending >= 95 % of
# its allreduce on bytes, and at least 8 buckets to a gradient.
FUSE_MIN, FUSE_MAX, FUSE_SHARE, FUSE_BUCKETS = 1 << 20, 64 << 20, 0.95, 8
# Within this share of the fastest modelled time the ring is taken. The model gives the ring and Rabenseifner
# the same bytes and parts them by a few latencies, which it cannot price to 2 %; what it leaves out favours the
# ring, which sums each chunk while the next travels and keeps one connection busy each way: pipelined
# Rabenseifner measured 1.08-1.09x the ring at 8-32 MiB on 4 hosts x 1 (benchmarks/claims.md, fourteenth pass).
RING_MARGIN = 0.02


def _fastest(times: dict[str, float]) -> str:
    """The algorithm of least modelled time, the ring where it is within RING_MARGIN of that."""
    best = min(times, key=times.get)
    return "ring" if "ring" in times and times["ring"] <= times[best] * (1 + RING_MARGIN) else best


@dataclass(frozen=True)
class CostModel:
    """An alpha-beta model of one allreduce: `alpha` seconds a message step, beta seconds a byte on a link.

    alpha and beta_node are this layer's on the 2-vCPU development VM (a
    step of Isend/Irecv with its Python and its reduction: ~70 us; shared
    memory with the sum: ~0.5 ns a byte, jobs.bench.collectives);
    beta_cross is a node's link ($MPITRAIN_LINK_BANDWIDTH, else 10 Gbit/s).
    A measured table (jobs.bench.collectives --choose) replaces the model on
    the layout it was taken on. Ranks of one node share its link, so what
    they send across it at once adds up.
    """
    alpha: float = 70e-6
    beta_cross: float = 8 / DEFAULT_LINK_BPS
    beta_node: float = 1 / 2e9

    @classmethod
    def measured(cls, topology) -> "CostModel":
        """From $MPITRAIN_LINK_BANDWIDTH, else, on several nodes, from the link measured once per process
        (mpicomm.link_probe, shared with p3's tuning; agreed by every rank): what a node's ranks push at once,
        and the time of one step of a small allreduce as alpha (8 ranks on 4 emulated hosts of this VM's 2
        cores: 0.1-0.2 ms; at 70 us the model sent 64 KiB through Rabenseifner's 4 cross-node steps, 1.5x
        slower there than doubling's 2). Below the default too: on 2 fake hosts x 2 a step takes 25-50 us, and
        with 70 us the model priced Rabenseifner's 4 steps above its whole call and took doubling at 256 KiB,
        1.22x slower (benchmarks/topology.md)."""
        from .agree import check_same_structure
        from .link_probe import measured_link

        # Whether to probe (a collective) follows the variable: every rank must see the same one.
        text = os.environ.get(ENV_LINK, "").strip()
        check_same_structure(topology.world, [f"${ENV_LINK}={text!r}"], "setting")
        if text or topology.num_nodes == 1:
            return cls.from_env()
        link = measured_link(topology.world)
        # The probe sends to every peer at once: (P-L)/(P-1) of a rank's bytes cross the link, which the
        # node's L ranks share.
        P, L = topology.size, topology.local_size
        return cls(alpha=link.step_time or cls.alpha, beta_cross=1 / (link.bandwidth * L * (P - L) / (P - 1)))

    @classmethod
    def for_algorithm(cls, topology, algorithm: str | None) -> "CostModel":
        """The model a Collectives of `algorithm` is given: auto and the hierarchy (its cross-node step's choice)
        get the measured link; the other named algorithms never ask it (the defaults, or the variable's rate).
        By the defaults, 10 Gbit/s and 70 us, the hierarchy took another cross-node algorithm on 4 hosts x 2 at
        1 Gbit/s, 1.45x slower at 256 KiB (benchmarks/topology.md)."""
        return cls.measured(topology) if algorithm in (None, "auto", "hierarchical") else cls.from_env()

    @classmethod
    def from_env(cls) -> "CostModel":
        text = os.environ.get(ENV_LINK, "").strip()
        if not text:
            return cls()
        from .emulation.netns import parse_bandwidth
        try:
            bps = parse_bandwidth(text)
        except ValueError as exc:
            raise ValueError(f"${ENV_LINK}={text!r}: {exc}") from None
        return cls(beta_cross=8 / bps) if bps else cls()

    def ring(self, n: float, lay: Layout) -> float:
        P = lay.ranks
        if P == 1:
            return 0.0
        # Placed node by node, one ring edge leaves each node: the cross edges are the slowest.
        beta = self.beta_cross if lay.nodes > 1 else self.beta_node
        return 2 * (P - 1) * (self.alpha + n / P * beta)

    def doubling(self, n: float, lay: Layout) -> float:
        P, L = lay.ranks, lay.per_node
        if P == 1:
            return 0.0
        m = P.bit_length() - 1
        t = 0.0
        for k in range(m):  # partners 2^k apart: inside the node while 2^k < L; then every local rank crosses
            t += self.alpha + n * (self.beta_node if (1 << k) < L else self.beta_cross * L)
        extra = doubling_steps(P) - m  # the fold and unfold, inside a node when nodes hold pairs
        return t + extra * (self.alpha + n * (self.beta_node if L > 1 else self.beta_cross))

    def rabenseifner(self, n: float, lay: Layout) -> float:
        P, L = lay.ranks, lay.per_node
        if P == 1:
            return 0.0
        m = P.bit_length() - 1
        p2 = 1 << m
        t = 0.0
        for k in range(m):  # halving: partners p2/2^(k+1) apart, halves of n/2^k; the doubling mirrors it
            d, msg = p2 >> (k + 1), n / (2 << k)
            t += 2 * (self.alpha + msg * (self.beta_node if d < L else self.beta_cross * L))
        extra = halving_steps(P) - 2 * m
        return t + extra * (self.alpha + n * (self.beta_node if L > 1 else self.beta_cross))

    def hierarchical(self, n: float, lay: Layout) -> float:
        N, L = lay.nodes, lay.per_node
        k = pieces(int(n))  # the runtime's split of a large message
        inner = 2 * (L - 1) * (self.alpha + n / k / L * self.beta_node)  # node reduce-scatter and allgather
        cross = min(self._cross(n / k, N).values())
        # k pieces in flight: one's node steps overlap another's cross-node steps. Each piece also pays one step's
        # time for the hand-off between its phases (the node's reduced block set up for the cross step): at 4 KiB
        # the hierarchy measured 0.39 ms against doubling's 0.23 on 2 fake hosts x 2 (one step more, ~0.08 ms
        # each), and 1.6-2.0 ms against 1.1 on 4 hosts x 2 (one more, ~0.2-0.3 ms); without it the model took the
        # hierarchy at 256 KiB on the fake hosts, 1.42x doubling (benchmarks/topology.md).
        return k * max(inner, cross) + min(inner, cross) + k * self.alpha

    def _cross(self, n: float, N: int) -> dict[str, float]:
        """The hierarchy's cross-node step: L cross groups of 1/L blocks at once share each node's link."""
        if N == 1:
            return {"ring": 0.0}
        m = N.bit_length() - 1
        fold = (halving_steps(N) - 2 * m) * (self.alpha + n * self.beta_cross)
        return {"ring": 2 * (N - 1) * (self.alpha + n / N * self.beta_cross),
                "doubling": doubling_steps(N) * (self.alpha + n * self.beta_cross),
                "rabenseifner": 2 * m * self.alpha + 2 * (1 - 1 / (1 << m)) * n * self.beta_cross + fold}

    def cross_algorithm(self, n: float, lay: Layout) -> str:
        """The algorithm of the hierarchy's cross-node step for (a piece of) `n` bytes (its block: n / L)."""
        return _fastest(self._cross(n, lay.nodes))

    def best(self, n: float, lay: Layout) -> str:
        times = {"ring": self.ring(n, lay), "doubling": self.doubling(n, lay), "rabenseifner": self.rabenseifner(n, lay)}
        if lay.hierarchical:
            times["hierarchical"] = self.hierarchical(n, lay)
        return _fastest(times)

    def time(self, n: float, lay: Layout, algorithm: str) -> float:
        """The modelled seconds of one allreduce of `n` bytes by `algorithm` (hierarchical: the flat ring where
        the layout has one level, as Chooser runs it)."""
        if algorithm == "hierarchical" and not lay.hierarchical:
            algorithm = "ring"
        return getattr(self, algorithm)(n, lay)

    def fuse_size(self, lay: Layout, choose=None, total: float | None = None, share: float = FUSE_SHARE) -> int:
        """Bytes a fused bucket should hold: the smallest of 1, 2, 4 ... 64 MiB whose allreduce spends at least
        `share` of its modelled time moving bytes (the rest, the per-step latencies, is paid once per bucket), and
        no more than 1/FUSE_BUCKETS of `total` (the gradient's bytes): where compute hides the exchange, only the
        last bucket's shows, so a few large buckets cost at most that share of it. Few nodes on a slow link keep
        1 MiB; many nodes or a fast link, whose steps cost more than a small bucket's bytes, get larger ones.
        choose: the algorithm per size (Chooser.choose; default best())."""
        choose = choose or (lambda n: self.best(float(n), lay))
        high = FUSE_MAX
        while total is not None and high > FUSE_MIN and high * FUSE_BUCKETS > total:
            high //= 2
        size = FUSE_MIN
        while size < high and lay.ranks > 1:
            how = choose(size)
            total_s = self.time(size, lay, how)
            if total_s <= 0 or replace(self, alpha=0.0).time(size, lay, how) >= share * total_s:
                break
            size *= 2
        return size


def read_table(path: str) -> dict:
    """A table `jobs.bench.collectives --choose` wrote: {"layout": {...}, "allreduce": [[below_bytes, name], ...]}."""
    try:
        with open(path) as f:
            doc = json.load(f)
        lay = Layout(**{k: int(doc["layout"][k]) for k in ("ranks", "nodes", "per_node")})
        rows = [(None if b is None else int(b), str(a)) for b, a in doc["allreduce"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path!r} is not an allreduce table from `jobs.bench.collectives --choose` "
                         f"({type(exc).__name__}: {exc})") from None
    bad = sorted({a for _, a in rows} - set(ALGORITHMS))
    if bad:
        raise ValueError(f"{path!r} names unknown algorithm(s) {bad} (known: {', '.join(ALGORITHMS)})")
    if not rows or rows[-1][0] is not None:
        raise ValueError(f"{path!r}: the last row must cover every larger size (below_bytes null)")
    return {"layout": lay, "rows": rows}


class Chooser:
    """Picks the algorithm of each allreduce from its size; identical on every rank for the same settings.

    algorithm: "auto" (default: $MPITRAIN_ALLREDUCE, else auto) or a name of
    ALGORITHMS. Auto follows a measured table ($MPITRAIN_ALLREDUCE_TABLE, or
    `table`) when it was measured on this layout, else the cost model.
    "hierarchical" on a layout without two levels is the flat ring (it would
    be the same messages).
    """

    def __init__(self, layout: Layout, algorithm: str | None = None, table: str | dict | None = None,
                 model: CostModel | None = None):
        algorithm = (algorithm or os.environ.get(ENV_ALGORITHM, "").strip() or "auto").lower()
        if algorithm not in CHOICES:
            raise ValueError(f"unknown allreduce algorithm {algorithm!r} (use one of {', '.join(CHOICES)}; "
                             f"${ENV_ALGORITHM} sets the default)")
        self.layout, self.algorithm, self.model = layout, algorithm, model or CostModel.from_env()
        table = os.environ.get(ENV_TABLE, "").strip() or None if table is None else table
        self.table_source = table if isinstance(table, str) else ("given" if table else None)
        self.table = read_table(table) if isinstance(table, str) else table
        self.table_applies = bool(self.table) and self.table["layout"] == layout
        self._cache: dict[int, str] = {}

    def choose(self, nbytes: int) -> str:
        got = self._cache.get(nbytes)
        if got is None:
            got = self._cache[nbytes] = self._choose(nbytes)
        return got

    def _choose(self, nbytes: int) -> str:
        if self.layout.ranks == 1:
            return "ring"
        name = self.algorithm
        if name == "auto":
            if self.table_applies:
                name = next(a for below, a in self.table["rows"] if below is None or nbytes < below)
            else:
                name = self.model.best(float(nbytes), self.layout)
        if name == "hierarchical" and not self.layout.hierarchical:
            return "ring"
        return name

    def describe(self) -> str:
        """What every rank must hold alike (checked when the collectives are built)."""
        if self.algorithm != "auto":
            return f"allreduce algorithm {self.algorithm}"
        if self.table_applies:
            return f"allreduce auto, table {self.table['rows']}"
        m = self.model
        return f"allreduce auto, cost model alpha={m.alpha:g} beta_cross={m.beta_cross:g} beta_node={m.beta_node:g}"

    def note(self) -> str | None:
        """Why a table given was not used (a benchmark of another layout), for logs."""
        if self.table and not self.table_applies:
            return (f"allreduce table {self.table_source} was measured on {self.table['layout'].describe()}, "
                    f"this run is {self.layout.describe()}: the cost model picks instead")
        return None

