"""Pipelined Rabenseifner's plan at 2-32 exchange ranks: sends meet receives, and step by step it sums.

The MPI suite runs the algorithm on at most 4 ranks (two halving steps); the
order of the chunks nests one level deeper per doubling of P, so the plan
itself is checked here at every power of two to 32, run as a step-by-step
exchange between numpy arrays.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpicomm.buffers import block_counts, offsets
from mpicomm.halving import _dependencies, _plan, halving_steps


def plans(p2, count, per):
    offs = offsets(block_counts(count, p2)) + [count]
    return [_plan(n, p2, 0, offs, per) for n in range(p2)]


@pytest.mark.parametrize("p2", [2, 4, 8, 16, 32])
@pytest.mark.parametrize("count,per", [(0, 4), (5, 1), (97, 3), (4096, 64), (4096, 5000)])
def test_plan_pairs_and_sums(p2, count, per):
    every = plans(p2, count, per)
    assert all(len(steps) == halving_steps(p2) for steps in every)
    rng = np.random.default_rng(p2 * 1000 + count)
    data = [rng.integers(-50, 50, count) for _ in range(p2)]
    total = np.sum(data, axis=0)
    for i in range(halving_steps(p2)):
        before = [d.copy() for d in data]
        for n in range(p2):
            partner, recvs, _, reduces, _ = every[n][i]
            assert every[partner][i][0] == n, f"step {i}: {n} -> {partner} is not mutual"
            assert every[partner][i][2] == recvs, f"step {i}: {partner}'s sends differ from {n}'s receives"
            for a, z in recvs:
                data[n][a:z] = data[n][a:z] + before[partner][a:z] if reduces else before[partner][a:z]
    assert all(np.array_equal(d, total) for d in data)


@pytest.mark.parametrize("p2", [4, 8, 16])
def test_every_send_waits_for_the_sum_it_carries(p2):
    """Each send after the first step depends on a receive of an earlier step (none goes out unsummed), and a
    halving step's sends all become ready during the step before it: the pipelining the algorithm is for."""
    for steps in plans(p2, 1000, 7):
        deps = _dependencies(steps)
        assert all(d is None for d in deps[0])
        for i in range(1, len(steps)):
            assert all(d is not None and d[0] < i for d in deps[i]), f"step {i}"
        halving = p2.bit_length() - 1
        for i in range(1, halving):
            assert {d[0] for d in deps[i]} == {i - 1}


def test_a_send_matching_no_receive_is_refused():
    step0 = (1, [(0, 10)], [(10, 20)], True, (0, 10))
    step1 = (1, [(10, 20)], [(0, 5)], True, (10, 20))  # (0, 5) is half of what step 0 received as one chunk
    with pytest.raises(AssertionError, match="matches no receive"):
        _dependencies([step0, step1])
