"""One post-norm transformer encoder layer (self-attention + GELU feed-forward), no dropout."""

import torch
import torch.nn as nn

batch_size = 16
seq_len = 512
d_model = 1024
nhead = 16
dim_feedforward = 4096

KBV = {
    "cpu_sizes": {"batch_size": 2, "seq_len": 16, "d_model": 64, "nhead": 4, "dim_feedforward": 128},
    "tags": ["model", "attention", "normalization", "matmul", "tf32-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, d_model: int, nhead: int, dim_feedforward: int):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward=dim_feedforward, dropout=0.0, activation="gelu", batch_first=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def get_inputs():
    return [torch.rand(batch_size, seq_len, d_model)]


def get_init_inputs():
    return [d_model, nhead, dim_feedforward]
