"""The emulated cluster: bring it up, run MPI jobs across its hosts, report its state, take it down."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import signal
import subprocess
from datetime import datetime, timezone

from ..launch import mpiexec
from . import netns
from .netns import EmulationError

STATE_DIR = os.environ.get("MPITRAIN_CLUSTER_DIR", "/run/mpitrain-cluster")
NETNS_SSH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launcher", "netns-ssh")
# Environment every rank gets: UCX must not use shared memory, or ranks of different emulated
# hosts (all on this one machine) would bypass the shaped links; the same for libfabric.
#
# UCX's tcp transport reads a socket into segments of UCX_TCP_RX_SEG_SIZE, by default 64 KB, and a progress call
# reads only so many: a 1 MB message to a rank that polls every millisecond (a pipeline stage waiting for its
# neighbour) took ~16 ms to land at 10 Gbit/s, where the wire needs 1. The char-LSTM pipeline's step went from
# 0.226 s to 0.130 s with 4 MB segments (torch's gloo, which reads in threads of its own, took 0.114 s): the
# segments a TCP cluster's MPI should be given (benchmarks/pipeline.md).
RANK_ENV = {"UCX_TLS": "tcp,self", "UCX_TCP_RX_SEG_SIZE": "4mb", "FI_PROVIDER": "tcp",
            "GLOO_SOCKET_IFNAME": netns.IFACE, "MPITRAIN_CLUSTER_IFACE": netns.IFACE}
# UCX's rendezvous protocol over its tcp transport stalls when both directions of a slow link are
# busy: MPICH's default allreduce took 1.5-1.6x the bandwidth bound at 1 Gbit/s with it, 1.13-1.19x
# with eager messages only. On fast links the wire is no longer the limit but the copies are: eager
# cut the 10 Gbit/s ping-pong from 9.5 to 6.5 Gbit/s. So eager up to this rate (benchmarks/cluster.md).
EAGER_UP_TO_BPS = 2_500_000_000


@functools.lru_cache(maxsize=None)
def tcp_wmem_max() -> int:
    """This machine's largest TCP send buffer (tcp_wmem's third figure), in bytes."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 4 << 20  # Linux's default


def eager_send_buffer(bps: float | None, wmem_max: int | None = None) -> int:
    """Bytes one connection takes before an eager send of it completes on links shaped to `bps`: the largest TCP
    send buffer (`wmem_max`, by default this machine's) where the ranks send eagerly, else 0 (rendezvous: a send
    completes once it is delivered)."""
    if not (bps and bps <= EAGER_UP_TO_BPS):
        return 0
    return tcp_wmem_max() if wmem_max is None else wmem_max


