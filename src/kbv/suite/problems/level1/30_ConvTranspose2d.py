"""Transposed 2-D convolution, 4x4 kernel, stride 2 (doubles the spatial size)."""

import torch
import torch.nn as nn

batch_size = 16
in_channels = 64
out_channels = 32
kernel_size = 4
stride = 2
padding = 1
height = 128
width = 128

KBV = {
    "cpu_sizes": {"batch_size": 1, "in_channels": 8, "out_channels": 4, "height": 8, "width": 8},
    "tags": ["convolution", "transposed", "tf32-sensitive", "library-baseline"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, padding: int):
        super().__init__()
        self.conv_t = nn.ConvTranspose2d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_t(x)


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, stride, padding]
