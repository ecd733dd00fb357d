"""Sufficient-factor broadcasting of one Linear layer: gather every rank's input and output-gradient rows, rebuild Σ δᵀu."""

from __future__ import annotations

import torch

from mpicomm.buffers import offsets
from mpicomm.ring import IN_PLACE

from ..emulate.accelerator import active as emulated_accelerator


class FactorExchange:
    """One layer's factors for one step, and the buffers they travel in (kept across steps, resized when K changes).

    The rows of every rank land in two gathered buffers, u_all (ΣK x M) and
    δ_all (ΣK x N), each rank's block at its offset: this rank packs its own
    block in place and a ring allgatherv fills in the others. Every rank then
    computes the same product δ_allᵀ u_all on the same data in the same order,
    so the weights stay identical across ranks (a sum of local gradient and
    peers' products would differ in the last bits from rank to rank).

    Under emulated compute (runtime.emulate) the rows are still packed and
    gathered for real (they are what goes on the wire), after the modelled
    copy of this rank's rows off the device; the rebuild waits the device's
    GEMM time instead of computing (see `rebuild`).
    """

    def __init__(self, name: str, M: int, N: int, dtype: torch.dtype, tag: int):
        self.name, self.M, self.N, self.dtype, self.tag = name, M, N, dtype, tag
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input, output gradient) per use
        self.u_all = torch.empty(0, dtype=dtype)
        self.d_all = torch.empty(0, dtype=dtype)

    def add(self, inputs: torch.Tensor, grad_output: torch.Tensor) -> None:
        self.pairs.append((inputs, grad_output))

    def drop(self) -> None:
        """Forget this step's captured rows (the activations they reference can be freed)."""
        self.pairs = []

    def start(self, ring, rows: list[int], rank: int):
        """Pack this rank's rows, start both allgathervs; a Task whose poll() ends with the rebuild inputs ready.

        rows[p]: the rows rank p contributes (the step's census). Rows this
        rank counted in forward but got no output gradient for (an output
        that backward never reached) contribute zeros.
        """
        total = sum(rows)
        if self.u_all.numel() != total * self.M:  # a new batch size: the only time these are allocated
            self.u_all = torch.empty(total * self.M, dtype=self.dtype)
            self.d_all = torch.empty(total * self.N, dtype=self.dtype)
        lo = offsets(rows)[rank]
        mine = rows[rank]
        u = self.u_all[lo * self.M:(lo + mine) * self.M].view(mine, self.M)
        d = self.d_all[lo * self.N:(lo + mine) * self.N].view(mine, self.N)
        at = 0
        for inputs, grad in self.pairs:
            k = inputs.numel() // self.M
            if at + k > mine:
                raise RuntimeError(f"hybcomm: layer {self.name} saw {at + k} rows in backward but {mine} in forward "
                                   "this step: a forward pass outside the step's accounting (activation "
                                   "checkpointing re-runs forward; use force='ps' for such a model)")
            u[at:at + k].copy_(inputs.reshape(k, self.M))
            d[at:at + k].copy_(grad.reshape(k, self.N))
            at += k
        if at < mine:
            u[at:].zero_()
            d[at:].zero_()
        self.drop()
        acc = emulated_accelerator()
        if acc is not None:  # the rows leave the GPU for MPI's host memory: the caller's thread waits for the copy
            acc.issue("d2h", acc.model.copy_s(mine * (self.M + self.N) * u.element_size()))
        handles = [ring.allgatherv(IN_PLACE, self.u_all, counts=[r * self.M for r in rows], tag=self.tag),
                   ring.allgatherv(IN_PLACE, self.d_all, counts=[r * self.N for r in rows], tag=self.tag + 1)]
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
