"""p3's automatic slice size, credit and polling interval: bounds, monotony, what is kept as given."""

from __future__ import annotations

import itertools

import pytest

from mpicomm.link_probe import LinkEstimate
from runtime.p3 import tuning
from runtime.p3.tuning import AUTO, choose

MB = 1 << 20
LINKS = [LinkEstimate(gbit * 1e9 / 8, rt) for gbit in (0.5, 1, 2.5, 10, 25, 100) for rt in (20e-6, 200e-6, 2e-3)]
MODELS = [(0.8 * MB, 4), (24 * MB, 4), (94 * MB, 4), (156 * MB, 4), (156 * MB, 64), (24 * MB, 2), (512 * MB, 8)]


@pytest.mark.parametrize("link, model", list(itertools.product(LINKS, MODELS)))
def test_auto_settings_stay_within_their_bounds(link, model):
    total, ranks = model
    t = choose(link, int(total), 4, ranks)
    slice_bytes = t.slice_size * 4
    assert t.slice_size % 1024 == 0 and t.chosen == ("slice_size", "credit") and t.link is link
    assert tuning.MIN_SLICE_BYTES <= slice_bytes <= tuning.MAX_SLICE_BYTES
    # every rank owns a fair share: a slice is never more than 1/(4 P) of the model (unless at the floor)
    assert slice_bytes <= max(tuning.MIN_SLICE_BYTES, total / (tuning.SLICES_PER_OWNER * ranks))
    assert tuning.MIN_CREDIT <= t.credit <= tuning.MAX_CREDIT
    assert tuning.MIN_RELAXED_SLEEP <= t.relaxed_sleep <= tuning.MAX_RELAXED_SLEEP
    # a slice's fixed cost stays a small share of its time on the wire, unless the fair share caps it
    if slice_bytes < min(tuning.MAX_SLICE_BYTES, total / (tuning.SLICES_PER_OWNER * ranks)) - 4096 * 4:
        assert slice_bytes / link.bandwidth >= link.round_time / tuning.FIXED_COST_SHARE * 0.99 \
            or slice_bytes == tuning.MIN_SLICE_BYTES


def test_faster_links_get_fewer_larger_messages():
    """The issue's point: where the link is fast, messages grow (until the model's fair share caps them)."""
    rates = [0.5, 1, 2.5, 10, 25, 40]
    slices = [choose(LinkEstimate(g * 1e9 / 8, 100e-6), 156 * MB, 4, 4).slice_size for g in rates]
    assert slices == sorted(slices) and slices[0] < slices[-1]
    # a costlier message (longer small round) asks for larger slices too
    costs = [choose(LinkEstimate(2.5e9 / 8, rt), 156 * MB, 4, 4).slice_size for rt in (20e-6, 200e-6, 1e-3)]
    assert costs == sorted(costs) and costs[0] < costs[-1]


def test_given_settings_are_kept_and_only_the_auto_ones_chosen():
    link = LinkEstimate(1.25e9, 100e-6)
    t = choose(link, 156 * MB, 4, 4, slice_size=5000, credit=AUTO)
    assert (t.slice_size, t.chosen) == (5000, ("credit",))
    t = choose(link, 156 * MB, 4, 4, slice_size=AUTO, credit=3)
    assert (t.credit, t.chosen) == (3, ("slice_size",))
    assert "credit 3 (given)" in t.describe() and "MiB, auto)" in t.describe() and "Gbit/s" in t.describe()


def test_without_a_measured_link_slices_are_the_smallest_and_all_may_fly():
    """One rank, or a model too small to probe for: the floor slice and the largest credit."""
    for link in (None, LinkEstimate(float("inf"), 0.0)):
        t = choose(link, 3 * MB, 4, 4)
        assert (t.slice_size * 4, t.credit, t.relaxed_sleep) == \
            (tuning.MIN_SLICE_BYTES, tuning.MAX_CREDIT, tuning.DEFAULT_RELAXED_SLEEP)
    assert choose(None, 3 * MB, 8, 4).slice_size == tuning.MIN_SLICE_BYTES // 8  # in elements of the itemsize


def test_node_pushes_are_paced_only_with_node_peers_and_a_measured_link():
    """Twice the node's link rate over its ranks' bytes (LOCAL_PACE): pushes inside a node stay ahead of the link
    without flooding MPICH's shared memory; one rank a node, or no measured link: nothing to pace by."""
    link = LinkEstimate(1e9 / 8 / 2, 500e-6)  # 1 Gbit/s shared by 2 ranks
    assert choose(link, 575 * MB, 4, 8, ranks_per_node=2).local_rate == tuning.LOCAL_PACE * 2 * link.bandwidth
    assert choose(link, 575 * MB, 4, 8).local_rate is None
    assert choose(None, 575 * MB, 4, 8, ranks_per_node=2).local_rate is None
    assert "node pushes paced at 238 MiB/s" in choose(link, 575 * MB, 4, 8, ranks_per_node=2).describe()
