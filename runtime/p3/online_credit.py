"""p3's credit chosen online: a few credits tried in turn over the first steps, the fastest kept (credit="online")."""

# No fixed credit serves every model and link (benchmarks/topology.md, "p3's credit at 128 x 8"): a
# communication-bound model wants enough slices in flight to keep the link busy, a compute-bound one wants
# few, so that the next forward's first slices are not queued behind them. ByteScheduler tunes its credit
# from the measured training speed, and Horovod's autotune its knobs; this is the same idea, kept simple and
# deterministic so that every rank takes the same decision without a message of its own:
#
#     step:    0 1 2 | 3 4 5 | 6 7 8 | 9 10 11 | 12 13 14 | 15 ... 23 | 24 25 26 | 27    | 28 ...
#     credit:  start | start | 2     | 4       | 8        | 8 4 2     | start    | start | the fastest
#              warm-up  trial blocks, HOLD steps each (start 16 here), reversed the second time
#                                                                                ^ the decision is not yet
#                                                                                  in on every rank
#
# The figure of step k is the time from step k-1's step() to step k's on the slowest rank, agreed in the
# step's own agreement round (mpicomm.step_check, MAX over ranks), so every rank sees the same figures.
# An interval counts for a candidate when both of its steps ran with it (a step's exchange lasts into the
# next forward): HOLD - 1 intervals a block. The fastest median wins; a candidate must beat the one
# before it in the order by more than TIE to replace it, so noise keeps the start credit.

from __future__ import annotations

import statistics

__all__ = ["CANDIDATES", "CreditTrials", "fastest"]

CANDIDATES = (2, 4, 8, 16)  # the simulator's sweep at 128 x 8: the best of these within 1 % of the best of 1-32
WARMUP = 3  # steps at the start credit first: allocation, the first forward's priorities, the link probe
HOLD = 3  # steps per trial block (HOLD - 1 clean intervals)
ROUNDS = 2  # every candidate tried this many times, the order reversed each round (drift cancels)
TIE = 0.01  # a candidate must be this much faster than the best so far to replace it


def fastest(figures: dict[int, list[float]], order: list[int], tie: float = TIE) -> int:
    """The credit of the lowest median step time; in `order`, a later one must be faster by more than `tie`."""
    best = None
    for credit in order:
        if not figures.get(credit):
            continue
        median = statistics.median(figures[credit])
        if best is None or median < best[1] * (1 - tie):
            best = (credit, median)
    if best is None:
        raise ValueError("no step time was recorded for any credit")
    return best[0]


class CreditTrials:
    """The credit of each step (a pure function of its index and the agreed figures) and the decision."""

    def __init__(self, start: int, candidates=CANDIDATES, warmup: int = WARMUP, hold: int = HOLD,
                 rounds: int = ROUNDS):
        if not isinstance(start, int) or start < 1:
            raise ValueError(f"the start credit must be an integer >= 1, got {start!r}")
        if hold < 2 or rounds < 1 or warmup < 1:
            raise ValueError(f"need hold >= 2, rounds >= 1, warmup >= 1; got {hold}, {rounds}, {warmup}")
        self.start, self.warmup, self.hold = start, warmup, hold
        # The start credit first: ties keep it (fastest's order).
        self.order = [start, *sorted(c for c in set(candidates) if c != start)]
        blocks = [self.order if r % 2 == 0 else self.order[::-1] for r in range(rounds)]
        self.schedule = [start] * warmup + [c for block in blocks for c in block for _ in range(hold)]
        self.figures: dict[int, list[float]] = {c: [] for c in self.order}
        self.seen: set[int] = set()
        self.chosen: int | None = None

    @property
    def last_trial(self) -> int:
        return len(self.schedule) - 1

    def credit_for(self, step: int) -> int:
        """The credit of step `step`'s exchange (0-based, one exchange a step)."""
        if step < len(self.schedule):
            return self.schedule[step]
        if step == len(self.schedule):
            # The last trial's figure comes with that step's agreement, which a rank may finish only at this
            # step's step(), after this step's exchange began: the start credit, on every rank alike.
            return self.start
        if self.chosen is None:
            raise RuntimeError(f"p3's online credit: step {step} needs the decision, but the figures of steps "
                               f"{sorted(set(range(1, len(self.schedule))) - self.seen)} never came")
        return self.chosen

    def observe(self, step: int, seconds: float) -> None:
        """Step `step`'s agreed figure: the time from step `step - 1`'s step() to its own (0: none)."""
        if self.chosen is not None or not 1 <= step <= self.last_trial:
            return
        self.seen.add(step)
        in_block = step - 1 >= self.warmup and \
            (step - 1 - self.warmup) // self.hold == (step - self.warmup) // self.hold  # both steps in one block
        if in_block and seconds > 0:
            self.figures[self.schedule[step]].append(seconds)
        if step == self.last_trial:  # no figure at all (no clock?): the start credit stays
            self.chosen = fastest(self.figures, self.order) if any(self.figures.values()) else self.start

    def describe(self) -> str:
        """'credit online: 2 1.234 s, 4 1.201 s, ...; chose 4' (medians of the clean intervals)."""
        parts = [f"{c} {statistics.median(v):.4g} s" if v else f"{c} -" for c, v in self.figures.items()]
        return f"credit online: {', '.join(parts)}; " + \
            (f"chose {self.chosen}" if self.chosen is not None else "trying")
