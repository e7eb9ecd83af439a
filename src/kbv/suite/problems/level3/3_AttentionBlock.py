"""Multi-head self-attention: Q/K/V projections, scaled dot-product attention, output projection."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 16
seq_len = 1024
embed_dim = 1024
num_heads = 16

KBV = {
    "cpu_sizes": {"batch_size": 2, "seq_len": 32, "embed_dim": 64, "num_heads": 4},
    "tags": ["model", "attention", "softmax", "matmul", "tf32-sensitive"],
    "domain": "any",
}


class Model(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, e = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        attn = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(attn.transpose(1, 2).reshape(b, s, e))


def get_inputs():
    return [torch.rand(batch_size, seq_len, embed_dim)]


def get_init_inputs():
    return [embed_dim, num_heads]
