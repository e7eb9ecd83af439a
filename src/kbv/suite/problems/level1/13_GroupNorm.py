"""GroupNorm over channel groups of a 4-D activation."""

import torch
import torch.nn as nn

batch_size = 16
features = 64
num_groups = 8
dim1 = 256
dim2 = 256

KBV = {
    "cpu_sizes": {"batch_size": 2, "features": 16, "num_groups": 4, "dim1": 16, "dim2": 16},
    "tags": ["normalization", "reduction", "offset-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, features: int, num_groups: int):
        super().__init__()
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gn(x)


def get_inputs():
    return [torch.rand(batch_size, features, dim1, dim2)]


def get_init_inputs():
    return [features, num_groups]
