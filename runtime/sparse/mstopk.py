"""MSTopK: approximate top-k of |x| by a threshold search instead of a sort (Shi et al., MLSys 2021)."""

from __future__ import annotations

import math

import numpy as np
import torch

from .mstopk_device import DeviceMSTopK
from .selection import check_index_dtype, check_topk

DEFAULT_ITERS = 30     # threshold probes per call; past the first few they run on a small working set
SAMPLE_HITS = 256      # sample size n*256/k: about 256 sampled elements fall above the k-th largest
MIN_SAMPLE_HITS = 32   # below this many the estimate is too loose to be worth a sample
SAMPLE_MARGIN = 4.0    # standard deviations of slack below the sample's estimate of the k-th largest
COMPACT_RATIO = 8      # narrow the working set once a probe keeps at most 1/8 of it


class _Workspace:
    """Buffers for one (numel, dtype): |x|, a compare mask, and the sample."""

    def __init__(self, n: int, dtype: torch.dtype):
        # Half types have no NumPy twin (bfloat16) or slow kernels (float16): search them in float32.
        work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        self.abs_t = torch.empty(n, dtype=work)
        self.abs = self.abs_t.numpy()
        self.mask = np.empty(n, dtype=bool)
        self.pos_t = torch.empty(0, dtype=torch.int64)
        self.sample = np.empty(0, dtype=self.abs.dtype)

    def sample_buffers(self, m: int):
        if self.pos_t.numel() < m:
            self.pos_t = torch.empty(m, dtype=torch.int64)
            self.sample = np.empty(m, dtype=self.abs.dtype)
        return self.pos_t[:m], self.sample[:m]


