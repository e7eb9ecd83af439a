"""Linear layer, scaled, plus the input as a residual (square layer)."""

import torch
import torch.nn as nn

batch_size = 8192
features = 4096
scale = 0.5

KBV = {
    "cpu_sizes": {"batch_size": 32, "features": 256},
    "tags": ["fusion", "matmul", "tf32-sensitive", "residual"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, features: int, scale: float):
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale + x


def get_inputs():
    return [torch.rand(batch_size, features)]


def get_init_inputs():
    return [features, scale]
