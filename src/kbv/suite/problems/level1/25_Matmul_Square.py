"""Square fp32 matrix multiplication. Large K makes TF32 error visible."""

import torch
import torch.nn as nn

N = 4096

KBV = {
    "cpu_sizes": {"N": 128},
    "tags": ["matmul", "tf32-sensitive", "library-baseline"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return torch.matmul(A, B)


def get_inputs():
    return [torch.rand(N, N), torch.rand(N, N)]


def get_init_inputs():
    return []
