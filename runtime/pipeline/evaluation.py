"""Forward-only passes through the pipeline: loss and accuracy of the current weights on a data set."""

from __future__ import annotations

import numpy as np
import torch

from mpicomm.requests import abandon
from mpicomm.stall import wait_until


def evaluate(pipe, inputs, targets, batch_size: int) -> dict:
    """{'loss', 'accuracy', 'count'} on every rank of `pipe`'s pipeline; inputs on the first stage, targets on the last.

    Batches go down the pipeline one after another, each stage's output sent
    as soon as it is computed; batch sizes follow from the sample count,
    which the first stage broadcasts. Accuracy: argmax over the last
    dimension against the targets (classes, or tokens for a language model).
    """
    # Every rank posts both broadcasts, whatever fails where: one left unposted on a rank would stay posted on the
    # others for ever (MPI cannot cancel a collective). A first stage that cannot count its inputs sends -1.
    count = np.array([-1], dtype=np.int64)
    problem = None
    if pipe.first:
        inputs = inputs[0] if isinstance(inputs, (tuple, list)) and len(inputs) == 1 else inputs
        try:
            count[0] = len(inputs)
        except TypeError as exc:
            problem = TypeError(f"evaluate(): inputs must be a tensor on the first stage ({exc})")
    _broadcast(pipe, count, 0, "sample count")
    if problem is not None:
        raise problem
    n = int(count[0])
    if n < 0:
        raise ValueError("evaluate(): the first stage had no inputs to count (its error is its own)")
    if pipe.link is None or pipe._meta is None:
        raise RuntimeError("evaluate() needs the boundaries agreed by a first train_step")
    in_meta = pipe._meta[pipe.stage - 1] if not pipe.first else None
    totals = np.zeros(3)  # loss x samples, correct, targets scored
    # Summed where the outputs are (on a GPU: no host synchronisation per batch), read once at the end.
    loss_sum = torch.zeros((), dtype=torch.float64, device=pipe.device)
    correct = torch.zeros((), dtype=torch.int64, device=pipe.device)
    was_training = pipe.module.training
    pipe.module.eval()
    try:
        with torch.no_grad():
            for a in range(0, n, batch_size):
                b = min(n, a + batch_size)
                x = inputs[a:b].to(pipe.device) if pipe.first else \
                    pipe.link.recv_eval((b - a, *in_meta[0][1:]), in_meta[1])
                out = pipe.module(x)
                if not pipe.last:
                    pipe.link.send_eval(out)
                    continue
                y = targets[a:b].to(pipe.device)
                loss_sum += pipe.loss_fn(out, y).double() * (b - a)
                correct += (out.argmax(-1) == y).sum()
                totals[2] += y.numel()
        pipe.link.flush_sends()
    except BaseException:
        totals[:] = -1  # from the last stage: it failed (its failure notice follows)
        abandon(pipe.layout.pipeline.Ibcast(totals, root=pipe.stages - 1), "evaluate()", (totals,))  # joined
        raise
    finally:
        pipe.module.train(was_training)
    totals[0], totals[1] = float(loss_sum), int(correct)
    _broadcast(pipe, totals, pipe.stages - 1, "scores")
    if totals[2] < 0:  # the last stage failed after its batches: its notice, on its way, is raised here
        wait_until(lambda: False, what=f"stage {pipe.stage}: the last stage's failure notice", policy=pipe.policy,
                   interrupt=pipe._interrupt)
    return dict(loss=totals[0] / max(1, n), accuracy=totals[1] / max(1, totals[2]), count=n)


def _broadcast(pipe, buf: np.ndarray, root: int, what: str) -> None:
    """Bcast over the pipeline, waited as its other waits are: a peer's failure raises here (its beacon), where a
    blocking call would sit until fail-stop's watcher ended the rank."""
    request = pipe.layout.pipeline.Ibcast(buf, root=root)
    try:
        wait_until(request.Test, what=f"stage {pipe.stage}: evaluate()'s {what}", policy=pipe.policy,
                   interrupt=pipe._interrupt, report=lambda: f"stage {root} has not sent it (is it still running?)")
    except BaseException:
        abandon(request, "evaluate()", (buf,))  # MPI cannot cancel a collective: kept until the others post theirs
        raise
