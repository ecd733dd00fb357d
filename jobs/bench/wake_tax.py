"""The host CPU a step's thinnest possible work costs after the host idled: the floor under an emulated step's host share."""

from __future__ import annotations

import statistics
import time

__all__ = ["IDLES_MS", "floor_rows", "format_floor"]

IDLES_MS = (0.0, 1.0, 5.0, 20.0)  # how long the host sleeps before the work: none, a short layer, a step's forward, a step


def _empty():
    """Nothing between two clock reads: the cost of waking alone."""


def _bare_step():
    """The least autograd a training step can run: one torch.autograd.Function forward, one loss node, backward()."""
    import torch

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.zeros(()).expand(32, 1000)

        @staticmethod
        def backward(ctx, grad):
            return torch.zeros(())

    class Loss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out):
            return torch.zeros(())

        @staticmethod
        def backward(ctx, grad):
            return torch.zeros(()).expand(32, 1000)

    leaf = torch.zeros((), requires_grad=True)

    def step():
        Loss.apply(Node.apply(leaf)).backward()
    return step


def _emulated_step():
    """An emulated step of the thinnest model (one Linear unit, no modelled time): zero_grad, forward, loss,
    backward and the optimizer's step, through runtime.emulate as a paper model's steps go."""
    import torch

    from runtime.emulate import accelerator, emulate, emulate_optimizer, emulated_loss

    accelerator.deactivate()
    model = torch.nn.Sequential(torch.nn.Linear(1, 1))
    x = torch.zeros(1, 1)
    emulate(model, "v100", (x,), times=[(0.0, 0.0)])
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    def step():
        opt.zero_grad()
        emulated_loss(model(x)).backward()
        opt.step()
    step.model = model
    return step


WORKS = (("empty interval", lambda: _empty), ("bare torch step", _bare_step), ("emulated step", _emulated_step))


def floor_rows(idles_ms=IDLES_MS, repeats: int = 40) -> list[dict]:
    """For each idle length and each work: the median thread CPU of the work right after sleeping that long.

    The works are interleaved within each repeat, so that a change in the machine's load moves all alike; at idle
    0 each runs twice in a row and the second is timed (warm).
    Thread CPU (time.thread_time): the work's own, not the sleep's. The shortest step whose host work can stay
    within 2 % of its modelled compute is the emulated step's figure / 0.02.
    """
    from runtime.emulate import accelerator

    works = [(name, make()) for name, make in WORKS]
    for _, work in works:  # warm: the first call builds what later calls reuse
        work()
    cpu = {(idle, name): [] for idle in idles_ms for name, _ in works}
    for _ in range(repeats):
        for idle in idles_ms:
            for name, work in works:
                if idle:
                    time.sleep(idle / 1e3)
                else:  # idle 0: warm, the same work just ran
                    work()
                t0 = time.thread_time()
                work()
                cpu[idle, name].append(time.thread_time() - t0)
    accelerator.deactivate()
    rows = []
    for idle in idles_ms:
        for name, _ in works:
            us = statistics.median(cpu[idle, name]) * 1e6
            rows.append(dict(table="floor", idle_ms=idle, work=name, cpu_us=us, repeats=repeats,
                             shortest_step_at_2pct_ms=us / 0.02 / 1e3))
    return rows


def format_floor(rows) -> str:
    rows = [r for r in rows if r["table"] == "floor"]
    if not rows:
        return ""
    out = ["| host idle before, ms | work | host CPU, us (median) | shortest step within 2 %, ms |",
           "|---:|---|---:|---:|"]
    out += [f"| {r['idle_ms']:g} | {r['work']} | {r['cpu_us']:.1f} | {r['shortest_step_at_2pct_ms']:.2f} |"
            for r in rows]
    return "\n".join(out)
