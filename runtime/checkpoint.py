"""Checkpoints of a data-parallel run: one file written by rank 0, read by rank 0, decided for every rank together."""

# Only rank 0 needs the file (node-local checkpoint directories work): when
# resuming, rank 0 reads it and every rank learns from rank 0 whether there is
# one, and receives the state. The file holds the model, the optimizer's
# unsharded state, the strategy's state (the sparse strategies' step counter,
# and each rank's residuals and velocity) and whatever the caller adds.

from __future__ import annotations

import os

import torch

from mpicomm.agree import broadcast_tensors, fail_together

FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, read or used here; raised on every rank with one line of text."""


# -- the optimizer's part (DistributedOptimizer.state_dict / load_state_dict) ----------------------
def optimizer_state(dopt) -> dict:
    """Collective: the optimizer's unsharded state and the strategy's; rank-local parts gathered on rank 0."""
    if dopt.pto is not None:
        dopt.pto.consolidate_into(dopt.optimizer)
    state = dopt.optimizer.state_dict()
    if dopt.pto is not None:
        dopt.optimizer.state.clear()  # the dict keeps its tensors; the pieces stay the only live copy
    if dopt.moved_momentum:
        for group in state["param_groups"]:
            group["momentum"] = dopt.moved_momentum  # what the user configured: a resumed run moves it again
    strategy = dopt.strategy.state_dict()
    local = dopt.comm.gather(strategy["local"], root=0)  # checkpoints only: pickling is fine
    return {"format": FORMAT, "optimizer": state, "strategy": dopt.options.name, "steps": dopt.steps,
            "world_size": dopt.size, "strategy_shared": strategy["shared"], "strategy_local": local}


def load_optimizer_state(dopt, state: dict | None) -> None:
    """Collective: rank 0's `state` (state_dict()'s, or a plain torch optimizer state) on every rank."""
    comm, root = dopt.comm, dopt.rank == 0
    problem = None
    if root:
        problem = _why_unusable(state, dopt)
    fail_together(comm, problem, CheckpointError)
    everyone = comm.allgather(state is not None)
    if not all(everyone):
        state = comm.bcast(state if root else None, root=0)  # rare path: pickling is fine
    full = "format" in state
    opt_state = state["optimizer"] if full else state
    dopt.optimizer.load_state_dict(opt_state)
    if dopt.moved_momentum:
        for group in dopt.optimizer.param_groups:
            group["momentum"] = 0.0  # still held by the sparsifier (momentum correction)
    if dopt.pto is not None:
        dopt.pto.load_from(dopt.optimizer)
        dopt.optimizer.state.clear()
    if full:
        parts = None
        if root:
            parts = state["strategy_local"] if any(state["strategy_local"]) else [{}] * dopt.size
        local = comm.scatter(parts, root=0)
        dopt.strategy.load_state_dict(state["strategy_shared"], local)
        dopt.steps = int(state["steps"])


def _why_unusable(state, dopt) -> str | None:
    if not isinstance(state, dict):
        return f"expected the dict DistributedOptimizer.state_dict() returns, got {type(state).__name__}"
    if "format" not in state:
        return None if "param_groups" in state else "not an optimizer state (no 'format' nor 'param_groups')"
    if state["format"] != FORMAT:
        return f"optimizer state format {state['format']}, this version reads {FORMAT}"
    if state["strategy"] != dopt.options.name:
        return f"the state is of strategy {state['strategy']}, this run uses {dopt.options.name}"
    local = state["strategy_local"]
    if local is None or (any(local) and len(local) != dopt.size):
        return (f"the state holds rank-local strategy state of {state['world_size']} ranks, this run has "
                f"{dopt.size}: resume with as many ranks")
    return None


# -- whole checkpoints for jobs --------------------------------------------------------------
def save_checkpoint(path: str, model: torch.nn.Module, dopt, **extra) -> None:
    """Collective: rank 0 writes model + optimizer + strategy state + extra atomically; errors stop every rank."""
    opt_state = dopt.state_dict()
    problem = None
    if dopt.rank == 0:
        state = dict(model=model.state_dict(), optimizer=opt_state, **extra)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save(state, tmp)
            os.replace(tmp, path)  # readers see the old or the new checkpoint, never half of one
        except OSError as exc:
            problem = f"cannot write checkpoint {path}: {exc.strerror or exc}"
            try:
                os.remove(tmp)
            except OSError:
                pass
    fail_together(dopt.comm, problem, CheckpointError)


def read_checkpoint(path: str, comm) -> dict | None:
    """Collective: rank 0 reads `path`. None on every rank when it does not exist there; raises on every rank when
    it exists but is not a checkpoint. Returns the checkpoint on rank 0 and {} on the others."""
    status, ckpt = None, None
    if comm.Get_rank() == 0:
        if os.path.exists(path):
            try:
                ckpt = torch.load(path, weights_only=False, map_location="cpu")
                if not isinstance(ckpt, dict) or "model" not in ckpt or "optimizer" not in ckpt:
                    status = f"{path} is not a checkpoint of this program (no model and optimizer state)"
            except Exception as exc:  # noqa: BLE001 - any unreadable file is one line, not a traceback
                status = f"cannot read checkpoint {path}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        else:
            status = "missing"
    status = comm.bcast(status, root=0)
    if status == "missing":
        return None
    if status is not None:
        raise CheckpointError(status)
    return ckpt if comm.Get_rank() == 0 else {}


def load_checkpoint(path: str, model: torch.nn.Module, dopt) -> dict | None:
    """Collective: resume model, optimizer and strategy from rank 0's `path`; returns the extra entries
    (e.g. the epoch) on every rank, or None when there is no checkpoint."""
    dopt.agree_on("load_checkpoint()")  # before rank 0's read and its broadcast: every rank is here
    ckpt = read_checkpoint(path, dopt.comm)
    if ckpt is None:
        return None
    problem = None
    if dopt.rank == 0:
        try:
            model.load_state_dict(ckpt["model"])
        except (RuntimeError, KeyError) as exc:
            problem = f"checkpoint {path} does not fit this model: {str(exc).splitlines()[0][:200]}"
    fail_together(dopt.comm, problem, CheckpointError)
    with torch.no_grad():
        broadcast_tensors(dopt.comm, [p.detach() for p in model.parameters()] + list(model.buffers()))
    dopt.load_state_dict(ckpt.get("optimizer") if dopt.rank == 0 else None)
    extra = {k: v for k, v in ckpt.items() if k not in ("model", "optimizer")} if dopt.rank == 0 else None
    return dopt.comm.bcast(extra, root=0)
