"""The pipeline's models: char-lstm, a cuttable nn.Sequential that learns; fc-heavy's size and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from runtime.workloads.models import FC_HEAVY_HIDDEN, TOKEN_MODELS, build_model, input_shape, loss_fn, model_input
from runtime.workloads.sequential import CHAR_VOCAB, CharLSTM, LSTMLayer

torch.set_num_threads(1)

SMALL_LSTM = dict(embed=16, hidden=64, layers=2)


def test_char_lstm_is_a_sequential_of_embedding_lstm_layers_and_head():
    torch.manual_seed(0)
    model = build_model("char-lstm")
    assert isinstance(model, nn.Sequential) and isinstance(model, CharLSTM)
    kinds = [type(m) for m in model]
    assert kinds == [nn.Embedding, LSTMLayer, LSTMLayer, LSTMLayer, nn.Linear]  # 5 modules: up to 5 stages
    assert model[0].num_embeddings == model[-1].out_features == CHAR_VOCAB
    assert model[0].embedding_dim == 64 and model[-1].in_features == 512
    assert all(m.lstm.num_layers == 1 and m.lstm.batch_first for m in model[1:4])
    narrow = build_model("char-lstm", vocab=30, embed=8, hidden=16, layers=1)
    assert [type(m) for m in narrow] == [nn.Embedding, LSTMLayer, nn.Linear] and narrow[-1].out_features == 30
    with pytest.raises(ValueError, match="layers must be >= 1"):
        CharLSTM(layers=0)


def test_char_lstm_shapes_and_cut_into_stages_gives_the_same_output():
    torch.manual_seed(0)
    model = build_model("char-lstm", **SMALL_LSTM).eval()
    (x,), y = model_input("char-lstm", 3, seed=1)
    assert x.shape == y.shape == (3, 64) and x.dtype == y.dtype == torch.int64
    hidden = model[:2](x)
    assert isinstance(hidden, torch.Tensor) and hidden.shape == (3, 64, 64)  # a tensor, not LSTM's (out, state)
    # A slice is a plain nn.Sequential (CharLSTM's constructor takes sizes, not modules).
    stages = [model[0:1], model[1:2], model[2:3], model[3:]]
    assert all(type(s) is nn.Sequential for s in stages)
    with torch.no_grad():
        whole, h = model(x), x
        for stage in stages:
            h = stage(h)
    assert whole.shape == (3, 64, CHAR_VOCAB) and torch.equal(h, whole)


def test_char_lstm_synthetic_text_is_shifted_and_deterministic():
    (x,), y = model_input("char-lstm", 4, seed=7, seq_len=20, vocab=12)
    assert x.shape == (4, 20) and torch.equal(x[:, 1:], y[:, :-1])
    assert x.min() >= 1 and max(x.max(), y.max()) < 12  # id 0 (unknown, not scored) never appears
    (again,), y2 = model_input("char-lstm", 4, seed=7, seq_len=20, vocab=12)
    assert torch.equal(again, x) and torch.equal(y2, y)
    assert not torch.equal(model_input("char-lstm", 4, seed=8, seq_len=20, vocab=12)[0][0], x)


def test_char_lstm_trains_on_synthetic_text():
    """A few Adam steps: the training loss falls from uniform, and so does the loss on text of another seed."""
    torch.manual_seed(0)
    model = build_model("char-lstm", embed=16, hidden=32, layers=2)
    (x,), y = model_input("char-lstm", 64, seed=0, seq_len=16)
    (held_x,), held_y = model_input("char-lstm", 64, seed=1, seq_len=16)
    criterion = loss_fn("char-lstm")
    with torch.no_grad():
        held_before = criterion(model(held_x), held_y).item()
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        held_after = criterion(model(held_x), held_y).item()
    assert abs(losses[0] - math.log(CHAR_VOCAB)) < 0.3  # starts near uniform
    assert losses[-1] < 0.6 * losses[0], losses[::6]
    assert held_after < 0.6 * held_before, (held_before, held_after)


def test_fc_heavy_parameter_count_on_the_meta_device():
    with torch.device("meta"):  # shapes only: no 832 MB of weights
        model = build_model("fc-heavy")
    widths = [784, *FC_HEAVY_HIDDEN, 10]
    expected = sum(a * b + b for a, b in zip(widths, widths[1:]))
    assert expected == 207_863_818
    assert sum(p.numel() for p in model.parameters()) == expected
    assert isinstance(model.net, nn.Sequential)
    assert [m.out_features for m in model.net if isinstance(m, nn.Linear)] == [8192] * 4 + [10]
    assert input_shape("fc-heavy") == (784,)


def test_narrow_fc_heavy_forward_backward():
    torch.manual_seed(0)
    model = build_model("fc-heavy", hidden=[32] * 4)
    (x,), y = model_input("fc-heavy", 4, seed=2)
    assert x.shape == (4, 784) and y.shape == (4,)
    out = model(x)
    assert out.shape == (4, 10)
    loss_fn("fc-heavy")(out, y).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert loss_fn("fc-heavy") is loss_fn("mlp")


def test_token_models_agree_with_jobs_choices_and_train_checks_the_data(capsys):
    from jobs.common import choices
    from jobs.train import parse_args

    assert choices.TOKEN_MODELS == TOKEN_MODELS
    assert parse_args(["--model", "fc-heavy"]).data == "fashion-mnist"  # 784 inputs: Fashion-MNIST fits
    assert parse_args(["--model", "char-lstm", "--data", "synthetic"]).model == "char-lstm"
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "char-lstm"])
    assert exit_.value.code == 2
    assert "--data: char-lstm trains on sequences: use --data synthetic or --data austen" in capsys.readouterr().err
