"""Gradients as views of flat buffers, one per dtype (DDP's gradient_as_bucket_view): no packing copies."""

from __future__ import annotations

import torch

from .emulate.landing import defer_zero


def dense_layout(t: torch.Tensor) -> bool:
    """Whether t's elements fill exactly numel() consecutive slots in some dimension order (no gaps, no overlap).

    Contiguous and channels_last tensors do; expanded or sliced ones do not.
    """
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def runs_last_first(sizes: list[int], keys: list, nbytes: int, across_large: bool = True) -> list[list[int]]:
    """Indices in runs of about nbytes, last first (backward's order); an entry of nbytes or more alone, a run of
    one key (a dtype, a buffer). across_large: small entries keep gathering in the open run past a large one, as
    DDP's buckets do (wfbp's buckets); else a large one closes it (the staging's groups: none waits past it)."""
    out, current, size = [], [], 0
    for i in reversed(range(len(sizes))):
        if sizes[i] >= nbytes:
            if current and not across_large:
                out.append(current)
                current, size = [], 0
            out.append([i])
            continue
        if current and keys[current[0]] != keys[i]:
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += sizes[i]
        if size >= nbytes:
            out.append(current)
            current, size = [], 0
    return out + [current] if current else out


def coalesce(segments: list[tuple[int, int, int]], indices) -> list[tuple[int, int, int]]:
    """(buffer, start, stop) ranges covering these parameters' segments, adjacent ones merged: fewer copies."""
    ranges: list[list[int]] = []
    for b, a, z in sorted(segments[i] for i in indices):
        if a == z:
            continue
        if ranges and ranges[-1][0] == b and ranges[-1][2] == a:
            ranges[-1][2] = z
        else:
            ranges.append([b, a, z])
    return [tuple(r) for r in ranges]


