"""Host batches onto the training device: on a GPU through reused pinned buffers and non-blocking copies."""

from __future__ import annotations

from collections import deque

import torch


class DeviceFeed:
    """Host batches onto the training device: on a GPU through reused pinned buffers and non-blocking copies.

    On the CPU (staged=False, the default there) batches pass through untouched. Staged (the default
    on CUDA), each tensor is first written into a host staging buffer of its shape and dtype, pinned
    on CUDA so that `.to(device, non_blocking=True)` is a DMA the host does not wait for, then
    copied to the device; the copy is a new device tensor, the buffer is kept. Pinning page-locks
    memory through the driver, far dearer than a copy, so buffers are made once and reused:
    a buffer is refilled only once the copy that last read it is over (its CUDA event), else
    another is made, up to `max_buffers` per shape, beyond which the host waits for the oldest.
    staged=True on the CPU runs the same bookkeeping in ordinary memory, so CPU tests cover it.
    """

    MAX_SHAPES = 8  # batch shapes kept (a cache that skipped samples yields short batches)

    def __init__(self, device, staged: bool | None = None, max_buffers: int = 4):
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.staged = self.pinned if staged is None else bool(staged)
        self.max_buffers = max_buffers
        # (shape, dtype) -> deque of [buffer, event or None], least recently filled first; the dict is
        # kept in order of use so that the shape unused longest is the one dropped.
        self._pools: dict[tuple, deque] = {}

    def __call__(self, tensors) -> tuple[torch.Tensor, ...]:
        """These host tensors on the device, equal in value."""
        if not self.staged:
            return tuple(t.to(self.device) for t in tensors)
        return tuple(self._send(t.shape, t.dtype, lambda buf, t=t: buf.copy_(t)) for t in tensors)

    def take(self, tensors, idx) -> tuple[torch.Tensor, ...]:
        """Rows `idx` of each host tensor, on the device: gathered straight into the staging buffer."""
        idx = torch.as_tensor(idx)
        if not self.staged:
            return tuple(t[idx].to(self.device) for t in tensors)
        return tuple(self._send((len(idx), *t.shape[1:]), t.dtype,
                                lambda buf, t=t: torch.index_select(t, 0, idx, out=buf)) for t in tensors)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The staging buffers held now, every shape."""
        return [slot[0] for pool in self._pools.values() for slot in pool]

    def _send(self, shape, dtype, fill) -> torch.Tensor:
        slot = self._slot(tuple(shape), dtype)
        fill(slot[0])
        # copy=True: a tensor of its own on a CPU device too, as the GPU copy is, so the buffer can be reused.
        out = slot[0].to(self.device, non_blocking=self.pinned, copy=True)
        if slot[1] is not None:
            # On the stream the copy ran on (the device's current one, whichever device is current on this
            # thread), after it: done means the buffer is free.
            slot[1].record(torch.cuda.current_stream(self.device))
        return out

    def _slot(self, shape: tuple, dtype: torch.dtype) -> list:
        key = (shape, dtype)
        pool = self._pools.pop(key, None)
        if pool is None:
            pool = deque()
            if len(self._pools) >= self.MAX_SHAPES:
                # Freeing a pinned buffer mid-copy is safe: torch's host allocator holds it until its copies end.
                self._pools.pop(next(iter(self._pools)))
        self._pools[key] = pool
        # One stream's copies end in order: if the oldest is still running, so are the rest.
        if pool and (pool[0][1] is None or pool[0][1].query()):
            slot = pool.popleft()
        elif len(pool) < self.max_buffers:
            slot = [torch.empty(shape, dtype=dtype, pin_memory=self.pinned),
                    torch.cuda.Event(blocking=True) if self.pinned else None]  # the host may wait: it sleeps
        else:
            slot = pool.popleft()
            slot[1].synchronize()  # max_buffers copies in flight: the GPU is that far behind anyway
        pool.append(slot)
        return slot
