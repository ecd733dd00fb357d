"""A char-LSTM pipeline on 4 ranks in every mode: its weights flattened into one buffer per LSTM (as cuDNN does on
CUDA) train as the unflattened ones; on a GPU box, the CUDA run follows the CPU run."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_everywhere
from runtime.pipeline import MODES, Pipeline
from runtime.workloads.models import build_model, loss_fn
from runtime.workloads.sequential import synthetic_text
from test_pipeline_versions import flatten_lstms

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
VOCAB = 20


def needs_four(world):
    if world.Get_size() != 4:
        pytest.skip("4 stages: embedding, 2 LSTM layers, head")


def char_lstm(flat: bool = False):
    torch.manual_seed(0)
    model = build_model("char-lstm", vocab=VOCAB, embed=8, hidden=16, layers=2)
    if flat:
        assert flatten_lstms(model) == 2
    return model


def run(mode: str, flat: bool = False, device: str = "cpu", steps: int = 3) -> tuple[list, object, dict]:
    """(the stage's parameters on the CPU after a drain, its Pipeline (closed), its stats)."""
    pipe = Pipeline(char_lstm(flat), lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9), loss_fn=loss_fn("char-lstm"),
                    balance=[1, 1, 1, 1], microbatches=4, mode=mode, device=device, say=None)
    for step in range(steps):
        x, y = synthetic_text(8, 6, VOCAB, seed=step)
        pipe.train_step(x, y)
    pipe.drain()
    params = [p.detach().cpu().clone() for p in pipe.params]
    stats = pipe.stats()
    pipe.close()
    return params, pipe, stats


def shared_storages(pipe) -> int:
    """Parameters of this stage that share their storage with another parameter."""
    ptrs = [p.untyped_storage().data_ptr() for p in pipe.params]
    return sum(ptrs.count(q) > 1 for q in ptrs)


@pytest.mark.parametrize("mode", MODES)
def test_a_flattened_char_lstm_pipeline_trains_as_the_unflattened_one(world, mode):
    needs_four(world)
    plain, _, _ = run(mode)
    flat, pipe, _ = run(mode, flat=True)
    err = max([(a - b).abs().max().item() for a, b in zip(plain, flat)] + [0.0])
    shared = shared_storages(pipe)
    lstm_stage = pipe.stage in (1, 2)
    ok = err < 1e-6 and (shared == 4) == lstm_stage and (shared == 0) == (not lstm_stage)
    assert_everywhere(world, ok, f"{mode}, stage {pipe.stage}: max difference {err:.3g} from the unflattened run, "
                                 f"{shared} parameters sharing a storage")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.gpu
@needs_cuda
def test_cuda_char_lstm_pipeline_follows_the_cpu_run(world, mode):
    """On CUDA, .to(device) flattens each LSTM into one cuDNN buffer: the stages train on it in every mode."""
    needs_four(world)
    cpu, _, _ = run(mode)
    gpu, pipe, stats = run(mode, device="cuda")
    err = max([(a - b).abs().max().item() for a, b in zip(cpu, gpu)] + [0.0])
    shared = shared_storages(pipe)
    held = stats["weight_copy_bytes"]
    # The LSTM stages (1, 2) keep a copy per micro-batch in flight of their whole cuDNN buffer in stash mode.
    keeps = mode != "stash" or pipe.stage not in (1, 2) or held >= (pipe.stages - pipe.stage) * stats["parameter_bytes"]
    ok = err < 1e-4 and stats["device"].startswith("cuda") and (shared == 4) == (pipe.stage in (1, 2)) and keeps
    assert_everywhere(world, ok, f"{mode}, stage {pipe.stage}: max difference {err:.3g} from the CPU run, "
                                 f"{shared} parameters sharing a storage, {held} bytes of weight copies")
