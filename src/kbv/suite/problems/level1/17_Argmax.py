"""Argmax over the middle dimension; the output is int64 and must match exactly."""

import torch
import torch.nn as nn

batch_size = 128
dim1 = 2048
dim2 = 1024
reduce_dim = 1

KBV = {
    "cpu_sizes": {"batch_size": 4, "dim1": 256, "dim2": 64},
    "tags": ["reduction", "integer-output", "exact-compare", "sign-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.argmax(x, dim=self.dim)


def get_inputs():
    return [torch.rand(batch_size, dim1, dim2)]


def get_init_inputs():
    return [reduce_dim]
