"""Linear layer, an extra learned bias, HardTanh, then Mish."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 8192
in_features = 2048
out_features = 2048

KBV = {
    "cpu_sizes": {"batch_size": 32, "in_features": 128, "out_features": 128},
    "tags": ["fusion", "matmul", "tf32-sensitive", "activation", "sign-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(out_features) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) + self.bias
        y = F.hardtanh(y)
        return F.mish(y)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
