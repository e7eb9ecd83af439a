"""Smooth-L1 (Huber) loss, mean-reduced to a scalar. With torch.rand inputs every difference is
below 1, so the linear branch is never exercised."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 4096
dim = 8192
beta = 1.0

KBV = {
    "cpu_sizes": {"batch_size": 16, "dim": 1024},
    "tags": ["loss", "scalar-output", "reduction", "branch-coverage", "magnitude-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, beta: float):
        super().__init__()
        self.beta = beta

    def forward(self, predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.smooth_l1_loss(predictions, targets, beta=self.beta)


def get_inputs():
    return [torch.rand(batch_size, dim), torch.rand(batch_size, dim)]


def get_init_inputs():
    return [beta]
