"""LayerNorm over the last dimension. A single-pass E[x^2] - E[x]^2 variance is accurate on
[0, 1) inputs and cancels catastrophically when the rows have a large mean."""

import torch
import torch.nn as nn

batch_size = 4096
dim = 8192

KBV = {
    "cpu_sizes": {"batch_size": 64, "dim": 1024},
    "tags": ["normalization", "reduction", "offset-sensitive", "cancellation"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return [dim]
