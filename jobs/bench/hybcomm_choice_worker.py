"""The MPI side of jobs.bench.hybcomm_choice: each FC layer alone, forced through SFB and PS, and the cost model's pick.

    mpiexec -n 4 mpitrain bench hybcomm-choice-worker --model vgg19-22k --batch-sizes 2,8,32,128 --bandwidth 1gbit

For every eligible nn.Linear of --model (--layers: indices into runtime.hybrid.layers.fc_layers,
default all; the model is built on the meta device, for its shapes only) and every K in
--batch-sizes, a one-layer model nn.Linear(M, N) (the same seed on every rank) trains on K
synthetic rows per rank (loss: the mean squared output; SGD, momentum 0.9), wrapped in
runtime.DistributedOptimizer with hybcomm at --bandwidth:

- force="auto" for one step: the cost model's choice for this K and P, its predicted seconds
  per step of both paths, and the GEMM rate it priced the rebuild at (measured at wrap, the
  slowest rank's);
- force="sfb" and force="ps", each in --rounds rounds of --warmup untimed and --iters timed
  steps, the order of the two alternating from round to round so that a drift in the
  machine's load cannot decide; a round's seconds per step are the slowest rank's;
- the rebuild alone (runtime.hybrid.factors.FactorExchange.rebuild on P·K rows, every rank at
  once), timed once after a warm-up: the GEMM rate this shape really gets.

One wrapped model at a time, each closed before the next (the 4096×21841 layer is 358 MB of
weights, as much again in gradients and in momentum per rank). Rank 0 prints a "ROW {json}"
per (layer, K): sfb_s and ps_s (medians over rounds; _min_s/_max_s the spread, _rounds_s
each), measured_faster, separated (the rounds' ranges do not overlap: the measurement
decides, not the noise), predicted, predicted_sfb_s/_ps_s/_rebuild_s, gflops (priced),
rebuild_s and rebuild_gflops (measured), agree, and the compute fields (jobs.common.compute).

--compute emulated:DEVICE: the layer is emulated (runtime.emulate; a fresh one per K, traced at K rows),
its loss and optimizer too, and the cost model prices the rebuild at the device's modelled GEMM rate on
measure_gflops' shape (64 rows of 1024 x 1024; gflops_source says which) instead of the CPU probe;
rebuild_modelled_s is the device's time for this rebuild (N x P·K by P·K x M).
"""

from __future__ import annotations

import gc
import statistics
import time

from jobs.bench.strategies_worker import slowest, timed_batches
from jobs.common.choices import MODELS
from jobs.common.cluster_sweep import print_row
from jobs.common.compute import Compute, add_compute_arguments, check_compute
from jobs.common.inputs import InputError, JobParser, at_least, int_list, link_rate, one_of, parse

LR, MOMENTUM = 0.01, 0.9
PATHS = ("sfb", "ps")


def add_settings(p) -> None:
    """The options jobs.bench.hybcomm_choice hands on to the worker under the same names."""
    p.add_argument("--model", default="vgg19-22k", help="whose Linear layers (default vgg19-22k)")
    p.add_argument("--layers", default="all", help="indices among the model's eligible Linear layers, or all")
    p.add_argument("--batch-sizes", default="2,8,32,128", help="K, rows per rank per step (default 2,8,32,128)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of sfb and ps (default 3)")
    p.add_argument("--iters", type=int, default=2, help="timed steps per path per round (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per path per round (default 1)")
    p.add_argument("--bandwidth", default="1gbit", help="the link rate: the cost model's, and the emulated cluster's (default 1gbit)")
    p.add_argument("--seed", type=int, default=0)
    add_compute_arguments(p)


def check_settings(args) -> None:
    """Everything the worker would refuse; last the layers, whose shapes need torch."""
    one_of("--model", args.model, MODELS)
    args.batch_sizes = int_list("--batch-sizes", args.batch_sizes, 1)
    at_least(args, 1, "rounds", "iters")
    at_least(args, 0, "warmup", "seed")
    wanted = None if args.layers.strip() == "all" else int_list("--layers", args.layers, 0)
    args.bps = link_rate("--bandwidth", args.bandwidth)
    args.fc = pick_layers(args.model, wanted)
    check_compute(args)


