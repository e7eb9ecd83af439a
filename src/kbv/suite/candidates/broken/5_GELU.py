"""Broken candidate: raises inside forward. Expected outcome: runtime_error."""

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.linspace(-4.0, 4.0, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Lookup-table GELU; the index computation produces floats, which cannot index a tensor.
        idx = (x.clamp(-4.0, 4.0) + 4.0) / 8.0 * 1023.0
        return self.table[idx] * x
