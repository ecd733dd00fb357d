"""runtime.hybrid.cost_model: Poseidon's formulas, the ring's links, the rebuild term and the choice per layer."""

from __future__ import annotations

import math

import pytest
from torch import nn

from runtime.hybrid.cost_model import (Links, format_plan, layer_cost, measure_gflops, plan, ps_numbers,
                                       sfb_numbers, totals)
from runtime.hybrid.layers import fc_layers

SLOW = Links(inter_bps=1e9, intra_bps=40e9, gflops=50)
FAST = Links(inter_bps=10e9, intra_bps=40e9, gflops=50)
FREE_GEMM = Links(inter_bps=1e9, intra_bps=40e9, gflops=math.inf)


def test_poseidon_numbers_for_the_22k_head():
    M, N, K, P = 4096, 21841, 8, 8
    assert ps_numbers(M, N, P) == 2 * (4096 * 21841 + 21841) * 7 / 8
    assert ps_numbers(M, N, P, bias=False) == 2 * 4096 * 21841 * 7 / 8
    assert sfb_numbers(M, N, K, P) == 8 * 7 * (4096 + 21841)
    c = layer_cost("head", M, N, K, P, 1, SLOW)
    assert c.ps_link_bytes == round(2 * 7 / 8 * (4096 * 21841 + 21841) * 4)
    assert c.sfb_link_bytes == 7 * 8 * (4096 + 21841) * 4
    assert layer_cost("head", M, N, K, P, 1, SLOW, itemsize=2).sfb_link_bytes == c.sfb_link_bytes // 2
    # Both paths over 1 Gbit/s; SFB adds the rebuild: 2·P·K·M·N + P·K·N flop at 50 GFLOP/s.
    assert c.ps_seconds == pytest.approx(c.ps_link_bytes * 8 / 1e9)
    rebuild = (2 * P * K * M * N + P * K * N) / 50e9
    assert c.sfb_seconds == pytest.approx(c.sfb_link_bytes * 8 / 1e9 + rebuild)
    assert (c.choice, c.reason) == ("sfb", "cost model")


def _sfb_up_to(M, N, P, links, per_node=1):
    """The largest K that goes SFB (every smaller K too): Poseidon's crossover, from the formulas by hand."""
    ps_s = 2 * (P - 1) / P * (M * N + N) * 4 * 8 / links.inter_bps
    per_row = (P - 1) * (M + N) * 4 * 8 / links.inter_bps + (2 * P * M * N + P * N) / (links.gflops * 1e9)
    return math.floor(ps_s / per_row)


@pytest.mark.parametrize("links, expected", [(SLOW, 130), (FAST, 16)])
def test_choice_flips_from_sfb_to_ps_as_rows_grow(links, expected):
    k = _sfb_up_to(4096, 4096, 8, links)
    assert k == expected
    for rows in (1, k // 2, k):
        assert layer_cost("fc", 4096, 4096, rows, 8, 1, links).choice == "sfb"
    for rows in (k + 1, 2 * k, 4096):
        assert layer_cost("fc", 4096, 4096, rows, 8, 1, links).choice == "ps"


def test_ties_go_to_ps():
    one = layer_cost("fc", 4096, 4096, 8, 1, 1, SLOW)
    assert one.ps_seconds == one.sfb_seconds == 0 and one.ps_link_bytes == one.sfb_link_bytes == 0
    assert (one.choice, one.reason) == ("ps", "cost model")
    # No bias, free GEMM, K = M/P on a square layer: K(P-1)·2M = 2(P-1)/P·M² numbers both ways.
    even = layer_cost("fc", 64, 64, 8, 8, 1, FREE_GEMM, bias=False)
    assert even.sfb_link_bytes == even.ps_link_bytes == 28672
    assert even.sfb_seconds == even.ps_seconds
    assert even.choice == "ps"


def test_force_and_a_callers_reason():
    big_k = layer_cost("fc", 4096, 4096, 4096, 8, 1, SLOW, force="sfb")
    assert (big_k.choice, big_k.reason) == ("sfb", "forced")
    small_k = layer_cost("fc", 4096, 4096, 1, 8, 1, SLOW, force="ps")
    assert (small_k.choice, small_k.reason) == ("ps", "forced")
    # A layer that cannot use SFB this step goes PS whatever the cost or the force.
    for force in ("auto", "sfb", "ps"):
        c = layer_cost("fc", 4096, 4096, 1, 8, 1, SLOW, force=force, reason="used twice in one forward")
        assert (c.choice, c.reason) == ("ps", "used twice in one forward")
    with pytest.raises(ValueError, match="force"):
        layer_cost("fc", 4, 4, 1, 2, 1, SLOW, force="fastest")


def test_topology_picks_the_slowest_link_on_the_ring():
    links = Links(inter_bps=1e9, intra_bps=20e9, gflops=math.inf)
    one_node = layer_cost("fc", 1024, 1024, 4, 8, 8, links)
    assert one_node.ps_seconds == pytest.approx(one_node.ps_link_bytes * 8 / 20e9)
    assert one_node.ps_inter_bytes == one_node.sfb_inter_bytes == 0
    four_nodes = layer_cost("fc", 1024, 1024, 4, 8, 2, links)
    assert four_nodes.ps_seconds == pytest.approx(four_nodes.ps_link_bytes * 8 / 1e9)
    assert four_nodes.ps_inter_bytes == four_nodes.ps_link_bytes > 0
    assert four_nodes.sfb_inter_bytes == four_nodes.sfb_link_bytes > 0
    # Links per node are the same bytes: the ring leaves each node once, whatever the topology.
    assert four_nodes.ps_link_bytes == one_node.ps_link_bytes
    # One rank per node: no shared-memory link on the ring, even a slower one.
    slow_shm = Links(inter_bps=10e9, intra_bps=1e9, gflops=math.inf)
    assert layer_cost("fc", 1024, 1024, 4, 8, 1, slow_shm).ps_seconds == pytest.approx(
        one_node.ps_link_bytes * 8 / 10e9)
    assert layer_cost("fc", 1024, 1024, 4, 8, 2, slow_shm).ps_seconds == pytest.approx(
        one_node.ps_link_bytes * 8 / 1e9)


@pytest.mark.parametrize("M, N, K, P", [(4096, 4096, 8, 8), (4096, 4096, 1000, 8), (512, 10, 64, 4),
                                         (784, 256, 32, 16), (4096, 21841, 2000, 8)])
def test_a_free_gemm_compares_bytes(M, N, K, P):
    c = layer_cost("fc", M, N, K, P, 1, FREE_GEMM)
    assert c.choice == ("sfb" if c.sfb_link_bytes < c.ps_link_bytes else "ps")
    assert c.sfb_seconds == pytest.approx(c.sfb_link_bytes * 8 / 1e9)


def test_the_rebuild_makes_ps_win_on_a_fast_link():
    slow, fast = (layer_cost("fc", 4096, 4096, 100, 8, 1, links) for links in (SLOW, FAST))
    assert slow.choice == "sfb" and fast.choice == "ps"
    assert fast.sfb_link_bytes < fast.ps_link_bytes  # fewer bytes, yet slower: the GEMM over P·K rows
    assert layer_cost("fc", 4096, 4096, 100, 8, 1, Links(10e9, 40e9, math.inf)).choice == "sfb"


def _model():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16, bias=False))


