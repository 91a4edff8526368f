"""ResNet (He et al., 2015), as torchvision builds it: stride on the 3x3 conv of a bottleneck (v1.5), BatchNorm."""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ResNetConfig:
    block: str = "basic"  # "basic" (two 3x3 convs) or "bottleneck" (1x1, 3x3, 1x1 with 4x expansion)
    layers: tuple[int, ...] = (2, 2, 2, 2)  # blocks per stage
    width: int = 64  # channels of the stem and first stage; each later stage doubles them
    num_classes: int = 1000


CONFIGS = {
    "resnet18": ResNetConfig(),
    "resnet50": ResNetConfig(block="bottleneck", layers=(3, 4, 6, 3)),
}


def shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module:
    """Identity when shapes match, else a strided 1x1 projection."""
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))


# The blocks use in-place ReLU and residual adds like torchvision, so their memory profile matches it.
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_ch: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = shortcut(in_ch, planes, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.downsample(x)
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = shortcut(in_ch, planes * 4, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += self.downsample(x)
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig):
        super().__init__()
        block = {"basic": BasicBlock, "bottleneck": Bottleneck}[config.block]
        self.conv1 = nn.Conv2d(3, config.width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(config.width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, in_ch = [], config.width
        for i, n_blocks in enumerate(config.layers):
            planes = config.width * 2**i
            blocks = []
            for j in range(n_blocks):
                blocks.append(block(in_ch, planes, stride=2 if i > 0 and j == 0 else 1))
                in_ch = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, config.num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.avgpool(self.stages(x))
        return self.fc(x.flatten(1))


def build(config: ResNetConfig, batch_size: int, image_size: int = 224):
    """The model and its (images,) input."""
    return ResNet(config), (torch.randn(batch_size, 3, image_size, image_size),)
