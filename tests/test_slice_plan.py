"""P3's slice plan: coverage of the flat buffers, tensor-slice maps, owners, tags and their bound."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from mpi4py import MPI

from conftest import ROOT
from mpicomm.slice_plan import SlicePlan
from mpicomm.tags import TagError, check_tag, explicit_tag_bound

SELF = MPI.COMM_SELF


def plan(buffer_sizes, segments, slice_size, ranks=1):
    return SlicePlan(buffer_sizes, segments, slice_size, ranks, SELF)


def overlaps(slice_, segment) -> bool:
    (b, a, z), (tb, ta, tz) = slice_, segment
    return b == tb and ta < tz and a < tz and ta < z


def check_plan(p: SlicePlan, buffer_sizes, segments, slice_size, ranks) -> None:
    """Every invariant of a plan, checked against brute force."""
    # Each buffer is cut at multiples of slice_size, in buffer order: every element once, in order.
    want = [(b, a, min(a + slice_size, n)) for b, n in enumerate(buffer_sizes) for a in range(0, n, slice_size)]
    assert p.slices == want and p.count == len(want)
    for b, n in enumerate(buffer_sizes):
        covered = [i for (sb, a, z) in p.slices if sb == b for i in range(a, z)]
        assert covered == list(range(n))
    assert all(0 < z - a <= slice_size for _, a, z in p.slices)
    # slices_of and tensors_of: exactly the overlapping pairs, each list in increasing order.
    assert len(p.slices_of) == len(segments) and len(p.tensors_of) == p.count
    for t, seg in enumerate(segments):
        assert p.slices_of[t] == [s for s, sl in enumerate(p.slices) if overlaps(sl, seg)], (t, seg)
        b, ta, tz = seg
        if tz > ta:  # a tensor's slices span exactly its range, with no gap
            first, last = p.slices[p.slices_of[t][0]], p.slices[p.slices_of[t][-1]]
            assert first[1] <= ta < first[2] and last[1] < tz <= last[2]
            assert p.slices_of[t] == list(range(p.slices_of[t][0], p.slices_of[t][-1] + 1))
    for s, sl in enumerate(p.slices):
        assert p.tensors_of[s] == [t for t, seg in enumerate(segments) if overlaps(sl, seg)], (s, sl)
    # Owners round-robin; push and result tags all distinct and explicit.
    assert [p.owner(s) for s in range(p.count)] == [s % ranks for s in range(p.count)]
    tags = [p.push_tag(s) for s in range(p.count)] + [p.result_tag(s) for s in range(p.count)]
    assert len(set(tags)) == len(tags)
    assert all(check_tag(SELF, tag) == tag for tag in tags)


# Buffer 0: t0, t1 share slice 0 (t1 ends on its boundary), t2 crosses four slices, t3 is empty, t4 shares
# slice 4 with t2's tail. Buffer 1 (interleaved tensor order, as with mixed dtypes): t5 over two slices.
# Buffer 2 is empty, and so is its tensor t6.
SIZES = [20, 6, 0]
SEGMENTS = [(0, 0, 2), (0, 2, 4), (0, 4, 17), (0, 17, 17), (1, 0, 6), (0, 17, 20), (2, 0, 0)]


def test_slices_cut_each_buffer_in_order_at_most_slice_size_long():
    p = plan(SIZES, SEGMENTS, 4)
    assert p.slices == [(0, 0, 4), (0, 4, 8), (0, 8, 12), (0, 12, 16), (0, 16, 20), (1, 0, 4), (1, 4, 6)]
    check_plan(p, SIZES, SEGMENTS, 4, 1)


def test_slices_of_and_tensors_of_are_inverse_maps():
    """Small tensors share a slice, a long one spans several, an empty one has none.

    Catches: stop // slice_size instead of (stop - 1) // slice_size (t1 would also claim slice 1), slices
    numbered per buffer rather than globally (t5 would claim slices 0 and 1 of buffer 0), an empty tensor
    given the slice at its position.
    """
    p = plan(SIZES, SEGMENTS, 4)
    assert p.slices_of == [[0], [0], [1, 2, 3, 4], [], [5, 6], [4], []]
    assert p.tensors_of == [[0, 1], [2], [2], [2], [2, 5], [4], [4]]
    for t, ids in enumerate(p.slices_of):
        assert all(t in p.tensors_of[s] for s in ids)


def test_one_element_slices_and_one_slice_for_everything():
    check_plan(plan(SIZES, SEGMENTS, 1), SIZES, SEGMENTS, 1, 1)
    whole = plan(SIZES, SEGMENTS, 1000)
    assert whole.slices == [(0, 0, 20), (1, 0, 6)]
    assert whole.tensors_of == [[0, 1, 2, 5], [4]]


def test_owners_are_round_robin_over_the_ranks():
    """Every rank is the server of every ranks-th slice, so the load differs by at most one slice."""
    p = SlicePlan(SIZES, SEGMENTS, 4, 3, SELF)
    assert [p.owner(s) for s in range(p.count)] == [0, 1, 2, 0, 1, 2, 0]
    alone = plan(SIZES, SEGMENTS, 4)
    assert {alone.owner(s) for s in range(alone.count)} == {0}


def test_push_and_result_tags_are_distinct_and_explicit():
    """A result tag equal to some push tag would let an owner's average be taken for a peer's push."""
    p = plan(SIZES, SEGMENTS, 4)
    push = {p.push_tag(s) for s in range(p.count)}
    result = {p.result_tag(s) for s in range(p.count)}
    assert len(push) == len(result) == p.count and not push & result
    assert max(push | result) <= explicit_tag_bound(SELF) and min(push | result) >= 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4", None])
def test_bad_slice_sizes_are_refused(bad):
    with pytest.raises(ValueError, match=f"slice_size must be an integer >= 1, got {bad!r}"):
        plan(SIZES, SEGMENTS, bad)


def test_a_plan_with_more_tags_than_the_bound_is_refused_before_it_is_built():
    """2 * slices tags must fit under explicit_tag_bound: one slice more than fits raises TagError.

    The plan is far too large to build (over 10^8 slices), so this also checks that the tag bound is checked
    before the lists are built: a plan that checked last exhausted memory instead of raising. It runs in a
    child with a memory limit, so that such a plan fails here with MemoryError rather than swapping the host.
    """
    code = (
        "import resource\n"
        "from mpi4py import MPI\n"
        "from mpicomm.slice_plan import SlicePlan\n"
        "from mpicomm.tags import TagError, explicit_tag_bound\n"
        "vm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize:')) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))\n"
        "fits = (explicit_tag_bound(MPI.COMM_SELF) + 1) // 2  # the most slices whose 2*S-1 tags fit\n"
        "for sizes, slice_size in (([fits + 1], 1), ([fits, 1], 1), ([10**12], 1000)):\n"
        "    try:\n"
        "        SlicePlan(sizes, [(0, 0, sizes[0])], slice_size, 4, MPI.COMM_SELF)\n"
        "        print('built')\n"
        "    except TagError as e:\n"
        "        print('TagError', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("TagError tag ") and "TAG_UB" in line for line in lines), out.stdout
    # `fits` slices is the largest plan: its last result tag is still explicit.
    fits = (explicit_tag_bound(SELF) + 1) // 2
    check_tag(SELF, 2 * fits - 1)
    with pytest.raises(TagError):
        check_tag(SELF, 2 * (fits + 1) - 1)


def random_layout(rng: random.Random):
    """Up to 4 buffers (some empty), tensors of 0..40 elements packed in them in an interleaved order."""
    nbuf = rng.randint(1, 4)
    sizes = [0] * nbuf
    segments = []
    for _ in range(rng.randint(0, 12)):
        b, n = rng.randrange(nbuf), rng.choice([0, 1, 2, 3, rng.randint(0, 40)])
        segments.append((b, sizes[b], sizes[b] + n))
        sizes[b] += n
    return sizes, segments


@pytest.mark.parametrize("seed", range(5))
def test_random_layouts_keep_every_invariant(seed):
    rng = random.Random(seed)
    for _ in range(200):
        sizes, segments = random_layout(rng)
        slice_size, ranks = rng.randint(1, 16), rng.randint(1, 5)
        check_plan(SlicePlan(sizes, segments, slice_size, ranks, SELF), sizes, segments, slice_size, ranks)
