"""Conv2d, GroupNorm, then tanh."""

import torch
import torch.nn as nn

batch_size = 16
in_channels = 32
out_channels = 64
kernel_size = 3
num_groups = 8
height = 128
width = 128

KBV = {
    "cpu_sizes": {
        "batch_size": 1, "in_channels": 4, "out_channels": 8, "num_groups": 2, "height": 16, "width": 16,
    },
    "tags": ["fusion", "convolution", "tf32-sensitive", "normalization", "activation"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, num_groups: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
        self.gn = nn.GroupNorm(num_groups, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.gn(self.conv(x)))


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, num_groups]