def pick_layers(model: str, wanted: list[int] | None) -> list[tuple[int, object]]:
    """(index, FCLayer) of the model's eligible Linear layers, all or those `wanted`; shapes only (meta device)."""
    import torch

    from runtime.hybrid.layers import fc_layers
    from runtime.workloads.models import build_model

    with torch.device("meta"):  # no memory, no initialisation: vgg19-22k's 128 M parameters cost nothing
        layers, _ = fc_layers(build_model(model))
    if not layers:
        raise InputError("--model", f"{model} has no Linear layer that can send sufficient factors")
    if wanted is None:
        return list(enumerate(layers))
    for i in wanted:
        if i >= len(layers):
            raise InputError("--layers", f"{i} is out of range: {model} has {len(layers)} eligible Linear "
                                         f"layer{'s' * (len(layers) > 1)} (0..{len(layers) - 1})")
    return [(i, layers[i]) for i in dict.fromkeys(wanted)]


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.hybcomm_choice_worker", description=__doc__.split("\n\n")[0])
    add_settings(p)
    p.add_argument("--label", help="the bandwidth written into the rows (default --bandwidth)")
    p.add_argument("--ranks-per-node", type=int, help="emulate nodes of this many consecutive ranks")
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    at_least(args, 1, "ranks_per_node")
    check_settings(args)
    args.label = args.label or args.bandwidth


class ChoiceBench:
    """One rank's side: the topology every wrap shares, and the timing of one layer shape at one K."""

    def __init__(self, args):
        import torch

        from mpicomm import Topology

        torch.set_num_threads(1)  # the ranks share the cores, as in jobs.bench.strategies_worker
        self.args, self.torch = args, torch
        self.topo = Topology(ranks_per_node=args.ranks_per_node)
        self.comm, self.P, self.rank = self.topo.world, self.topo.size, self.topo.rank
        self.compute = Compute.from_args(args)
        self.started = time.perf_counter()
        self.loss = self.compute.loss(lambda out, _target=None: out.square().mean())
        self.gflops = None  # the cost model's GEMM rate: measured by the strategy at wrap (real compute)
        if self.compute.emulated:
            from runtime.emulate import compute_model

            # The device's, not this host's: its modelled rate on the strategy's probe shape, slowed by the scale.
            gemm_s = compute_model(args.compute.removeprefix("emulated:")).gemm_s(1024, 1024, 64) * args.compute_scale
            self.gflops = 2 * 64 * 1024 * 1024 / gemm_s / 1e9

    def wrap(self, module, force: str):
        """DistributedOptimizer(SGD) over `module` with hybcomm forced to `force` (a context manager: closes)."""
        from runtime import DistributedOptimizer, HybCommOptions

        opt = self.torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)  # fresh: no momentum to broadcast
        options = HybCommOptions(force=force, bandwidth=float(self.args.bps), gflops=self.gflops)
        return DistributedOptimizer(self.compute.optimizer(opt), module, options, topology=self.topo)

    def run(self, module, x, force: str, measure: bool = True):
        """Seconds per step of one round through `force` (measure), or the strategy after one step (not)."""
        with self.wrap(module, force) as dopt:
            def step():
                dopt.zero_grad()
                self.loss(module(x)).backward()
                dopt.step()
            if measure:
                def finish():
                    dopt.synchronize()
                    self.compute.synchronize()  # an emulated device's queued backward and update count too
                out = timed_batches(self.comm, step, finish, self.args.warmup, 1, self.args.iters, self.compute.now)[0]
            else:
                step()
                dopt.synchronize()
                out = dopt.strategy.plan[0], dopt.strategy.links.gflops
        module.zero_grad(set_to_none=True)  # the closed wrap's gradient buffers and momentum go now
        gc.collect()
        return out

    def rebuild_seconds(self, layer, K: int) -> float:
        """The slowest rank's time for the SFB rebuild alone on P·K rows, the output already paged in."""
        from runtime.hybrid.factors import FactorExchange

        torch, rows = self.torch, self.P * K
        ex = FactorExchange(layer.name, layer.M, layer.N, torch.float32, 0)
        ex.u_all, ex.d_all = torch.randn(rows * layer.M), torch.randn(rows * layer.N)
        grad_w = torch.empty(layer.N, layer.M)
        grad_b = torch.empty(layer.N) if layer.has_bias else None
        ex.rebuild(grad_w, grad_b, self.P)  # warm-up: first touch of a fresh output faults its pages in
        self.comm.Barrier()
        t0 = time.perf_counter()
        ex.rebuild(grad_w, grad_b, self.P)
        return slowest(self.comm, time.perf_counter() - t0)

    def layer(self, index: int, layer) -> list[dict]:
        """Rows of one layer shape, one per K."""
        torch, args = self.torch, self.args
        torch.manual_seed(args.seed)
        module = None if self.compute.emulated else torch.nn.Linear(layer.M, layer.N, bias=layer.has_bias)
        rows = []
        for K in args.batch_sizes:
            x = torch.randn(K, layer.M, generator=torch.Generator().manual_seed(args.seed * 7919 + self.rank))
            if self.compute.emulated:  # traced at these K rows: a fresh layer per K, its values never read
                module = None
                gc.collect()
                fc = torch.nn.Linear(layer.M, layer.N, bias=layer.has_bias, device="meta").to_empty(device="cpu")
                module = self.compute.model(torch.nn.Sequential(fc), (x,))  # emulate() emulates a model's units
            plan, gflops = self.run(module, x, "auto", measure=False)
            times = {path: [] for path in PATHS}
            for r in range(args.rounds):
                for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                    times[path].append(self.run(module, x, path))
            rows.append(row(args, index, layer, K, self.P, plan, gflops, times, self.rebuild_seconds(layer, K),
                            self.compute))
            if self.rank == 0:  # progress (jobs.common.cluster_sweep shows "# " lines): a large layer takes minutes
                r = rows[-1]
                print(f"# {time.perf_counter() - self.started:.0f} s: {layer.name} {layer.M}×{layer.N} K={K} "
                      f"P={self.P}: sfb {r['sfb_s'] * 1e3:.1f} ms, ps {r['ps_s'] * 1e3:.1f} ms, picked "
                      f"{r['predicted']}", flush=True)
        del module
        gc.collect()
        return rows


