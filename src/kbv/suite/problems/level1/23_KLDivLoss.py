"""KL divergence between two row-stochastic matrices (batchmean). The inputs must stay
probabilities: negated or signed inputs make log() NaN."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 4096
dim = 8192

KBV = {
    "cpu_sizes": {"batch_size": 16, "dim": 512},
    "tags": ["loss", "scalar-output", "log", "near-zero-output"],
    "domain": "probabilities",
}


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.kl_div(torch.log(predictions), targets, reduction="batchmean")


def get_inputs():
    predictions = torch.rand(batch_size, dim).softmax(dim=-1)
    targets = torch.rand(batch_size, dim).softmax(dim=-1)
    return [predictions, targets]


def get_init_inputs():
    return []
