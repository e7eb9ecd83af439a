"""Row-wise softmax of moderate width. Skipping the max-subtraction is harmless on [0, 1) inputs
and overflows for logits above ~88."""

import torch
import torch.nn as nn

batch_size = 4096
dim = 4096

KBV = {
    "cpu_sizes": {"batch_size": 32, "dim": 512},
    "tags": ["softmax", "reduction", "overflow-sensitive", "offset-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return []
