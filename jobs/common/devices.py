"""--device for the jobs: each rank's GPU (by local rank), the device header, losses read without a stall."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported inside each function: importing a job module must start neither torch nor MPI.


def rank_device(name: str, topo) -> torch.device:
    """The device this rank trains on; with cuda it becomes the current device too (a collective-free choice).

    GPUs are dealt out by local rank (the node communicator), so ranks on one host spread over its GPUs
    and, when there are more ranks than GPUs, share them round-robin. jobs.common.inputs.check_device has
    already refused cuda where torch sees no GPU.
    """
    import torch

    if name != "cuda":
        return torch.device("cpu")
    index = topo.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def describe(device: torch.device, comm, dopt=None) -> dict:
    """Collective over `comm`: the run's device, every rank's, torch, CUDA and how gradients reach MPI.

    `transport` is the DistributedOptimizer's own description (without one: host memory on a CPU, else None).
    """
    import torch
    from mpi4py import MPI

    from mpicomm.cuda_support import mpi_cuda_aware

    info = dict(type=device.type, device=str(device),
                name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                # host/device per rank: shows which ranks share a GPU
                rank_devices=comm.allgather(f"{MPI.Get_processor_name()}/{device}"),
                torch=torch.__version__, cuda=torch.version.cuda,
                mpi_cuda_aware=mpi_cuda_aware(),
                transport=dopt.transport if dopt is not None else ("host memory" if device.type == "cpu" else None))
    return info


def header_line(info: dict) -> str:
    """`device cuda:0 (NVIDIA H100), 4 ranks on 1 cuda device(s), torch ..., CUDA 12.8, MPI CUDA-aware: no; ...`."""
    aware = {True: "yes", False: "no", None: "unknown"}[info["mpi_cuda_aware"]]
    where = info["device"] if info["type"] == "cpu" else f"{info['device']} ({info['name']})"
    shared = len(set(info["rank_devices"]))
    return (f"device {where}, {len(info['rank_devices'])} ranks on {shared} {info['type']} device(s), "
            f"torch {info['torch']}, CUDA {info['cuda'] or 'none'}, MPI CUDA-aware: {aware}; "
            f"gradient transport: {info['transport'] or 'unknown'}")


class LossValues:
    """Each step's loss as a float: at once on the CPU, one step late on a GPU so the host never waits for it.

    On CUDA, `loss.item()` would make the host wait until the GPU has run everything queued, an empty
    queue every step. Instead the loss is copied non-blocking into a pinned slot and read at the next
    step, by which time the following step's work is already queued behind it.
    """

    def __init__(self, device: torch.device):
        import torch

        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.zeros(2, dtype=torch.float32, pin_memory=True)
            # Blocking: flush() sleeps in synchronize() instead of spinning a core.
            self.events = [torch.cuda.Event(blocking=True), torch.cuda.Event(blocking=True)]
        self.slot, self.pending = 0, None

    def push(self, loss: torch.Tensor) -> float | None:
        """This step's loss (CPU), or the previous step's (CUDA; None at the first step)."""
        if not self.cuda:
            return loss.detach().item()
        import torch

        self.host[self.slot].copy_(loss.detach(), non_blocking=True)
        # On the stream the copy went on: the loss's device's, which need not be the current device.
        self.events[self.slot].record(torch.cuda.current_stream(loss.device))
        value = self.flush()
        self.pending, self.slot = self.slot, 1 - self.slot
        return value

    def flush(self) -> float | None:
        """The loss still owed (CUDA, at the end of an epoch), or None."""
        if self.pending is None:
            return None
        self.events[self.pending].synchronize()  # a step old: normally done already
        value, self.pending = float(self.host[self.pending]), None
        return value
