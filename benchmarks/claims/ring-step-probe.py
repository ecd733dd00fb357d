"""The progress-driven ring's cost per step beyond the wire, as wfbp drives it: 8 buckets, one after another or together."""

import time

import numpy as np
from mpi4py import MPI

from mpicomm import Ring
from mpicomm.progress import HandleTask, ProgressThread

LINK_BYTES_PER_S = 1e9 / 8 * 0.94  # the emulated 1 Gbit/s link's payload (the calibrated efficiency)

comm = MPI.COMM_WORLD
P = comm.Get_size()
ring = Ring(comm)
thread = ProgressThread("ring-step-probe", drive=True)  # as wfbp's, where compute is off the host
for size in (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20):
    bufs = [np.ones(size // 4, np.float32) for _ in range(8)]
    for mode in ("serial", "together"):
        times = []
        for _ in range(4):
            comm.Barrier()
            t = time.perf_counter()
            futures = []
            for b in bufs:
                futures.append(thread.submit(HandleTask(ring.allreduce(b))))
                if mode == "serial":
                    with thread.driven():
                        futures[-1].wait()
            with thread.driven():
                for f in futures:
                    f.wait()
            times.append((time.perf_counter() - t) / len(bufs))
        per_bucket = float(np.median(times[1:]))  # the first repeat warms the connections
        if comm.Get_rank() == 0:
            wire = 2 * (P - 1) / P * size / LINK_BYTES_PER_S
            print(f"{size >> 10:6d} KiB {mode:8s} {per_bucket * 1e3:8.2f} ms a bucket, wire {wire * 1e3:7.2f} ms, "
                  f"beyond it {(per_bucket - wire) / (2 * (P - 1)) * 1e6:6.0f} us a step", flush=True)
thread.stop()
ring.free()
