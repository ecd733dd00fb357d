"""Sufficient-factor broadcasting of one Linear layer: gather every rank's input and output-gradient rows, rebuild Σ δᵀu."""

from __future__ import annotations

import threading

import torch

from ..emulate.accelerator import active as emulated_accelerator


class FactorExchange:
    """One layer's factors for one step, and the buffers they travel in (kept across steps, resized when K changes).

    This rank's rows go to two host buffers, u_mine (K x M) and δ_mine
    (K x N), from the layer's output-gradient hook (`add`): on the thread and
    the stream that produced them, as backward reaches the layer, so the
    thread that later sends them (the staging or the progress thread, which
    also drives every other message) waits for nothing but that copy. Beside
    a GPU the buffers are pinned and the copies run on a side stream that
    waits for the producing stream, with a blocking event after them: no
    copy reads factors before they are final, and none waits for the rest of
    the device. A layer that will likely go PS (the last plan said so) keeps
    references instead, and copies only if the plan of this step says SFB.

    Every rank's rows land in two gathered buffers, u_all (ΣK x M) and δ_all
    (ΣK x N), each rank's block at its offset, filled by a ring allgatherv.
    Every rank then computes the same product δ_allᵀ u_all on the same data
    in the same order, so the weights stay identical across ranks (a sum of
    local gradient and peers' products would differ in the last bits from
    rank to rank).

    Under emulated compute (runtime.emulate) the rows are still copied and
    gathered for real (they are what goes on the wire), after the modelled
    copy of this rank's rows off the device; the rebuild waits the device's
    GEMM time instead of computing (see `rebuild`).
    """

    def __init__(self, name: str, M: int, N: int, dtype: torch.dtype, tag: int):
        self.name, self.M, self.N, self.dtype, self.tag = name, M, N, dtype, tag
        # Uses whose rows are not on the host yet: (input, output gradient, first row, CUDA event or None).
        self.pairs: list[tuple] = []
        self.at = 0  # rows this step has placed (copied or reserved) in u_mine / d_mine
        self.u_mine = torch.empty(0, dtype=dtype)  # grow-only; pinned beside a GPU
        self.d_mine = torch.empty(0, dtype=dtype)
        self._pinned = False
        self.u_all = torch.empty(0, dtype=dtype)
        self.d_all = torch.empty(0, dtype=dtype)
        self.pin = False  # u_mine / d_mine pinned: rows come from a GPU
        self.device = None  # that GPU
        self.stream = None  # the side stream of the copies (CUDA)
        self.copied = None  # blocking CUDA event after the last copy into u_mine / d_mine
        self._pending = False  # whether `copied` guards copies the host has not waited for
        self.copy_threads: set[str] = set()  # threads that took rows to the host (reported, tested)

    def add(self, inputs: torch.Tensor, grad_output: torch.Tensor, rows: int, copy: bool = True) -> None:
        """One use's rows, from the output-gradient hook (on the thread and current stream that produced them).

        rows: the rows forward counted for this layer so far this step (the
        buffers' size). copy: take them to the host now; else keep references
        until `start` knows the plan (a layer that goes PS never copies them).
        """
        if inputs.is_cuda:
            self.pin, self.device = True, inputs.device
        k = inputs.numel() // self.M
        at, self.at = self.at, self.at + k
        if not copy:  # no buffer either: a PS layer's rows (batch x sequence) can be far larger than its gradient
            event = None
            if inputs.is_cuda:  # start() may copy them on another thread: after what produced them, not before
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(inputs.device))
            self.pairs.append((inputs, grad_output, at, event))
            return
        self._reserve(max(self.at, rows), keep=at)
        self._copy(inputs, grad_output, at, None)

    def _reserve(self, rows: int, keep: int) -> None:
        """u_mine / d_mine hold at least `rows` rows; the first `keep` survive a reallocation."""
        held = self.u_mine.numel() // self.M
        if held >= rows and self._pinned == self.pin:
            return
        self._settle()  # copies may still be landing in the old buffers
        keep = min(keep, held)
        cap = max(rows, 2 * held)  # doubling: few reallocations while K grows
        u = torch.empty(cap * self.M, dtype=self.dtype, pin_memory=self.pin)
        d = torch.empty(cap * self.N, dtype=self.dtype, pin_memory=self.pin)
        u[:keep * self.M].copy_(self.u_mine[:keep * self.M])
        d[:keep * self.N].copy_(self.d_mine[:keep * self.N])
        self.u_mine, self.d_mine, self._pinned = u, d, self.pin

    def _copy(self, inputs: torch.Tensor, grad: torch.Tensor, at: int, event) -> None:
        """Rows at..at+k of u_mine / d_mine from this use; on CUDA queued on the side stream after `event` (None:
        after the current stream's work, which produced them: the caller is their hook)."""
        self.copy_threads.add(threading.current_thread().name)
        k = inputs.numel() // self.M
        u = self.u_mine[at * self.M:(at + k) * self.M].view(k, self.M)
        d = self.d_mine[at * self.N:(at + k) * self.N].view(k, self.N)
        if not inputs.is_cuda:
            u.copy_(inputs.reshape(k, self.M))
            d.copy_(grad.reshape(k, self.N))
            return
        device = inputs.device
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
            self.copied = torch.cuda.Event(blocking=True)  # the communication thread sleeps on it
        if event is None:
            self.stream.wait_stream(torch.cuda.current_stream(device))
        else:
            self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            u.copy_(inputs.reshape(k, self.M), non_blocking=True)
            d.copy_(grad.reshape(k, self.N), non_blocking=True)
            self.copied.record(self.stream)
        # The caching allocator may hand their memory to the producing stream once the references are dropped:
        # not before this stream has read them.
        inputs.record_stream(self.stream)
        grad.record_stream(self.stream)
        self._pending = True

    def _settle(self) -> None:
        """Wait for this rank's copies into u_mine / d_mine alone (not for the device)."""
        if self._pending:
            self.copied.synchronize()
            self._pending = False

    def drop(self) -> None:
        """Forget this step's captured rows (the activations they reference can be freed)."""
        self.pairs = []
        self.at = 0

    def start(self, ring, rows: list[int], rank: int):
        """This rank's rows on the host, then both allgathervs started; a Task whose poll() ends with the rebuild
        inputs ready.

        rows[p]: the rows rank p contributes (the step's census). Rows this
        rank counted in forward but got no output gradient for (an output
        that backward never reached) contribute zeros.
        """
        if self.device is not None:  # this thread's CUDA calls (a wait, a late copy): the model's device, not GPU 0
            torch.cuda.set_device(self.device)
        total = sum(rows)
        mine = rows[rank]
        if self.at > mine:
            raise RuntimeError(f"hybcomm: layer {self.name} saw {self.at} rows in backward but {mine} in forward "
                               "this step: a forward pass outside the step's accounting (activation "
                               "checkpointing re-runs forward; use force='ps' for such a model)")
        if self.u_all.numel() != total * self.M:  # a new batch size: the only time these are allocated
            self.u_all = torch.empty(total * self.M, dtype=self.dtype)
            self.d_all = torch.empty(total * self.N, dtype=self.dtype)
        self._reserve(mine, keep=self.at)
        pairs, self.pairs = self.pairs, []
        for inputs, grad, at, event in pairs:  # the plan changed to SFB after backward passed the layer
            self._copy(inputs, grad, at, event)
        self._settle()
        u, d = self.u_mine[:mine * self.M], self.d_mine[:mine * self.N]
        if self.at < mine:
            u[self.at * self.M:].zero_()
            d[self.at * self.N:].zero_()
        self.at = 0
        acc = emulated_accelerator()
        if acc is not None:
            # The rows' copy off the device, modelled on this (the sending) thread's clock as it always was; on a
            # real GPU the hook queued it on a side stream during backward, and this thread waits for what is left.
            acc.issue("d2h", acc.model.copy_s(mine * (self.M + self.N) * u.element_size()))
        handles = [ring.allgatherv(u, self.u_all, counts=[r * self.M for r in rows], tag=self.tag),
                   ring.allgatherv(d, self.d_all, counts=[r * self.N for r in rows], tag=self.tag + 1)]
        return handles

    def rebuild(self, grad_weight: torch.Tensor, grad_bias: torch.Tensor | None, size: int) -> None:
        """The averaged gradient from everyone's factors: W = δ_allᵀ u_all / P, b = Σ δ_all / P."""
        total = self.u_all.numel() // self.M
        acc = emulated_accelerator()
        if acc is not None:
            # Emulated: the device's GEMM (N x ΣK by ΣK x M; Σ δ and the divisions are small beside it) on the
            # calling thread's stream, the progress thread's: its own clock, as a side stream overlaps
            # backward. grad_weight and grad_bias keep what they hold (this rank's fixed emulated gradient):
            # nothing reads their values but an emulated optimizer, and the factors were exchanged for real.
            acc.issue("rebuild", acc.model.gemm_s(self.N, self.M, total))
            return
        u = self.u_all.view(total, self.M)
        d = self.d_all.view(total, self.N)
        torch.mm(d.t(), u, out=grad_weight)
        grad_weight.div_(size)
        if grad_bias is not None:
            torch.sum(d, dim=0, out=grad_bias)
            grad_bias.div_(size)
