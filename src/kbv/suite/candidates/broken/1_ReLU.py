"""Broken candidate: the C++ source does not compile (undeclared identifier and a type error),
so load_inline raises at import time. Expected outcome: compile_error."""

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CPP = r"""
#include <torch/extension.h>

torch::Tensor relu_forward(torch::Tensor x) {
    auto out = torch::empty_like(x);
    float* dst = out.data_ptr<float>();
    const float* src = x.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) {
        dst[i] = src[i] > 0.0f ? src[i] : zero_value;
    }
    return dst;
}
"""

_ext = load_inline(
    name="kbv_broken_relu_compile_error",
    cpp_sources=_CPP,
    functions=["relu_forward"],
    extra_cflags=["-O2"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ext.relu_forward(x)
