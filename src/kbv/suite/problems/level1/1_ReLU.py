"""Elementwise ReLU. With torch.rand inputs (all in [0, 1)) ReLU is the identity."""

import torch
import torch.nn as nn

batch_size = 4096
dim = 32768

KBV = {
    "cpu_sizes": {"batch_size": 8, "dim": 1024},
    "tags": ["activation", "elementwise", "sign-sensitive", "identity-on-rand"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return []
