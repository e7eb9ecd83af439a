"""A multi-layer perceptron: Linear + ReLU blocks and a final Linear."""

import torch
import torch.nn as nn

batch_size = 1024
input_size = 4096
hidden_size = 2048
num_hidden = 3
output_size = 1000

KBV = {
    "cpu_sizes": {"batch_size": 16, "input_size": 256, "hidden_size": 128, "output_size": 32},
    "tags": ["model", "matmul", "tf32-sensitive", "sign-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, input_size: int, hidden_size: int, num_hidden: int, output_size: int):
        super().__init__()
        layers = []
        width = input_size
        for _ in range(num_hidden):
            layers.append(nn.Linear(width, hidden_size))
            layers.append(nn.ReLU())
            width = hidden_size
        layers.append(nn.Linear(width, output_size))
        self.network = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def get_inputs():
    return [torch.rand(batch_size, input_size)]


def get_init_inputs():
    return [input_size, hidden_size, num_hidden, output_size]
