"""Honest candidate in plain PyTorch: addmm for the linear layer, exact GELU, and layer_norm
with the same parameters (names and creation order match the problem's Model)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.ln = nn.LayerNorm(out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(self.linear.bias, x, self.linear.weight.t())
        y = F.gelu(y)
        return F.layer_norm(y, (y.shape[-1],), self.ln.weight, self.ln.bias, self.ln.eps)
