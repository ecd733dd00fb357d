"""Whether the MPI library can take GPU memory: asked of the library itself (MPIX_Query_cuda_support)."""

from __future__ import annotations

import ctypes
import functools

from mpi4py import MPI


@functools.lru_cache(maxsize=None)
def mpi_cuda_aware() -> bool | None:
    """True/False as the library answers at run time; None when it has no such query.

    MPICH (>= 4) and Open MPI both export MPIX_Query_cuda_support(); it
    reports what this run can do (a CUDA-built MPICH still answers 0 unless
    MPIR_CVAR_ENABLE_GPU is on), unlike a compile-time macro. The symbol is
    looked up through mpi4py's extension module, which links the library
    that actually runs.
    """
    try:
        query = getattr(ctypes.CDLL(MPI.__file__), "MPIX_Query_cuda_support")
    except (OSError, AttributeError):
        return None
    query.restype, query.argtypes = ctypes.c_int, []
    return bool(query())


def describe_cuda_support() -> str:
    aware = mpi_cuda_aware()
    return {True: "CUDA-aware", False: "not CUDA-aware", None: "CUDA-awareness unknown (no MPIX query)"}[aware]
