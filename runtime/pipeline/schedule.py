"""The one-forward-one-backward (1F1B) order of each stage's work, across steps or drained every step."""

# Stage k of N first runs N - k - 1 forwards (warm-up), then alternates one
# forward and one backward (steady state), so it never holds more than N - k
# micro-batches in flight; at a flush it runs the backwards still owed
# (drain). Four stages, eight micro-batches, forward and backward one tick
# each, drained at the end (`diagram(4, 8)`; digits: micro-batch, F/B above):
#
#     stage 0 | F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 F7 B4 .. B5 .. B6 .. B7
#     stage 1 | .. F0 F1 F2 .. .. B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .. B6 .. B7 ..
#     stage 2 | .. .. F0 F1 .. B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .. B7 .. ..
#     stage 3 | .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .. .. ..
#
# Asynchronous modes never drain between steps: step t's forwards are
# micro-batches tM .. tM+M-1 on every stage, each followed by the backward of
# the micro-batch N - k - 1 places earlier, so the steady state carries over
# from one step to the next (PipeDream). `flush` drains every step
# (PipeDream-Flush, GPipe's synchronous semantics with 1F1B's memory).

from __future__ import annotations

from typing import Iterator

FORWARD, BACKWARD = "F", "B"


def warmup(stage: int, stages: int) -> int:
    """Forwards stage `stage` runs before its first backward: N - k - 1 (it then holds N - k micro-batches)."""
    return stages - stage - 1


def step_ops(stage: int, stages: int, first: int, count: int, base: int) -> Iterator[tuple[str, int]]:
    """Ops of one step: forwards of micro-batches first .. first+count-1, each followed by a backward owed.

    `base` is the first micro-batch since the pipeline was last empty: no
    backward before it is owed.
    """
    w = warmup(stage, stages)
    for i in range(first, first + count):
        yield FORWARD, i
        if i - w >= base:
            yield BACKWARD, i - w


def drain_ops(stage: int, stages: int, end: int, base: int) -> Iterator[tuple[str, int]]:
    """Backwards still owed once micro-batches base .. end-1 have all been forwarded."""
    for j in range(max(base, end - warmup(stage, stages)), end):
        yield BACKWARD, j


def ticks(stages: int, microbatches: int) -> list[dict[tuple[str, int], int]]:
    """Per stage, the tick at which each op of a drained step runs (each op one tick, messages instant).

    An op starts when its stage is free and its input exists: a forward after
    the previous stage's forward of that micro-batch, a backward after the next
    stage's backward (on the last stage, after its own forward). Raises if the
    order can never complete, which would be a deadlock.
    """
    orders = [list(step_ops(k, stages, 0, microbatches, 0)) + list(drain_ops(k, stages, microbatches, 0))
              for k in range(stages)]
    done: list[dict[tuple[str, int], int]] = [{} for _ in range(stages)]
    pos, free = [0] * stages, [0] * stages
    while any(p < len(o) for p, o in zip(pos, orders)):
        progressed = False
        for k in range(stages):
            if pos[k] == len(orders[k]):
                continue
            op, i = orders[k][pos[k]]
            if op == FORWARD:
                dep = None if k == 0 else done[k - 1].get((FORWARD, i), -1)
            else:
                dep = done[k].get((FORWARD, i), -1) if k == stages - 1 else done[k + 1].get((BACKWARD, i), -1)
            if dep == -1:
                continue
            start = max(free[k], 0 if dep is None else dep + 1)
            done[k][(op, i)] = start
            free[k] = start + 1
            pos[k] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"1F1B order deadlocks with {stages} stages and {microbatches} micro-batches")
    return done


def diagram(stages: int, microbatches: int) -> str:
    """ASCII picture of a drained step (the one in this module's opening comment)."""
    done = ticks(stages, microbatches)
    width = max(max(d.values()) for d in done) + 1
    rows = []
    for k, d in enumerate(done):
        cells = [".."] * width
        for (op, i), t in d.items():
            cells[t] = f"{op}{i}"
        rows.append(f"stage {k} | " + " ".join(c.ljust(2) for c in cells))
    return "\n".join(rows)
