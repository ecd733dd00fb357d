"""MSTopK: exactly k valid unique indices, signed values, near-exact captured mass, ties, dtypes, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.sparse.mstopk import MSTopK, _first_true
from runtime.sparse.selection import exact_topk, k_for_density

torch.set_num_threads(1)

VARIANTS = {"sampled": dict(sampled=True), "bisection": dict(sampled=False)}


@pytest.fixture(params=list(VARIANTS))
def op(request):
    return MSTopK(**VARIANTS[request.param])


def check_selection(x, k, values, indices, index_dtype=torch.int64):
    """Exactly k unique in-range indices, and the values are x's own (signed) values there."""
    flat = x.reshape(-1)
    assert values.shape == (k,) and indices.shape == (k,)
    assert indices.dtype == index_dtype and values.dtype == x.dtype
    assert int(indices.min()) >= 0 and int(indices.max()) < flat.numel()
    assert torch.unique(indices).numel() == k
    assert torch.equal(values, flat[indices.long()])


def mass_ratio(x, k, values):
    exact_values, _ = exact_topk(x, k)
    return float((values.double() ** 2).sum() / (exact_values.double() ** 2).sum())


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 1000, 4097, 50_000])
def test_exactly_k_for_many_sizes(op, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for k in sorted({1, 2, n // 3, n // 2, n - 1, n} - {0}):
        if k <= n:
            check_selection(x, k, *op(x, k))


@pytest.mark.parametrize("data", ["normal", "cubed", "outlier"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_captures_the_top_k_mass(op, data, density):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=g)
    if data == "cubed":
        x = x ** 3  # heavy-tailed
    elif data == "outlier":
        x[12_345] = -1e30  # one value 1e30x the rest: the value range is mostly empty
    k = k_for_density(x.numel(), density)
    values, indices = op(x, k)
    check_selection(x, k, values, indices)
    assert mass_ratio(x, k, values) >= 0.99
    if data == "outlier":
        assert 12_345 in indices.tolist()


def test_default_search_finds_the_exact_set_on_distinct_values():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(2))
    for sampled in (True, False):
        _, indices = MSTopK(sampled=sampled)(x, 1000)
        assert set(indices.tolist()) == set(exact_topk(x, 1000)[1].tolist())


def test_few_iterations_still_return_exactly_k():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(3)) ** 3
    for iters in (1, 2, 3):
        for sampled in (True, False):
            check_selection(x, 500, *MSTopK(iters, sampled=sampled)(x, 500))


@pytest.mark.parametrize("k", [1, 10, 999, 1000])
def test_all_equal_values(op, k):
    x = torch.full((1000,), -2.5)
    values, indices = op(x, k)
    check_selection(x, k, values, indices)
    assert torch.all(values == -2.5)


def test_ties_at_the_threshold(op):
    # 5 clear winners, then 100 tied at the threshold: all 5 plus 45 of the tied ones.
    x = torch.cat([torch.full((5,), 3.0), torch.full((100,), -1.0), torch.full((1000,), 0.5)])
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(4))]
    values, indices = op(x, 50)
    check_selection(x, 50, values, indices)
    assert int((values == 3.0).sum()) == 5 and int((values == -1.0).sum()) == 45


def test_zeros(op):
    zeros = torch.zeros(1000)
    check_selection(zeros, 10, *op(zeros, 10))
    sparse = torch.zeros(10_000)
    sparse[[3, 500, 9_999]] = torch.tensor([1.0, -2.0, 0.5])
    values, indices = op(sparse, 100)  # more than the nonzeros: all of them, then zeros
    check_selection(sparse, 100, values, indices)
    assert {3, 500, 9_999} <= set(indices.tolist()) and int((values != 0).sum()) == 3


def test_band_fill_scans_only_as_far_as_it_needs():
    m = np.zeros(1_000_000, dtype=bool)
    m[::10_000] = True  # sparse: the first prefix holds too few, so the scan has to grow
    assert _first_true(m, 50).tolist() == list(range(0, 500_000, 10_000))
    assert _first_true(m, 100).tolist() == list(range(0, 1_000_000, 10_000))
    assert _first_true(np.ones(10, dtype=bool), 3).tolist() == [0, 1, 2]


def test_negative_values_selected_by_magnitude(op):
    x = torch.tensor([-5.0, 1.0, -0.1, 4.0, -3.0, 0.2, 2.0])
    values, indices = op(x, 3)
    assert sorted(indices.tolist()) == [0, 3, 4]
    assert sorted(values.tolist()) == [-5.0, -3.0, 4.0]


