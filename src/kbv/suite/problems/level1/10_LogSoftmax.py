"""Row-wise log-softmax. log(softmax(x)) computed naively underflows to -inf for spread logits."""

import torch
import torch.nn as nn

batch_size = 4096
dim = 16384

KBV = {
    "cpu_sizes": {"batch_size": 16, "dim": 1024},
    "tags": ["softmax", "reduction", "overflow-sensitive", "underflow-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=1)


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return []