@contextlib.contextmanager
def _locked():
    """Serialise up/down between processes sharing this machine."""
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(os.path.join(STATE_DIR, "lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _state_path() -> str:
    return os.path.join(STATE_DIR, "state.json")


def read_state() -> dict | None:
    try:
        with open(_state_path()) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class EmulatedCluster:
    """`hosts` network namespaces joined by links of `bandwidth` each way; a context manager for tests.

    MPI runs across them with hydra: mpiexec itself runs in host 0 and
    reaches the others through the `netns-ssh` launcher on their addresses.
    burst: the links' token bucket in bytes (None: netns.tbf_args' ~2 ms).
    congestion_control: the hosts' TCP congestion control, "cubic" say (None: the machine's, which new
    namespaces inherit); `congestion_control_in_effect` is what they run once up.
    """

    def __init__(self, hosts: int = 4, bandwidth: str | int | None = "1gbit", ranks_per_host: int = 1,
                 netmod: str | None = None, burst: int | None = None, congestion_control: str | None = None):
        if not isinstance(hosts, int) or not 1 <= hosts <= netns.MAX_HOSTS:
            raise EmulationError(f"hosts must be between 1 and {netns.MAX_HOSTS}, got {hosts!r}")
        if not isinstance(ranks_per_host, int) or not 1 <= ranks_per_host <= 64:
            raise EmulationError(f"ranks per host must be between 1 and 64, got {ranks_per_host!r}")
        if netmod not in (None, "ucx", "ofi"):
            raise EmulationError(f"netmod must be ucx or ofi, got {netmod!r}")
        if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int) or burst < 1):
            raise EmulationError(f"burst must be a whole number of bytes >= 1, got {burst!r}")
        if congestion_control is not None:
            netns.check_congestion_control(congestion_control)
        self.hosts = hosts
        self.bps = bandwidth if isinstance(bandwidth, int) or bandwidth is None else netns.parse_bandwidth(bandwidth)
        self.ranks_per_host = ranks_per_host
        self.netmod = netmod
        self.burst = burst
        self.congestion_control = congestion_control
        self.congestion_control_in_effect: str | None = None

    @classmethod
    def current(cls) -> "EmulatedCluster":
        """The cluster `up` left running, as recorded in the state file."""
        state = read_state()
        if state is None or not netns.our_namespaces():
            raise EmulationError("no emulated cluster is up: start one with `python -m jobs.cluster up`")
        cluster = cls(state["hosts"], state["bandwidth_bps"], state["ranks_per_host"], state.get("netmod"),
                      state.get("burst_bytes"), state.get("congestion_control"))
        cluster.congestion_control_in_effect = state.get("congestion_control_in_effect")
        return cluster

    @property
    def bandwidth(self) -> str:
        return netns.format_bandwidth(self.bps)

    # -- lifecycle ---------------------------------------------------------
    def up(self) -> "EmulatedCluster":
        problem = netns.why_not()
        if problem:
            raise EmulationError(problem)
        with _locked():
            existing, state = netns.our_namespaces(), read_state()
            if existing and state:
                raise EmulationError(
                    f"a cluster is already up ({state['hosts']} hosts at "
                    f"{netns.format_bandwidth(state['bandwidth_bps'])}, since {state['created']}); "
                    "run `python -m jobs.cluster down` first")
            if existing:
                raise EmulationError(f"leftover namespaces from a crashed run: {' '.join(existing)}; "
                                     "run `python -m jobs.cluster down` to remove them")
            netns.build(self.hosts, self.bps, self.burst, self.congestion_control)
            self.congestion_control_in_effect = netns.congestion_control(netns.host_ns(0))
            state = dict(hosts=self.hosts, bandwidth_bps=self.bps, ranks_per_host=self.ranks_per_host,
                         netmod=self.netmod, burst_bytes=self.burst, congestion_control=self.congestion_control,
                         congestion_control_in_effect=self.congestion_control_in_effect,
                         addresses=[netns.host_addr(i) for i in range(self.hosts)],
                         created=datetime.now(timezone.utc).isoformat(timespec="seconds"), pid=os.getpid())
            with open(_state_path() + ".tmp", "w") as f:
                json.dump(state, f, indent=1)
            os.replace(_state_path() + ".tmp", _state_path())
        return self

    @staticmethod
    def down() -> list[str]:
        """Remove every namespace of ours (the recorded cluster or leftovers) and its processes."""
        with _locked():
            removed = netns.teardown()
            with contextlib.suppress(FileNotFoundError):
                os.remove(_state_path())
        return removed

    def __enter__(self) -> "EmulatedCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- running jobs ------------------------------------------------------
    def mpiexec_command(self, cmd: list[str], np: int | None = None, ranks_per_host: int | None = None,
                        env: dict | None = None) -> list[str]:
        """The full command line that runs `cmd` as an MPI job across the hosts."""
        per = ranks_per_host or self.ranks_per_host
        np = np or self.hosts * per
        hosts = ",".join(f"{netns.host_addr(i)}:{per}" for i in range(self.hosts))
        base = dict(RANK_ENV, **({"UCX_RNDV_THRESH": "inf"} if self.bps and self.bps <= EAGER_UP_TO_BPS else {}))
        genv = {k: os.environ.get(k, v) for k, v in base.items()}  # the caller's environment wins
        genv.update({"MPIR_CVAR_CH4_NETMOD": self.netmod} if self.netmod else {}, **(env or {}))
        flags = [x for k, v in genv.items() for x in ("-genv", k, str(v))]
        # mpiexec runs in host 0 (its proxies could not reach it from the root namespace), under
        # that host's name like every other host's processes.
        return netns.in_ns(netns.host_ns(0), "unshare", "--uts", "bash", "-c", 'hostname h0 && exec "$@"', "mpiexec",
                           mpiexec(), "-iface", netns.IFACE, "-hosts", hosts, "-launcher", "ssh",
                           "-launcher-exec", NETNS_SSH, *flags, "-n", str(np), *cmd)

    def run(self, cmd: list[str], np: int | None = None, ranks_per_host: int | None = None,
            env: dict | None = None, timeout: float | None = None, capture: bool = False,
            echo: str | None = None) -> subprocess.CompletedProcess:
        """Run an MPI job across the hosts; on timeout or Ctrl-C its whole process group is killed. echo: print
        the captured stdout lines that start with it as they come (run_killable)."""
        return run_killable(self.mpiexec_command(cmd, np, ranks_per_host, env), timeout, capture, echo)

    def exec_on(self, host: int, cmd: list[str], timeout: float | None = None,
                capture: bool = False) -> subprocess.CompletedProcess:
        """Run a plain (non-MPI) command inside one host's namespace."""
        if not 0 <= host < self.hosts:
            raise EmulationError(f"host {host} outside 0..{self.hosts - 1}")
        return run_killable(netns.in_ns(netns.host_ns(host), *cmd), timeout, capture)

    def status(self) -> dict:
        present = netns.our_namespaces()
        return dict(hosts=self.hosts, bandwidth=self.bandwidth, ranks_per_host=self.ranks_per_host,
                    burst_bytes=self.burst, congestion_control=self.congestion_control_in_effect, namespaces=present,
                    processes={ns: len(netns.processes_in(ns)) for ns in present},
                    link_bytes=[netns.qdisc_bytes(i) if self.bps else None for i in range(self.hosts)])


