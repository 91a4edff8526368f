"""Vision Transformer (Dosovitskiy et al., 2020), as torchvision's vit_b_16.

Pre-LayerNorm blocks, a class token, learned positions, no dropout (torchvision's default).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 224  # part of the model: it sets the size of the position table
    patch_size: int = 16
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    ffn_dim: int = 3072
    num_classes: int = 1000


CONFIGS = {"vit-b16": ViTConfig()}


class EncoderBlock(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=1e-6)
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, config.ffn_dim), nn.GELU(),
                                 nn.Linear(config.ffn_dim, config.n_embd))

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        if config.image_size % config.patch_size:
            raise ValueError(f"image_size {config.image_size} is not a multiple of patch_size {config.patch_size}")
        n_patches = (config.image_size // config.patch_size) ** 2
        self.conv_proj = nn.Conv2d(3, config.n_embd, config.patch_size, config.patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, config.n_embd))
        self.pos_embedding = nn.Parameter(torch.empty(1, n_patches + 1, config.n_embd))
        nn.init.normal_(self.pos_embedding, std=0.02)
        self.layers = nn.ModuleList(EncoderBlock(config) for _ in range(config.n_layer))
        self.ln = nn.LayerNorm(config.n_embd, eps=1e-6)
        self.head = nn.Linear(config.n_embd, config.num_classes)

    def forward(self, images):
        x = self.conv_proj(images).flatten(2).transpose(1, 2)  # (B, patches, n_embd)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x)[:, 0])  # classify from the class token


def build(config: ViTConfig, batch_size: int):
    """The model and its (images,) input; image_size is a config field because the position table depends on it."""
    return ViT(config), (torch.randn(batch_size, 3, config.image_size, config.image_size),)
