"""A small LeNet-style CNN: two conv/ReLU/max-pool stages and two linear layers."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 256
in_channels = 3
image_size = 64
num_classes = 100

KBV = {
    "cpu_sizes": {"batch_size": 2, "image_size": 32, "num_classes": 10},
    "tags": ["model", "convolution", "tf32-sensitive", "pooling"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, in_channels: int, image_size: int, num_classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        reduced = image_size // 4
        self.fc1 = nn.Linear(64 * reduced * reduced, 256)
        self.fc2 = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def get_inputs():
    return [torch.rand(batch_size, in_channels, image_size, image_size)]


def get_init_inputs():
    return [in_channels, image_size, num_classes]
