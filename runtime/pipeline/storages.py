"""Where a stage's parameters live: each storage holding parameters seen whole, saved tensors found by storage."""

# A parameter usually has a storage of its own, but not always: on CUDA,
# nn.LSTM's flatten_parameters() re-points its weights into one cuDNN buffer
# (each weight a view at its own offset), and cuDNN's forward then saves the
# whole buffer besides the weights. A tensor autograd saves is found by its
# storage; a weight version (a stash, a prediction) is a copy of the whole
# storage, so that a saved tensor's (size, stride, offset) reads the same
# elements in the copy as in the live storage, whichever parameter or span of
# parameters it covers.

from __future__ import annotations

import torch


class ParamStorage:
    """One storage holding parameters: `flat`, a 1-D tensor over all of it; `members`, the parameters' indices."""

    __slots__ = ("flat", "members", "covered")

    def __init__(self, p: torch.Tensor):
        n = p.untyped_storage().nbytes() // p.element_size()
        with torch.no_grad():
            self.flat = torch.empty(0, dtype=p.dtype, device=p.device).set_(p.untyped_storage(), 0, (n,))
        self.members: list[int] = []
        self.covered = 0  # elements of the storage that are parameters' (all of it: no gap to copy apart)


class ParamStorages:
    """The storages of `params`, and which one a tensor shares (by its storage's address)."""

    def __init__(self, params: list[torch.Tensor]):
        self.blocks: list[ParamStorage] = []
        self.of: list[int | None] = []  # per parameter: its storage's index (None: an empty parameter)
        self._by_ptr: dict[int, int] = {}
        spans: dict[int, list[tuple[int, int, int]]] = {}
        for i, p in enumerate(params):
            if p.numel() == 0:  # no storage to speak of, nothing autograd would save
                self.of.append(None)
                continue
            ptr = p.untyped_storage().data_ptr()
            b = self._by_ptr.setdefault(ptr, len(self.blocks))
            if b == len(self.blocks):
                self.blocks.append(ParamStorage(p))
            block = self.blocks[b]
            if p.dtype != block.flat.dtype:
                raise ValueError(f"parameters #{block.members[0]} ({block.flat.dtype}) and #{i} ({p.dtype}) share "
                                 "one storage with different dtypes; the pipeline's weight versions cannot copy it")
            block.members.append(i)
            block.covered += p.numel()
            self.of.append(b)
            spans.setdefault(b, []).append((p.storage_offset(), p.storage_offset() + extent(p), i))
        for b, s in spans.items():  # two parameters over the same elements would be updated twice
            s.sort()
            for (_, end, i), (start, _, j) in zip(s, s[1:]):
                if start < end:
                    raise ValueError(f"parameters #{i} and #{j} overlap in memory (one storage); the pipeline's "
                                     "weight versions need each element in one parameter at most")

    def find(self, t: torch.Tensor) -> int | None:
        """Index of the parameters' storage `t` is a view of (None: it shares none, or reads it as another dtype)."""
        b = self._by_ptr.get(t.untyped_storage().data_ptr())
        return b if b is not None and t.dtype == self.blocks[b].flat.dtype else None

    def view(self, copy: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Parameter p's elements in `copy`, a tensor like its storage's flat one."""
        return copy.as_strided(p.size(), p.stride(), p.storage_offset())

    def touched(self, b: int, size, stride, offset: int, params: list[torch.Tensor]) -> list[int]:
        """The parameters of storage b that a view (size, stride, offset) of it reads elements of."""
        if any(n == 0 for n in size):
            return []
        end = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
        return [i for i in self.blocks[b].members
                if params[i].storage_offset() < end and offset < params[i].storage_offset() + extent(params[i])]


def extent(t: torch.Tensor) -> int:
    """Elements from t's first to one past its last, in its storage."""
    return sum((n - 1) * s for n, s in zip(t.size(), t.stride())) + 1 if t.numel() else 0
