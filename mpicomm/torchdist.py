"""torch.distributed (gloo) started from MPI ranks: rank 0 picks the port, MPI broadcasts the rendezvous."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from datetime import timedelta

from mpi4py import MPI

_SIOCGIFADDR = 0x8915


def interface_address(ifname: str) -> str:
    """IPv4 address of a network interface in this process's namespace (e.g. eth0 of an emulated host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError as exc:
            raise RuntimeError(f"interface {ifname!r} has no IPv4 address here: {exc}") from None
    return socket.inet_ntoa(packed[20:24])


def _rendezvous_address(comm: MPI.Comm) -> str:
    """Where rank 0 listens: its cluster interface, loopback on a single host, else its hostname."""
    iface = os.environ.get("MPITRAIN_CLUSTER_IFACE") or os.environ.get("GLOO_SOCKET_IFNAME")
    if iface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        return interface_address(iface)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    single_host = comm.allreduce(node.Get_size() == comm.Get_size(), op=MPI.LAND)
    node.Free()
    if single_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def init_gloo(comm: MPI.Comm | None = None, timeout_s: float = 120.0):
    """Join every rank of `comm` into torch.distributed's default process group over gloo.

    Collective over `comm`. Sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
    as torch expects, so DDP and other torch code that reads them work too.
    Returns the default group; call `torch.distributed.destroy_process_group()` when done.
    """
    import torch.distributed as dist

    comm = comm or MPI.COMM_WORLD
    addr = _rendezvous_address(comm)
    port = 0
    if comm.Get_rank() == 0:
        # Ask the kernel for a free port on the rendezvous address; the tiny window before gloo
        # binds it again is the usual trade-off of this pattern.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
    addr, port = comm.bcast((addr, port), root=0)  # once, at start-up: pickling is fine here
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(comm.Get_rank()),
                      WORLD_SIZE=str(comm.Get_size()))
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=timedelta(seconds=timeout_s))
    return dist.group.WORLD


def shutdown_gloo(comm: MPI.Comm | None = None) -> None:
    """Tear the default group down on every rank together.

    A rank that exits while another is still destroying its gloo group (or
    still talking to rank 0's TCPStore) can make the latter abort with
    "terminate called without an active exception"; barriers on both sides
    keep every rank in step.

    Drop every DDP model on the group first. The group's gloo backend joins
    its worker threads when its last owner lets go. Python's handle on the
    group lets go with the GIL released; a DDP Reducer lets go holding it,
    so a worker that still needs the GIL (to free a tensor of its last
    collective) would wait for it forever. One CI run hung where a test's
    DDP model went out of scope after this call: that rank in no Python
    frame, with one frameless thread more than its peers. So this call
    keeps its own handle, collects the models that reference cycles still
    hold while the group lives, and lets go last.
    """
    import gc

    import torch.distributed as dist

    comm = comm or MPI.COMM_WORLD
    group = dist.group.WORLD  # released last, with the GIL dropped (see above)
    comm.Barrier()
    gc.collect()
    dist.destroy_process_group()
    comm.Barrier()
    del group
