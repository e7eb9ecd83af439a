"""Linear layer, exact GELU, then LayerNorm over the features."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 8192
in_features = 2048
out_features = 2048

KBV = {
    "cpu_sizes": {"batch_size": 32, "in_features": 128, "out_features": 256},
    "tags": ["fusion", "matmul", "tf32-sensitive", "normalization", "activation"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.ln = nn.LayerNorm(out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(F.gelu(self.linear(x)))


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
