"""Llama 2 / Llama 3 (Touvron et al., 2023; Meta, 2024): RMSNorm, rotary positions, SwiGLU, grouped-query attention."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int = 32
    n_embd: int = 4096
    n_head: int = 32
    n_kv_head: int = 32  # fewer than n_head means grouped-query attention
    ffn_dim: int = 11008
    vocab_size: int = 32000
    context_len: int = 4096  # the default input length; rotary positions themselves have no table to outgrow
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


CONFIGS = {
    "llama2-7b": LlamaConfig(),
    "llama2-13b": LlamaConfig(n_layer=40, n_embd=5120, n_head=40, n_kv_head=40, ffn_dim=13824),
    "llama2-70b": LlamaConfig(n_layer=80, n_embd=8192, n_head=64, n_kv_head=8, ffn_dim=28672),
    "llama3-8b": LlamaConfig(n_kv_head=8, ffn_dim=14336, vocab_size=128256, context_len=8192,
                             rope_theta=500000.0),
}


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device):
    """cos/sin of each position's rotation angles, laid out for rotate_half (dim i pairs with i + head_dim/2)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.wq = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: a SiLU-gated linear unit."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.n_embd, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.n_embd, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # untied from the embedding

    def forward(self, idx, targets):
        x = self.tok_embeddings(idx)
        # Computed per call from the sequence length, so no buffer caps it and no complex dtype is needed.
        cos, sin = rotary_cos_sin(idx.shape[1], self.config.n_embd // self.config.n_head,
                                  self.config.rope_theta, idx.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(config: LlamaConfig, batch_size: int, seq_len: int | None = None):
    """The model and its (idx, targets) inputs; seq_len defaults to the model's context length."""
    seq_len = config.context_len if seq_len is None else seq_len
    idx = torch.randint(config.vocab_size, (batch_size, seq_len))
    targets = torch.randint(config.vocab_size, (batch_size, seq_len))
    return Llama(config), (idx, targets)
