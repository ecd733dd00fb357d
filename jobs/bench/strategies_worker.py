"""The MPI side of jobs.bench.strategies: each strategy's training throughput on one model, on the links it runs on.

    mpiexec -n 4 mpitrain bench strategies-worker --model vgg19 --strategies allreduce,wfbp,p3,ddp
    mpiexec -n 4 mpitrain bench strategies-worker --strategies allreduce,topk,hier-topk,allreduce+pto --density 0.001
    mpiexec -n 4 mpitrain bench strategies-worker --model vgg19-22k --strategies wfbp,hybcomm,hybcomm-sfb,hybcomm-ps
    mpiexec -n 4 mpitrain bench strategies-worker --device cuda --model resnet50 --strategies allreduce,wfbp,p3,ddp

Rank 0 prints one JSON line per strategy (prefixed "ROW "). The contenders
(the plain step, "compute", and each strategy) are measured in --rounds
interleaved rounds, round k starting at contender k mod n, each one built,
warmed up, timed and released within its round: T_compute (the step without
any synchronisation), then per strategy T_iter (--batches timed batches of
--iters back-to-back steps, each after an untimed lead-in step so that it
times the steady state: p3's exchange overlapping the next forward included;
slowest rank; after --warmup steps), T_comm (its
synchronisation alone, gradients already computed, --iters calls) and the
CPU-seconds per step all ranks' processes used for the plain step, the
training step and the synchronisation alone. A row gives medians over the
rounds with jobs.common.stats's order-statistic CI of the median (few rounds:
their min-max, its coverage in ci_coverage), samples/s from the median T_iter, the per-round values, and
overlap efficiency max(T_compute, T_comm) / T_iter and the hidden share of
the shorter phase (jobs.bench.strategies_rows), per round, medians over rounds. T_comm
hands every strategy fresh gradients each call (one copy into its buffers;
DDP's copies into its flat buffer too), so that each exchanges, and waits
for, all of them. A "+pto" suffix runs a strategy with PTO (sharded
optimizer update + allgather). "p3@SLICE/CREDIT" (each auto or a count, the credit
also online: its trials then warm up too) runs p3 with those settings beside
"p3"; p3 rows carry what was chosen, messages and polls per step.
"wfbp/N" (or "wfbp/all"): WfbpOptions(in_flight=N or None).
Sparse strategies also report the bytes their exchange sent per step, summed
over ranks, to peers on the same node and on other nodes. On the emulated
cluster every strategy reports the bytes its hosts' interfaces sent per timed
step (wire_bytes_per_step, all hosts; wire_bytes_per_host_per_step); without
one interface per host (locally) they are None. hybcomm runs with the cost
model's choice per layer (its plan in the row), hybcomm-sfb and hybcomm-ps
with every eligible layer forced one way; --bandwidth is the link rate the
cost model assumes (unshaped: its default). Their T_comm, overlap and
communication CPU are None: the factors exist only inside a backward pass,
so a synchronisation without one would time the dense part alone.
With --device cuda every rank trains on GPU local_rank % GPUs (ranks may share one), the synthetic batch
stays there, ddp is torch DDP on the GPU over gloo (NCCL refuses several ranks on one GPU), and the clock
is read after the GPU has finished each timed batch. Rows carry the device and torch's CUDA version.
With --compute emulated:DEVICE (runtime.emulate) every contender's model,
optimizer and loss are emulated: each layer waits the time DEVICE would take
(times --compute-scale) instead of computing, gradients of the true sizes
reach the strategies in the true order, and the communication is real. T_comm
is timed as without emulation. Rows then carry the compute mode
(jobs.common.compute: compute, compute_device, compute_scale, emulated_parts,
real_parts), modelled_compute_s (the modelled device seconds per timed step;
per kind of work in modelled_parts_s), ranks_per_core (ranks on this machine
over its usable cores) and peak_rss_mb (the largest rank's peak resident
memory during the contender; peak_rss_ranks_mb: all ranks' summed), as rows
without emulation do too, the modelled figures None.
"""

from __future__ import annotations

import os
import time

