"""Plan: which fully connected layers hybcomm sends as sufficient factors (SFB) or through the dense path (PS).

    mpitrain plan --model vgg19-22k --batch-size 8 --ranks 8
    mpitrain plan --model vgg19-22k --batch-size 32 --ranks 8 --ranks-per-node 2 --bandwidth 1gbit
    mpitrain plan --model transformer --batch-size 16 --ranks 4 --gflops 50 --json results/plan.json

No MPI and no training: one forward pass on a synthetic batch of --batch-size samples counts the
rows K each eligible nn.Linear sees per rank (batch, or batch x positions), then
runtime.hybrid.cost_model prices both paths per layer for --ranks ranks (--ranks-per-node
each, consecutive on the ring) on links of --bandwidth (between nodes) and --intra-bandwidth
(within one), with --gflops for the factor products (default: measured here). Prints a
markdown table (MB and ms per step over the busiest link) and the bytes per step of the
whole model by the plan vs all-PS; --json writes the same (meta, layers, refused,
dense_bytes, totals).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict

from jobs.common.choices import HYBCOMM_FORCE as FORCE
from jobs.common.choices import MODELS
from jobs.common.inputs import InputError, JobParser, at_least, link_rate, one_of, output_file, parse
from jobs.common.report import run_metadata, write_document


def parse_args(argv=None):
    p = JobParser(prog="python -m jobs.hybcomm_plan", description=__doc__.split("\n\n")[0],
                  formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default="vgg19-22k", help="a runtime.workloads.models name (default vgg19-22k)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step (default 8)")
    p.add_argument("--ranks", type=int, default=8, help="P (default 8)")
    p.add_argument("--ranks-per-node", type=int, default=1, help="must divide --ranks (default 1)")
    p.add_argument("--bandwidth", default="10gbit", help="a node's network link, each direction (default 10gbit, "
                                                         "as HybCommOptions)")
    p.add_argument("--intra-bandwidth", default="40gbit", help="between ranks of one node (default 40gbit)")
    p.add_argument("--gflops", type=float, help="one rank's GEMM rate (default: measured on this machine)")
    p.add_argument("--force", choices=FORCE, default="auto")
    p.add_argument("--json", metavar="PATH")
    return parse(p, argv, check_args)


def check_args(args) -> None:
    one_of("--model", args.model, MODELS)
    at_least(args, 1, "batch_size", "ranks", "ranks_per_node")
    if args.ranks % args.ranks_per_node:
        raise InputError("--ranks-per-node", f"{args.ranks_per_node} does not divide --ranks {args.ranks}")
    if args.gflops is not None and not 0 < args.gflops < math.inf:
        raise InputError("--gflops", f"must be a positive finite number, got {args.gflops}")
    output_file(args, "json")
    args.inter_bps = link_rate("--bandwidth", args.bandwidth)  # last: imports torch
    args.intra_bps = link_rate("--intra-bandwidth", args.intra_bandwidth)


def count_rows(model, layers, inputs) -> tuple[dict[str, int], dict[str, int]]:
    """({name: rows per step}, {name: calls}) of the eligible layers in one forward pass.

    rows = input.numel() // M: a [B, T, M] input is B·T rows, each a sufficient factor.
    """
    import torch

    rows = {layer.name: 0 for layer in layers}
    calls = dict(rows)

    def recorder(layer):
        def record(module, args, kwargs, output):
            x = args[0] if args else kwargs["input"]
            rows[layer.name] += x.numel() // layer.M
            calls[layer.name] += 1
        return record

    handles = [layer.module.register_forward_hook(recorder(layer), with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return rows, calls


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpicomm.emulation import format_bandwidth
    from runtime.hybrid.cost_model import Links, format_plan, measure_gflops, plan, totals
    from runtime.hybrid.layers import fc_layers
    from runtime.workloads.models import build_model, model_input

    P, per_node = args.ranks, args.ranks_per_node
    model = build_model(args.model)
    layers, refused = fc_layers(model)
    inputs, _ = model_input(args.model, args.batch_size)
    rows, calls = count_rows(model, layers, inputs)
    # SFB sends the factors of one forward: a layer run twice has two sets, one unused has none.
    ps_only = {name: "used twice in one forward" for name, n in calls.items() if n > 1}
    ps_only.update({name: "not used in the forward" for name, n in calls.items() if n == 0})

    measured = args.gflops is None
    gflops = measure_gflops() if measured else args.gflops
    links = Links(args.inter_bps, args.intra_bps, gflops)
    costs = plan(layers, rows, P, per_node, links, force=args.force, ps_only=ps_only)

    # Every other trainable parameter goes through the dense path's ring allreduce.
    fc_params = {id(p) for layer in layers for p in
                 ([layer.module.weight] + ([layer.module.bias] if layer.has_bias else []))}
    dense_numel = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in fc_params)
    dense_bytes = round(2 * (P - 1) / P * dense_numel * 4)

    nodes = P // per_node
    rate = f"measured here: {gflops:.1f} GFLOP/s" if measured else f"{gflops:g} GFLOP/s"
    print(f"{args.model}, batch {args.batch_size} per rank: P = {P} rank{'s' * (P > 1)}, {per_node} per node, {nodes} "
          f"node{'s' * (nodes > 1)}; links {format_bandwidth(args.inter_bps)} between nodes, "
          f"{format_bandwidth(args.intra_bps)} within one; GEMM per rank {rate}\n")
    print(format_plan(costs, dense_bytes=dense_bytes))
    if refused:
        print("\nrefused (dense path):")
        for name, why in refused.items():
            print(f"  {name}: {why}")
    if args.json:
        meta = run_metadata("jobs.hybcomm_plan", argv, model=args.model, batch_size=args.batch_size, ranks=P,
                            ranks_per_node=per_node, nodes=nodes, inter_bps=args.inter_bps,
                            intra_bps=args.intra_bps, gflops=gflops, gflops_measured=measured, force=args.force)
        write_document(args.json, dict(meta=meta, layers=[asdict(c) for c in costs], refused=refused,
                                       dense_bytes=dense_bytes, totals=totals(costs, dense_bytes)))
    return 0


if __name__ == "__main__":
    from mpicomm.quick_exit import exit_with

    exit_with(main)