class GradientBuffers:
    """Every managed parameter's gradient lives in a flat buffer of its dtype; p.grad is a view into it.

    Parameters sit in the model's order (identical on every rank) inside each
    dtype's buffer, or in an order the strategy asks for (wfbp: bucket by
    bucket), and each view has its parameter's strides, so a
    channels_last weight gets a channels_last gradient. Autograd accumulates
    into an existing .grad in place, so once attached the backward pass
    writes straight into the buffers that the strategies send: nothing is
    packed or unpacked. A gradient that arrives elsewhere (the user set
    .grad to None, or replaced it) is copied in once and the view re-attached.
    """

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], order: list[int] | None = None,
                 staged: bool = False):
        """order: the parameters' order inside the buffers (default: theirs), e.g. a strategy's buckets.

        The gradients (p.grad, `grads`, `device_flats`) live on the parameters'
        device. staged: the strategies work on a host mirror of the same
        layout (`flats`, `views`, `flat(i)`), pinned when the device is a GPU;
        runtime.device.staging moves data between the two. Without it both
        names are the same memory (a CPU model, or a strategy that works on
        the GPU itself: on_device).
        """
        self.params = params
        for p, name in zip(params, names):
            if not dense_layout(p):
                raise ValueError(f"parameter {name} {tuple(p.shape)} with strides {p.stride()} has gaps or overlaps "
                                 "in memory: make it contiguous (or channels_last) before wrapping")
        self.device = params[0].device if params else torch.device("cpu")
        self.staged = staged
        self.dtypes: list[torch.dtype] = list(dict.fromkeys(p.dtype for p in params))
        sizes = [0] * len(self.dtypes)
        self.segments: list[tuple[int, int, int]] = [(0, 0, 0)] * len(params)  # param -> (buffer, start, stop)
        for i in (range(len(params)) if order is None else order):
            p = params[i]
            b = self.dtypes.index(p.dtype)
            self.segments[i] = (b, sizes[b], sizes[b] + p.numel())
            sizes[b] += p.numel()
        self.device_flats = [torch.zeros(n, dtype=d, device=self.device) for n, d in zip(sizes, self.dtypes)]
        pin = staged and self.device.type == "cuda"  # DMA straight from the GPU, and copies that do not block
        try:
            self.flats = [torch.zeros(n, dtype=d, pin_memory=pin) for n, d in zip(sizes, self.dtypes)] \
                if staged else self.device_flats
        except RuntimeError as exc:  # MPI cannot read GPU memory here, so without this mirror nothing moves
            total = sum(n * torch.empty(0, dtype=d).element_size() for n, d in zip(sizes, self.dtypes))
            raise RuntimeError(f"cannot allocate {total / 2**20:.1f} MiB of pinned host memory to stage the "
                               f"gradients of {names[0]} and {len(names) - 1} more parameters on {self.device} "
                               f"(raise the locked-memory limit, ulimit -l): {exc}") from exc
        self.grads = self._shaped(self.device_flats)  # what p.grad is
        self.views = self._shaped(self.flats) if staged else self.grads  # the same, as the strategies see it
        self._placeholders: list[torch.Tensor] | None = None  # park()'s, made at its first call
        self._versions = [0] * len(params)  # their version counters at park()
        self.flat_views = [self.flats[b][a:z] for b, a, z in self.segments]
        self.device_flat_views = [self.device_flats[b][a:z] for b, a, z in self.segments]
        with torch.no_grad():
            for i, p in enumerate(params):
                if p.grad is not None:  # a sparse one: an embedding's, or a placeholder a failed run left
                    self.grads[i].copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
                p.grad = self.grads[i]

    def _shaped(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        return [flats[b].as_strided(p.shape, p.stride(), a) for p, (b, a, _) in zip(self.params, self.segments)]

    def holds(self, i: int) -> bool:
        """Whether parameter i's .grad is None, parked or its view here (not a tensor the user assigned)."""
        g = self.params[i].grad
        return g is None or self.parked(i) or (g.data_ptr() == self.grads[i].data_ptr()
                                               and g.stride() == self.grads[i].stride())

    def attach(self, i: int) -> torch.Tensor:
        """Make sure parameter i's gradient is in its view (copying it there if autograd put it elsewhere)."""
        p, view = self.params[i], self.grads[i]
        g = p.grad
        if g is None or self.parked(i):
            view.zero_()
        elif self.holds(i):
            return view
        else:
            view.copy_(g)
        p.grad = view
        return view

    def park(self) -> None:
        """Point every .grad at a zero placeholder of its own, which holds no memory, until unpark().

        A deferred step (p3) leaves each average landing in the buffers until
        the parameter's update, at its next forward. A loop that zeroes .grad
        meanwhile, through the model and in place (model.zero_grad(set_to_none=
        False)), would zero that average: it zeroes the placeholder instead,
        whose version counter says so (unpark). A sparse tensor of no entries
        takes autograd's accumulation out of place, so a gradient that arrives
        before unpark() still reaches the post-accumulate hook, and its error.
        """
        if self._placeholders is None:
            self._placeholders = [_placeholder(p) for p in self.params]
        for i, (p, ph) in enumerate(zip(self.params, self._placeholders)):
            p.grad = ph
            self._versions[i] = ph._version

    def parked(self, i: int) -> bool:
        return self._placeholders is not None and self.params[i].grad is self._placeholders[i]

    def unpark(self, indices) -> tuple[list[int], dict[int, torch.Tensor]]:
        """These parameters' views back in .grad (the buffers kept their averages); returns what a loop did to .grad
        since park(): (cleared, replaced), those it zeroed or set to None, and those it set to a tensor of its own.
        Without park(), a .grad set to None (model.zero_grad() after the step) counts as cleared."""
        cleared, replaced = [], {}
        placeholders = self._placeholders
        for i in indices:
            p, view = self.params[i], self.grads[i]
            g = p.grad
            if g is view:
                continue
            if placeholders is not None and g is placeholders[i]:
                if g._version != self._versions[i]:
                    cleared.append(i)
            elif g is None:
                cleared.append(i)
            else:
                replaced[i] = g
            p.grad = view
        return cleared, replaced

    def restore(self, replaced: dict[int, torch.Tensor]) -> None:
        """Gradients a loop assigned to .grad while parked, copied into their views (unpark's `replaced`)."""
        with torch.no_grad():
            for i, g in replaced.items():
                self.grads[i].copy_(g)

    def zero(self, indices=None) -> None:
        """Zero these parameters' gradients in place (all when None), keeping the views attached."""
        if indices is None:
            if not defer_zero(self.params):  # emulated: the next gradients are copied over them instead
                for flat in self.device_flats:
                    flat.zero_()
            for p, view in zip(self.params, self.grads):
                if p.grad is not view:
                    p.grad = view
            return
        if not defer_zero(self.params[i] for i in indices):
            # Neighbours' segments merged: one memset per run, not one per tensor (p3 zeroes a layer at a time).
            for b, a, z in coalesce(self.segments, indices):
                self.device_flats[b][a:z].zero_()
        for i in indices:
            if self.params[i].grad is not self.grads[i]:
                self.params[i].grad = self.grads[i]

    def nonzero(self, indices) -> list[bool]:
        """Whether each of these parameters' gradients (.grad, on its device) holds a nonzero value, read in
        one go: on a GPU one wait for the device, not one per parameter."""
        if len(indices) == 0:
            return []
        return torch.stack([self.device_flat_views[i].any() for i in indices]).tolist()

    def flat(self, i: int) -> torch.Tensor:
        """Parameter i's gradient as a 1-D slice of its buffer (memory order)."""
        return self.flat_views[i]

    @property
    def numel(self) -> int:
        return sum(f.numel() for f in self.flats)

    def subset(self, indices: list[int]) -> "GradientSubset":
        """The gradients of these parameters, for a strategy that averages only them (hybcomm's dense path)."""
        return GradientSubset(self, indices)


class GradientSubset:
    """Some parameters' gradients as a strategy sees GradientBuffers: flats and segments, renumbered.

    The parameters must sit at the front of their dtype's buffer (the owning
    strategy's layout puts them there), so each flat here is a prefix view of
    the full buffer: the sub-strategy reduces them in place and never touches
    the gradients that travel another way.
    """

    def __init__(self, full: GradientBuffers, indices: list[int]):
        used = sorted({full.segments[i][0] for i in indices})
        ends = {b: max(full.segments[i][2] for i in indices if full.segments[i][0] == b) for b in used}
        for b in used:
            members = [i for i in indices if full.segments[i][0] == b]
            if sum(full.params[i].numel() for i in members) != ends[b]:
                raise ValueError("a gradient subset must fill the front of its buffers (a layout problem)")
        self.params = [full.params[i] for i in indices]
        self.dtypes = [full.dtypes[b] for b in used]
        self.flats = [full.flats[b][:ends[b]] for b in used]
        self.segments = [(used.index(full.segments[i][0]),) + full.segments[i][1:] for i in indices]
        self.views = [full.views[i] for i in indices]
        self.flat_views = [full.flat_views[i] for i in indices]
        self.staged, self.device = full.staged, full.device

    def flat(self, i: int) -> torch.Tensor:
        return self.flat_views[i]

    @property
    def numel(self) -> int:
        return sum(f.numel() for f in self.flats)


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    """A zero gradient for p that holds no memory: a sparse tensor of no entries (in-place ops bump its version)."""
    return torch.sparse_coo_tensor(torch.empty((p.dim(), 0), dtype=torch.long, device=p.device),
                                   torch.empty(0, dtype=p.dtype, device=p.device), p.shape,
                                   check_invariants=False, is_coalesced=True)


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor's elements in the order they sit in memory (its layout's flat form)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())
