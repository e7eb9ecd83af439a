"""Elementwise ELU. Identity on non-negative inputs; the exponential branch needs negatives."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 4096
dim = 32768
alpha = 1.0

KBV = {
    "cpu_sizes": {"batch_size": 8, "dim": 1024},
    "tags": ["activation", "elementwise", "sign-sensitive", "identity-on-rand"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.elu(x, alpha=self.alpha)


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return [alpha]
