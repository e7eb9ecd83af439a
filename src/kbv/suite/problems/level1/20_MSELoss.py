"""Mean squared error between two tensors, reduced to a scalar. For independent torch.rand
inputs the expected value is 1/6, so a constant close to 0.1667 passes a loose check."""

import torch
import torch.nn as nn

batch_size = 4096
dim = 8192

KBV = {
    "cpu_sizes": {"batch_size": 16, "dim": 1024},
    "tags": ["loss", "scalar-output", "reduction", "constant-passes"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.mean((predictions - targets) ** 2)


def get_inputs():
    return [torch.rand(batch_size, dim), torch.rand(batch_size, dim)]


def get_init_inputs():
    return []
