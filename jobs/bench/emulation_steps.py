"""jobs.bench.emulation's step table: one rank's emulated steps per hook variant and compute scale, interleaved.

Every variant of a model and device (the hooks, the compute scales) is built first, each with its own emulated
accelerator; then --repeats rounds each run one block of --steps steps of every variant, in an order rotated
every round and reversed every other, so that a change in the machine's load (another process, a CPU's clock)
moves every variant alike instead of deciding which looked cheaper. A row's figures are medians over the blocks
(T_iter, the modelled time, the error) and over every timed step (the host CPU).
"""

from __future__ import annotations

import functools
import resource
import statistics
import time

HOOKS = ("none", "ready-aware", "plain", "accumulator")  # a step row's hook on every parameter: see StepVariant


def cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def rotated(items: list, rnd: int) -> list:
    """Round `rnd`'s order: rotated by the round, reversed every other, so that each item runs at every position
    and after each of the others in turn."""
    base = items if rnd % 2 == 0 else items[::-1]
    k = (rnd // 2) % len(items)
    return base[k:] + base[:k]


def _no_op(*_) -> None:
    pass


class StepVariant:
    """One paper model emulated on one device, with a hook on every parameter that does nothing (hooks): marked
    ready_aware (a staged strategy's: the backward runs ahead and fires them), plain (a user's post-accumulate
    hook: the one node fires them on time), or on each parameter's accumulator (DDP's reducer's, Horovod's: the
    backward goes unit by unit to fire them on time), or none; its modelled times times `scale`."""

    def __init__(self, name: str, dev: str, hooks: str = "none", scale: float = 1.0):
        import torch
        from torch.autograd.graph import get_gradient_edge

        from runtime.emulate import accelerator, emulate, emulate_optimizer, emulated_loss
        from runtime.emulate.watch import ready_aware
        from runtime.workloads.models import PAPER_BATCH, build_model, model_input

        self.name, self.hooks, self.scale = name, hooks, scale
        accelerator.deactivate()  # its own accelerator: a process has one active, swapped in for each block
        self.batch = PAPER_BATCH.get(name, 32)  # the paper's, for a model of one of the papers
        self.model = build_model(name)
        inputs, _ = model_input(name, self.batch)
        emulate(self.model, dev, inputs, scale=scale)
        self.opt = emulate_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9))
        self.acc = accelerator.active()
        self.held = []  # the accumulators hooked: whoever hooks one holds it (DDP's reducer does, in C++)
        if hooks == "accumulator":
            for p in self.model.parameters():
                self.held.append(get_gradient_edge(p).node)
                self.held[-1].register_hook(_no_op)
        elif hooks != "none":
            hook = ready_aware(functools.partial(_no_op)) if hooks == "ready-aware" else _no_op
            for p in self.model.parameters():
                p.register_post_accumulate_grad_hook(hook)
        accelerator.deactivate()
        self.loss, self.inputs = emulated_loss, inputs
        self.blocks, self.positions = [], []

    def _step(self) -> None:
        self.opt.zero_grad()
        self.loss(self.model(*self.inputs)).backward()
        self.opt.step()

    def run(self, steps: int, warmup: int = 0, position: int | None = None) -> None:
        """One block: `warmup` untimed steps, then `steps` timed ones, on this variant's accelerator.

        T_iter over the block, on the device's timeline: from the end of the queued work to the end of the last
        step's (the host returns from a step before its backward and update end, so a step timed on the host
        alone can look shorter than its model while the device falls behind, by up to one step at the end)."""
        from runtime.emulate import accelerator

        accelerator.deactivate()
        acc = accelerator.activate(self.acc)
        try:
            for _ in range(warmup):
                self._step()
            if not steps:
                return
            acc.clock.sync()
            run_t0, run_m0 = time.perf_counter(), sum(acc.seconds.values())
            # The sync's sleep wakes late (tens of microseconds, more on a loaded host): without this the first
            # step's work (its zero_grad's memset, queued after the last deadline) would run on the device's
            # timeline before the block's clock started, and T_iter come out below the work it ran.
            acc.clock.after(run_t0)
            block = dict(times=[], cpus=[], modelled=[], landing=[])
            for _ in range(steps):
                m0, c0, t0, l0 = sum(acc.seconds.values()), cpu_s(), time.perf_counter(), acc.landing_cpu_s
                self._step()
                block["times"].append(time.perf_counter() - t0)
                block["cpus"].append(cpu_s() - c0)
                block["modelled"].append(sum(acc.seconds.values()) - m0)
                block["landing"].append(acc.landing_cpu_s - l0)
            acc.clock.sync()
            block["t_iter"] = (time.perf_counter() - run_t0) / steps
            block["t_model"] = (sum(acc.seconds.values()) - run_m0) / steps
            self.blocks.append(block)
            self.positions.append(position)
        finally:
            accelerator.deactivate()

    def row(self) -> dict:
        """The row of the blocks run: medians over blocks and steps, and one warm copy of every gradient."""
        import torch

        def pooled(key):
            return [x for b in self.blocks for x in b[key]]
        grads = [p.grad for p in self.model.parameters()]
        copies = [torch.empty_like(g) for g in grads]
        copy_times = []
        for _ in range(3):  # landing every gradient in host memory once: what a GPU's staging copies cost here
            c0 = cpu_s()
            for c, g in zip(copies, grads):
                c.copy_(g)
            copy_times.append(cpu_s() - c0)
        t_iter = statistics.median(b["t_iter"] for b in self.blocks)
        t_model = statistics.median(b["t_model"] for b in self.blocks)
        cpus, landing = pooled("cpus"), pooled("landing")
        rest = statistics.median(c - lc for c, lc in zip(cpus, landing))
        return dict(table="steps", model=self.name, device=self.acc.model.label, batch=self.batch,
                    hooked=self.hooks != "none", hooks=self.hooks,
                    params=sum(p.numel() for p in self.model.parameters()),
                    modelled_s=t_model, t_iter_s=t_iter, host_step_median_s=statistics.median(pooled("times")),
                    modelled_step_median_s=statistics.median(pooled("modelled")),
                    error=statistics.median(b["t_iter"] / b["t_model"] - 1 for b in self.blocks),
                    block_errors=[b["t_iter"] / b["t_model"] - 1 for b in self.blocks],
                    host_cpu_s=statistics.median(cpus), grad_copy_cpu_s=min(copy_times),
                    landing_cpu_s=statistics.median(landing), host_rest_s=rest,
                    host_rest_share=max(0.0, rest) / t_model, steps=len(self.blocks[0]["times"]),
                    rounds=len(self.blocks), round_positions=self.positions, compute_scale=self.scale,
                    parts=self.acc.describe())

    def close(self) -> None:
        self.model = self.opt = self.held = self.inputs = self.acc = None  # freed before the next variants are built


def interleaved_rows(variants: list[StepVariant], steps: int, warmup: int, rounds: int) -> list[dict]:
    """Each variant's row: warmed in turn, then `rounds` rounds of one block each, in rotated order."""
    for v in variants:
        v.run(0, warmup)
    for rnd in range(rounds):
        for position, v in enumerate(rotated(variants, rnd)):
            v.run(steps, position=position)
    rows = [v.row() for v in variants]
    for v in variants:
        v.close()
    return rows