def test_plan_rows_per_layer_and_ps_only():
    layers, _ = fc_layers(_model())
    costs = plan(layers, {"0": 4, "2": 12}, 4, 2, SLOW, ps_only={"2": "used twice in one forward"})
    assert [(c.name, c.M, c.N, c.bias, c.K) for c in costs] == [("0", 32, 64, True, 4), ("2", 64, 16, False, 12)]
    assert costs[0] == layer_cost("0", 32, 64, 4, 4, 2, SLOW)
    assert (costs[1].choice, costs[1].reason) == ("ps", "used twice in one forward")
    assert [c.K for c in plan(layers, 7, 4, 2, SLOW)] == [7, 7]
    assert {c.choice for c in plan(layers, 7, 4, 2, SLOW, force="sfb")} == {"sfb"}
    with pytest.raises(ValueError, match="no row count"):
        plan(layers, {"0": 4}, 4, 2, SLOW)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="inter_bps"):
        Links(0, 1e9, 50)
    with pytest.raises(ValueError, match="gflops"):
        Links(1e9, 1e9, -1)
    with pytest.raises(ValueError, match="P must be"):
        layer_cost("fc", 4, 4, 1, 0, 1, SLOW)
    with pytest.raises(ValueError, match="K must be"):
        layer_cost("fc", 4, 4, -1, 2, 1, SLOW)


def test_measure_gflops_is_a_rate():
    for rate in (measure_gflops(), measure_gflops(rows=8, size=128, repeats=1)):
        assert 0 < rate < math.inf


def test_format_plan_lists_layers_and_totals():
    layers, _ = fc_layers(_model())
    costs = plan(layers, 4, 8, 1, SLOW, ps_only={"2": "used twice in one forward"})
    text = format_plan(costs)
    assert "| 0 | 32×64 | 4 | sfb |" in text and "| 2 | 64×16 | 4 | ps (used twice in one forward) |" in text
    assert "MB/step by the plan" in text and "fewer bytes" not in text
    dense = 1_000_000
    t = totals(costs, dense)
    assert t["plan_bytes"] == costs[0].sfb_link_bytes + costs[1].ps_link_bytes + dense
    assert t["all_ps_bytes"] == costs[0].ps_link_bytes + costs[1].ps_link_bytes + dense
    assert t["ratio"] == pytest.approx(t["all_ps_bytes"] / t["plan_bytes"]) and t["ratio"] > 1
    assert f"hybcomm moves {t['ratio']:.2f}× fewer bytes than all-PS" in format_plan(costs, dense_bytes=dense)
    forced = plan(layers, 4096, 8, 1, SLOW, force="sfb")
    assert "× more bytes than all-PS" in format_plan(forced, dense_bytes=dense)
