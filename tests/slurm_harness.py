"""A real SLURM on localhost for tests: munged, slurmctld and one or two slurmd, state in a temporary directory."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import random
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

MUNGE_DIR = "/run/munge"
MUNGED = "/usr/sbin/munged"
SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
CMD_TIMEOUT = 20  # seconds for any one client command (munge, sinfo)
STOP_WAIT = 10  # seconds between SIGTERM and SIGKILL, and after SIGKILL
LOG_TAIL = 40  # lines of each log shown in an error
# Variables of an enclosing allocation (pytest run inside a SLURM job) would leak into ours.
FOREIGN_ENV = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")


class SlurmHarnessError(RuntimeError):
    pass


@dataclass
class Cluster:
    """A running local cluster; its `env` (SLURM_CONF set) is what client commands need."""

    tmpdir: str
    conf: str
    nodes: list[str]
    env: dict[str, str]
    daemons: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def run(self, args: list[str], timeout: float = CMD_TIMEOUT, env: dict | None = None,
            **kw) -> subprocess.CompletedProcess:
        """A client command against this cluster, output captured; `env` adds variables (None unsets one)."""
        merged = {k: v for k, v in {**self.env, **(env or {})}.items() if v is not None}
        return subprocess.run(args, env=merged, capture_output=True, text=True, timeout=timeout, **kw)

    def logs(self) -> str:
        """Which daemons still run, and the tail of every log: for error messages."""
        parts = [f"{name} pid {p.pid}: " + ("running" if p.poll() is None else f"exited rc={p.returncode}")
                 for name, p in self.daemons]
        for name in sorted(os.listdir(self.tmpdir)):
            if name.endswith(".log"):
                with open(os.path.join(self.tmpdir, name), errors="replace") as f:
                    tail = f.read().splitlines()[-LOG_TAIL:]
                parts.append(f"--- {name} (last {len(tail)} lines) ---\n" + "\n".join(tail))
        return "\n".join(parts)


def free_ports(n: int) -> list[int]:
    """n TCP ports nothing listens on now (held open together while the kernel picks, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def slurm_conf(tmpdir: str, nodes: list[str], ports: list[int], cpus: int) -> str:
    """slurm.conf text: root runs everything, no cgroups, no accounting, every path in tmpdir."""
    host = socket.gethostname().split(".")[0]
    ctld_port, node_ports = ports[0], ports[1:]
    lines = [
        "ClusterName=mpitrain-test",
        # slurmctld only starts on the host it is configured for; the address keeps DNS out of it.
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"StateSaveLocation={tmpdir}/state",
        # %n (the node name) keeps two slurmd on one host apart.
        f"SlurmdSpoolDir={tmpdir}/spool-%n",
        f"SlurmctldPidFile={tmpdir}/slurmctld.pid",
        f"SlurmdPidFile={tmpdir}/slurmd-%n.pid",
        f"SlurmctldLogFile={tmpdir}/slurmctld.log",
        f"SlurmdLogFile={tmpdir}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        # MPICH names its shared-memory segments after the job (pmi2's kvsname, "<jobid>.<step>"):
        # a fresh controller would number jobs from 1 again, and a job that met a segment left by a
        # killed one of the same number failed in MPI_Init ("MPIDI_POSIX_comm_bootstrap: Out of
        # memory"). Numbering each test cluster's jobs from its own random start avoids that.
        f"FirstJobId={random.randrange(1_000, 60_000_000)}",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        # sbatch --wait polls every 2 s only while 2 >= MinJobAge/2 (integer division), else it
        # backs off to 8 and 32 s; 5 also keeps a finished job's record longer than one poll.
        "MinJobAge=5",
        "KillWait=5",
        "MailProg=/bin/true",  # the default, /bin/mail, is missing: an error line in every log
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    if len(nodes) == 1:
        lines += [f"SlurmdPort={node_ports[0]}", f"NodeName={nodes[0]} CPUs={cpus} State=UNKNOWN"]
    else:
        # Fake nodes all on this host: each slurmd needs its own port.
        lines += [f"NodeName={n} NodeHostname=localhost Port={p} CPUs={cpus} State=UNKNOWN"
                  for n, p in zip(nodes, node_ports)]
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4")
    return "\n".join(lines) + "\n"


def _munge_works() -> bool:
    """Whether a munged answers on the default socket (a credential encoded, then decoded)."""
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=CMD_TIMEOUT)
        return cred.returncode == 0 and subprocess.run(
            ["unmunge"], input=cred.stdout, capture_output=True, timeout=CMD_TIMEOUT).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the test process dies, even by SIGKILL or os._exit."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _start(cluster: Cluster, name: str, args: list[str], env: dict | None = None, **kw) -> None:
    """A daemon in the foreground, so the PID held is the daemon's own; its output in NAME.stdout.log."""
    with open(os.path.join(cluster.tmpdir, f"{name}.stdout.log"), "w") as log:  # the child keeps its copy
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=cluster.env if env is None else env, preexec_fn=_die_with_parent, **kw)
    cluster.daemons.append((name, proc))


