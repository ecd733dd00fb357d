"""Pipeline pieces without MPI: SpecTrain's version differences, the 1F1B order, the partitioner."""

from __future__ import annotations

import pytest
import torch.nn as nn

from runtime.pipeline import PartitionError, as_layers, best_balance, diagram, schedule, version_difference
from runtime.pipeline.partition import LayerProfile, check_balance

# (s_forward, s_backward) per stage k, written out: paper = (⌊k/2⌋ + N − k − 1, ⌊k/2⌋); once = (N − k − 1) twice.
PAPER = {2: [(1, 0), (0, 0)],
         3: [(2, 0), (1, 0), (1, 1)],
         4: [(3, 0), (2, 0), (2, 1), (1, 1)]}
ONCE = {2: [(1, 1), (0, 0)],
        3: [(2, 2), (1, 1), (0, 0)],
        4: [(3, 3), (2, 2), (1, 1), (0, 0)]}


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_spectrain_version_differences_follow_the_table(stages):
    assert [version_difference(k, stages) for k in range(stages)] == PAPER[stages]
    assert [version_difference(k, stages, "once") for k in range(stages)] == ONCE[stages]


def test_the_comment_diagram_is_what_the_schedule_does():
    with open(schedule.__file__) as f:
        assert diagram(4, 8) in f.read().replace("#     stage", "stage")


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 8, 9])
def test_1f1b_completes_and_holds_at_most_n_minus_k_in_flight(stages, micro):
    schedule.ticks(stages, micro)  # raises on a deadlock
    for k in range(stages):
        ops = list(schedule.step_ops(k, stages, 0, micro, 0)) + list(schedule.drain_ops(k, stages, micro, 0))
        assert sorted(ops) == sorted([(op, i) for i in range(micro) for op in "FB"])
        held = peak = 0
        for op, _ in ops:
            held += 1 if op == "F" else -1
            peak = max(peak, held)
        assert peak == min(stages - k, micro)


def test_asynchronous_steps_are_one_continuous_stream():
    """Three steps of 4 micro-batches, never drained, are the 1F1B order of 12 micro-batches."""
    for k in range(4):
        steps = [op for t in range(3) for op in schedule.step_ops(k, 4, 4 * t, 4, 0)]
        stream = list(schedule.step_ops(k, 4, 0, 12, 0))
        assert steps == stream


def test_as_layers_flattens_and_names_what_is_not_a_chain():
    inner = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    assert len(as_layers(nn.Sequential(inner, nn.Linear(3, 1)))) == 3
    with pytest.raises(PartitionError, match="layer 1 is a int, not an nn.Module"):
        as_layers([nn.ReLU(), 3])
    with pytest.raises(PartitionError, match="Bilinear is not sequential"):
        as_layers(nn.Bilinear(2, 2, 2))
    with pytest.raises(PartitionError, match="covers 3 layers, the model has 4"):
        check_balance([1, 2], 4)
    with pytest.raises(PartitionError, match="empty stage"):
        check_balance([4, 0], 4)


def test_best_balance_minimises_the_slowest_stage_with_the_transfers():
    def profile(seconds, out_bytes=0):
        return [LayerProfile(str(i), s, out_bytes, 0, 0) for i, s in enumerate(seconds)]

    assert best_balance(profile([1, 1, 1, 1]), 2) == [2, 2]
    assert best_balance(profile([4, 1, 1, 1, 1]), 2) == [1, 4]
    assert best_balance(profile([1, 1, 1, 1, 1, 1]), 3) == [2, 2, 2]
    # A cut after layer 1 would send its 1-byte output at 1 bit/s (8 s): the even split moves.
    slow = profile([1, 1, 1, 1])
    slow[1] = LayerProfile("1", 1, 1, 0, 0)
    assert best_balance(slow, 2) == [2, 2]
    assert best_balance(slow, 2, bandwidth_bps=1.0) == [1, 3]
    assert best_balance(profile([1, 1]), 2) == [1, 1]
