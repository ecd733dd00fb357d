"""Forward-only passes through the pipeline: loss and accuracy of the current weights on a data set."""

from __future__ import annotations

import numpy as np
import torch


def evaluate(pipe, inputs, targets, batch_size: int) -> dict:
    """{'loss', 'accuracy', 'count'} on every rank of `pipe`'s pipeline; inputs on the first stage, targets on the last.

    Batches go down the pipeline one after another, each stage's output sent
    as soon as it is computed; batch sizes follow from the sample count,
    which the first stage broadcasts. Accuracy: argmax over the last
    dimension against the targets (classes, or tokens for a language model).
    """
    layout = pipe.layout
    comm = layout.pipeline
    count = np.array([0], dtype=np.int64)
    if pipe.first:
        inputs = inputs[0] if isinstance(inputs, (tuple, list)) and len(inputs) == 1 else inputs
        count[0] = len(inputs)
    comm.Bcast(count, root=0)
    n = int(count[0])
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
    finally:
        pipe.module.train(was_training)
    totals[0], totals[1] = float(loss_sum), int(correct)
    comm.Bcast(totals, root=pipe.stages - 1)
    return dict(loss=totals[0] / max(1, n), accuracy=totals[1] / max(1, totals[2]), count=n)
