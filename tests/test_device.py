"""Device placement checks, the staging bookkeeping and the MPI library's CUDA query (one process)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn

from mpicomm.cuda_support import describe_cuda_support, mpi_cuda_aware
from runtime import DistributedOptimizer
from runtime.device import STAGING_ENV, GradientStaging, model_device, staging_wanted
from runtime.device.delivery import Delivery
from runtime.device.staging import coalesce, size_groups
from runtime.device.threads import device_setup
from runtime.grad_buffers import GradientBuffers

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")


def named(model):
    pairs = [(n, p) for n, p in model.named_parameters()]
    return [n for n, _ in pairs], [p for _, p in pairs]


def test_one_device_is_found():
    assert model_device(*named(nn.Linear(2, 2))) == torch.device("cpu")
    assert model_device([], []) == torch.device("cpu")


def test_a_model_split_across_devices_names_the_parameter():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].to("meta")
    with pytest.raises(ValueError, match=r"parameter 1.weight is on meta"):
        model_device(*named(model))


def test_optimizer_refuses_a_split_model_before_any_collective():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].bias = nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match=r"parameter 0.bias is on meta"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, "wfbp")


def test_staging_setting(monkeypatch):
    assert not staging_wanted(torch.device("cpu"))
    assert staging_wanted(torch.device("cuda", 0))
    monkeypatch.setenv(STAGING_ENV, "force")
    assert staging_wanted(torch.device("cpu"))
    monkeypatch.setenv(STAGING_ENV, "sometimes")
    with pytest.raises(ValueError, match="MPITRAIN_STAGING must be 'auto' or 'force', got 'sometimes'"):
        staging_wanted(torch.device("cpu"))


@pytest.mark.parametrize("strategy", ["wfbp", "p3", "hybcomm"])
def test_progress_threads_drive_only_where_compute_is_off_the_host(monkeypatch, strategy):
    """A model computing on the host's cores keeps its progress thread's back-off (spinning while its training
    thread waits would take the cores its neighbours compute on); a staged one (a GPU's, here forced) drives.
    p3 keeps its own polling (relaxed, urgent when a layer waits) everywhere."""
    for staged, drive in ((False, False), (True, strategy != "p3")):
        monkeypatch.setenv(STAGING_ENV, "force" if staged else "auto")
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        dopt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy)
        try:
            model(torch.ones(2, 3)).sum().backward()
            dopt.step()
            assert dopt.strategy.progress.drive is drive, (strategy, staged)
            assert ("progress thread drives" in dopt.transport) is drive, dopt.transport
        finally:
            dopt.close()


def test_coalesce_merges_neighbours_only():
    segments = [(0, 0, 4), (0, 4, 6), (1, 0, 3), (0, 9, 12), (0, 6, 6)]
    assert coalesce(segments, [0, 1, 2, 3, 4]) == [(0, 0, 6), (0, 9, 12), (1, 0, 3)]
    assert coalesce(segments, [3, 0]) == [(0, 0, 4), (0, 9, 12)]
    assert coalesce(segments, []) == []


def test_cpu_staging_copies_out_delivers_and_returns_once():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    names, params = named(model)
    buffers = GradientBuffers(params, names, staged=True)
    assert buffers.flats[0].data_ptr() != buffers.device_flats[0].data_ptr()
    delivered = []
    staging = GradientStaging(buffers, lambda i: delivered.append((i, buffers.flat(i).clone())))
    model(torch.randn(5, 3)).sum().backward()
    for i in reversed(range(len(params))):
        staging.to_host(i)
    assert [i for i, _ in delivered] == [3, 2, 1, 0]
    assert all(torch.equal(g, params[i].grad.reshape(-1)) for i, g in delivered)
    for i in range(len(params)):
        buffers.flat(i).fill_(float(i))  # what a strategy's average leaves in the mirror
    staging.to_device([0, 1])
    assert staging.copies_to_device == 1  # two neighbours, one copy
    assert torch.equal(params[1].grad, torch.ones(4)) and not torch.equal(params[2].grad, torch.full((4, 4), 2.0))
    params[0].grad.zero_()
    staging.to_device(range(len(params)))  # 0 and 1 went back already: only 2 and 3 now
    assert float(params[0].grad.abs().sum()) == 0 and torch.equal(params[3].grad, torch.full((2,), 3.0))
    staging.drain()
    staging.close()


def test_cpu_staging_sends_back_as_averaged_and_to_device_then_copies_nothing():
    """averaged() (the strategy's thread, as a bucket's average completes) puts it in p.grad at once; the
    update's to_device() copies only what was not sent back, and each average goes back once a step."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    names, params = named(model)
    buffers = GradientBuffers(params, names, staged=True)
    staging = GradientStaging(buffers, lambda i: None)
    model(torch.randn(5, 3)).sum().backward()
    for i in reversed(range(len(params))):
        staging.to_host(i)
    for i in range(len(params)):
        buffers.flat(i).fill_(float(i + 1))  # the averages, in the mirror
    done = threading.Thread(target=staging.averaged, args=([2, 3],))  # the last layer's bucket
    done.start()
    done.join()
    assert staging.copies_as_averaged == staging.copies_to_device == 1
    assert torch.equal(params[3].grad, torch.full((2,), 4.0)) and not torch.equal(params[0].grad, torch.ones(4, 3))
    params[3].grad.mul_(0.5)  # what a user does after synchronize() stays: it is not sent back again
    staging.averaged([3])
    staging.to_device(range(len(params)))
    assert staging.copies_to_device == 2 and staging.copies_as_averaged == 1  # only 0 and 1 now, one copy
    assert torch.equal(params[0].grad, torch.ones(4, 3)) and torch.equal(params[3].grad, torch.full((2,), 2.0))
    staging.close()


def test_staging_copies_and_hands_over_a_group_at_a_time():
    """One copy of the group's slice and one hand-over once its last gradient is final (on a GPU: one event,
    one copy and one queue put per group, on the thread that launches backward's kernels), in hook order."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])  # 6 parameters
    names, params = named(model)
    buffers = GradientBuffers(params, names, staged=True)
    delivered = []
    staging = GradientStaging(buffers, delivered.append, groups=[[5, 4, 3], [2, 1, 0]])
    model(torch.randn(2, 4)).sum().backward()
    for i in (5, 3):
        staging.to_host(i)
    assert delivered == [] and staging.batches_to_host == staging.copies_to_host == 0
    staging.to_host(4)
    assert delivered == [5, 3, 4] and staging.batches_to_host == staging.copies_to_host == 1
    assert torch.equal(buffers.flats[0][buffers.segments[3][1]:], buffers.device_flats[0][buffers.segments[3][1]:])
    assert float(buffers.flats[0][:buffers.segments[3][1]].abs().sum()) == 0  # the other group: not yet
    for i in (2, 1, 0):
        staging.to_host(i)
    assert delivered == [5, 3, 4, 2, 1, 0] and staging.batches_to_host == staging.copies_to_host == 2
    assert torch.equal(buffers.flats[0], buffers.device_flats[0])
    for i in range(6):  # the next step: the groups start over
        staging.to_host(i)
    assert staging.batches_to_host == 4
    with pytest.raises(ValueError, match="every parameter index"):
        GradientStaging(buffers, print, groups=[[0, 1], [1, 2, 3, 4, 5]])


def test_staging_groups_by_size_last_parameters_first_one_dtype_each():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, dtype=torch.float64), nn.Linear(8, 8))
    names, params = named(model)
    buffers = GradientBuffers(params, names, staged=True)
    assert size_groups(buffers, 1 << 20) == [[5, 4], [3, 2], [1, 0]]  # small: one group per run of a dtype
    assert size_groups(buffers, 300) == [[5, 4], [3], [2], [1, 0]]  # the float64 weight (512 bytes) alone
    assert size_groups(buffers, 256) == [[5], [4], [3], [2], [1], [0]]  # a group never spans a large weight


def test_a_wrapped_model_goes_to_the_host_a_bucket_at_a_time(monkeypatch):
    """Through DistributedOptimizer's hooks (one rank): wfbp's buckets are the groups; 12 parameters, 1 batch."""
    monkeypatch.setenv(STAGING_ENV, "force")
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(6)])
    dopt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, "wfbp")
    try:
        for _ in range(2):
            dopt.zero_grad()
            model(torch.randn(3, 6)).sum().backward()
            dopt.step()
        assert dopt.staging.copies_to_host == 2  # one copy a step, not 12
        assert dopt.staging.groups == dopt.strategy.bucket_params == [list(range(11, -1, -1))]
        assert dopt.staging.batches_to_host == 2
    finally:
        dopt.close()


def test_the_staging_thread_runs_its_setup_first():
    ran, delivered = [], []
    delivery = Delivery(lambda i, copy: None, delivered.append, lambda: None,
                        setup=lambda: ran.append(threading.get_ident()))
    delivery.put(7, None)
    delivery.drain()
    assert ran == [delivery._thread.ident] and delivered == [7]
    delivery.close()

    def broken():
        raise RuntimeError("no such device")

    delivery = Delivery(lambda i, copy: None, delivered.append, lambda: None, setup=broken)
    delivery.put(8, None)
    with pytest.raises(RuntimeError, match="no such device"):
        delivery.drain()
    assert delivered == [7]
    delivery.close()
    assert device_setup(torch.device("cpu")) is None


def test_unstaged_buffers_are_one_memory():
    names, params = named(nn.Linear(3, 2))
    buffers = GradientBuffers(params, names)
    assert buffers.flats is buffers.device_flats and buffers.views is buffers.grads
    with pytest.raises(ValueError, match="staged=True"):
        GradientStaging(buffers, print)


def test_the_mpi_library_answers_the_cuda_query():
    aware = mpi_cuda_aware()
    assert aware in (True, False, None)
    assert describe_cuda_support() in ("CUDA-aware", "not CUDA-aware", "CUDA-awareness unknown (no MPIX query)")


@pytest.mark.gpu
@needs_cuda
def test_cuda_staging_delivers_in_hook_order_and_returns_on_the_stream():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).cuda()
    names, params = named(model)
    buffers = GradientBuffers(params, names, staged=True)
    assert buffers.flats[0].is_pinned() and buffers.device_flats[0].is_cuda
    delivered = []
    staging = GradientStaging(buffers, lambda i: delivered.append((i, buffers.flat(i).clone())))
    hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: staging.to_host(i)) for i, p in enumerate(params)]
    model(torch.randn(64, 256, device="cuda")).square().sum().backward()
    staging.drain()
    assert [i for i, _ in delivered] == [3, 2, 1, 0]
    assert all(torch.equal(g, params[i].grad.reshape(-1).cpu()) for i, g in delivered)
    for i in range(len(params)):
        buffers.flat(i).fill_(float(i + 1))
    staging.to_device(range(len(params)))
    # The current stream waits on the copies' event: work queued now sees the returned values.
    total = sum(float(p.grad.sum()) for p in params)
    assert total == sum((i + 1) * p.numel() for i, p in enumerate(params))
    for h in hooks:
        h.remove()
    staging.close()


needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs two CUDA devices (torch sees fewer)")


@pytest.mark.gpu
@needs_cuda
def test_the_staging_thread_sleeps_while_it_waits_for_a_copy():
    """Its events are blocking: waiting on one costs the host (almost) no CPU time; a spinning wait would
    take a core for as long as the GPU is busy."""
    model = nn.Linear(8, 8).cuda()
    names, params = named(model)
    staging = GradientStaging(GradientBuffers(params, names, staged=True), lambda i: None)
    with torch.cuda.stream(staging.stream):
        torch.cuda._sleep(400_000_000)  # 0.2-0.4 s
        staging.copied[0].record(staging.stream)
    cpu, wall = time.thread_time(), time.perf_counter()
    staging.copied[0].synchronize()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    assert wall > 0.05 and cpu < 0.5 * wall, f"waited {wall:.3f} s using {cpu:.3f} s of CPU"
    staging.close()


@pytest.mark.gpu
@needs_two_gpus
def test_staging_and_progress_threads_work_on_the_models_gpu():
    """A model on the second GPU while the training thread's current device is the first: the staging thread
    and wfbp's progress thread set theirs to the model's (no context on GPU 0, streams and events there)."""
    torch.cuda.set_device(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)).to("cuda:1")
    names, params = named(model)
    buffers = GradientBuffers(params, names, staged=True)
    seen = []
    staging = GradientStaging(buffers, lambda i: seen.append(torch.cuda.current_device()))
    hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: staging.to_host(i)) for i, p in enumerate(params)]
    model(torch.randn(5, 64, device="cuda:1")).sum().backward()
    staging.drain()
    assert seen == [1] * len(params) and torch.cuda.current_device() == 0
    for h in hooks:
        h.remove()
    staging.close()
    from mpicomm.progress import ProgressThread, Task

    class Where(Task):
        def poll(self):
            self.device = torch.cuda.current_device()
            return True

    progress = ProgressThread("test-device", setup=device_setup(torch.device("cuda", 1)))
    try:
        assert progress.submit(Where()).wait(30).device == 1
    finally:
        progress.stop()
