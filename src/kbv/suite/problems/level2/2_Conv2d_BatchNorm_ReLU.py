"""Conv2d, BatchNorm with its running statistics (inference semantics, whatever the module's
training flag), then ReLU. The running statistics are randomised at construction."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 16
in_channels = 32
out_channels = 64
kernel_size = 3
height = 128
width = 128

KBV = {
    "cpu_sizes": {"batch_size": 1, "in_channels": 4, "out_channels": 8, "height": 16, "width": 16},
    "tags": ["fusion", "convolution", "tf32-sensitive", "normalization", "sign-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
        self.bn = nn.BatchNorm2d(out_channels)
        with torch.no_grad():
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)
            self.bn.running_mean.uniform_(-0.2, 0.2)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y = F.batch_norm(
            y, self.bn.running_mean, self.bn.running_var, self.bn.weight, self.bn.bias,
            training=False, eps=self.bn.eps,
        )
        return torch.relu(y)


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size]