def row(args, index: int, layer, K: int, P: int, plan, gflops: float, times: dict, rebuild_s: float,
        compute: Compute) -> dict:
    """One (layer, K): both paths measured, the cost model's pick and prices, and whether they agree."""
    from runtime.hybrid.cost_model import rebuild_flop

    med = {path: statistics.median(times[path]) for path in PATHS}
    faster = "sfb" if med["sfb"] < med["ps"] else "ps"  # a tie goes to PS, as in the cost model
    slower = "ps" if faster == "sfb" else "sfb"
    flop = rebuild_flop(layer.M, layer.N, K, P, layer.has_bias)
    out = dict(model=args.model, layer=layer.name, index=index, M=layer.M, N=layer.N, K=K, P=P,
               ranks_per_node=plan.ranks_per_node, bandwidth=args.label, link_bps=args.bps)
    for path in PATHS:
        out.update({f"{path}_s": med[path], f"{path}_min_s": min(times[path]), f"{path}_max_s": max(times[path]),
                    f"{path}_rounds_s": times[path]})
    out.update(measured_faster=faster, separated=max(times[faster]) < min(times[slower]), predicted=plan.choice,
               predicted_sfb_s=plan.sfb_seconds, predicted_ps_s=plan.ps_seconds,
               predicted_rebuild_s=flop / (gflops * 1e9), gflops=gflops, rebuild_s=rebuild_s,
               rebuild_gflops=flop / max(rebuild_s, 1e-9) / 1e9, agree=plan.choice == faster,
               rounds=args.rounds, iters=args.iters, warmup=args.warmup, gflops_source="measured at wrap",
               rebuild_modelled_s=None, **compute.describe())
    if compute.emulated:
        from runtime.emulate import active

        acc = active()
        out.update(gflops_source=f"modelled: {acc.model.device_name} on 64 x 1024 x 1024",
                   rebuild_modelled_s=acc.model.gemm_s(layer.N, layer.M, P * K) * acc.scale)
    return out


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    b = ChoiceBench(args)
    for index, layer in args.fc:
        for r in b.layer(index, layer):
            if b.rank == 0:
                print_row(r)
    b.topo.free()
    return 0


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops every rank here, one line and exit 2, before any layer is built
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
