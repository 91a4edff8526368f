"""An LSTM language model: embedding, a stacked nn.LSTM, a linear head over the vocabulary."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LSTMConfig:
    vocab_size: int = 10000
    n_embd: int = 512
    hidden_size: int = 1024
    n_layer: int = 2
    dropout: float = 0.2


CONFIGS = {"lstm": LSTMConfig()}


class LSTMLanguageModel(nn.Module):
    def __init__(self, config: LSTMConfig):
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.lstm = nn.LSTM(config.n_embd, config.hidden_size, config.n_layer,
                            batch_first=True, dropout=config.dropout)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, idx, targets):
        out, _ = self.lstm(self.drop(self.embedding(idx)))
        logits = self.head(self.drop(out))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(config: LSTMConfig, batch_size: int, seq_len: int = 256):
    """The model and its (idx, targets) inputs."""
    idx = torch.randint(config.vocab_size, (batch_size, seq_len))
    targets = torch.randint(config.vocab_size, (batch_size, seq_len))
    return LSTMLanguageModel(config), (idx, targets)
