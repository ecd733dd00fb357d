"""runtime.emulate under a step: gradients land over marked buffers in the real order, and lazy waits add up."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from runtime.emulate import accelerator, emulate, emulate_optimizer, emulated_loss
from runtime.emulate.pattern import fixed
from runtime.emulate.clock import LAZY_S, Clock
from runtime.workloads.models import build_model, model_input


@pytest.fixture(autouse=True)
def fresh_accelerator():
    accelerator.deactivate()
    yield
    accelerator.deactivate()


def emulated(name="cnn"):
    model = build_model(name)
    inputs, _ = model_input(name, 4)
    emulate(model, "v100", inputs)
    return model, inputs


def test_after_zero_grad_the_gradient_lands_once_and_micro_batches_add():
    model, inputs = emulated()
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    templates = [fixed(p) for p in model.parameters()]
    for _ in range(2):
        opt.zero_grad()
        emulated_loss(model(*inputs)).backward()
        assert all(torch.equal(p.grad, t) for p, t in zip(model.parameters(), templates))
        grads = [p.grad for p in model.parameters()]
    # Without a zero_grad in between, a second backward adds, as autograd does for micro-batches.
    emulated_loss(model(*inputs)).backward()
    assert all(torch.equal(p.grad, 2 * t) for p, t in zip(model.parameters(), templates))
    # The buffers are the same tensors step after step: nothing allocated per step.
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    # A user's set_to_none zero_grad on the model still gets fresh gradients from autograd.
    model.zero_grad(set_to_none=True)
    emulated_loss(model(*inputs)).backward()
    assert all(torch.equal(p.grad, t) for p, t in zip(model.parameters(), templates))


@pytest.mark.parametrize("hooked", [False, True])
def test_the_forward_lands_the_marked_gradients_and_two_forwards_ahead_of_their_backwards_add(hooked):
    """The copies are made as a forward that backward will follow starts (landing.land_ahead), so they overlap
    the whole pass. Forwards ahead of their backwards (a pipeline's 1F1B) still end with one gradient per
    backward: the first lands, the second adds."""
    model, inputs = emulated()
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    if hooked:  # a strategy's hook on every parameter: the backward goes unit by unit
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda q: None)
    templates = [fixed(p) for p in model.parameters()]
    emulated_loss(model(*inputs)).backward()
    opt.zero_grad()
    for p in model.parameters():
        p.grad.fill_(7.0)  # what a strategy left there (an average, say): a marked buffer is not zeroed
    with torch.no_grad():
        model(*inputs)  # no backward follows: nothing lands
    assert all(bool((p.grad == 7.0).all()) for p in model.parameters())
    first = emulated_loss(model(*inputs))
    assert all(torch.equal(p.grad, t) for p, t in zip(model.parameters(), templates))
    second = emulated_loss(model(*inputs))
    first.backward()
    assert all(torch.equal(p.grad, t) for p, t in zip(model.parameters(), templates))
    second.backward()
    assert all(torch.equal(p.grad, 2 * t) for p, t in zip(model.parameters(), templates))


@pytest.mark.parametrize("name", ["cnn", "resnet50"])
def test_landed_gradients_run_their_hooks_in_the_real_order(name):
    model, inputs = emulated(name)
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    emulated_loss(model(*inputs)).backward()  # autograd accumulates: the order it fires in is the real one
    order, seen = [], []

    def hook(q, n):
        order.append(n)
        seen.append(torch.equal(q.grad, fixed(q)))  # a hook sees its gradient landed already
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda q, n=n: hook(q, n))
    opt.zero_grad()
    emulated_loss(model(*inputs)).backward()
    landed = list(order)
    assert all(seen) and len(seen) == len(list(model.parameters()))
    order.clear()
    model.zero_grad(set_to_none=True)
    emulated_loss(model(*inputs)).backward()  # nothing marked: autograd accumulates and fires the hooks
    assert landed == order


def test_a_tensor_hook_still_sees_the_gradient_on_its_way():
    model, inputs = emulated()
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    emulated_loss(model(*inputs)).backward()
    seen = []
    p = next(model.parameters())
    p.register_hook(lambda g: seen.append(g.shape))
    opt.zero_grad()
    emulated_loss(model(*inputs)).backward()
    assert seen == [p.shape]


def test_lazy_runs_owe_less_than_a_millisecond_and_sync_pays_it():
    clock = Clock()
    t = time.perf_counter()
    for _ in range(200):
        clock.run(0.00005, lazy=True)
    owed = clock.deadline - time.perf_counter()
    assert owed <= LAZY_S
    clock.sync()
    assert time.perf_counter() - t >= 200 * 0.00005
    assert clock.busy == pytest.approx(0.01)
    assert clock.deadline <= time.perf_counter()


def test_absorbed_host_work_lets_one_pass_start_early_and_no_more():
    clock = Clock()
    clock.run(0.001)
    clock.absorb(1.0)  # a second of the device's work done by the host (copies): the next pass may start early
    time.sleep(0.02)
    clock.begin()
    clock.run(0.01)  # started at the last deadline, 20 ms ago: no wait
    clock.begin()
    t = time.perf_counter()
    clock.run(0.01)  # the credit is spent: this pass starts now and waits its whole time
    assert time.perf_counter() - t >= 0.01


def test_a_staged_gradient_handed_over_ahead_is_delivered_in_hook_order_not_before_its_copy_could_end():
    """EmulatedStaging under a backward that runs ahead (ready_aware hooks): every gradient is delivered, in
    hook order, no earlier than its ready time plus its modelled copy, less the LAZY_S that a lazy wait may
    deliver early; the backward itself returns without waiting for any of them."""
    from runtime.device import EmulatedStaging
    from runtime.emulate.trace import trace
    from runtime.emulate.watch import ready_aware
    from runtime.grad_buffers import GradientBuffers

    model = build_model("cnn")
    inputs, _ = model_input("cnn", 4)
    emulate(model, "v100", inputs, times=[(0.0005, 0.003)] * len(trace(model, inputs).calls))
    acc = accelerator.active()
    names, params = zip(*model.named_parameters())
    delivered, handed = [], []
    staging = EmulatedStaging(acc, GradientBuffers(list(params), list(names)),
                              lambda i: delivered.append((i, time.perf_counter())))
    index = {id(p): i for i, p in enumerate(params)}

    def to_host(p):
        handed.append((index[id(p)], accelerator.ready_at()))
        staging.to_host(index[id(p)])
    try:
        for p in params:
            p.register_post_accumulate_grad_hook(ready_aware(to_host))
        loss = emulated_loss(model(*inputs))
        wakes = acc.clock.wakes
        loss.backward()
        assert acc.clock.wakes == wakes  # the backward did not wait for its gradients
        staging.drain()
    finally:
        staging.close()
    assert [i for i, _ in delivered] == [i for i, _ in handed] and len(handed) == len(params)
    copied = 0.0
    for (i, at), (_, ready) in zip(delivered, handed):
        copied = max(copied, ready) + acc.model.copy_s(params[i].numel() * 4)
        assert at >= copied - LAZY_S


def test_averages_sent_back_as_they_complete_delay_the_update_only_until_their_copies_end():
    """EmulatedStaging.averaged(), on the strategy's thread as its exchange completes them: the copies back are
    queued on that thread's clock from then on, without waiting; to_device() on the training thread then only
    makes its next work (the update) start after them, and copies nothing more."""
    import threading

    from runtime.device import EmulatedStaging
    from runtime.emulate.trace import trace
    from runtime.grad_buffers import GradientBuffers

    model = build_model("mlp", hidden=[4096, 4096])
    inputs, _ = model_input("mlp", 4)
    emulate(model, "v100", inputs, times=[(0.0, 0.0)] * len(trace(model, inputs).calls))
    acc = accelerator.active()
    names, params = zip(*model.named_parameters())
    staging = EmulatedStaging(acc, GradientBuffers(list(params), list(names)), lambda i: None)
    took = []

    def averaged():  # on the strategy's thread, as the exchange completes them
        t0 = time.perf_counter()
        staging.averaged(range(len(params)))
        took.append((t0, acc.clock.wakes, acc.clock.waited))  # this thread's clock
    try:
        for i in range(len(params)):
            staging.to_host(i)
        staging.drain()
        copy = sum(acc.model.copy_s(p.numel() * 4) for p in params)
        side = threading.Thread(target=averaged)
        side.start()
        side.join()
        (t0, wakes, waited), = took
        assert (wakes, waited) == (0, 0.0)  # queued, not waited for: the strategy's thread never slept
        back = max(staging.back_at)
        assert back >= t0 + copy * 0.999
        staging.to_device(range(len(params)))
        assert staging.copies_to_device == staging.copies_as_averaged == 1
        acc.run("optimizer", 0.001, wait=False)  # the update, on the training thread's stream
        assert acc.clock.deadline == pytest.approx(back + 0.001)
        assert acc.seconds["h2d"] == pytest.approx(acc.model.copy_s(sum(p.numel() * 4 for p in params)))  # one range
    finally:
        staging.close()


def test_micro_batches_accumulate_on_the_device_with_no_host_pass_over_a_large_gradient():
    """A GPU adds a micro-batch's gradients on the device: modelled time, queued ("accumulate"). The host adds
    the small ones (cheap, exact) and leaves a LARGE one as it is: no write to it (its version counter)."""
    from runtime.emulate.pattern import LARGE

    model = build_model("mlp", hidden=[1024, 1024])
    inputs, _ = model_input("mlp", 4)
    emulate(model, "v100", inputs)
    acc = accelerator.active()
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.zero_grad()
    emulated_loss(model(*inputs)).backward()
    large = [p for p in model.parameters() if p.numel() >= LARGE]
    small = [p for p in model.parameters() if p.numel() < LARGE]
    assert large and small
    versions = [p.grad._version for p in large]
    emulated_loss(model(*inputs)).backward()  # no zero_grad: a second micro-batch
    assert [p.grad._version for p in large] == versions
    assert all(torch.equal(p.grad, 2 * fixed(p)) for p in small)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert acc.seconds["accumulate"] == pytest.approx(acc.model.pass_s(3 * nbytes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_gradient_keeps_no_template_and_lands_and_checks_from_its_row_scales(dtype):
    """A LARGE parameter keeps its row scales, no full-size template (VGG19-22K's would be 916 MB a rank);
    write and firsts, which work from the scales, give the values the template would (the product the
    block times each row's scale), each row its own (top-k finds no repeats), none zero. A small one keeps
    its template and no rows."""
    from runtime.emulate.pattern import LARGE, ROW, _block, firsts, fixed, template, write

    g = torch.Generator().manual_seed(0)
    big = torch.nn.Parameter(torch.zeros(LARGE + 16 * ROW + 5, dtype=dtype))
    small = torch.nn.Parameter(torch.zeros(3, ROW // 2 + 1, dtype=dtype))
    big._emulated_grad, small._emulated_grad = template(big, g), template(small, g)
    assert big._emulated_grad is None and hasattr(big, "_emulated_rows") and not hasattr(small, "_emulated_rows")
    t, ts = fixed(big), fixed(small)
    assert ts is small._emulated_grad and fixed(big) is not t  # a LARGE one's is made each time
    rows = big._emulated_rows.view(-1)
    expected = torch.cat([_block(dtype) * r for r in rows[:-1]] + [_block(dtype)[:5] * rows[-1]])
    assert torch.equal(t, expected) and bool((t != 0).all()) and bool((ts != 0).all())
    out = torch.full_like(t, 7.0)
    write(out, big._emulated_rows)
    assert torch.equal(out, t)
    assert torch.equal(firsts(big), t[::ROW])
    full = t[: (t.numel() // ROW) * ROW].view(-1, ROW).float()[:4]  # bfloat16's scales may tie over 20 rows
    assert len({float(r.abs().sum()) for r in full}) == full.shape[0]


def test_a_vgg_step_lands_its_large_gradients_from_their_rows():
    model, inputs = emulated("vgg19")
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    large = [p for p in model.parameters() if hasattr(p, "_emulated_rows")]
    assert large
    for _ in range(2):
        opt.zero_grad()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(3.0)  # what a strategy left there: the landing writes over it
        emulated_loss(model(*inputs)).backward()
        assert all(torch.equal(p.grad, fixed(p)) for p in model.parameters())



def test_a_large_gradient_that_still_holds_its_values_is_not_written_again_and_a_changed_one_is():
    """A plain step (no strategy) leaves its gradients as they landed: the next landing writes none of the
    LARGE ones (their version counters do not move), as a GPU's host writes nothing where they stay on the
    device. One a torch op changed in place, or one whose memory was written behind torch's back (MPI into a
    buffer, here numpy), is written again; every gradient equals its template after each step."""
    model, inputs = emulated("vgg19")
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    large = [p for p in model.parameters() if hasattr(p, "_emulated_rows")]
    assert len(large) >= 3

    def step():
        opt.zero_grad()
        emulated_loss(model(*inputs)).backward()
        assert all(torch.equal(p.grad, fixed(p)) for p in model.parameters())

    step()
    step()  # the first step made the gradients, the second wrote them
    versions = [p.grad._version for p in large]
    step()
    assert [p.grad._version for p in large] == versions  # nothing written
    large[0].grad.mul_(4.0)  # an average in place, say
    large[1].grad.numpy()[:] *= 4.0  # MPI's receive into the buffer: torch sees no change
    step()
    assert large[0].grad._version > versions[0] + 1 and large[1].grad._version > versions[1]
    assert [p.grad._version for p in large[2:]] == versions[2:]

def test_a_host_too_slow_to_land_the_gradients_within_the_pass_is_told_once():
    """A compute model a million times faster than a V100 leaves no host time to write the gradients in:
    after SLOW_ROW such steps, one RuntimeWarning says the steps are this host's, with the figures; the
    same model on a device a hundred times slower than a V100 (a small CNN's gradients land in microseconds,
    its pass takes milliseconds) says nothing."""
    from runtime.emulate import landing

    def steps(scale, n):
        accelerator.deactivate()
        model = build_model("cnn")
        inputs, _ = model_input("cnn", 4)
        emulate(model, "v100", inputs, scale=scale)
        opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(n):
            opt.zero_grad()
            emulated_loss(model(*inputs)).backward()
            opt.step()

    landing._slow.update(row=0, said=False)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            steps(100.0, landing.SLOW_ROW + 2)
        assert not [w for w in seen if "bound by this host" in str(w.message)]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            steps(1e-6, landing.SLOW_ROW + 3)
        said = [str(w.message) for w in seen if "bound by this host" in str(w.message)]
        assert len(said) == 1 and "MB" in said[0] and "GB/s" in said[0] and "--compute-scale" in said[0]
    finally:
        landing._slow.update(row=0, said=False)


def test_synchronize_waits_for_the_backward_and_update_a_step_queued_as_a_gpu_does():
    """A step returns with its backward and update still queued on the emulated device (the host runs ahead,
    as a GPU's does); runtime.emulate.synchronize() returns once they are done, as torch.cuda.synchronize()
    does, so that a benchmark's clock reads the device's work and not the host's queueing."""
    from runtime.emulate import synchronize

    synchronize()  # not emulating: nothing to wait for
    model = build_model("cnn")
    inputs, _ = model_input("cnn", 4)
    emulate(model, "v100", inputs, scale=1000.0)  # a step of about a second: the queue is long
    acc = accelerator.active()
    opt = emulate_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.zero_grad()
    emulated_loss(model(*inputs)).backward()
    opt.step()
    assert acc.clock.deadline > time.perf_counter()  # queued, not done
    synchronize()
    assert time.perf_counter() >= acc.clock.deadline


def test_a_parked_placeholder_gets_a_gradient_of_its_own_not_a_copy():
    """After a deferred step (p3) each .grad is a sparse placeholder (GradientBuffers.park) until its update. One
    still parked and marked as a forward starts is not copied into (it holds no memory): the backward makes the
    parameter a gradient of its own, which unpark() hands back as the loop's, to be copied into its view."""
    from runtime.emulate.landing import defer_zero
    from runtime.grad_buffers import GradientBuffers

    model, inputs = emulated()
    params = list(model.parameters())
    buffers = GradientBuffers(params, [n for n, _ in model.named_parameters()])
    emulated_loss(model(*inputs)).backward()
    assert defer_zero(params)  # zero_grad's marks, as exchange() leaves a parameter this rank did not use
    buffers.park()
    assert all(p.grad.is_sparse for p in params)
    emulated_loss(model(*inputs)).backward()
    templates = [fixed(p) for p in params]
    assert all(not p.grad.is_sparse and torch.equal(p.grad, t) for p, t in zip(params, templates))
    cleared, replaced = buffers.unpark(range(len(params)))
    assert not cleared and sorted(replaced) == list(range(len(params)))
    buffers.restore(replaced)
    assert all(p.grad is v and torch.equal(v, t) for p, v, t in zip(params, buffers.grads, templates))
