"""Elementwise LeakyReLU. Identity on all-positive inputs."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 4096
dim = 32768
negative_slope = 0.01

KBV = {
    "cpu_sizes": {"batch_size": 8, "dim": 1024},
    "tags": ["activation", "elementwise", "sign-sensitive", "identity-on-rand"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, negative_slope: float):
        super().__init__()
        self.negative_slope = negative_slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, negative_slope=self.negative_slope)


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return [negative_slope]
