"""One step of a DistributedOptimizer: the ranks' agreement, the gradients handed over, the update now or owed."""

# A deferred strategy (p3) returns from step() with the agreement still in
# flight: it sends every gradient whichever were used and updates each layer
# only at its next forward, so what the agreement says (which parameters any
# rank used, or the error every rank raises) is needed only then. `settle`
# finishes it there, or wherever the parameters, the module buffers or the
# agreement's communicator are touched first; a zero_grad() before it zeroes
# once it is in. Behind p3's bulk traffic the agreement's few bytes wait for
# what is queued on the link ahead of them (benchmarks/claims.md, fifteenth
# and sixteenth passes); the training loop's own work now runs in that time.
# The module buffers' average is still posted only after the agreement, on
# every rank alike (error paths rely on that), unless the strategy carries
# them in its own exchange (p3: runtime.model_buffers).
#
# Where this rank used every parameter and found no problem (and the buffers,
# if any, are carried), the agreement cannot change what is owed (it ORs the
# ranks' flags): every update is owed at once (`_owed_early`), the next forward
# runs without waiting for the agreement, and its gates and hooks finish it only
# if it is in already (settle's wait=False). The next step() finishes it in any
# case, so a disagreement still raises on every rank, before another round.

from __future__ import annotations

import time

import numpy as np

from mpicomm.step_check import EXCHANGE, ReportedProblem, digest

from .trace import span_of
from .updates import describe_hyper, hyperparameters

__all__ = ["exchange", "finish_round", "ready_twice", "settle", "update"]


def exchange(dopt, full: bool) -> None:
    """Agree with every rank, hand over the gradients backward did not produce, start the averaging."""
    with dopt._failing():  # raised here, the other ranks hear of it
        dopt.frozen.check()
    if dopt._owed_early:
        settle(dopt)  # the previous step's agreement: its updates were owed before it was in
    if dopt.staging is not None:
        with dopt._failing():  # the staging thread is the strategy's only caller until it is idle
            dopt.staging.drain()
    dopt._apply()  # parameters this step's forward and backward skipped
    if dopt.gate is not None and dopt.gate.gate is None:
        # The first forward pass is over: gates and priorities are known from now on.
        dopt.strategy.set_priorities(dopt.gate.freeze())
    unsent = [i for i in range(len(dopt.params)) if not dopt._sent[i]]
    for i in unsent:
        if dopt._passes[i] or not dopt.buffers.holds(i):
            # Accumulated in fewer passes than backward_passes_per_step, or set by hand (.grad = ...).
            dopt.buffers.attach(i)
            dopt._used[i] = True
        else:
            dopt.buffers.zero([i])  # no gradient here this step: counts as zeros in the average
    problem = dopt.strategy.local_problem()
    hyper = hyperparameters(dopt.optimizer)
    settings = describe_hyper(hyper) + [f"comm hook {dopt._comm_hook}"]
    # The time since the previous step(), in microseconds: the agreement gives every rank the slowest rank's.
    now = time.perf_counter()
    since = 0 if dopt._stepped_at is None else round(1e6 * (now - dopt._stepped_at))
    dopt._stepped_at = now
    with dopt._failing():
        dopt.check.start(EXCHANGE, dopt.steps, digest("\n".join(settings)), dopt._used, problem or "",
                         describe=lambda: settings, figure=since)
    dopt.steps += 1
    # The others need the agreement's `used` to finish; a deferred strategy's step() leaves it to settle(),
    # in flight (dopt.check.pending) until then.
    in_flight = dopt.strategy.deferred and dopt.pto is None and not full
    used = None if in_flight else finish_round(dopt)
    # Every parameter used here and no problem: whatever the others used, every update is owed (the agreement ORs
    # the flags), so the next forward need not wait for the agreement, queued behind the exchange's bulk
    # (benchmarks/claims.md, twentieth pass). It still completes, and raises on every rank, before the next step.
    buffers = dopt.model_buffers
    early = in_flight and dopt.strategy.exact and bool(dopt._used.all()) and problem is None and \
        (not buffers.active or buffers.carrier is not None)
    with dopt._failing():
        for i in unsent:
            dopt._send(i)
        if dopt.staging is not None:
            dopt.staging.drain()  # every gradient handed over, in hook order, before finish()
        if buffers.carrier is not None and not buffers.handed:
            buffers.hand_over()  # no gradient was sent this step (DistributedOptimizer._on_grad hands it over first)
        dopt.strategy.finish(used, full)
    buffers.handed = False
    if not in_flight:
        buffers.start()  # after the agreement: every rank posts it (error paths rely on that)
    else:
        dopt.buffers.park()  # the averages land in the buffers; a loop's zero_grad() meanwhile must not reach them
        if buffers.active and buffers.carrier is None:
            dopt.strategy.hold()  # until the agreement and the buffers' average are done (DistributedOptimizer._buffers_done)
    dopt._update_mask = used
    dopt._owed_early = early
    if early:
        dopt.deferred.owe(np.ones(len(dopt.params), dtype=bool), hyper)
    dopt._open = dopt._zeroed_open = False
    dopt._used[:] = False
    dopt._passes = [0] * len(dopt.params)
    dopt._sent = [False] * len(dopt.params)
    dopt._hyper = hyper


