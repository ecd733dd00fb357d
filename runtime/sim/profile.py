"""A model's measured profile, per layer in forward order: compute times, gradient and activation bytes, shapes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

FORMAT = "mpitrain-profile/1"


class ProfileError(ValueError):
    """A profile file that is not one, or one missing what a simulation needs."""


@dataclass(frozen=True)
class Layer:
    """One module owning parameters: its share of a step, as measured, and what it sends.

    fwd_s: from this layer's forward start to the next one's (so the parameter-free modules between
    are counted); bwd_s: from the previous gradient (in backward order) to this layer's last one.
    params: its parameters' sizes in elements, registration order. act_bytes: what a pipeline cut
    after it sends on per step (the next such layer's input; the last one's output). linear:
    (M inputs, N outputs, K rows per step, bias) for a fully connected layer (Poseidon's sufficient
    factors), else None.
    """

    name: str
    fwd_s: float
    bwd_s: float
    params: tuple[int, ...]
    act_bytes: int = 0
    linear: tuple[int, int, int, bool] | None = None

    @property
    def elements(self) -> int:
        return sum(self.params)


@dataclass(frozen=True)
class Profile:
    """What one rank's step costs on the profiled machine, and under what conditions it was measured.

    step_s: a whole training step without synchronisation; optimizer_s: its optimizer step; other_s:
    the rest outside the layers (loss, zero_grad, input). ranks_at_once: ranks computing concurrently
    while it was profiled, on `cores` cores; cores_per_rank: what one rank's compute kept busy (CPU).
    select_s_per_element: runtime.sparse's local work in a step (velocity, error feedback, selection,
    the sum of the pairs, masking), seconds per gradient element;
    gflops: one rank's GEMM rate (sufficient-factor rebuild); copy_gbs: GB/s of a copy between pinned host
    memory and the device (0: not measured, a CPU's profile or an older one); itemsize: bytes per gradient
    element; memory_gbs: GB/s of an element-wise pass over device memory, reads and writes together
    (accumulating micro-batches' gradients; 0: not known, and not simulated); buffer_elements: elements of the
    model's floating-point buffers (BatchNorm statistics), made equal on every rank each step (runtime.model_buffers
    averages them after the step; torch DDP broadcasts rank 0's before each forward; 0 in older files);
    watched_buffers: of those, the flags of buffers only watched (a constant such as the Transformer's positions:
    p3 then averages the vector with MPI's allreduce rather than in its own exchange; 0 in older files).
    """

    model: str
    batch_size: int
    device: str
    layers: tuple[Layer, ...]
    step_s: float
    optimizer_s: float
    other_s: float
    ranks_at_once: int = 1
    cores: float = 1.0
    cores_per_rank: float = 1.0
    threads: int = 1
    select_s_per_element: float = 0.0
    gflops: float = 100.0
    copy_gbs: float = 0.0
    itemsize: int = 4
    memory_gbs: float = 0.0
    buffer_elements: int = 0
    watched_buffers: int = 0
    machine: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.layers:
            raise ProfileError(f"profile of {self.model!r} has no layers")
        for v in (self.step_s, self.optimizer_s):
            if not v >= 0:
                raise ProfileError(f"profile of {self.model!r}: negative time {v}")

    @property
    def grad_bytes(self) -> int:
        return sum(layer.elements for layer in self.layers) * self.itemsize

    @property
    def compute_s(self) -> float:
        return sum(l.fwd_s + l.bwd_s for l in self.layers) + self.other_s + self.optimizer_s

    def scaled(self, factor: float, device: str | None = None) -> "Profile":
        """The same model on a device `factor` times as fast (a GPU's profile from a CPU one, say)."""
        layers = tuple(Layer(l.name, l.fwd_s / factor, l.bwd_s / factor, l.params, l.act_bytes, l.linear)
                       for l in self.layers)
        d = asdict(self)
        d.update(layers=layers, step_s=self.step_s / factor, optimizer_s=self.optimizer_s / factor,
                 other_s=self.other_s / factor, select_s_per_element=self.select_s_per_element / factor,
                 gflops=self.gflops * factor, memory_gbs=self.memory_gbs * factor, device=device or self.device)
        return Profile(**d)

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        if d.get("format") != FORMAT:
            raise ProfileError(f"not a {FORMAT} profile (format {d.get('format')!r})")
        d = {k: v for k, v in d.items() if k != "format"}
        try:
            d["layers"] = tuple(Layer(**{**l, "params": tuple(l["params"]),
                                         "linear": tuple(l["linear"]) if l.get("linear") else None})
                                for l in d["layers"])
            profile = cls(**d)
        except (KeyError, TypeError) as e:
            raise ProfileError(f"profile of {d.get('model')!r} is incomplete: {e}") from None
        # A file is a measurement: a step of no time, or a layer of negative time, is a broken one (and every
        # speed-up against it a division by zero). Built in code, a zero profile still lays out buckets.
        times = {f"{l.name} {k}": t for l in profile.layers for k, t in (("forward", l.fwd_s), ("backward", l.bwd_s))}
        bad = [f"{k} {t!r} s" for k, t in {**times, "other": profile.other_s}.items() if not t >= 0]
        if bad:
            raise ProfileError(f"profile of {profile.model!r}: negative or missing times ({', '.join(bad[:3])})")
        if not profile.compute_s > 0:
            raise ProfileError(f"profile of {profile.model!r}: its layers, optimizer step and the rest take no time: "
                               "not a measured step (nothing to project or compare against)")
        return profile

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                return cls.from_json(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"cannot read profile {path}: {e}") from None
