"""A two-layer LSTM over a sequence; returns the last layer's output at every step."""

import torch
import torch.nn as nn

batch_size = 64
seq_len = 256
input_size = 256
hidden_size = 512
num_layers = 2

KBV = {
    "cpu_sizes": {"batch_size": 2, "seq_len": 16, "input_size": 16, "hidden_size": 32},
    "tags": ["model", "recurrent", "matmul", "tf32-sensitive", "sequential"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, input_size: int, hidden_size: int, num_layers: int):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers=num_layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return out


def get_inputs():
    return [torch.rand(batch_size, seq_len, input_size)]


def get_init_inputs():
    return [input_size, hidden_size, num_layers]
