"""Divide a tensor by its Frobenius norm. Each output element is tiny (about 1/sqrt(numel)),
so an all-zero output passes a loose absolute tolerance."""

import torch
import torch.nn as nn

batch_size = 16
features = 64
dim1 = 256
dim2 = 256

KBV = {
    "cpu_sizes": {"batch_size": 2, "features": 8, "dim1": 32, "dim2": 32},
    "tags": ["normalization", "reduction", "zeros-pass-atol", "global-reduction"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.sqrt(torch.sum(x * x))
        return x / norm


def get_inputs():
    return [torch.rand(batch_size, features, dim1, dim2)]


def get_init_inputs():
    return []
