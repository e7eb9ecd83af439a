"""Honest CPU candidate: ReLU as a C++ loop built with load_inline."""

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

torch::Tensor relu_forward(torch::Tensor x) {
    TORCH_CHECK(x.device().is_cpu(), "relu_forward: expected a CPU tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "relu_forward: expected float32");
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    const float* src = xc.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    const int64_t n = xc.numel();
    at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const float v = src[i];
            dst[i] = v > 0.0f ? v : 0.0f;
        }
    });
    return out;
}
"""

_ext = load_inline(
    name="kbv_honest_cpu_relu",
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
