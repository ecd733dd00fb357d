"""The emulated accelerator of this process: its compute model, its clocks and what each kind of its work cost."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict

from .clock import Clock
from .compute_model import ComputeModel

__all__ = ["Accelerator", "active", "activate", "deactivate", "device_time", "device_work", "ready_at", "synchronize"]


class Accelerator:
    """One per process while emulating. Work on the main thread runs on its compute stream's clock; a
    strategy's thread (progress, staging) gets a clock of its own, as work on a side stream overlaps."""

    def __init__(self, model: ComputeModel, scale: float = 1.0):
        if not scale > 0:
            raise ValueError(f"compute scale must be > 0, got {scale}")
        self.model, self.scale = model, scale
        self._clocks = threading.local()
        self.seconds: dict[str, float] = defaultdict(float)  # modelled seconds per kind of work
        self.calls: dict[str, int] = defaultdict(int)
        self.real: set[str] = set()  # kinds of accelerator work that ran for real (not emulated)
        self._lock = threading.Lock()  # the accounts: the main, progress and staging threads all run work
        # Host CPU seconds that landing the gradients took (runtime.emulate.landing): the copies that stand in
        # for a GPU's staging copies, the host work an emulated step is allowed beyond its own.
        self.landing_cpu_s = 0.0

    @property
    def clock(self) -> Clock:
        c = getattr(self._clocks, "clock", None)
        if c is None:
            c = self._clocks.clock = Clock()
        return c

    def run(self, kind: str, seconds: float, lazy: bool = False, wait: bool = True) -> None:
        """Wait out `seconds` of modelled work (times the compute scale), accounted under `kind` (lazy, wait: see
        Clock.run; lazy for work inside a pass that nothing outside the pass sees end, wait=False for work the
        host launches and does not wait for)."""
        seconds *= self.scale
        self.account(kind, seconds)
        self.clock.run(seconds, lazy, wait)

    def account(self, kind: str, seconds: float, calls: int = 1) -> None:
        """Count `seconds` of modelled work (scaled already) under `kind`, run by the caller (a pass's layers
        are counted once a pass, not once a layer)."""
        with self._lock:
            self.seconds[kind] += seconds
            self.calls[kind] += calls

    def issue(self, kind: str, seconds: float) -> None:
        """Work the host issues now, after waiting for something (a gradient, a message, its last copy): it
        starts now or when this thread's stream is free, whichever is later, not at the stream's last deadline
        (a side stream idle since the last step would otherwise owe nothing)."""
        self.clock.begin()
        self.run(kind, seconds)

    @contextlib.contextmanager
    def device_work(self, kind: str, seconds: float = 0.0):
        """Host work that stands in for the device's (zeroing gradient buffers in host memory, say): its host
        time does not delay the device's timeline; `seconds` of modelled time are queued instead, which the
        host does not wait for (a memset it launched): the next work starts after them."""
        t = time.perf_counter()
        try:
            yield
        finally:
            # Queued after the last work; the host's time here does not delay the next pass's start.
            self.clock.absorb(time.perf_counter() - t)
            self.run(kind, seconds, wait=False)

    def ran_for_real(self, kind: str) -> None:
        self.real.add(kind)

    def describe(self) -> dict:
        """What the figures were measured under: the model, the scale, what was emulated and what was real."""
        return dict(compute=self.model.label, device=self.model.device_name, compute_scale=self.scale,
                    emulated=sorted(self.seconds), real=sorted(self.real - set(self.seconds)))


_active: Accelerator | None = None


def active() -> Accelerator | None:
    """The process's emulated accelerator, or None: the strategies then do their work for real."""
    return _active


def activate(acc: Accelerator) -> Accelerator:
    global _active
    if _active is not None and _active is not acc:
        if _active.model.label != acc.model.label or _active.scale != acc.scale:
            raise ValueError(f"an emulated accelerator is active already ({_active.model.label}, scale "
                             f"{_active.scale}): one per process")
        return _active
    _active = acc
    return acc


def deactivate() -> None:
    global _active
    _active = None


def device_work(kind: str, seconds_of=None):
    """Accelerator.device_work on the active accelerator (seconds_of(its compute model) of modelled time), or
    nothing when not emulating."""
    if _active is None:
        return contextlib.nullcontext()
    return _active.device_work(kind, seconds_of(_active.model) if seconds_of else 0.0)


def ready_at() -> float | None:
    """When the gradient whose hook runs now is ready on the emulated device (a time.perf_counter() time), where
    a backward that runs ahead fires its ready_aware hooks (runtime.emulate.watch) before the device made it;
    None otherwise: not emulating, or the gradient is ready now."""
    return None if _active is None else _active.clock.ready_at


def device_time() -> float:
    """A time.perf_counter() time on the calling thread's emulated stream: now, or when the work queued on it
    ends if that is later. A timed window read at step boundaries without a synchronize (a backward and an
    update queued, not waited for) then holds whole periods of the device's timeline: with several ranks a
    core, the host can read its clock well before its queued work ends and the window would miss that tail."""
    now = time.perf_counter()
    return now if _active is None else max(now, _active.clock.deadline)


def synchronize() -> None:
    """Wait until the work queued on the calling thread's emulated stream is done, as torch.cuda.synchronize()
    does on a GPU (a backward and an optimizer step are queued without the host waiting for them); nothing
    when not emulating."""
    if _active is not None:
        _active.clock.sync()
