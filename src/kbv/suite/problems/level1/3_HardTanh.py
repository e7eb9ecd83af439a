"""Elementwise HardTanh clamping to [min_val, max_val]. Identity on inputs in [0, 1)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 4096
dim = 32768
min_val = -1.0
max_val = 1.0

KBV = {
    "cpu_sizes": {"batch_size": 8, "dim": 1024},
    "tags": ["activation", "elementwise", "sign-sensitive", "magnitude-sensitive", "identity-on-rand"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, min_val: float, max_val: float):
        super().__init__()
        self.min_val = min_val
        self.max_val = max_val

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.hardtanh(x, min_val=self.min_val, max_val=self.max_val)


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return [min_val, max_val]
