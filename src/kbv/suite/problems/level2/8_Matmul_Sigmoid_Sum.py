"""Linear layer, sigmoid, then a sum over the features (one value per row)."""

import torch
import torch.nn as nn

batch_size = 8192
in_features = 4096
out_features = 1024

KBV = {
    "cpu_sizes": {"batch_size": 32, "in_features": 128, "out_features": 64},
    "tags": ["fusion", "matmul", "tf32-sensitive", "reduction", "activation"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear(x)).sum(dim=1, keepdim=True)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
