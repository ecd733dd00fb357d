"""Benchmark: how faithful emulated compute is: the named devices against published throughputs, wait precision,
and one rank's emulated step against its model, with the host CPU it costs.

    mpitrain bench emulation --json results/emulation.json
    mpitrain bench emulation --models resnet50-224 --devices v100 --steps 5

Three tables. Calibration: every published single-GPU training throughput of
a model we build (runtime.emulate.published) against the named device's
prediction (runtime.emulate.calibration), with the error. Waits: --waits
modelled waits adding up to 0.1 s, run --repeats times with plain time.sleep
and with the accelerator's deadline clock (runtime.emulate.clock), both in
each repeat, the first alternating: the total's median error and the
CPU-seconds each used. Steps: for each model
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
unit by unit through autograd to fire them on time). A model's variants (its
hooks, its --scales) are built together and run in --repeats rounds of one
block of --steps steps each, in an order rotated every round
(jobs.bench.emulation_steps); a row's figures are medians over its blocks and
steps. --profiles runs measured profiles
as devices too, each on the model it was taken from. --scales S,... adds a
fourth table: the same steps (no hooks) with the modelled times times S, and
the host CPU each costs beyond the landing, which grows with how long the step
sleeps (its Python runs from caches gone cold meanwhile). --idles MS,...
adds a fifth, the floor under that share: the host CPU of an empty interval, of
the least autograd a step can run (bare torch) and of the thinnest emulated step
(one Linear unit, no modelled time), right after the host slept each idle length
(jobs.bench.wake_tax), with the shortest step whose host work could stay within
2 % of its compute. All figures: emulated compute, on this machine, one process; the
header, the PNG's title and the JSON meta name both.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

from jobs.bench.emulation_steps import HOOKS, StepVariant, cpu_s, interleaved_rows
from jobs.bench.wake_tax import IDLES_MS, floor_rows, format_floor
from jobs.common.inputs import JobParser, at_least, comma_list, output_file, parse
from jobs.common.outputs import write_results
from jobs.common.compute import where_and_how, where_and_how_line
from jobs.common.report import run_metadata, save_figure

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
    p.add_argument("--repeats", type=int, default=5,
                   help="repeats of each wait row, both ways in each; and rounds of the step rows, every hook variant "
                        "and scale of a model and device running --steps steps in each, in rotated order (default 5)")
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
    args.profiles = [(_profile_model(path), path) for path in
                     comma_list("--profiles", args.profiles, unique=True)] if args.profiles.strip() else []
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


def calibration_rows() -> list[dict]:
    from runtime.emulate.calibration import predictions

    return [dict(table="calibration", device=p.device, model=p.point.model, batch=p.point.batch,
                 precision=p.point.precision, published=p.point.samples_per_s, unit=p.point.unit,
                 predicted=round(p.predicted, 2), error=p.error, framework=p.point.framework, source=p.point.source)
            for p in predictions()]


WAYS = ("time.sleep", "deadline clock")


def wait_rows(counts: list[int], repeats: int) -> list[dict]:
    """Per count, both ways of waiting in every repeat, the first of them alternating: a change in the machine's
    load (another process) moves both alike instead of landing on the one timed in its stretch."""
    from runtime.emulate.clock import Clock

    rows = []
    for n in counts:
        dt = 0.1 / n
        errors, cpus, first = {w: [] for w in WAYS}, {w: [] for w in WAYS}, {w: 0 for w in WAYS}
        for rep in range(repeats):
            order = WAYS if rep % 2 == 0 else WAYS[::-1]
            first[order[0]] += 1
            for how in order:
                clock = Clock()
                c0, t0 = cpu_s(), time.perf_counter()
                for _ in range(n):
                    time.sleep(dt) if how == "time.sleep" else clock.run(dt)
                errors[how].append((time.perf_counter() - t0) / 0.1 - 1)
                cpus[how].append(cpu_s() - c0)
        rows += [dict(table="waits", how=how, waits=n, wait_s=dt, error=statistics.median(errors[how]),
                      error_max=max(errors[how]), cpu_s_per_modelled_s=statistics.median(cpus[how]) / 0.1,
                      repeats=repeats, first_in=first[how]) for how in WAYS]
    return rows


def step_row(name: str, dev: str, steps: int, warmup: int, hooks: str = "none", scale: float = 1.0) -> dict:
    """One variant's row alone (one block): for scripts that time a single one (jobs.bench.emulation_steps)."""
    return interleaved_rows([StepVariant(name, dev, hooks, scale)], steps, warmup, 1)[0]


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


def plot(rows, path: str, meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cal = [r for r in rows if r["table"] == "calibration"]
    fig, ax = plt.subplots(figsize=(7.5, 5.2))  # the title's machine line fits
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
    ax.set_title(f"Emulated devices against published training throughputs\n{where_and_how_line(meta)}", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    import torch

    torch.set_num_threads(1)
    devices = [*args.devices, *(f"{path} ({model})" for model, path in args.profiles)]
    compute = (f"emulated compute: {', '.join(devices)}" + (f", scales 1, {', '.join(f'{s:g}' for s in args.scales)}"
                                                            if args.scales else "") + "; one process")
    meta = run_metadata("jobs.bench.emulation", argv, **where_and_how(compute), torch=torch.__version__,
                        devices=args.devices, profiles=[path for _, path in args.profiles], scales=args.scales,
                        repeats=args.repeats, steps=args.steps, warmup=args.warmup)
    print(f"# {where_and_how_line(meta)}", flush=True)
    rows = calibration_rows()
    rows += wait_rows(args.waits, args.repeats)
    # Every model on every named device, then each profile on the model it was taken from: its hook variants and
    # its scales (the host's CPU a step against how long it sleeps) built together and run round by round.
    for name, dev in [(n, d) for n in args.models for d in args.devices] + args.profiles:
        print(f"# {name} on {dev}: {args.warmup} warm-up, {args.repeats} rounds of {args.steps} steps", flush=True)
        variants = [StepVariant(name, dev, hooks) for hooks in (HOOKS if args.hooked else HOOKS[:1])]
        variants += [StepVariant(name, dev, scale=s) for s in args.scales]
        for i, row in enumerate(interleaved_rows(variants, args.steps, args.warmup, args.repeats)):
            rows.append(row if i < len(variants) - len(args.scales) else dict(row, table="scales"))
    if args.idles:
        rows += floor_rows(args.idles, 10 * args.repeats)
    print(format_tables(rows))
    write_results(None, args, meta, rows, lambda path: plot(rows, path, meta))
    return 0


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
