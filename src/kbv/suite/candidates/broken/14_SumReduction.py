"""Broken candidate: wrong output shape (drops the reduced dimension instead of keeping it as
size 1). Expected outcome: incorrect."""

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sum(x, dim=self.dim)
