"""MSTopK in plain torch on any device: a threshold search whose counts stay on the device, exactly k out."""

from __future__ import annotations

import math

import torch

from .selection import check_index_dtype, check_topk

PASSES = 6             # full compare-and-count passes: the sampled bracket's two ends, then bisection
SAMPLE_HITS = 256      # sample n*256/k elements: about 256 of them fall above the k-th largest
MIN_SAMPLE_HITS = 32   # below this (k < 256) the estimate is too loose: torch.topk, exact, instead
SAMPLE_MARGIN = 4.0    # standard deviations of slack on each side of the sample's estimate
FALLBACK_MARGIN = 12.0  # the third probe's slack, where a 4-sigma end failed (rare)
SAMPLE_CAP = 8         # the sample is at most n/8 elements: more costs what the passes it saves cost


class _Workspace:
    """Grow-only buffers for one (dtype, device): |x|, masks, compaction scratch, the k outputs."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        # Half types search in float32: counts and thresholds agree, and their kernels are not faster.
        self.work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        self.dtype, self.device = dtype, device
        self.bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < n:
            buf = self.bufs[name] = torch.empty(n, dtype=dtype, device=self.device)
        return buf[:n]

    def arange(self, n: int) -> torch.Tensor:
        """0, 1, ..., n-1, computed once."""
        buf = self.bufs.get("arange")
        if buf is None or buf.numel() < n:
            buf = self.bufs["arange"] = torch.arange(n, dtype=torch.int64, device=self.device)
        return buf[:n]


class DeviceMSTopK:
    """Approximate top-k of |x| (x flattened) on x's device: exactly k (signed value, index) pairs, unsorted.

    No step reads a device value on the host, so on a GPU the whole call is
    queued without a synchronisation. The threshold search keeps lo and hi as
    0-d device tensors with count(|x| >= lo) >= k and count(|x| >= hi) <= k:
    a random sample of about 256*n/k elements gives a bracket (4 standard
    deviations each side of its estimate of the k-th largest), `passes` full
    compare-and-count passes probe its ends and then bisect it (torch.where
    keeps whichever bound a count allows; a failed end is retried with a
    12-sigma one). The result is every element with |x| >= hi, then the
    first elements of the band [lo, hi) in index order up to k, compacted
    by torch.nonzero_static (fixed size): no sort of x, and exactly k even
    with ties, zeros or NaN. For k < 256 the sample is too small: torch.topk.

    Buffers grow per (dtype, device) to the largest n and k seen, not per
    (numel, k): a density ramp or per-layer selection would otherwise keep
    one set per step or layer. The values and indices returned are views of
    those buffers, valid until the next call for the same dtype and device.
    """

    def __init__(self, passes: int = PASSES, *, index_dtype: torch.dtype = torch.int64, seed: int = 0):
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 2:
            raise ValueError(f"passes must be an integer >= 2, got {passes!r}")
        check_index_dtype(index_dtype)
        self.passes, self.index_dtype, self.seed = passes, index_dtype, seed
        self._cache: dict[tuple[torch.dtype, torch.device], _Workspace] = {}
        self._gens: dict[torch.device, torch.Generator] = {}

    def clear_cache(self) -> None:
        self._cache.clear()

    def __call__(self, x: torch.Tensor, k: int):
        check_topk(x, k)
        flat = x.detach().reshape(-1)
        n, dev = flat.numel(), flat.device
        ws = self._cache.get((flat.dtype, dev))
        if ws is None:
            ws = self._cache[(flat.dtype, dev)] = _Workspace(flat.dtype, dev)
        values = ws.get("values", k, flat.dtype)
        if k == n:
            idx = ws.arange(n)
            values.copy_(flat)
        else:
            a = ws.get("abs", n, ws.work)
            if ws.work == flat.dtype:
                torch.abs(flat, out=a)
            else:
                a.copy_(flat).abs_()
            m = min(math.ceil(SAMPLE_HITS * n / k), n // SAMPLE_CAP)
            if k * m / n < MIN_SAMPLE_HITS:
                idx = ws.get("idx", k, torch.int64)
                torch.topk(a, k, sorted=False, out=(ws.get("topk", k, ws.work), idx))
            else:
                lo, hi = self._search(ws, a, k, m)
                idx = self._compact(ws, a, k, lo, hi)
            torch.index_select(flat, 0, idx, out=values)
        if self.index_dtype == torch.int64:
            return values, idx
        return values, ws.get("idx32", k, torch.int32).copy_(idx)

    # -- the threshold search ---------------------------------------------------------
    def _generator(self, dev: torch.device) -> torch.Generator:
        gen = self._gens.get(dev)
        if gen is None:
            gen = self._gens[dev] = torch.Generator(device=dev).manual_seed(self.seed)
        return gen

    def _search(self, ws: _Workspace, a: torch.Tensor, k: int, m: int):
        """(lo, hi) as 0-d device tensors: count(a >= lo) >= k, count(a >= hi) <= k, the band narrowed."""
        n = a.numel()
        pos = ws.get("sample_pos", m, torch.int64)
        torch.randint(0, n, (m,), generator=self._generator(a.device), out=pos)
        sample = torch.index_select(a, 0, pos, out=ws.get("sample", m, ws.work))
        hits = k * m / n
        # Ranks in the sample, largest first (0-based): the estimate of the k-th largest is at rank hits - 1.
        rank = lambda margin: min(m - 1, max(0, round(hits - 1 + margin * math.sqrt(hits))))
        r_lo, r_hi = rank(SAMPLE_MARGIN), rank(-SAMPLE_MARGIN)
        r_lo_wide, r_hi_wide = rank(FALLBACK_MARGIN), rank(-FALLBACK_MARGIN)
        top = torch.topk(sample, r_lo_wide + 1, sorted=True).values  # a few hundred of the sample's largest
        lo = torch.zeros((), dtype=a.dtype, device=a.device)           # count(a >= 0) = n >= k
        hi = torch.full((), math.inf, dtype=a.dtype, device=a.device)  # nothing is >= inf (NaN aside)
        mask = ws.get("mask", n, torch.bool)
        for p in range(self.passes):
            if p == 0:
                t = top[r_lo]
            elif p == 1:
                t = top[r_hi]
            elif p == 2:
                # Whichever sampled end failed (the count fell on the wrong side of k) is retried wider.
                t = torch.where(lo == 0, top[r_lo_wide], torch.where(torch.isinf(hi), top[r_hi_wide], _mid(lo, hi)))
            else:
                t = _mid(lo, hi)
            torch.ge(a, t, out=mask)
            count = mask.sum()
            # Counts fall as t rises: each probe can only tighten a bound, and keeps lo <= hi.
            lo = torch.where(count >= k, torch.maximum(lo, t), lo)
            hi = torch.where(count <= k, torch.minimum(hi, t), hi)
        return lo, hi

    # -- exactly k out ------------------------------------------------------------------
    def _compact(self, ws: _Workspace, a: torch.Tensor, k: int, lo: torch.Tensor, hi: torch.Tensor):
        """Positions of everything >= hi (at most k kept), then the band's first ones in index order: k in all.

        Two fixed-size stream compactions (torch.nonzero_static: the first `size` positions in index order,
        padded; unlike nonzero it need not tell the host how many there are) and a few k-long steps; the
        search keeps count(a >= lo) >= k, so the two together always hold k.
        """
        n = a.numel()
        mask, tmp = ws.get("mask", n, torch.bool), ws.get("mask_tmp", n, torch.bool)
        above, band = ws.get("above", k, torch.int64), ws.get("band", k, torch.int64)
        torch.nonzero_static(torch.ge(a, hi, out=mask), size=k, fill_value=-1, out=above.view(k, 1))
        # The band: neither below lo nor at/above hi, so a NaN is in it: k stays reachable whatever x holds.
        mask.logical_or_(torch.lt(a, lo, out=tmp)).logical_not_()
        torch.nonzero_static(mask, size=k, fill_value=-1, out=band.view(k, 1))
        kept = ws.get("kept", k, torch.bool)
        taken = torch.ge(above, 0, out=kept).sum()  # how many are >= hi (k where ties at the top are more)
        j = ws.arange(k)
        from_band = torch.sub(j, taken, out=ws.get("from_band", k, torch.int64)).clamp_(min=0)
        filled = torch.gather(band, 0, from_band, out=ws.get("filled", k, torch.int64))
        return torch.where(torch.lt(j, taken, out=kept), above, filled, out=ws.get("idx", k, torch.int64))


def _mid(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The next probe between lo and hi, as a 0-d tensor of their dtype.

    Gradients are heavy-tailed: halving the log-range (hi > 4 lo) gets near
    the k-th largest in far fewer passes than halving the value range. lo = 0:
    probe "nonzero" (the smallest normal float) first, as gradients often hold
    exact zeros. hi = inf (no count has been <= k yet): double lo.
    """
    tiny = torch.finfo(lo.dtype).tiny
    geometric = lo.sqrt() * hi.sqrt()  # not sqrt(lo * hi): the product can overflow
    arithmetic = lo + (hi - lo) / 2
    t = torch.where(hi > 4 * lo, geometric, arithmetic)
    t = torch.where(lo == 0, torch.where(hi > tiny, torch.full_like(lo, tiny), hi / 2), t)
    return torch.where(torch.isinf(hi), torch.clamp(lo * 2, min=tiny), t)
