"""Elementwise sigmoid. Naive 1/(1+exp(-x)) variants can overflow for large negative inputs."""

import torch
import torch.nn as nn

batch_size = 4096
dim = 32768

KBV = {
    "cpu_sizes": {"batch_size": 8, "dim": 1024},
    "tags": ["activation", "elementwise", "magnitude-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return []
