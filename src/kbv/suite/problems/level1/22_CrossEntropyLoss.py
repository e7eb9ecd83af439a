"""Cross-entropy of logits against integer class targets, mean-reduced to a scalar."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 4096
num_classes = 8192

KBV = {
    "cpu_sizes": {"batch_size": 32, "num_classes": 512},
    "tags": ["loss", "scalar-output", "softmax", "integer-input", "overflow-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(predictions, targets)


def get_inputs():
    return [torch.rand(batch_size, num_classes), torch.randint(0, num_classes, (batch_size,))]


def get_init_inputs():
    return []
