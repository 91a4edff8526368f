"""A small 2D UNet (Ronneberger et al., 2015) for segmentation.

Conv-BN-ReLU pairs, max-pool down, transposed-conv up, skip connections by concatenation.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class UNetConfig:
    in_channels: int = 3
    num_classes: int = 2  # per-pixel classes
    base_channels: int = 32  # channels at full resolution; each level down doubles them
    depth: int = 3  # down-sampling steps


CONFIGS = {"unet": UNetConfig()}


class DoubleConv(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int):
        super().__init__(
            nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False), nn.BatchNorm2d(out_ch), nn.ReLU(),
            nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False), nn.BatchNorm2d(out_ch), nn.ReLU(),
        )


class Up(nn.Module):
    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.upsample = nn.ConvTranspose2d(in_ch, out_ch, 2, stride=2)
        self.conv = DoubleConv(2 * out_ch, out_ch)  # upsampled features concatenated with the skip

    def forward(self, x, skip):
        return self.conv(torch.cat([skip, self.upsample(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, config: UNetConfig):
        super().__init__()
        widths = [config.base_channels * 2**i for i in range(config.depth + 1)]
        self.stem = DoubleConv(config.in_channels, widths[0])
        self.downs = nn.ModuleList(DoubleConv(widths[i], widths[i + 1]) for i in range(config.depth))
        self.ups = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(config.depth)))
        self.head = nn.Conv2d(widths[0], config.num_classes, 1)

    def forward(self, images):
        x, skips = self.stem(images), []
        for down in self.downs:
            skips.append(x)
            x = down(F.max_pool2d(x, 2))
        for up in self.ups:
            x = up(x, skips.pop())
        return self.head(x)  # (B, num_classes, H, W) logits


def build(config: UNetConfig, batch_size: int, image_size: int = 128):
    """The model and its (images,) input."""
    if image_size % 2**config.depth:
        raise ValueError(f"image_size {image_size} must be a multiple of 2**depth = {2**config.depth}")
    return UNet(config), (torch.randn(batch_size, config.in_channels, image_size, image_size),)
