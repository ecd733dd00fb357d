"""Whether MPICH moves a node's large messages in one copy (CMA), by MPICH's own rule, and what follows if not."""

from __future__ import annotations

import os

__all__ = ["YAMA", "single_copy"]

YAMA = "/proc/sys/kernel/yama/ptrace_scope"


def single_copy(library: str, env=os.environ, yama: str = YAMA) -> tuple[bool | None, str]:
    """(on, why) for the MPI library named `library` (MPI.Get_library_version()); on is None for another MPI.

    MPICH's ch4 reads one large message from its sender's memory with process_vm_readv unless
    MPIR_CVAR_CH4_CMA_ENABLE=0 or Yama's ptrace_scope is not 0 (its MPIDI_CMA_init_local; Ubuntu's default
    is 1). Without it each such message moves a cell per progress call, and MPICH polls its network
    module only when shared memory made no progress: wfbp's node phases took 1.6x and p3's node messages
    7x as long at 4 hosts x 2 (benchmarks/topology.md), which is why p3, and there the hierarchical allreduce,
    go through shared windows.
    """
    if not library.startswith("MPICH"):
        return None, "not MPICH: its own shared-memory transport decides"
    for name in ("MPIR_CVAR_CH4_CMA_ENABLE", "MPICH_CH4_CMA_ENABLE", "MPIR_PARAM_CH4_CMA_ENABLE"):
        if env.get(name, "").strip() == "0":
            return False, f"{name}=0"
    try:
        with open(yama) as f:
            scope = f.read(1)
    except OSError:
        return True, "no Yama ptrace_scope here"
    if scope != "0":
        return False, f"kernel.yama.ptrace_scope={scope} (sysctl kernel.yama.ptrace_scope=0 turns it on)"
    return True, "kernel.yama.ptrace_scope=0"
