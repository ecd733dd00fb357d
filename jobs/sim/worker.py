"""The MPI side of jobs.simulate: a model's profile, taken on every rank at once, or the transport's costs.

    mpiexec -n 4 mpitrain simulate-worker profile --model vgg19 --batch-size 16 --out vgg19.json
    mpiexec -n 2 mpitrain simulate-worker transport        # across two hosts of an emulated cluster

profile: every rank profiles the same model at the same time (runtime.sim.measure), so that a
profile taken on n ranks of one machine carries the contention those n ranks put on its cores
and memory, as a training run of n ranks there does. Rank 0 writes the profile whose every
figure comes from the rank slowest at each step (slowest_per_step). With --device cuda each rank
profiles its node-local rank's GPU, as the training jobs (jobs.common.devices.rank_device).
transport: mpicomm.transport_probe between pairs of ranks, then the ring allreduce's rate over
all of them.
Both print one "ROW {json}" line.
"""

from __future__ import annotations

import argparse

from jobs.common.choices import MODELS
from jobs.common.cluster_sweep import print_row
from jobs.common.inputs import JobParser, at_least, one_of, parse


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.sim.worker", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("profile", "transport"))
    p.add_argument("--model", default="vgg19")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="profiled steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--density", type=float, default=1e-3, help="top-k density whose selection is timed")
    p.add_argument("--out", help="profile: where rank 0 writes it")

    def check(args):
        one_of("--model", args.model, MODELS)
        at_least(args, 1, "batch_size", "steps", "threads")
        at_least(args, 0, "warmup")

    return parse(p, argv, check, mpi=True)


def profile(args, comm) -> None:
    import torch

    from jobs.common.devices import rank_device
    from jobs.common.report import machine, machine_line
    from mpicomm.topology import Topology
    from runtime.sim.measure import measure
    from runtime.sim.profile import Profile
    from runtime.workloads.models import build_model, loss_fn, model_input

    torch.set_num_threads(args.threads)
    # The GPU of this rank's node-local rank, made current (as the training jobs choose it): measure's
    # torch.cuda.synchronize() waits on the current device, so a rank timing another GPU than the
    # current one would time its launches, not its kernels. By world rank, a second host's ranks
    # would not start at its GPU 0 wherever its ranks and GPUs differ in number.
    with Topology(comm) as topo:
        dev = rank_device(args.device, topo)
    torch.manual_seed(0)
    model = build_model(args.model).to(dev)
    inputs, target = model_input(args.model, args.batch_size, comm.Get_rank())
    inputs, target = tuple(t.to(dev) for t in inputs), target.to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)  # jobs.bench.strategies_worker's
    comm.Barrier()
    mine = measure(model, inputs, target, loss_fn(args.model), optimizer, steps=args.steps, warmup=args.warmup,
                   name=args.model, device=str(dev), ranks_at_once=comm.Get_size(), threads=args.threads,
                   sparse_density=args.density, machine=machine_line(machine()).removeprefix("machine: ")
                   + (f", {torch.cuda.get_device_name(dev)}" if args.device == "cuda" else ""))
    every = comm.gather(mine.to_json(), root=0)  # once per job, not a hot path
    if comm.Get_rank():
        return
    merged = slowest_per_step([Profile.from_json(d) for d in every])
    if args.out:
        merged.save(args.out)
    print_row({"what": "profile", "model": args.model, "ranks": comm.Get_size(), "step_s": merged.step_s,
               "compute_s": merged.compute_s, "path": args.out})


def slowest_per_step(profiles: list):
    """One profile from ranks profiled together: each step's figures from the rank slowest at it (a
    synchronous step waits for that one), averaged over steps."""
    from statistics import fmean

    from runtime.sim.profile import Layer, Profile

    first = profiles[0]
    steps = len(first.extra["steps"])
    picks = [max((p.extra["steps"][i] for p in profiles), key=lambda st: st["total"]) for i in range(steps)]
    layers = tuple(Layer(l.name, fmean([st["fwd"][j] for st in picks]), fmean([st["bwd"][j] for st in picks]),
                         l.params, l.act_bytes, l.linear) for j, l in enumerate(first.layers))
    keep = ("model", "batch_size", "device", "ranks_at_once", "cores", "cores_per_rank", "threads", "itemsize",
            "buffer_elements", "watched_buffers", "machine")
    return Profile(**{k: getattr(first, k) for k in keep}, layers=layers,
                   step_s=max(p.step_s for p in profiles), optimizer_s=fmean([st["opt"] for st in picks]),
                   other_s=max(0.0, fmean([st["rest"] for st in picks])),
                   select_s_per_element=max(p.select_s_per_element for p in profiles),
                   gflops=min(p.gflops for p in profiles), copy_gbs=min(p.copy_gbs for p in profiles),
                   extra={"step_s_ranks": [p.step_s for p in profiles], "rank_devices": [p.device for p in profiles],
                          "merged": "slowest rank per step"})


def transport(args, comm) -> None:
    from mpicomm.transport_probe import probe_chain, probe_ring, probe_transport

    est = probe_transport(comm)
    ring = probe_ring(comm)
    chain = probe_chain(comm)
    chain2 = probe_chain(comm, two_way=True)  # for the record (jobs.bench.links); the simulator does not use it
    if comm.Get_rank() == 0:
        print_row({"what": "transport", "ranks": comm.Get_size(), **est.to_json(), **ring, **chain, **chain2})


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI

    (profile if args.what == "profile" else transport)(args, MPI.COMM_WORLD)
    return 0


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