from jobs.bench import host_usage
from jobs.bench.between_contenders import release_memory, warm_mpi
from jobs.bench.contenders import FORCED, STRATEGIES, check_settings, strategy_options
from jobs.bench.host_usage import ranks_cpu_s
from jobs.bench.strategies_rows import row
from jobs.common.choices import MODELS, SPARSE_STRATEGIES as SPARSE
from jobs.common.cluster_sweep import print_row
from jobs.common.compute import Compute, add_compute_arguments, check_compute
from jobs.common.inputs import JobParser, add_device_argument, at_least, check_device, one_of, parse
from jobs.common.plans import PLAN_KEYS, plan_rows

COMPUTE = "compute"  # the contender with no synchronisation at all: T_compute


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.bench.strategies_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vgg19")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender and round")
    p.add_argument("--batches", type=int, default=5, help="timed batches per contender and round")
    p.add_argument("--iters", type=int, default=2, help="steps per timed batch")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the contenders (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--slice-size", default="auto", help="p3: elements per slice, or auto (default)")
    p.add_argument("--credit", default="auto", help="p3: messages in flight, auto (default) or online")
    p.add_argument("--density", type=float, default=0.001, help="topk/hier-topk: fraction sent (default 0.001)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="sgd with momentum 0.9, or adam")
    p.add_argument("--bandwidth", default="unshaped", help="label written into the rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks-per-node", type=int, help="emulate nodes of this many consecutive ranks")
    add_device_argument(p)
    add_compute_arguments(p)
    return parse(p, argv, check_args, mpi=True)


def check_args(args) -> None:
    one_of("--model", args.model, MODELS)
    args.strategies = check_settings(args)
    at_least(args, 0, "seed")
    at_least(args, 1, "ranks_per_node")
    check_device(args)
    check_compute(args)  # imports torch when emulating: last


def slowest(comm, seconds: float) -> float:
    """The most seconds any rank of `comm` took (collective)."""
    import numpy as np
    from mpi4py import MPI
    t = np.array([seconds])
    comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
    return float(t[0])


LEAD_IN = 1  # untimed steps before each timed batch (steps_per_batch): the batch starts in the steady state


def steps_per_batch(iters: int) -> int:
    """Steps a timed batch of `iters` runs in all: its lead-in and its own."""
    return LEAD_IN + iters


def timed_batches(comm, step, finish, warmup: int, batches: int, iters: int, now=None) -> list[float]:
    """Per-batch seconds per step of `iters` back-to-back steps in the steady state, slowest rank, after `warmup`
    steps and finish().

    Each batch starts after a barrier and LEAD_IN untimed steps, and is read at step boundaries: from the end of
    the lead-in to the end of its last step, then finish() (untimed). So a strategy that overlaps a step's
    exchange with the next forward (p3 defers its updates to it) is timed as it runs: with one step a batch and
    finish() inside the batch, p3's whole exchange was waited for in every timed step (VGG-19 at balance:
    1.08 s against 0.78 s in training). Each timed window holds `iters` whole periods: the exchange owed when
    it opens (the lead-in's) and when it closes (its last step's) are alike. `now` (default time.perf_counter)
    reads both ends (emulated: the device's timeline, Compute.now); on a GPU `finish` also waits for the device."""
    now = now or time.perf_counter  # looked up at the call (a test's clock replaces it)
    for _ in range(warmup):
        step()
    finish()
    per_batch = []
    for _ in range(batches):
        comm.Barrier()
        for _ in range(LEAD_IN):
            step()
        t0 = now()
        for _ in range(iters):
            step()
        t = now() - t0
        finish()  # p3 owes the last update: untimed, as the lead-in's was owed when the window opened
        per_batch.append(slowest(comm, t) / iters)
    return per_batch


class Bench:
    def __init__(self, args):
        import torch
        from mpi4py import MPI

        from jobs.common.devices import describe, rank_device
        from mpicomm import Topology
        from runtime.workloads.models import build_model, loss_fn, model_input

        torch.set_num_threads(args.threads)  # default 1: the ranks share the cores
        self.args, self.MPI, self.torch = args, MPI, torch
        self.topo = Topology(ranks_per_node=args.ranks_per_node)
        self.comm, self.P = self.topo.world, self.topo.size
        self.device = dev = rank_device(args.device, self.topo)
        self.device_info = describe(dev, self.comm)  # collective; the transport is each contender's
        # Horovod's synthetic protocol: one batch, made once, already where the model is.
        inputs, target = model_input(args.model, args.batch_size, args.seed + self.topo.rank)
        self.inputs, self.target = tuple(t.to(dev) for t in inputs), target.to(dev)
        self.compute = Compute.from_args(args)
        # Every timed batch ends with the device idle (a GPU, or an emulated one), so that the clock measures its
        # work (not its queueing).
        self.sync = lambda: self.compute.synchronize(dev)
        # Emulated (if so) before a strategy or DDP hooks its parameters; a fresh model per contender and round.
        self.build = lambda: self.compute.model(
            (torch.manual_seed(args.seed), build_model(args.model).to(dev))[1], self.inputs)
        self.loss = self.compute.loss(loss_fn(args.model))
        self.ranks_per_core = host_usage.ranks_per_core(self.comm)  # collective
        # Set by the emulated cluster, where each host is a namespace with this one interface.
        self.iface = os.environ.get("MPITRAIN_CLUSTER_IFACE")
        self.steps = args.warmup + args.batches * steps_per_batch(args.iters)  # per contender and round

    def timed(self, step, finish=lambda: None, warmup: int | None = None) -> tuple[list[float], dict, dict | None]:
        """(per-batch seconds per step, slowest rank, after warm-up (--warmup steps unless given); bytes sent per
        timed step (wire_per_step); this rank's modelled device seconds per timed step and kind, or None)."""
        a = self.args

        def done():
            finish()
            self.sync()
        timed_batches(self.comm, step, done, a.warmup if warmup is None else warmup, 0, a.iters)  # the warm-up alone
        self.comm.Barrier()
        tx0, modelled = self.host_tx_bytes(), host_usage.modelled_s()
        per_batch = timed_batches(self.comm, step, done, 0, a.batches, a.iters, self.compute.now)
        modelled = host_usage.modelled_since(modelled, a.batches * steps_per_batch(a.iters))
        tx1 = self.host_tx_bytes()  # every step is over: each received all it waited for, so it was sent
        return per_batch, self.wire_per_step(tx1 - tx0 if self.iface else None), modelled

    def host_tx_bytes(self) -> int:
        """Bytes this host's interface has sent, read by the host's first rank (its ranks share it), else 0."""
        if not self.iface or self.topo.local_rank != 0:
            return 0
        with open(f"/sys/class/net/{self.iface}/statistics/tx_bytes") as f:
            return int(f.read())

    def wire_per_step(self, sent: int | None) -> dict:
        """Bytes on the wire per timed step, all hosts and per host; None without an interface per host.

        The per-batch barrier and slowest-rank allreduce add a few hundred bytes per batch.
        """
        if sent is None:
            return dict(wire_bytes_per_step=None, wire_bytes_per_host_per_step=None)
        import numpy as np
        total = np.array([sent], dtype=np.int64)
        self.comm.Allreduce(self.MPI.IN_PLACE, total)
        per_step = int(total[0]) / (self.args.batches * steps_per_batch(self.args.iters))
        return dict(wire_bytes_per_step=per_step, wire_bytes_per_host_per_step=per_step / self.topo.num_nodes)

    def train_step(self, model, opt):
        def step():
            opt.zero_grad()
            self.loss(model(*self.inputs), self.target).backward()
            opt.step()
        return step

    def optimizer(self, model):
        if self.args.optimizer == "adam":
            return self.compute.optimizer(self.torch.optim.Adam(model.parameters(), lr=1e-4))
        return self.compute.optimizer(self.torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    def measure(self, name: str) -> dict:
        """One round of one contender, on a model and optimizer of its own, released before the next.

        Keys: batches (per-batch seconds per step), t_iter (their mean), wire, modelled (per kind, emulated),
        rss (peak resident MB: largest rank, all ranks); the plain step also cpu (machine CPU-seconds per
        step), a strategy also t_comm, comm_cpu, traffic, plan, transport.
        """
        host_usage.reset_peak_rss()
        out = self.compute_only() if name == COMPUTE else self.strategy(name)
        out["rss"] = host_usage.peak_rss_mb(self.comm)  # collective
        release_memory()
        out["t_iter"] = sum(out["batches"]) / len(out["batches"])
        return out

    def compute_only(self) -> dict:
        """The step with no synchronisation at all, and the machine's CPU-seconds per step it cost."""
        model = self.build()
        opt = self.optimizer(model)
        c0 = ranks_cpu_s(self.comm)
        per_batch, wire, modelled = self.timed(self.train_step(model, opt))
        return dict(batches=per_batch, wire=wire, modelled=modelled, cpu=(ranks_cpu_s(self.comm) - c0) / self.steps)

    def strategy(self, name: str) -> dict:
        """One strategy's timed steps and T_comm; a sparse one's traffic, a hybcomm one's plan."""
        torch = self.torch
        model = self.build()
        opt = self.optimizer(model)
        out = dict(traffic={}, plan=None, t_comm=None, comm_cpu=None)
        if name == "ddp":
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            # gloo all-reduces CUDA tensors itself (through host memory); device_ids: the module's one GPU.
            cuda = self.device.type == "cuda"
            # Its gradients are views of its buckets: no copies in and out (on a GPU, the device's; here, the host's).
            ddp = DDP(model, device_ids=[self.device.index] if cuda else None, gradient_as_bucket_view=True)
            out["transport"] = "torch DDP, gloo" + (" (CUDA tensors)" if cuda else "")
            c0 = ranks_cpu_s(self.comm)
            out["batches"], out["wire"], out["modelled"] = self.timed(self.train_step(ddp, opt))
            out["step_cpu"] = (ranks_cpu_s(self.comm) - c0) / self.steps
            model.zero_grad(set_to_none=True)  # the steps' gradients are done with: room for the flat buffer
            flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=self.device)
            grads = fixed_gradients(model) or [torch.randn_like(flat)]
            views = flat.split([g.numel() for g in grads])

            def allreduce():  # the same copy of every gradient as the strategies' sync below
                for view, g in zip(views, grads):
                    view.copy_(g.view(-1))
                dist.all_reduce(flat)
            out["t_comm"], out["comm_cpu"] = self._time_comm(allreduce)
            return out
        from runtime import DistributedOptimizer

        base = name.removesuffix("+pto")
        strategy = strategy_options(base, self.args)
        hybrid = base == "hybcomm" or base in FORCED
        with DistributedOptimizer(opt, model, strategy, topology=self.topo, pto=name.endswith("+pto")) as dopt:
            out["transport"] = getattr(dopt, "transport", self.device_info["transport"])
            before = self._traffic(dopt) if base in SPARSE else None  # hybcomm's traffic counts other things
            exchange = getattr(dopt.strategy, "exchange", None)  # p3's: it counts messages and polls
            counted = (exchange.messages, exchange.polls) if exchange is not None else None
            trials = dopt.strategy.trials  # credit="online": its trials are warm-up, the credit kept is timed
            extra = len(trials.schedule) + 2 if trials is not None else 0
            c0 = ranks_cpu_s(self.comm)
            out["batches"], out["wire"], out["modelled"] = self.timed(self.train_step(model, dopt),
                                                                      dopt.synchronize, self.args.warmup + extra)
            steps = self.steps + extra
            out["step_cpu"] = (ranks_cpu_s(self.comm) - c0) / steps
            if counted is not None:
                out["p3"] = dict(settings=dopt.strategy.tuning.describe(),
                                 messages=(exchange.messages - counted[0]) / steps,
                                 polls=(exchange.polls - counted[1]) / steps)
                if trials is not None:
                    out["p3"]["online"] = trials.describe()
            out["plan"] = plan_rows(dopt.strategy, PLAN_KEYS)
            if before is not None:
                out["traffic"] = {k: (v - before[k]) / steps for k, v in self._traffic(dopt).items()}
            if hybrid:  # no T_comm (see the module's docstring)
                return out
            params = list(model.parameters())
            grads = fixed_gradients(model) or [torch.randn_like(p) for p in params]

            def sync_only():
                # Fresh gradients each call (one copy into the strategy's buffers, as DDP's sync above
                # copies): every parameter counts as produced, so every strategy exchanges, and waits for,
                # all of them. A gradient left from the last call would count as none this step, and p3
                # would owe, and wait for, nothing.
                for p, g in zip(params, grads):
                    p.grad = g
                dopt.step()
                dopt.synchronize()
            if counted is not None:
                counted = exchange.polls
            out["t_comm"], out["comm_cpu"] = self._time_comm(sync_only)
            if counted is not None:
                out["p3"]["comm_polls"] = (exchange.polls - counted) / (max(1, self.args.iters) + 1)
        return out

    def _traffic(self, dopt) -> dict | None:
        """Bytes sent so far by every rank's sparse exchange, summed."""
        traffic = dopt.strategy.traffic
        import numpy as np
        mine = np.array([traffic.intra, traffic.inter], dtype=np.int64)
        self.comm.Allreduce(self.MPI.IN_PLACE, mine)
        return {"intra_node_bytes_per_step": int(mine[0]), "inter_node_bytes_per_step": int(mine[1])}

    def _time_comm(self, fn) -> tuple[float, float]:
        """(seconds per call, slowest rank; machine CPU-seconds per call) of --iters calls after one untimed."""
        fn()
        self.sync()
        self.comm.Barrier()
        c0 = ranks_cpu_s(self.comm)
        t0 = time.perf_counter()
        n = max(1, self.args.iters)
        for _ in range(n):
            fn()
        self.sync()
        seconds = slowest(self.comm, time.perf_counter() - t0) / n
        return seconds, (ranks_cpu_s(self.comm) - c0) / n


def fixed_gradients(model) -> list | None:
    """An emulated model's fixed gradients (runtime.emulate), one per parameter: T_comm's gradients without a
    second model-sized copy (VGG-19 at 224x224: 575 MB a rank); None for a model that computes. A LARGE one
    keeps no template (runtime.emulate.pattern): its landed .grad, of the same values, stands in (where the
    strategy's .grad views its buffer, its copy in is no copy), or, with no .grad, one made from its rows."""
    from runtime.emulate.pattern import fixed
    params = list(model.parameters())
    if not params or not all(hasattr(p, "_emulated_grad") for p in params):
        return None
    return [p.grad if p._emulated_grad is None and p.grad is not None else fixed(p) for p in params]


def main(argv=None, args=None) -> int:
    args = parse_args(argv) if args is None else args
    t_start = time.perf_counter()
    b = Bench(args)
    if "ddp" in args.strategies:
        from mpicomm.torchdist import init_gloo

        init_gloo(b.comm)
    contenders = [COMPUTE, *args.strategies]
    warm_mpi(b.comm, args.model)
    results: dict[str, list[dict]] = {c: [] for c in contenders}
    for k in range(args.rounds):
        shift = k % len(contenders)  # each contender in turn goes first: none always gets the fresh machine
        for name in contenders[shift:] + contenders[:shift]:
            r = b.measure(name)
            results[name].append(r)
            if b.topo.rank == 0:
                comm = "" if r.get("t_comm") is None else f", T_comm {r['t_comm']:.4f} s"
                print(f"# {time.perf_counter() - t_start:.1f} s: round {k + 1}/{args.rounds} {name}: "
                      f"T_iter {r['t_iter']:.4f} s{comm}", flush=True)
    for name in args.strategies:
        out = row(args, b, name, results[name], results[COMPUTE])
        if b.topo.rank == 0:
            print_row(out)
    if "ddp" in args.strategies:
        from mpicomm.torchdist import shutdown_gloo

        shutdown_gloo(b.comm)
    b.topo.free()
    return 0


if __name__ == "__main__":
    ARGS = parse_args()  # a bad input stops here, one line and exit 2, before torch and MPI start
    from mpicomm.launch import run_main

    run_main(lambda: main(args=ARGS))
