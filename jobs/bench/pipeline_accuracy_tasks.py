"""The three tasks of jobs.bench.pipeline_accuracy (SpecTrain's table): data, model, stage balance, learning rate.

- cnn: a small CNN on a Fashion-MNIST subset (validation: the start of the test set);
- fc: an MLP 784-512-512-256-10 on the same images;
- lstm: a character-level LSTM (runtime.workloads.sequential.CharLSTM, 2 LSTM layers of 128) on the
  start of Jane Austen's novels, the last 10 % of that text for validation; accuracy: next character.

Every model is an nn.Sequential whose `balance` cuts it into 4 stages, each holding parameters
(the staleness a layer sees in an asynchronous pipeline depends on its stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

STAGES = 4
IMAGE_SHAPE = (1, 28, 28)
# Characters per window. 32, not 64: the same characters make twice the updates (of half the cost),
# and in a few epochs the char-LSTM learns per update, not per character.
SEQ_LEN = 32
VAL_FRACTION = 0.1  # of the text


@dataclass(frozen=True)
class Task:
    name: str
    title: str
    model: str  # runtime.workloads.models name whose loss the task uses
    balance: tuple[int, ...]  # layers per stage
    lr: float  # peak learning rate of a step of 4 updates (each applies lr / 4), every method
    epochs: int
    build: Callable[[], object]  # -> nn.Sequential (call after torch.manual_seed)


def build_cnn():
    from runtime.workloads.models import build_model

    # Conv, ReLU, pool | conv, ReLU, pool | Flatten, Linear | ReLU, Linear: `mpitrain train --model cnn`'s model.
    return build_model("cnn", num_classes=10)


def build_fc():
    from runtime.workloads.models import MLP

    return MLP(num_classes=10, hidden=(512, 512, 256)).pipeline_layers()  # Flatten, (Linear, ReLU) x3, Linear


def build_lstm():
    from runtime.workloads.sequential import CharLSTM

    return CharLSTM(embed=64, hidden=128, layers=2)  # Embedding, LSTMLayer, LSTMLayer, Linear


# Learning rates of a pipeline step of 4 micro-batches, as `mpitrain train --lr` (each update applies
# a quarter: 0.02 and 2). Chosen per update before that rule: dp's best of {0.01, 0.02, 0.05} (images)
# and {0.5, 1, 2, 4} (text) per update with a constant rate (one seed, 3 epochs). With the job's warm-up
# and linear decay (two seeds, 3 epochs) dp does a little better at 0.05 (+0.2 to +0.5 point) and 8
# (+1.5 points) per update, rates at which every asynchronous pipeline diverged on the CNN and
# spectrain failed on the LSTM (29 %): the tasks keep these.
TASKS = {
    "cnn": Task("cnn", "CNN, Fashion-MNIST", "mlp", (3, 3, 2, 2), 0.08, 5, build_cnn),
    "fc": Task("fc", "FC 784-512-512-256-10, Fashion-MNIST", "mlp", (3, 2, 2, 1), 0.08, 5, build_fc),
    "lstm": Task("lstm", "char-LSTM (2 x 128), Jane Austen", "char-lstm", (1, 1, 1, 1), 8.0, 6, build_lstm),
}


def load_data(tasks, train_samples: int, val_samples: int, text_chars: int) -> dict:
    """{'images': (x, y, val x, val y), 'text': (x, y, val x, val y)}, as each of `tasks` needs; tensors.

    Images: the first train_samples of Fashion-MNIST's training set, the first val_samples of its
    test set, normalized as runtime.workloads.data.to_tensor does, shaped [N, 1, 28, 28]. Text: the first
    text_chars characters of the novels as SEQ_LEN-character windows (datacache.austen.CharCorpus).
    """
    import torch

    data = {}
    if any(TASKS[t].model != "char-lstm" for t in tasks):
        from datacache.idx import load_fashion_mnist
        from runtime.workloads.data import to_tensor

        xs, ys = load_fashion_mnist("train")
        txs, tys = load_fashion_mnist("test")
        data["images"] = (to_tensor(xs[:train_samples], IMAGE_SHAPE), torch.as_tensor(ys[:train_samples]),
                          to_tensor(txs[:val_samples], IMAGE_SHAPE), torch.as_tensor(tys[:val_samples]))
    if any(TASKS[t].model == "char-lstm" for t in tasks):
        from datacache.austen import CharCorpus, load_austen_text

        corpus = CharCorpus(load_austen_text()[:text_chars], seq_len=SEQ_LEN, val_fraction=VAL_FRACTION)
        data["text"] = (*corpus.tensors("train"), *corpus.tensors("val"))
    return data


def text_windows(chars: int) -> tuple[int, int]:
    """(training, validation) windows that CharCorpus cuts from a text of `chars` characters."""
    boundary = round(chars * (1.0 - VAL_FRACTION))
    return max(0, (boundary - 1) // SEQ_LEN), max(0, (chars - boundary - 1) // SEQ_LEN)


def task_data(data: dict, task: str):
    return data["text" if TASKS[task].model == "char-lstm" else "images"]
