"""DeviceMSTopK (plain torch, any device): exactly k, unique indices, signed values, mass; on CUDA against topk."""

from __future__ import annotations

import pytest
import torch

from runtime.sparse.mstopk import MSTopK
from runtime.sparse.mstopk_device import DeviceMSTopK
from runtime.sparse.selection import exact_topk, k_for_density

torch.set_num_threads(1)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")


def check_selection(x, k, values, indices, index_dtype=torch.int64):
    """Exactly k unique in-range indices, and the values are x's own (signed) values there."""
    flat = x.reshape(-1)
    assert values.shape == (k,) and indices.shape == (k,)
    assert indices.dtype == index_dtype and values.dtype == x.dtype
    assert values.device == x.device and indices.device == x.device
    assert int(indices.min()) >= 0 and int(indices.max()) < flat.numel()
    assert torch.unique(indices).numel() == k
    assert torch.equal(values, flat[indices.long()])


def mass_ratio(x, k, values):
    exact_values, _ = exact_topk(x, k)
    want = float((exact_values.double() ** 2).sum())
    return float((values.double() ** 2).sum()) / want if want > 0 else 1.0


def data(kind, n, seed=1, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "cubed":
        x = x ** 3  # heavy-tailed
    elif kind == "cauchy":
        x = torch.empty(n, dtype=torch.float64).cauchy_(generator=g)  # heavier still
    elif kind == "zeros":
        x[torch.rand(n, generator=g) < 0.995] = 0  # fewer nonzeros than k at the larger densities
    elif kind == "ties":
        x = torch.randint(-3, 4, (n,), generator=g).double()  # 7 values: the threshold is a big tie
    elif kind == "outlier":
        x[12_345] = -1e30
    return x.to(dtype).to(device)


@pytest.mark.parametrize("kind", ["normal", "cubed", "cauchy", "zeros", "ties", "outlier"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_captures_the_top_k_mass(kind, density):
    x = data(kind, 200_000)
    k = k_for_density(x.numel(), density)
    values, indices = DeviceMSTopK()(x, k)
    check_selection(x, k, values, indices)
    assert mass_ratio(x, k, values) >= 0.99
    if kind == "outlier":
        assert 12_345 in indices.tolist()


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 1000, 4097, 50_000])
def test_exactly_k_for_many_sizes(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    op = DeviceMSTopK()
    for k in sorted({1, 2, n // 3, n // 2, n - 1, n} - {0}):
        if k > n:
            continue
        check_selection(x, k, *op(x, k))


def test_k_one_and_k_all():
    x = data("cubed", 100_000)
    values, indices = DeviceMSTopK()(x, 1)
    assert indices.tolist() == [int(x.abs().argmax())]
    values, indices = DeviceMSTopK()(x, x.numel())
    assert torch.equal(indices, torch.arange(x.numel())) and torch.equal(values, x)


def test_the_search_path_with_few_passes_still_returns_exactly_k():
    x = data("cubed", 100_000, seed=3)
    for passes in (2, 3, 4):
        check_selection(x, 5000, *DeviceMSTopK(passes)(x, 5000))


def test_ties_at_the_threshold_fill_from_the_tie():
    # 5000 clear winners, then 100000 tied at the threshold: all 5000 plus 45000 of the tied ones, none of the rest.
    x = torch.cat([torch.full((5000,), 3.0), torch.full((100_000,), -1.0), torch.full((900_000,), 0.5)])
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(4))]
    values, indices = DeviceMSTopK()(x, 50_000)
    check_selection(x, 50_000, values, indices)
    assert int((values == 3.0).sum()) == 5000 and int((values == -1.0).sum()) == 45_000
    tied = torch.nonzero(x == -1.0).reshape(-1)  # the band fills in index order: the first 45000 of the tie
    assert torch.equal(torch.sort(indices[values == -1.0]).values, tied[:45_000])


@pytest.mark.parametrize("k", [300, 5000, 9999])
def test_all_equal_and_all_zero(k):
    for fill in (-2.5, 0.0):
        x = torch.full((10_000,), fill)
        values, indices = DeviceMSTopK()(x, k)
        check_selection(x, k, values, indices)
        assert torch.all(values == fill)


def test_nan_still_gives_exactly_k():
    x = torch.full((100_000,), float("nan"))
    x[:10] = 1.0
    values, indices = DeviceMSTopK()(x, 1000)
    assert values.shape == (1000,) and torch.unique(indices).numel() == 1000
    assert set(range(10)) <= set(indices.tolist())


def test_float64_and_half_types():
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        x = data("normal", 100_000, seed=7, dtype=dtype)
        values, indices = DeviceMSTopK()(x, 1000)
        check_selection(x, 1000, values, indices)
        assert mass_ratio(x, 1000, values) >= 0.99


def test_int32_indices():
    x = data("normal", 50_000, seed=6)
    values, indices = DeviceMSTopK(index_dtype=torch.int32)(x, 500)
    check_selection(x, 500, values, indices, index_dtype=torch.int32)
    values64, indices64 = DeviceMSTopK()(x, 500)
    assert torch.equal(indices.long(), indices64) and torch.equal(values, values64)


def test_buffers_grow_per_dtype_and_device_not_per_size():
    op = DeviceMSTopK()
    g = torch.Generator().manual_seed(8)
    for n, k in ((10_000, 500), (3_000, 300), (10_000, 1000), (10_000, 400)):
        x = torch.randn(n, generator=g)
        check_selection(x, k, *op(x, k))
    check_selection(x.double(), 400, *op(x.double(), 400))
    assert set(op._cache) == {(torch.float32, torch.device("cpu")), (torch.float64, torch.device("cpu"))}
    op.clear_cache()
    assert not op._cache


def test_same_seed_same_result_and_any_shape():
    x = torch.randn(30, 40, 50, generator=torch.Generator().manual_seed(9), requires_grad=True).transpose(0, 2)
    a, b = DeviceMSTopK(seed=3), DeviceMSTopK(seed=3)
    va, ia = a(x, 777)
    vb, ib = b(x, 777)
    assert torch.equal(ia, ib) and torch.equal(va, vb) and not va.requires_grad
    check_selection(x.detach(), 777, va, ia)


def test_bad_input_and_construction():
    op = DeviceMSTopK()
    with pytest.raises(ValueError, match="empty tensor"):
        op(torch.empty(0), 1)
    with pytest.raises(ValueError, match=r"k=11 is larger than the tensor \(10 elements\)"):
        op(torch.randn(10), 11)
    with pytest.raises(ValueError, match="passes must be an integer >= 2"):
        DeviceMSTopK(1)
    with pytest.raises(ValueError, match="index_dtype must be torch.int64 or torch.int32"):
        DeviceMSTopK(index_dtype=torch.float32)


def test_mstopk_keeps_numpy_for_cpu_tensors():
    op = MSTopK()
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(11))
    op(x, 1000)
    assert op._cache and not op.device_op._cache


# -- on CUDA ----------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["normal", "cubed", "cauchy", "zeros", "ties", "outlier"])
@pytest.mark.parametrize("density", [0.001, 0.01])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_against_torch_topk(kind, density, dtype):
    x = data(kind, 2_000_000, device="cuda", dtype=dtype)
    k = k_for_density(x.numel(), density)
    op = MSTopK(index_dtype=torch.int32)  # MSTopK sends CUDA tensors to its DeviceMSTopK
    values, indices = op(x, k)
    check_selection(x, k, values, indices, index_dtype=torch.int32)
    assert not op._cache and op.device_op._cache
    ref = torch.topk(x.abs(), k, sorted=False).values
    assert float((values.double() ** 2).sum()) >= 0.99 * float((ref.double() ** 2).sum())


@pytest.mark.gpu
@needs_cuda
def test_cuda_call_queues_without_host_synchronisation():
    x = data("cubed", 1_000_000, device="cuda")
    op = DeviceMSTopK()
    op(x, 10_000)  # buffers allocated
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any implicit device-to-host synchronisation raises
    try:
        values, indices = op(x, 10_000)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_selection(x, 10_000, values, indices)


@pytest.mark.gpu
@needs_cuda
def test_cuda_matches_cpu_exactly_at_k_all_and_on_distinct_values():
    x = data("normal", 1_000_000, seed=5)
    op = DeviceMSTopK()
    got = set(op(x.cuda(), 1000)[1].tolist())
    assert len(got & set(exact_topk(x, 1000)[1].tolist())) >= 990
    values, indices = op(x.cuda(), x.numel())
    assert torch.equal(values.cpu(), x) and torch.equal(indices.cpu(), torch.arange(x.numel()))
