"""Take a Profile: time a model's training steps layer by layer through hooks, on whatever device it is on."""

from __future__ import annotations

import os
import statistics
import time

import torch

from .profile import Layer, Profile

_now = time.perf_counter


def _owners(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(name or type(m).__name__, m) for name, m in model.named_modules()
            if any(True for _ in m.parameters(recurse=False))]


class _Recorder:
    """Forward pre-hooks on every module owning parameters, post-accumulate-grad hooks on every parameter."""

    def __init__(self, model: torch.nn.Module, sync):
        self.sync, self.handles = sync, []
        self.fwd: list[tuple[float, str]] = []  # (time, module) at each forward start
        self.bwd: dict[str, float] = {}  # module -> when its last gradient was accumulated
        self.out: dict[str, tuple] = {}  # module -> (output bytes, linear shape or None)
        # What a pipeline cut after a module sends on: the next owner's input (activations, pooling included).
        self.handoff: dict[str, int] = {}
        for name, m in _owners(model):
            self.handles.append(m.register_forward_pre_hook(lambda mod, inp, name=name: self._f(name, inp)))
            self.handles.append(m.register_forward_hook(lambda mod, inp, out, name=name: self._shape(name, mod, out)))
            for p in m.parameters(recurse=False):
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(lambda _, name=name: self._b(name)))

    def _f(self, name, inputs):
        self.sync()
        if self.fwd and self.fwd[-1][1] not in self.handoff:
            self.handoff[self.fwd[-1][1]] = sum(t.numel() * t.element_size() for t in inputs
                                                if isinstance(t, torch.Tensor))
        self.fwd.append((_now(), name))

    def _b(self, name):
        self.sync()
        self.bwd[name] = _now()

    def _shape(self, name, mod, out):
        if name in self.out:
            return
        t = out[0] if isinstance(out, (tuple, list)) else out
        nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        linear = None
        if isinstance(mod, torch.nn.Linear) and isinstance(t, torch.Tensor):
            linear = (mod.in_features, mod.out_features, t.numel() // mod.out_features, mod.bias is not None)
        self.out[name] = (nbytes, linear)

    def reset(self):
        self.fwd, self.bwd = [], {}  # handoff and out keep the first step's: shapes do not change

    def close(self):
        for h in self.handles:
            h.remove()


def measure(model: torch.nn.Module, inputs, target, loss_fn, optimizer, *, steps: int = 5, warmup: int = 2,
            name: str = "model", device: str = "cpu", ranks_at_once: int = 1, threads: int = 1, machine: str = "",
            sparse_density: float | None = 1e-3, gflops: bool = True) -> Profile:
    """Profile `steps` training steps (after `warmup`) of loss_fn(model(*inputs), target): per layer, optimizer, the rest."""
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    owners = [n for n, _ in _owners(model)]

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(*inputs), target)
        rec_loss.append(_now())
        loss.backward()
        sync()
        t = _now()
        optimizer.step()
        sync()
        return _now() - t

    rec_loss: list[float] = []
    for _ in range(warmup):
        step()
    plain, opt = [], []
    for _ in range(steps):  # whole steps, no hooks: what a step costs
        sync()
        t = _now()
        opt.append(step())
        plain.append(_now() - t)
    rec = _Recorder(model, sync)
    fwd: dict[str, list] = {n: [] for n in owners}
    bwd: dict[str, list] = {n: [] for n in owners}
    order: list[str] = []
    rest: list[float] = []  # per hooked step: its time outside the layers and the optimizer
    hooked_opt: list[float] = []
    totals: list[float] = []
    try:
        for _ in range(steps):
            rec.reset()
            rec_loss.clear()
            sync()
            t0 = _now()
            opt_s = step()
            total = _now() - t0
            hooked_opt.append(opt_s)
            totals.append(total)
            seen, per = [], {}
            marks = [*rec.fwd, (rec_loss[0], None)]
            for (t, n), (t_next, _) in zip(marks, marks[1:]):  # a module reused is charged each call
                per[n] = per.get(n, 0.0) + t_next - t
                if n not in seen:
                    seen.append(n)
            per[seen[0]] += rec.fwd[0][0] - t0  # zero_grad and the input before the first layer
            for n, v in per.items():
                fwd[n].append(v)
            rest.append(total - opt_s - sum(per.values()) - (max(rec.bwd.values()) - rec_loss[0]))
            order = seen
            last = rec_loss[0]
            for n, t in sorted(rec.bwd.items(), key=lambda kv: kv[1]):
                bwd[n].append(t - last)
                last = t
    finally:
        rec.close()
    layers, modules = [], dict(_owners(model))
    for n in order:
        params = tuple(p.numel() for p in modules[n].parameters(recurse=False) if p.requires_grad)
        nbytes, linear = rec.out.get(n, (0, None))
        nbytes = rec.handoff.get(n, nbytes)
        # Means, not medians: a throughput pays for the slow steps too.
        layers.append(Layer(n, statistics.fmean(fwd[n]) if fwd[n] else 0.0,
                            statistics.fmean(bwd[n]) if bwd[n] else 0.0, params, nbytes, linear))
    step_s, optimizer_s = statistics.fmean(plain), statistics.fmean(hooked_opt)
    other = max(0.0, statistics.fmean(rest))  # from the same steps as the layers: noise cannot leak in
    cores = float(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else float(os.cpu_count() or 1)
    # Every hooked step's figures, so that profiles of ranks measured together can be merged step by step.
    extra = {"step_s_all": plain, "steps": [
        {"total": totals[i], "fwd": [fwd[n][i] for n in order], "bwd": [bwd[n][i] for n in order],
         "rest": rest[i], "opt": hooked_opt[i]} for i in range(steps)]}
    select = _select_cost(sum(l.elements for l in layers), sparse_density, device, ranks_at_once) \
        if sparse_density else 0.0
    rate = _gflops(device) if gflops else 100.0
    copy = _copy_gbs(device, sum(l.elements for l in layers) * 4) if cuda else 0.0
    return Profile(name, int(inputs[0].shape[0]), "cuda" if cuda else "cpu", tuple(layers), step_s, optimizer_s, other,
                   ranks_at_once=ranks_at_once, cores=cores,
                   cores_per_rank=1.0 if cuda else min(float(threads), cores / ranks_at_once),
                   threads=threads, select_s_per_element=select, gflops=rate, copy_gbs=copy,
                   itemsize=4, **buffer_counts(model), machine=machine, extra=extra)


def buffer_counts(model: torch.nn.Module) -> dict:
    """The profile's buffer_elements and watched_buffers: the float64 elements runtime.model_buffers averages
    after each step (the floating-point state buffers, BatchNorm statistics, and a flag per watched one: a
    constant such as the Transformer's positions; integer ones, num_batches_tracked, advance alike on every
    rank), and how many of those flags there are. DDP's broadcast is priced on the same count."""
    from runtime.buffer_selection import synced_buffers

    sent, watched = synced_buffers(model)
    return dict(buffer_elements=sum(b.numel() for b in sent) + len(watched), watched_buffers=len(watched))


def _select_cost(n: int, density: float, device: str, ranks: int = 1, repeats: int = 3) -> float:
    """Seconds per element of runtime.sparse's local work in a step: the momentum-corrected velocity,
    error feedback and MSTopK's selection, the sum of every rank's pairs into the dense gradient, the
    average and DGC's masking; the exchange itself is the simulator's."""
    from runtime.sparse.error_feedback import ErrorFeedback
    from runtime.sparse.mstopk import MSTopK
    from runtime.sparse.selection import k_for_density

    x = torch.randn(n, device=device)
    velocity, out = torch.zeros_like(x), torch.empty_like(x)
    ef = ErrorFeedback(MSTopK())
    k = k_for_density(n, density)
    times = []
    for _ in range(repeats + 1):
        t = _now()
        velocity.mul_(0.9).add_(x)
        values, indices = ef.select("model", velocity, density)
        out.zero_()
        for _ in range(max(1, ranks)):  # every rank's k pairs (ours stand in for theirs)
            out.index_add_(0, indices[:k].long(), values[:k])
        out.div_(max(1, ranks))
        velocity.index_fill_(0, indices.long(), 0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(_now() - t)
    return statistics.median(times[1:]) / n


def _copy_gbs(device: str, nbytes: int, repeats: int = 3) -> float:
    """GB/s of a copy between pinned host memory and the device, each way, as the staging does it: the
    gradients' size (at most 256 MB), the slower direction's median."""
    n = max(1 << 20, min(nbytes, 256 << 20)) // 4
    dev = torch.empty(n, device=device)
    host = torch.empty(n, pin_memory=True)
    rates = []
    for dst, src in ((host, dev), (dev, host)):
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize(dev.device)
            t = _now()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(dev.device)
            times.append(_now() - t)
        rates.append(n * 4 / statistics.median(times[1:]) / 1e9)
    return min(rates)


def _gflops(device: str) -> float:
    if device.startswith("cuda"):
        a = torch.randn(4096, 4096, device=device)
        torch.cuda.synchronize()
        t = _now()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        return 10 * 2 * 4096 ** 3 / (_now() - t) / 1e9
    from runtime.hybrid.cost_model import measure_gflops

    return measure_gflops()
