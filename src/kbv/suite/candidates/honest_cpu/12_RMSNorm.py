"""Honest candidate in plain PyTorch: RMS normalisation via torch.rsqrt of the mean square over
the feature dimension (legal, reported as PyTorch-only)."""

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, features: int, eps: float):
        super().__init__()
        self.features = features
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inv_rms = torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + self.eps)
        return x * inv_rms
