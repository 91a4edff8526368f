"""BERT (Devlin et al., 2018) with a pooler and a sequence-classification head: post-LayerNorm encoder blocks."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    max_positions: int = 512  # size of the learned position table
    type_vocab_size: int = 2  # segment A / segment B
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    ffn_dim: int = 3072
    dropout: float = 0.1
    num_labels: int = 2
    norm_eps: float = 1e-12


CONFIGS = {
    "bert-base": BertConfig(),
    "bert-large": BertConfig(n_layer=24, n_head=16, n_embd=1024, ffn_dim=4096),
}


class Embeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.n_embd)
        self.position = nn.Embedding(config.max_positions, config.n_embd)
        self.token_type = nn.Embedding(config.type_vocab_size, config.n_embd)
        self.norm = nn.LayerNorm(config.n_embd, eps=config.norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids, token_type_ids):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(pos) + self.token_type(token_type_ids)
        return self.dropout(self.norm(x))


class Layer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout_p = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.attn_out = nn.Linear(config.n_embd, config.n_embd)
        self.attn_norm = nn.LayerNorm(config.n_embd, eps=config.norm_eps)
        self.ffn_in = nn.Linear(config.n_embd, config.ffn_dim)
        self.ffn_out = nn.Linear(config.ffn_dim, config.n_embd)
        self.ffn_norm = nn.LayerNorm(config.n_embd, eps=config.norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        # Bidirectional: every token sees every other, so neither a causal flag nor a mask.
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p if self.training else 0.0)
        x = self.attn_norm(x + self.dropout(self.attn_out(a.transpose(1, 2).reshape(B, T, C))))
        return self.ffn_norm(x + self.dropout(self.ffn_out(F.gelu(self.ffn_in(x)))))


class BertForSequenceClassification(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.n_layer))
        self.pooler = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.n_embd, config.num_labels)

    def forward(self, input_ids, token_type_ids, labels):
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            x = layer(x)
        pooled = torch.tanh(self.pooler(x[:, 0]))  # the [CLS] token summarises the sequence
        logits = self.classifier(self.dropout(pooled))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def build(config: BertConfig, batch_size: int, seq_len: int | None = None):
    """The model and its keyword inputs; seq_len defaults to the full position table."""
    seq_len = config.max_positions if seq_len is None else seq_len
    if seq_len > config.max_positions:
        raise ValueError(f"seq_len {seq_len} exceeds max_positions {config.max_positions} "
                         "(the learned position table); override max_positions too")
    inputs = {
        "input_ids": torch.randint(config.vocab_size, (batch_size, seq_len)),
        "token_type_ids": torch.randint(config.type_vocab_size, (batch_size, seq_len)),
        "labels": torch.randint(config.num_labels, (batch_size,)),
    }
    return BertForSequenceClassification(config), inputs