class MSTopK:
    """Approximate top-k of |x| (x flattened): exactly k (signed value, index) pairs, unsorted.

    A bisection on the threshold keeps lo and hi with count(|x| >= lo) >= k
    and count(|x| > hi) <= k; the result is everything above hi plus the
    first elements of the band [lo, hi] in index order, up to k. Each probe
    is one compare-and-count; once a probe keeps at most 1/8 of the working
    set, the search continues on those elements only, so later probes cost
    little and the default `iters` leaves the band a few float steps wide.

    sampled=True first estimates the threshold from a random sample of
    about 256*n/k elements (at most n/8), set a few standard deviations low
    so that one full compare almost always keeps >= k elements (~1.25k): one
    pass over x instead of the several that bisection from the mean takes.
    The estimate only seeds the search; counts stay exact, so a bad sample
    costs time, not correctness. Work buffers are cached per (numel, dtype):
    about 5 bytes per float32 element; clear_cache() drops them.

    This NumPy search is for CPU tensors. A tensor on another device (CUDA)
    goes to `device_op`, a DeviceMSTopK (runtime.sparse.mstopk_device): the
    same idea in plain torch with no host synchronisation; its results are
    views of its buffers, valid until its next call for that dtype and device.
    """

    def __init__(self, iters: int = DEFAULT_ITERS, *, sampled: bool = True,
                 index_dtype: torch.dtype = torch.int64, seed: int = 0):
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
            raise ValueError(f"iters must be a positive integer, got {iters!r}")
        check_index_dtype(index_dtype)
        self.iters, self.sampled, self.index_dtype = iters, sampled, index_dtype
        self._gen = torch.Generator().manual_seed(seed)
        self._cache: dict[tuple[int, torch.dtype], _Workspace] = {}
        self.device_op = DeviceMSTopK(index_dtype=index_dtype, seed=seed)

    def clear_cache(self) -> None:
        self._cache.clear()
        self.device_op.clear_cache()

    def __call__(self, x: torch.Tensor, k: int):
        check_topk(x, k)
        if x.device.type != "cpu":
            return self.device_op(x, k)
        flat = x.detach().reshape(-1)
        n = flat.numel()
        if k == n:
            return flat.clone(), torch.arange(n, dtype=self.index_dtype)
        ws = self._cache.get((n, flat.dtype))
        if ws is None:
            ws = self._cache[(n, flat.dtype)] = _Workspace(n, flat.dtype)
        if ws.abs_t.dtype == flat.dtype:
            torch.abs(flat, out=ws.abs_t)
        else:
            ws.abs_t.copy_(flat).abs_()
        idx = torch.from_numpy(self._select(ws, k))
        return flat[idx], idx.to(self.index_dtype)

    # The compare, count and nonzero kernels below run on NumPy views of the torch buffers: on one
    # CPU thread torch's bool-producing compare is ~4x, count_nonzero ~15x and nonzero ~10x slower
    # than NumPy's (measured on 25M float32), and those kernels are the whole search.

    def _select(self, ws: _Workspace, k: int) -> np.ndarray:
        """Positions of exactly k elements of ws.abs: all above hi, then the band's first."""
        a, mask = ws.abs, ws.mask
        real = a.dtype.type
        lo, hi = 0.0, None        # count(a >= lo) >= k; count(a > hi) <= k (hi None: nothing above)
        vals, where = a, None     # working set: every element >= lo, and its positions in a
        probe = self._sample_threshold(ws, k) if self.sampled else None
        seeded = probe is not None
        if not seeded:
            hi, probe = self._from_mean(ws)
        for _ in range(self.iters):
            if probe is None:
                if hi is None:
                    hi = float(vals.max())
                probe = _midpoint(lo, hi, real)
                if not lo < probe < hi:
                    break  # lo and hi are adjacent floats: nothing left to split
            m = mask[:vals.size]
            np.greater_equal(vals, probe, out=m)
            count = int(np.count_nonzero(m))
            if count >= k:
                lo = probe
                if count <= vals.size // COMPACT_RATIO or count == k:
                    keep = np.flatnonzero(m)
                    vals, where = vals[keep], keep if where is None else where[keep]
                if count == k:
                    break
                probe = None
            elif seeded:
                # The sample's estimate overshot (rare): start over from the mean, keeping it as hi.
                hi, probe = self._from_mean(ws, probe)
            else:
                hi, probe = probe, None
            seeded = False
        m = mask[:vals.size]
        if hi is None:
            above = np.empty(0, dtype=np.intp)
        else:
            np.greater(vals, hi, out=m)
            above = np.flatnonzero(m)  # at most k
        np.greater_equal(vals, lo, out=m)
        m[above] = False  # m is now the band [lo, hi]
        band = _first_true(m, k - above.size)  # the band's first ones found: no ordering needed
        pos = np.concatenate((above, band))
        return (pos if where is None else where[pos]).astype(np.int64, copy=False)

    @staticmethod
    def _from_mean(ws: _Workspace, hi: float = math.inf) -> tuple[float, float]:
        """hi = min(hi, max |x|), and mean |x| (at most hi: all equal, or rounding) as the next probe."""
        hi = min(hi, float(ws.abs.max()))
        return hi, min(float(ws.abs_t.mean()), hi)  # torch's mean is the faster one here, NumPy's max

    def _sample_threshold(self, ws: _Workspace, k: int) -> float | None:
        """A value that about k + 4 sqrt(k) elements of |x| reach, from a random sample; None: no gain."""
        n = ws.abs.size
        # A sample over 1/8 of x costs as much as the bisection passes it replaces.
        m = min(math.ceil(SAMPLE_HITS * n / k), n // COMPACT_RATIO)
        hits = k * m / n
        if hits < MIN_SAMPLE_HITS:
            return None  # k is too small a fraction of x to estimate from a cheap sample
        rank = min(m, math.ceil(hits + SAMPLE_MARGIN * math.sqrt(hits)) + 1)
        pos_t, sample = ws.sample_buffers(m)
        torch.randint(0, n, (m,), generator=self._gen, out=pos_t)
        np.take(ws.abs, pos_t.numpy(), out=sample)
        sample.partition(m - rank)  # in place: the rank-th largest lands at m - rank
        return float(sample[m - rank])


def _midpoint(lo: float, hi: float, real) -> float:
    """The next probe, rounded to the array's dtype so that counts and the final compare agree."""
    # Gradients are heavy-tailed: the largest can sit 1e6x above the k-th, and halving the value range
    # then takes ~20 full passes to get near it; halving the log-range takes ~5.
    if lo == 0:
        # Gradients often hold exact zeros: probe "nonzero" first. If fewer than k are, the band is
        # the zeros and the search ends; if not, the log-range bisection starts from the smallest float.
        return float(np.finfo(real).tiny)
    t = math.sqrt(lo * hi) if hi > 4 * lo else lo + (hi - lo) / 2
    return float(real(t))


def _first_true(m: np.ndarray, need: int) -> np.ndarray:
    """Positions of the first `need` True in m (which holds at least that many), scanning a prefix.

    The band can be most of x (ties, zeros): listing all of it would cost an n-long index array.
    """
    end = min(m.size, 2 * need + 4096)
    while True:
        pos = np.flatnonzero(m[:end])
        if pos.size >= need or end == m.size:
            return pos[:need]
        end = min(m.size, max(2 * end, int(1.5 * end * need / max(pos.size, 1))))
