"""Models that are one nn.Sequential, cuttable into pipeline stages: the character-level LSTM and its synthetic text."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

# datacache.austen.CharCorpus's ids: 0 unknown, 1 newline, 2..96 printable ASCII (tests check they agree).
CHAR_VOCAB = 97


class LSTMLayer(nn.Module):
    """One batch-first LSTM layer that returns only its output [B, T, hidden], so layers chain in nn.Sequential."""

    def __init__(self, input_size: int, hidden: int):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden, num_layers=1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every call starts from a zero state: each batch of windows is independent, and a
        # pipeline stage sees nothing but the activation tensor.
        return self.lstm(x)[0]


class CharLSTM(nn.Sequential):
    """Character language model: Embedding -> LSTMLayer x layers -> Linear; tokens [B, T] -> logits [B, T, vocab].

    Being an nn.Sequential of layers + 2 modules, it can be cut into that many pipeline stages at most
    (5 with the default 3 layers).
    """

    def __init__(self, vocab: int = CHAR_VOCAB, embed: int = 64, hidden: int = 512, layers: int = 3):
        if min(vocab, embed, hidden, layers) < 1:
            raise ValueError(f"vocab, embed, hidden, layers must be >= 1, got {vocab}, {embed}, {hidden}, {layers}")
        blocks = [LSTMLayer(embed if i == 0 else hidden, hidden) for i in range(layers)]
        super().__init__(nn.Embedding(vocab, embed), *blocks, nn.Linear(hidden, vocab))
        self.vocab = vocab

    def __getitem__(self, idx):
        # nn.Sequential builds a slice as self.__class__(OrderedDict(...)), which this constructor
        # (sizes, not modules) cannot take: a slice, a pipeline stage, is a plain nn.Sequential.
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)


def synthetic_text(n: int, seq_len: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y int64 [n, seq_len], y = x shifted by one token: a learnable Markov chain over tokens 1..vocab-1.

    Each token is followed by its image under a fixed random permutation 90 % of the time and by a
    uniform token otherwise, so a short run shows the loss falling. The permutation is the same for
    every seed (one task; seeds draw its samples), so a set drawn with another seed tests what was
    learnt. Token 0 (the corpus's unknown character, the loss's ignored PAD) never appears, so
    every target counts.
    """
    if n < 1 or seq_len < 1 or vocab < 2:
        raise ValueError(f"need n, seq_len >= 1 and vocab >= 2, got {n}, {seq_len}, {vocab}")
    successor = np.concatenate([[0], 1 + np.random.default_rng(0).permutation(vocab - 1)])
    rng = np.random.default_rng(seed)
    noise = rng.integers(1, vocab, size=(n, seq_len + 1))
    keep = rng.random((n, seq_len + 1)) < 0.9
    s = np.empty((n, seq_len + 1), dtype=np.int64)
    s[:, 0] = noise[:, 0]
    for t in range(1, seq_len + 1):
        s[:, t] = np.where(keep[:, t], successor[s[:, t - 1]], noise[:, t])
    s = torch.from_numpy(s)
    return s[:, :-1].contiguous(), s[:, 1:].contiguous()