def ready_twice(dopt, i: int) -> RuntimeError:
    """The error for a parameter whose gradient was handed to the strategy already this step. After a zero_grad()
    it is most likely a backward for another optimizer's loss through this model (a GAN's generator step through
    its discriminator, DCGAN's loop): this optimizer started averaging that gradient, which the loop then dropped."""
    said = (f"the gradient of {dopt.names[i]} became ready {dopt._passes[i]} times in one step: call step() after "
            f"every {dopt.bpps} backward pass(es), or accumulate with no_sync() / backward_passes_per_step")
    if dopt._zeroed_open:
        said += ("; zero_grad() dropped a gradient of this step that was being averaged already: a backward for "
                 "another optimizer's loss through this model (a GAN's generator step through its discriminator) "
                 "belongs under this optimizer's no_sync(), which keeps it local")
    return RuntimeError(said)


def finish_round(dopt):
    """The step's agreement: which parameters any rank used, or the error every rank raises."""
    with span_of(dopt.timeline, "wait step agreement", "sync"), dopt._failing():
        try:
            used = dopt.check.finish()
        except ReportedProblem as exc:
            raise dopt.strategy.problem_error(str(exc)) from None
    dopt.strategy.step_time(1e-6 * dopt.check.figure)
    return used


def settle(dopt, fresh=(), wait: bool = True) -> None:
    """The agreement a deferred step left pending: finished (or every rank raises), its updates owed, the
    module buffers' average started. Called before anything reads what it decides; once per step.

    wait=False (the forward's gates, backward's hooks): where the updates were owed without it (`_owed_early`),
    finished only if it is in already; the next step() finishes it otherwise."""
    if not dopt.check.pending or dopt.failed is not None:
        return
    if dopt._owed_early:
        if not wait and not dopt.check.ready():
            return
        dopt._owed_early = False
        finish_round(dopt)
        return
    dopt._update_mask = finish_round(dopt)
    dopt.deferred.owe(_mask(dopt), dopt._hyper, fresh)
    dopt.model_buffers.start()


def _mask(dopt) -> np.ndarray:
    """The parameters to update: those any rank used (the agreement's), or reached through delayed values."""
    mask = dopt._update_mask
    if not dopt.strategy.exact:  # delayed values (error feedback) may reach parameters no rank used
        unused = np.flatnonzero(~mask)
        mask[unused] = dopt.buffers.nonzero(unused)
    return mask


def update(dopt, immediately: bool) -> None:
    """step()'s update: applied now, or owed to the next forward (deferred), or left to settle()."""
    if dopt.check.pending:
        return
    mask = _mask(dopt)
    if dopt.strategy.deferred and not immediately and dopt.pto is None:
        dopt.deferred.owe(mask, dopt._hyper)
        return
    if dopt.pto is not None:
        # The sharded update reads the averages where the strategy left them (staged: the host mirror), not
        # from .grad, unless synchronize() put them there for the user to read or edit (`immediately`).
        dopt.strategy.wait(range(len(dopt.params)))
        where = None if immediately else dopt.buffers.flat_views if dopt.staging else dopt.buffers.device_flat_views
        dopt.pto.step(dopt.strategy.grad_shard, skip=np.flatnonzero(~mask).tolist(), grads=where)
    else:
        dopt._wait(range(len(dopt.params)))
        dopt.updater.step(np.flatnonzero(mask).tolist(), dopt._hyper)