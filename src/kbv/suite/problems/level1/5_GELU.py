"""Elementwise GELU (exact, erf form). On [0, 1) a tanh approximation is within ~1e-3."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 4096
dim = 32768

KBV = {
    "cpu_sizes": {"batch_size": 8, "dim": 1024},
    "tags": ["activation", "elementwise", "sign-sensitive", "approximation-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return []
