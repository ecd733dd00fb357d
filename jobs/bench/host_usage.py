"""What a benchmark's ranks use of their host: CPU-seconds, peak memory, ranks per core, modelled device seconds."""

from __future__ import annotations

import os


def ranks_cpu_s(comm) -> float:
    """Collective: the CPU-seconds (user + system, every thread) all ranks' processes have used so far.

    Per process, not machine-wide: another user's load on a shared machine is not counted, and
    progress threads, gloo's threads and the system calls that move the bytes are.
    """
    import resource

    import numpy as np
    from mpi4py import MPI

    use = resource.getrusage(resource.RUSAGE_SELF)
    total = np.array([use.ru_utime + use.ru_stime])
    comm.Allreduce(MPI.IN_PLACE, total)
    return float(total[0])


def ranks_per_core(comm) -> float:
    """Collective: the ranks on this rank's machine over the cores it may use.

    One machine is one running kernel (its boot id): the emulated cluster's hosts are namespaces of
    one machine, and their ranks share its cores.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = f.read().strip()
    except OSError:  # not Linux: the host name
        import platform
        machine = platform.node()
    here = sum(m == machine for m in comm.allgather(machine))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return here / cores


def memory_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB: now, and its peak so far."""
    with open("/proc/self/status") as f:
        found = {line[:5]: int(line.split()[1]) / 1024 for line in f if line.startswith(("VmRSS:", "VmHWM:"))}
    return found["VmRSS"], found["VmHWM"]


def reset_peak_rss() -> None:
    """Start this process's peak resident set (VmHWM) again from its current size (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak then covers the run so far
        pass


def peak_rss_mb(comm) -> tuple[float | None, float | None]:
    """Collective: (the largest rank's peak resident MB since reset_peak_rss, all ranks' peaks summed); None
    where /proc does not say."""
    kib = None
    try:
        with open("/proc/self/status") as f:
            kib = next((float(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)
    except OSError:
        pass
    every = comm.allgather(kib)
    if None in every:
        return None, None
    return max(every) / 1024, sum(every) / 1024


def modelled_s() -> dict[str, float] | None:
    """The emulated accelerator's modelled seconds so far, per kind of work; None when not emulating."""
    from runtime.emulate import active

    acc = active()
    return None if acc is None else dict(acc.seconds)


def modelled_since(before: dict[str, float] | None, steps: int) -> dict[str, float] | None:
    """Modelled seconds per step, per kind, since `before` (modelled_s()); None when not emulating."""
    now = modelled_s()
    if now is None or before is None:
        return None
    return {k: (v - before.get(k, 0.0)) / steps for k, v in sorted(now.items()) if v - before.get(k, 0.0) > 0}
