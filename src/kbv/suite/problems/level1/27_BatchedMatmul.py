"""Batched matrix multiplication (bmm)."""

import torch
import torch.nn as nn

batch_size = 128
m = 512
k = 1024
n = 512

KBV = {
    "cpu_sizes": {"batch_size": 4, "m": 32, "k": 64, "n": 32},
    "tags": ["matmul", "batched", "tf32-sensitive", "library-baseline"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return torch.bmm(A, B)


def get_inputs():
    return [torch.rand(batch_size, m, k), torch.rand(batch_size, k, n)]


def get_init_inputs():
    return []
