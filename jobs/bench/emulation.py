"""Benchmark: how faithful emulated compute is: the named devices against published throughputs, wait precision,
and one rank's emulated step against its model, with the host CPU it costs.

    mpitrain bench emulation --json results/emulation.json
    mpitrain bench emulation --models resnet50-224 --devices v100 --steps 5

Three tables. Calibration: every published single-GPU training throughput of
a model we build (runtime.emulate.published) against the named device's
prediction (runtime.emulate.calibration), with the error. Waits: --waits
modelled waits adding up to 0.1 s, run --repeats times with plain time.sleep
and with the accelerator's deadline clock (runtime.emulate.clock): the
total's median error and the CPU-seconds each used. Steps: for each model
and device (batch: the paper's, PAPER_BATCH, else 32), --steps emulated
training steps on one rank after --warmup (zero_grad, forward, backward,
optimizer step, the way DistributedOptimizer's user runs them): T_iter over
the run (synced to the device's timeline at both ends: the host returns from
a step before its queued work ends) against the modelled time per step, the
error, and the host's median CPU-seconds per step; of those, what landing
the gradients in host memory took in the step (the writes that stand in for
a GPU's staging copies: runtime.emulate.landing), beside one warm copy of
every gradient timed alone (a large gradient lands faster than that: it is
written from a cache-resident block, runtime.emulate.pattern), and the rest
as a share of the modelled compute. With --hooked (default), each model runs
three times more with a hook on every parameter: a ready-aware one, as a
staged strategy's (the backward stays one node and fires the hooks ahead,
runtime.emulate.watch); a plain post-accumulate one, as a user's (the one
node fires each group's hooks on time); and one on each parameter's
accumulator, as torch DDP's reducer and Horovod put theirs (the backward goes
unit by unit through autograd to fire them on time). --profiles runs measured profiles
as devices too, each on the model it was taken from. --scales S,... adds a
fourth table: the same steps (no hooks) with the modelled times times S, and
the host CPU each costs beyond the landing, which grows with how long the step
sleeps (its Python runs from caches gone cold meanwhile). --idles MS,...
adds a fifth, the floor under that share: the host CPU of an empty interval, of
the least autograd a step can run (bare torch) and of the thinnest emulated step
(one Linear unit, no modelled time), right after the host slept each idle length
(jobs.bench.wake_tax), with the shortest step whose host work could stay within
2 % of its compute. All figures: emulated compute, on this machine, one process.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import resource
import statistics
import time

from jobs.bench.wake_tax import IDLES_MS, floor_rows, format_floor
from jobs.common.inputs import JobParser, at_least, comma_list, output_file, parse
from jobs.common.outputs import write_results
from jobs.common.report import machine, machine_line, run_metadata, save_figure

MODELS = ("resnet50-224", "vgg19-224", "transformer-big")


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.emulation", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"default {','.join(MODELS)}")
    p.add_argument("--devices", default="h100,v100", help="named devices (default h100,v100)")
    p.add_argument("--profiles", default="", metavar="PATH,...",
                   help="measured profiles (mpitrain simulate --take-profile) to run as devices too, each on the "
                        "model it was taken from (default none)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per model and device (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--hooked", action=argparse.BooleanOptionalAction, default=True,
                   help="also run each step row with a hook on every parameter: a ready-aware one, as a staged "
                        "strategy's, and a plain one, as DDP's or a user's (default on)")
    p.add_argument("--scales", default="", metavar="S,...",
                   help="compute scales for a fourth table: each model and device's steps (no hooks) with its modelled "
                        "time times S, to show how the host's CPU a step follows the time it sleeps (default none)")
    p.add_argument("--idles", default=",".join(f"{i:g}" for i in IDLES_MS), metavar="MS,...",
                   help="host idle lengths for the floor table: the host CPU of the thinnest step right after the host "
                        "slept this long (default %(default)s; empty: no floor table)")
    p.add_argument("--waits", default="10,100,1000", help="waits per 0.1 s in the wait table (default 10,100,1000)")
    p.add_argument("--repeats", type=int, default=5, help="repeats of each wait row (default 5)")
    p.add_argument("--json", metavar="PATH", help="write the rows (and run metadata) here")
    p.add_argument("--plot", metavar="PNG", help="plot (default: the JSON path with .png)")
    return parse(p, argv, check_args)


def check_args(args) -> None:
    from jobs.common.choices import MODELS as ALL
    from runtime.emulate import EmulationError, device

    args.models = comma_list("--models", args.models, ALL)
    args.devices = comma_list("--devices", args.devices, unique=True)
    for d in args.devices:
        try:
            device(d)
        except EmulationError as e:
            from jobs.common.inputs import InputError
            raise InputError("--devices", str(e)) from None
    args.profiles = [(_profile_model(path), path) for path in comma_list("--profiles", args.profiles)] \
        if args.profiles.strip() else []
    # Each parsed here, not by a bare int() or float(): "abc" was a ValueError traceback, 0 waits a
    # ZeroDivisionError, an inf idle an OverflowError in time.sleep, and -10 waits a table of -100 %.
    args.waits = _numbers("--waits", args.waits, int, lambda w: w >= 1, "every wait count must be a whole number >= 1")
    args.idles = _numbers("--idles", args.idles, float, lambda i: 0 <= i < math.inf,
                          "every idle length must be >= 0 ms and finite") if args.idles.strip() else []
    args.scales = _numbers("--scales", args.scales, float, lambda s: 0 < s < math.inf,
                           "every scale must be > 0 and finite") if args.scales.strip() else []
    at_least(args, 1, "steps", "repeats")
    at_least(args, 0, "warmup")
    if args.plot is None and args.json:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    output_file(args, "json", "plot")


def _numbers(opt: str, text: str, kind, ok, want: str) -> list:
    """A list of numbers, none twice, each passing ok(): one `--opt: ...` line otherwise."""
    from jobs.common.inputs import InputError

    values = comma_list(opt, text, parse=kind, unique=True)
    bad = [v for v in values if not ok(v)]
    if bad:
        raise InputError(opt, f"{want}, got {bad[0]:g}")
    return values


def _profile_model(path: str) -> str:
    """The model a profile was taken from (its JSON's "model"), or a clear error naming the file."""
    import json

    from jobs.common.inputs import InputError
    try:
        with open(path) as f:
            model = json.load(f).get("model")
    except (OSError, ValueError, AttributeError) as e:
        raise InputError("--profiles", f"{path}: not a profile ({e})") from None
    if not isinstance(model, str):
        raise InputError("--profiles", f"{path}: names no model (not written by mpitrain simulate --take-profile)")
    return model


def cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def calibration_rows() -> list[dict]:
    from runtime.emulate.calibration import predictions

    return [dict(table="calibration", device=p.device, model=p.point.model, batch=p.point.batch,
                 precision=p.point.precision, published=p.point.samples_per_s, unit=p.point.unit,
                 predicted=round(p.predicted, 2), error=p.error, framework=p.point.framework, source=p.point.source)
            for p in predictions()]


def wait_rows(counts: list[int], repeats: int) -> list[dict]:
    from runtime.emulate.clock import Clock

    rows = []
    for n in counts:
        dt = 0.1 / n
        for how in ("time.sleep", "deadline clock"):
            errors, cpus = [], []
            for _ in range(repeats):
                clock = Clock()
                c0, t0 = cpu_s(), time.perf_counter()
                for _ in range(n):
                    time.sleep(dt) if how == "time.sleep" else clock.run(dt)
                errors.append((time.perf_counter() - t0) / 0.1 - 1)
                cpus.append(cpu_s() - c0)
            rows.append(dict(table="waits", how=how, waits=n, wait_s=dt, error=statistics.median(errors),
                             error_max=max(errors), cpu_s_per_modelled_s=statistics.median(cpus) / 0.1))
    return rows


HOOKS = ("none", "ready-aware", "plain", "accumulator")  # a step row's hook on every parameter: see step_row


def step_row(name: str, dev: str, steps: int, warmup: int, hooks: str = "none", scale: float = 1.0) -> dict:
    """One rank's emulated steps of a paper model: T_iter against the model, and the host CPU they cost. hooks:
    a hook on every parameter that does nothing, marked ready_aware (a staged strategy's: the backward runs
    ahead and fires them), plain (a user's post-accumulate hook: the one node fires them on time), or on each
    parameter's accumulator (DDP's reducer's, Horovod's: the backward goes unit by unit to fire them on time)."""
    import torch
    from torch.autograd.graph import get_gradient_edge

    from runtime.emulate import accelerator, emulate, emulate_optimizer, emulated_loss
    from runtime.emulate.watch import ready_aware
    from runtime.workloads.models import PAPER_BATCH, build_model, model_input

    accelerator.deactivate()
    batch = PAPER_BATCH.get(name, 32)  # the paper's, for a model of one of the papers
    model = build_model(name)
    inputs, _ = model_input(name, batch)
    emulate(model, dev, inputs, scale=scale)
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    acc = accelerator.active()
    held = []  # the accumulators hooked: whoever hooks one holds it (DDP's reducer does, in C++)
    if hooks == "accumulator":
        for p in model.parameters():
            held.append(get_gradient_edge(p).node)
            held[-1].register_hook(_no_op)
    elif hooks != "none":
        hook = ready_aware(functools.partial(_no_op)) if hooks == "ready-aware" else _no_op
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)

    def step():
        opt.zero_grad()
        emulated_loss(model(*inputs)).backward()
        opt.step()
    for _ in range(warmup):
        step()
    # T_iter over the run, on the device's timeline: from the end of the queued work to the end of the last step's
    # (the host returns from a step before its backward and update end, so a step timed on the host alone can
    # look shorter than its model while the device falls behind, by up to one step at the end of the run).
    acc.clock.sync()
    run_t0, run_m0 = time.perf_counter(), sum(acc.seconds.values())
    times, cpus, modelled, landing = [], [], [], []
    for _ in range(steps):
        m0, c0, t0, l0 = sum(acc.seconds.values()), cpu_s(), time.perf_counter(), acc.landing_cpu_s
        step()
        times.append(time.perf_counter() - t0)
        cpus.append(cpu_s() - c0)
        modelled.append(sum(acc.seconds.values()) - m0)
        landing.append(acc.landing_cpu_s - l0)
    acc.clock.sync()
    t_iter, t_model = (time.perf_counter() - run_t0) / steps, (sum(acc.seconds.values()) - run_m0) / steps
    grads = [p.grad for p in model.parameters()]
    copies = [torch.empty_like(g) for g in grads]
    copy_times = []
    for _ in range(3):  # landing every gradient in host memory once: what a GPU's staging copies cost here
        c0 = cpu_s()
        for c, g in zip(copies, grads):
            c.copy_(g)
        copy_times.append(cpu_s() - c0)
    host = statistics.median(cpus)
    copy = min(copy_times)
    rest = statistics.median(c - lc for c, lc in zip(cpus, landing))
    row = dict(table="steps", model=name, device=acc.model.label, batch=batch, hooked=hooks != "none", hooks=hooks,
               params=sum(p.numel() for p in model.parameters()), modelled_s=t_model, t_iter_s=t_iter,
               host_step_median_s=statistics.median(times), modelled_step_median_s=statistics.median(modelled),
               error=t_iter / t_model - 1, host_cpu_s=host, grad_copy_cpu_s=copy,
               landing_cpu_s=statistics.median(landing), host_rest_s=rest,
               host_rest_share=max(0.0, rest) / t_model, steps=steps, compute_scale=scale, parts=acc.describe())
    model = opt = grads = copies = held = None  # freed before the next row's model is built
    accelerator.deactivate()
    return row


