"""Inclusive prefix sum along each row."""

import torch
import torch.nn as nn

batch_size = 4096
dim = 32768
scan_dim = 1

KBV = {
    "cpu_sizes": {"batch_size": 8, "dim": 2048},
    "tags": ["scan", "accumulation-order", "cancellation"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, dim=self.dim)


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return [scan_dim]
