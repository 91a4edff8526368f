"""A small multilayer-perceptron classifier (flattened 28x28 images by default)."""

import itertools
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    in_features: int = 784
    hidden_size: int = 1024
    n_layer: int = 3  # hidden layers
    num_classes: int = 10


CONFIGS = {"mlp": MLPConfig()}


class MLP(nn.Sequential):
    def __init__(self, config: MLPConfig):
        widths = [config.in_features] + [config.hidden_size] * config.n_layer
        layers = []
        for d_in, d_out in itertools.pairwise(widths):
            layers += [nn.Linear(d_in, d_out), nn.ReLU()]
        super().__init__(*layers, nn.Linear(widths[-1], config.num_classes))


def build(config: MLPConfig, batch_size: int):
    """The model and its (features,) input."""
    return MLP(config), (torch.randn(batch_size, config.in_features),)
