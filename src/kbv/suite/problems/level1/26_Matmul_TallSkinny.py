"""Tall A (M x K) times skinny B (K x N) with a long reduction dimension."""

import torch
import torch.nn as nn

M = 32768
K = 4096
N = 64

KBV = {
    "cpu_sizes": {"M": 256, "K": 256, "N": 16},
    "tags": ["matmul", "tf32-sensitive", "skinny", "library-baseline"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return torch.matmul(A, B)


def get_inputs():
    return [torch.rand(M, K), torch.rand(K, N)]


def get_init_inputs():
    return []