def _no_op(*_) -> None:
    pass


def format_tables(rows) -> str:
    out = ["| device | model | batch | precision | published /s | predicted /s | error | source |",
           "|---|---|---:|---|---:|---:|---:|---|"]
    out += [f"| {r['device']} | {r['model']} | {r['batch']} | {r['precision']} | {r['published']:.1f} "
            f"| {r['predicted']:.1f} | {r['error'] * 100:+.1f} % | {r['framework']} |"
            for r in rows if r["table"] == "calibration"]
    out += ["", "| waits per 0.1 s | how | total error (median) | max | CPU s per modelled s |", "|---:|---|---:|---:|---:|"]
    out += [f"| {r['waits']} | {r['how']} | {r['error'] * 100:+.2f} % | {r['error_max'] * 100:+.2f} % "
            f"| {r['cpu_s_per_modelled_s']:.3f} |" for r in rows if r["table"] == "waits"]
    out += ["", "| model | device | hooks | batch | modelled s/step | T_iter s | error | host CPU s/step | of which "
            "landing | one warm copy | rest / modelled |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['model']} | {r['device']} | {r.get('hooks', 'plain' if r['hooked'] else 'none')} "
            f"| {r['batch']} "
            f"| {r['modelled_s']:.4f} | {r['t_iter_s']:.4f} | {r['error'] * 100:+.2f} % | {r['host_cpu_s']:.4f} "
            f"| {r['landing_cpu_s']:.4f} | {r['grad_copy_cpu_s']:.4f} | {r['host_rest_share'] * 100:.2f} % |"
            for r in rows if r["table"] == "steps"]
    scaled = [r for r in rows if r["table"] == "scales"]
    if scaled:
        out += ["", "| model | device | compute scale | modelled s/step | host CPU beyond landing, us/step | rest / modelled |",
                "|---|---|---:|---:|---:|---:|"]
        out += [f"| {r['model']} | {r['device']} | {r['compute_scale']:g} | {r['modelled_s']:.4f} "
                f"| {r['host_rest_s'] * 1e6:.0f} | {r['host_rest_share'] * 100:.2f} % |" for r in scaled]
    floor = format_floor(rows)
    return "\n".join(out + (["", floor] if floor else []))


