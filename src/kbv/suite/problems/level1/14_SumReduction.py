"""Sum over the middle dimension, keeping it as size 1."""

import torch
import torch.nn as nn

batch_size = 128
dim1 = 2048
dim2 = 1024
reduce_dim = 1

KBV = {
    "cpu_sizes": {"batch_size": 4, "dim1": 256, "dim2": 64},
    "tags": ["reduction", "accumulation-order", "cancellation"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sum(x, dim=self.dim, keepdim=True)


def get_inputs():
    return [torch.rand(batch_size, dim1, dim2)]


def get_init_inputs():
    return [reduce_dim]
