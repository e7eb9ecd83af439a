"""Linear layer, softmax over the features, then dropout with p = 0 (a no-op in any mode)."""

import torch
import torch.nn as nn

batch_size = 8192
in_features = 1024
out_features = 8192
dropout_p = 0.0

KBV = {
    "cpu_sizes": {"batch_size": 32, "in_features": 64, "out_features": 512},
    "tags": ["fusion", "matmul", "softmax", "tf32-sensitive", "zeros-pass-atol", "no-op-op"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, dropout_p: float):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.softmax(self.linear(x), dim=1))


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, dropout_p]
