"""Honest Triton candidate: LayerNorm over the last dimension, one program per row, three sweeps
(mean; mean of squared deviations; normalise with the affine weight and bias). The two-pass
variance stays accurate when the rows carry a large offset."""

import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, n_cols, stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride
    y_row = y_ptr + row * stride
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / n_cols
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - mean, 0.0)
        acc += d * d
    var = tl.sum(acc, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0)
        tl.store(y_row + cols, (x - mean) * rstd * w + b, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError("expected float32 input")
        shape = x.shape
        x2 = x.contiguous().view(-1, shape[-1])
        y2 = torch.empty_like(x2)
        rows, cols = x2.shape
        if rows == 0 or cols == 0:
            return y2.view(shape)
        block = min(triton.next_power_of_2(cols), 4096)
        weight = self.ln.weight.detach().contiguous()
        bias = self.ln.bias.detach().contiguous()
        grid = lambda meta: (rows,)  # noqa: E731
        _layer_norm_kernel[grid](
            x2, weight, bias, y2, cols, x2.stride(0), float(self.ln.eps), BLOCK=block, num_warps=8
        )
        return y2.view(shape)