def _wait_for(what: str, ready, timeout: float, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [(n, p.returncode) for n, p in cluster.daemons if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"daemon(s) exited: {dead}" if dead else f"not within {timeout:.0f} s"
            raise SlurmHarnessError(f"local SLURM: {what} failed ({why})\n{cluster.logs()}")
        time.sleep(0.2)


def _nodes_idle(cluster: Cluster) -> bool:
    try:
        out = cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"])
    except subprocess.TimeoutExpired:
        return False
    states = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())
    return out.returncode == 0 and all(states.get(n) == "idle" for n in cluster.nodes)


def _tagged_pids(conf: str) -> list[int]:
    """Processes whose environment names this cluster's slurm.conf: its daemons, slurmstepd, job tasks."""
    tag = f"SLURM_CONF={conf}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone meanwhile
            pass
    return [p for p in found if p != os.getpid()]


def _stop(cluster: Cluster) -> None:
    """SIGTERM each daemon started here (newest first), SIGKILL after STOP_WAIT, then check none is left."""
    for _, proc in reversed(cluster.daemons):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=STOP_WAIT)
    # slurmstepd detaches from slurmd, so a job still running outlives it: end what carries our tag.
    for pid in _tagged_pids(cluster.conf):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_WAIT
    while _tagged_pids(cluster.conf) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [f"{name} pid {p.pid}" for name, p in cluster.daemons if p.poll() is None]
    alive += [f"pid {pid}" for pid in _tagged_pids(cluster.conf)]
    if alive:
        raise SlurmHarnessError(f"local SLURM: still running after shutdown: {', '.join(alive)}")


@contextlib.contextmanager
def local_slurm(nodes: int = 1, startup_timeout: float = 30.0):
    """Bring up SLURM with one node ("localhost") or two ("n1", "n2", both this host); yield a Cluster.

    Needs root. A munged that already answers is used as it is; otherwise one is started here.
    Whatever is started here is stopped by PID on exit, also when the body raises.
    """
    if nodes not in (1, 2):
        raise ValueError(f"nodes must be 1 or 2, got {nodes}")
    names = ["localhost"] if nodes == 1 else ["n1", "n2"]
    with tempfile.TemporaryDirectory(prefix="mpitrain-slurm-") as tmpdir:
        conf = os.path.join(tmpdir, "slurm.conf")
        with open(conf, "w") as f:
            f.write(slurm_conf(tmpdir, names, free_ports(1 + nodes), os.cpu_count() or 1))
        os.mkdir(os.path.join(tmpdir, "state"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN_ENV)}
        # SLURM_CONF in the daemons' environment also tags every process they spawn (see _tagged_pids).
        cluster = Cluster(tmpdir, conf, names, env={**env, "SLURM_CONF": conf})
        try:
            if not _munge_works():
                munge = pwd.getpwnam("munge")
                os.makedirs(MUNGE_DIR, exist_ok=True)
                os.chown(MUNGE_DIR, munge.pw_uid, munge.pw_gid)
                _start(cluster, "munged", [MUNGED, "--foreground"], env=env,
                       user=munge.pw_uid, group=munge.pw_gid, extra_groups=[])
                _wait_for("munged start-up", _munge_works, startup_timeout, cluster)
            _start(cluster, "slurmctld", [SLURMCTLD, "-D", "-f", conf])
            for name in names:
                _start(cluster, f"slurmd-{name}", [SLURMD, "-D", "-f", conf, "-N", name])
            _wait_for(f"node(s) {','.join(names)} idle", lambda: _nodes_idle(cluster), startup_timeout, cluster)
            yield cluster
        finally:
            _stop(cluster)
