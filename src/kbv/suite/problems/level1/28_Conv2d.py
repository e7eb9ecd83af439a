"""Standard 2-D convolution, 3x3, padding 1, with bias."""

import torch
import torch.nn as nn

batch_size = 16
in_channels = 64
out_channels = 128
kernel_size = 3
height = 128
width = 128

KBV = {
    "cpu_sizes": {"batch_size": 1, "in_channels": 8, "out_channels": 16, "height": 16, "width": 16},
    "tags": ["convolution", "tf32-sensitive", "library-baseline"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size]