def plot(rows, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cal = [r for r in rows if r["table"] == "calibration"]
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for dev in sorted({r["device"] for r in cal}):
        mine = [r for r in cal if r["device"] == dev]
        ax.scatter([r["published"] for r in mine], [r["predicted"] for r in mine], label=dev)
    top = max(max(r["published"], r["predicted"]) for r in cal) * 1.1
    ax.plot([1, top], [1, top], "k-", lw=0.8)
    ax.plot([1, top], [1.15, 1.15 * top], "k:", lw=0.8)
    ax.plot([1, top], [0.85, 0.85 * top], "k:", lw=0.8, label="+-15 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("published samples/s (single GPU)")
    ax.set_ylabel("predicted by the device model")
    ax.set_title("Emulated devices against published training throughputs")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    import torch

    torch.set_num_threads(1)
    print(f"# {machine_line(machine())}; emulated compute, one process", flush=True)
    rows = calibration_rows()
    rows += wait_rows(args.waits, args.repeats)
    # Every model on every named device, then each profile on the model it was taken from.
    for name, dev in [(n, d) for n in args.models for d in args.devices] + args.profiles:
        print(f"# {name} on {dev}: {args.warmup} + {args.steps} steps", flush=True)
        for hooks in HOOKS if args.hooked else HOOKS[:1]:
            rows.append(step_row(name, dev, args.steps, args.warmup, hooks))
        # The host's CPU a step against how long the step sleeps: its Python runs from caches gone cold meanwhile.
        rows += [dict(step_row(name, dev, args.steps, args.warmup, scale=s), table="scales") for s in args.scales]
    if args.idles:
        rows += floor_rows(args.idles, 10 * args.repeats)
    print(format_tables(rows))
    meta = run_metadata("jobs.bench.emulation", argv, machine=machine(), compute="emulated", torch=torch.__version__)
    write_results(None, args, meta, rows, lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
