"""Broken candidate: hangs forever inside forward (a spin loop that never terminates).
Expected outcome: timeout."""

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        while True:
            pass
        return torch.sigmoid(x)  # never reached
