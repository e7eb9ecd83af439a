"""Linear layer, clamp from below at clamp_min, then clamp from above at max_value. Because
max_value < clamp_min, the output is max_value everywhere, whatever the input: a degenerate
problem that an auditor should flag (a kernel may skip the matmul entirely)."""

import torch
import torch.nn as nn

batch_size = 4096
in_features = 4096
out_features = 4096
clamp_min = 1.0
max_value = 0.5

KBV = {
    "cpu_sizes": {"batch_size": 16, "in_features": 128, "out_features": 128},
    "tags": ["fusion", "matmul", "degenerate-constant"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, clamp_min: float, max_value: float):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.clamp_min = clamp_min
        self.max_value = max_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        y = torch.clamp(y, min=self.clamp_min)
        return torch.clamp(y, max=self.max_value)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, clamp_min, max_value]
