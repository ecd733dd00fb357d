"""PTO's copies between its host buffers and a GPU model's tensors: pinned, batched, waited on only when needed."""

from __future__ import annotations

import torch


def _adjacent(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether 1-D dense y starts in memory where 1-D dense x ends (one copy can take both)."""
    return (x.device == y.device and x.dtype == y.dtype and x.stride() == y.stride() == (1,)
            and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
            and y.storage_offset() == x.storage_offset() + x.numel())


class ShardTransfers:
    """How ShardedUpdate's host buffers meet its parameters' device.

    Host buffers are pinned when a parameter is on a GPU, so that copies
    need not wait. `gather` fills the shard's gradient from its pieces'
    sources, adjacent ones merged, in one foreach call; if a source is on
    the GPU the host waits once, on an event, for all of them (a host
    source, such as the staged gradients' mirror, needs no wait).
    `to_params` copies the gathered parameters back in one foreach call of
    non-blocking copies on the current stream (the next forward pass queues
    behind them) and records an event; `host_free` waits for it before the
    host writes those buffers again. On the CPU the copies are plain ones.
    """

    def __init__(self, params: list[torch.Tensor]):
        self.devices = list(dict.fromkeys(p.device for p in params if p.device.type == "cuda"))
        self.pinned = bool(self.devices)
        self.ranges_copied = 0  # gradient ranges copied into the shard, so far (reported, tested)
        self.device_waits = 0  # waits of the host for gradients on a GPU, so far
        self._landed = {d: torch.cuda.Event(blocking=True) for d in self.devices}  # the host waits: no spinning
        self._gathered = {d: torch.cuda.Event(blocking=True) for d in self.devices}
        self._in_flight = False  # to_params' copies may still read the host buffers

    def host(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of n elements, pinned for a GPU model."""
        try:
            return torch.empty(n, dtype=dtype, pin_memory=self.pinned)
        except RuntimeError as exc:
            nbytes = n * torch.empty(0, dtype=dtype).element_size()
            raise RuntimeError(f"cannot allocate {nbytes / 2**20:.1f} MiB of pinned host memory for PTO's shard "
                               f"(raise the locked-memory limit, ulimit -l): {exc}") from exc

    def gather(self, sources: list, out: torch.Tensor, lengths: list[int]) -> None:
        """Fill `out` from (source, position) pieces of these lengths: a 1-D source, or None for zeros."""
        dsts, srcs, end = [], [], -1
        for (src, pos), n in zip(sources, lengths):
            if src is None:
                out[pos:pos + n].zero_()
            elif srcs and end == pos and _adjacent(srcs[-1], src):
                last = srcs[-1]
                srcs[-1] = last.as_strided((last.numel() + n,), (1,), last.storage_offset())
                dsts[-1] = out[pos - dsts[-1].numel():pos + n]
                end = pos + n
            else:
                srcs.append(src)
                dsts.append(out[pos:pos + n])
                end = pos + n
        if not srcs:
            return
        self.ranges_copied += len(srcs)
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
        on = list(dict.fromkeys(s.device for s in srcs if s.device.type == "cuda"))
        for d in on:  # the copies ran on each device's current stream, behind what produced the gradients
            self._gathered[d].record(torch.cuda.current_stream(d))
        for d in on:
            self._gathered[d].synchronize()
        self.device_waits += len(on)

    def to_params(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """Copy each host slice in srcs into its parameter (memory order) in dsts; not waited for on a GPU."""
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
        for d in self.devices:
            self._landed[d].record(torch.cuda.current_stream(d))
        self._in_flight = bool(self.devices)

    def host_free(self) -> None:
        """Block until to_params' copies have read the host buffers (at once on the CPU, and usually on a GPU:
        the gradients that the next step waits for are computed behind them)."""
        if self._in_flight:
            for d in self.devices:
                self._landed[d].synchronize()
            self._in_flight = False