def run_killable(cmd: list[str], timeout: float | None, capture: bool, echo: str | None = None
                 ) -> subprocess.CompletedProcess:
    """Run cmd in its own session, the whole group killed on a timeout or an interrupt. capture: keep its output;
    echo: also print each captured stdout line that starts with it as it comes (a long benchmark's progress)."""
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    try:
        out, err = _stream(proc, timeout, echo) if capture and echo else proc.communicate(timeout=timeout)
    except BaseException as exc:  # TimeoutExpired, KeyboardInterrupt, SystemExit
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()  # what the job printed before it was killed: where it stood
        if isinstance(exc, subprocess.TimeoutExpired):
            said = "".join(f"\n--- its last {name} ---\n{text[-4000:]}" for name, text in (("stdout", out),
                                                                                        ("stderr", err)) if text)
            raise EmulationError(f"job timed out after {timeout}s and was killed: {' '.join(cmd[-6:])}{said}"
                                 ) from None
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _stream(proc: subprocess.Popen, timeout: float | None, echo: str) -> tuple[str, str]:
    """communicate(), printing the stdout lines that start with `echo` as they arrive (a thread per pipe: either
    may fill while the other is read)."""
    import sys
    import threading

    got: dict[str, list[str]] = {"out": [], "err": []}

    def read(pipe, key):
        for line in pipe:
            got[key].append(line)
            if key == "out" and line.startswith(echo):
                print("  " + line, end="", flush=True)

    threads = [threading.Thread(target=read, args=(p, k), daemon=True) for p, k in ((proc.stdout, "out"),
                                                                                      (proc.stderr, "err"))]
    for t in threads:
        t.start()
    try:
        proc.wait(timeout=timeout)
    finally:  # on a timeout too: the group is killed, the pipes end, the readers with them (run_killable)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for t in threads:
            t.join()
    sys.stdout.flush()
    return "".join(got["out"]), "".join(got["err"])


def run_local(cmd: list[str], np: int, timeout: float | None = None, capture: bool = False, echo: str | None = None):
    """The documented fallback without root: the same job on this host, unshaped, and marked so."""
    env_flags = ["-genv", "MPITRAIN_UNSHAPED", "1"]
    return run_killable([mpiexec(), *env_flags, "-n", str(np), *cmd], timeout, capture, echo)

