"""wfbp's fuse_bytes="auto": every rank settles on the same bucket size, the cost model's, and buckets by it."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_everywhere
from layout_helpers import sub_topology
from runtime import DistributedOptimizer, WfbpOptions
from runtime.dense.wfbp import auto_fuse_bytes, buckets
from runtime.trace.timeline import Timeline

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

MI = 1 << 20


@pytest.mark.parametrize("P,L,link,expect", [(4, 1, "1gbit", MI), (4, 1, "100gbit", 4 * MI), (4, 2, "100gbit", 4 * MI),
                                             (2, 2, "1gbit", None)], ids=lambda v: str(v))
def test_auto_buckets_follow_the_cost_models_size_on_every_rank(world, P, L, link, expect, monkeypatch):
    """A slow link keeps 1 MiB buckets; a fast one, whose ring steps cost more than 1 MiB of bytes, takes the
    largest the 50 MB gradient allows (1/8 of it, 4 MiB). The link is the variable every rank reads."""
    monkeypatch.setenv("MPITRAIN_LINK_BANDWIDTH", link)
    with sub_topology(world, P, L) as (comm, topo):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])  # 50 MB of gradients
        tl = Timeline(comm.Get_rank())
        dopt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, WfbpOptions(), topology=topo,
                                    timeline=tl)
        try:
            fuse = dopt.options.fuse_bytes
            sizes = comm.allgather(fuse)
            assert_everywhere(comm, len(set(sizes)) == 1 and isinstance(fuse, int), f"settled {sizes}")
            total = sum(p.numel() * 4 for p in model.parameters())
            assert_everywhere(comm, fuse == auto_fuse_bytes(topo, None, total) and fuse == (expect or fuse), f"{fuse}")
            assert_everywhere(comm, dopt.strategy.bucket_params == buckets(dopt.params, fuse), "buckets")
            said = [e["args"] for e in tl.to_trace()["traceEvents"] if e["name"] == "wfbp buckets"]  # what it took
            assert_everywhere(comm, said == [{"fuse_bytes": fuse, "buckets": len(dopt.strategy.buckets)}], f"{said}")
            model(torch.randn(4, 1024)).sum().backward()
            dopt.step()  # the settled layout trains
        finally:
            dopt.close()
