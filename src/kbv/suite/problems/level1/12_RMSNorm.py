"""RMS normalisation over the feature dimension, written out by hand (no nn.RMSNorm)."""

import torch
import torch.nn as nn

batch_size = 16
features = 64
dim1 = 256
dim2 = 256
eps = 1e-5

KBV = {
    "cpu_sizes": {"batch_size": 2, "features": 16, "dim1": 16, "dim2": 16},
    "tags": ["normalization", "reduction", "magnitude-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, features: int, eps: float):
        super().__init__()
        self.features = features
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.sqrt(torch.mean(x * x, dim=1, keepdim=True) + self.eps)
        return x / rms


def get_inputs():
    return [torch.rand(batch_size, features, dim1, dim2)]


def get_init_inputs():
    return [features, eps]
