"""Zero-copy views of numpy arrays and CPU torch tensors as MPI byte buffers, and local reduction."""

from __future__ import annotations

import sys

import numpy as np

# Every supported dtype gets a small stable code so ranks can compare dtypes in
# an integer fingerprint. Transport is always MPI.BYTE: the reductions run
# locally in numpy/torch, so MPI never needs to know the element type (which
# also lets bfloat16 through, a type MPI has no standard datatype for).
DTYPE_CODES = {
    "float32": 1, "float64": 2, "float16": 3, "bfloat16": 4,
    "int8": 5, "int16": 6, "int32": 7, "int64": 8, "uint8": 9,
}
OP_CODES = {"sum": 1, "prod": 2, "max": 3, "min": 4}


class BufferError(TypeError):
    """A buffer this layer cannot send without a copy, or of a type it does not reduce."""


_NAMES: dict = {}  # dtype object -> name: numpy computes .name in Python, a cost on every small call


def _dtype_name(obj) -> str:
    dtype = obj.dtype
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = dtype.name if isinstance(obj, np.ndarray) else str(dtype).replace("torch.", "")
    return name


def is_torch(obj) -> bool:
    # Not imported here: a tensor cannot exist before its caller has imported torch, and the MPI layer's
    # torch-free users (topology, the emulated cluster's tools, bench collectives) then skip its ~1 CPU-s import.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def check_buffer(obj, what: str = "buffer") -> str | None:
    """Why `obj` cannot be used as a buffer, or None when it can."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            return f"{what} is a non-contiguous numpy array (use np.ascontiguousarray)"
        if not obj.flags.writeable:
            return f"{what} is a read-only numpy array"
    elif is_torch(obj):
        if obj.device.type != "cpu":
            return f"{what} is a torch tensor on {obj.device}, only CPU tensors are supported"
        if not obj.is_contiguous():
            return f"{what} is a non-contiguous torch tensor (call .contiguous())"
    else:
        return f"{what} must be a numpy array or a CPU torch tensor, got {type(obj).__name__}"
    if _dtype_name(obj) not in DTYPE_CODES:
        return f"{what} has unsupported dtype {_dtype_name(obj)} (supported: {', '.join(DTYPE_CODES)})"
    return None


class Buffer:
    """A flat element view of an array or tensor, sliced by element, shipped as bytes.

    No method copies the underlying memory except `scratch`, which allocates.
    """

    __slots__ = ("obj", "flat", "count", "itemsize", "dtype", "_bytes", "_torch")

    def __init__(self, obj, what: str = "buffer", checked: bool = False):
        problem = None if checked else check_buffer(obj, what)
        if problem:
            raise BufferError(problem)
        self.obj = obj
        self._torch = is_torch(obj)
        self.dtype = _dtype_name(obj)
        if self._torch:
            self.flat = obj.detach().reshape(-1)
            self.itemsize = self.flat.element_size()
            # A uint8 view shares storage and works for bfloat16, which numpy lacks.
            self._bytes = self.flat.view(sys.modules["torch"].uint8).numpy()
        else:
            self.flat = obj.reshape(-1)
            self.itemsize = obj.itemsize
            self._bytes = self.flat.view(np.uint8)
        self.count = self.flat.shape[0]

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype]

    def bytes(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """uint8 numpy view of elements [start, stop): what MPI sends or receives into."""
        stop = self.count if stop is None else stop
        return self._bytes[start * self.itemsize: stop * self.itemsize]

    def elements(self, start: int = 0, stop: int | None = None):
        stop = self.count if stop is None else stop
        return self.flat[start:stop]

    def scratch(self, count: int) -> "Buffer":
        """A new uninitialized buffer of `count` elements of the same kind and dtype."""
        if self._torch:
            return Buffer(self.flat.new_empty(count))
        return Buffer(np.empty(count, dtype=self.flat.dtype))

    def copy_from(self, other: "Buffer", start: int = 0) -> None:
        """Copy all of `other` into elements [start, start + other.count)."""
        self.bytes(start, start + other.count)[...] = other.bytes()


def wrap(obj, what: str):
    """(Buffer, None) or (None, BufferError) without raising, so that the error can be shared first."""
    problem = check_buffer(obj, what)
    return (None, BufferError(problem)) if problem else (Buffer(obj, what, checked=True), None)


def check_op(op: str) -> ValueError | None:
    return None if op in OP_CODES else ValueError(f"unsupported op {op!r} (use one of {sorted(OP_CODES)})")


def allreduce_operands(buf, out, op: str):
    """(src, dst, problem) of an allreduce (dst is src in place); a problem is returned, to be shared first."""
    src, problem = wrap(buf, "buf")
    problem = problem or check_op(op)
    dst = src
    if out is not None and problem is None:
        dst, problem = wrap(out, "out")
        if dst is not None and (dst.count != src.count or dst.dtype != src.dtype):
            problem = BufferError(f"out has {dst.count} x {dst.dtype}, buf has {src.count} x {src.dtype}")
    return src, dst, problem


def typed_like(raw: np.ndarray, like):
    """The bytes `raw` as `like`'s kind (numpy array or torch tensor) and dtype, no copy."""
    if is_torch(like):
        return sys.modules["torch"].from_numpy(raw).view(like.dtype)
    return raw.view(like.dtype)


def reduce_into(op: str, dst, a, b) -> None:
    """dst = a (op) b elementwise; arguments are same-length element views (dst may alias a)."""
    if is_torch(dst):
        torch = sys.modules["torch"]
        fn = {"sum": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}[op]
    else:
        fn = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    fn(a, b, out=dst)


def block_counts(count: int, parts: int) -> list[int]:
    """Split `count` elements into `parts` contiguous blocks, the first `count % parts` one larger."""
    base, extra = divmod(count, parts)
    return [base + (i < extra) for i in range(parts)]


def chunk_ranges(start: int, stop: int, per: int) -> list[tuple[int, int]]:
    """[start, stop) cut into (a, z) pieces of `per` elements, the last one shorter."""
    return [(a, min(a + per, stop)) for a in range(start, stop, per)]


def offsets(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