def test_k_equal_numel_returns_everything_as_a_copy(op):
    x = torch.randn(4, 5)
    values, indices = op(x, 20)
    assert torch.equal(indices, torch.arange(20)) and torch.equal(values, x.reshape(-1))
    values.zero_()
    assert x.abs().sum() > 0


def test_any_shape_noncontiguous_and_requires_grad(op):
    base = torch.randn(30, 40, 50, generator=torch.Generator().manual_seed(5), requires_grad=True)
    x = base.transpose(0, 2)  # not contiguous
    values, indices = op(x, 600)
    check_selection(x.detach(), 600, values, indices)
    assert not values.requires_grad
    assert mass_ratio(x.detach(), 600, values) >= 0.99


def test_int32_indices():
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(6))
    values, indices = MSTopK(index_dtype=torch.int32)(x, 500)
    check_selection(x, 500, values, indices, index_dtype=torch.int32)
    values64, indices64 = MSTopK()(x, 500)
    assert torch.equal(indices.long(), indices64) and torch.equal(values, values64)
    assert exact_topk(x, 5, index_dtype=torch.int32)[1].dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_float_dtypes(op, dtype):
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(7)).to(dtype)
    values, indices = op(x, 1000)
    check_selection(x, 1000, values, indices)
    assert mass_ratio(x, 1000, values) >= 0.99


def test_reuse_across_sizes_keeps_one_workspace_per_size():
    op = MSTopK()
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(n, generator=g) for n in (10_000, 3_000, 10_000)] + [torch.randn(10_000).double()]
    for x in xs:
        check_selection(x, 100, *op(x, 100))
    assert set(op._cache) == {(10_000, torch.float32), (3_000, torch.float32), (10_000, torch.float64)}
    buffer = op._cache[(10_000, torch.float32)].abs_t.data_ptr()
    check_selection(xs[0], 200, *op(xs[0], 200))
    assert op._cache[(10_000, torch.float32)].abs_t.data_ptr() == buffer  # same size: nothing reallocated
    op.clear_cache()
    assert not op._cache


def test_same_seed_same_result():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(9))
    a, b = MSTopK(seed=3), MSTopK(seed=3)
    for _ in range(2):
        va, ia = a(x, 777)
        vb, ib = b(x, 777)
        assert torch.equal(ia, ib) and torch.equal(va, vb)


@pytest.mark.parametrize("estimate", [0.0, 0.3, 1e9])
def test_a_wrong_sample_estimate_costs_time_not_correctness(estimate):
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(10))
    op = MSTopK()
    op._sample_threshold = lambda ws, k: estimate  # far too low, too low, too high
    values, indices = op(x, 1000)
    check_selection(x, 1000, values, indices)
    assert mass_ratio(x, 1000, values) >= 0.99


def test_exact_topk_reference():
    x = torch.tensor([[0.5, -4.0], [3.0, -1.0]])
    values, indices = exact_topk(x, 2)
    assert indices.dtype == torch.int64
    assert sorted(zip(indices.tolist(), values.tolist())) == [(1, -4.0), (2, 3.0)]


def test_k_for_density():
    assert k_for_density(25_000_000, 0.001) == 25_000
    assert k_for_density(100, 0.07) == 7 and k_for_density(100, 0.29) == 29  # no float fuzz
    assert k_for_density(1000, 0.0015) == 2 and k_for_density(10, 1e-9) == 1 and k_for_density(10, 1.0) == 10
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
            k_for_density(100, bad)
    with pytest.raises(ValueError, match="numel must be a positive integer"):
        k_for_density(0, 0.1)


@pytest.mark.parametrize("select", [MSTopK(), exact_topk], ids=["mstopk", "exact"])
def test_bad_input(select):
    with pytest.raises(ValueError, match="empty tensor"):
        select(torch.empty(0), 1)
    with pytest.raises(ValueError, match="floating-point tensor, got dtype torch.int64"):
        select(torch.arange(10), 1)
    with pytest.raises(ValueError, match="k must be at least 1, got 0"):
        select(torch.randn(10), 0)
    with pytest.raises(ValueError, match=r"k=11 is larger than the tensor \(10 elements\)"):
        select(torch.randn(2, 5), 11)
    with pytest.raises(TypeError, match="k must be an integer"):
        select(torch.randn(10), 2.0)


def test_bad_construction():
    with pytest.raises(ValueError, match="iters must be a positive integer"):
        MSTopK(0)
    with pytest.raises(ValueError, match="index_dtype must be torch.int64 or torch.int32"):
        MSTopK(index_dtype=torch.float32)
