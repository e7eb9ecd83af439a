"""Honest CPU candidate: row-wise softmax over the last dimension in C++ (load_inline), with the
row maximum subtracted before exponentiating so large logits cannot overflow."""

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>

torch::Tensor softmax_lastdim(torch::Tensor x) {
    TORCH_CHECK(x.device().is_cpu(), "softmax_lastdim: expected a CPU tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "softmax_lastdim: expected float32");
    TORCH_CHECK(x.dim() >= 1, "softmax_lastdim: expected at least one dimension");
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    const int64_t cols = xc.size(-1);
    const int64_t rows = cols == 0 ? 0 : xc.numel() / cols;
    const float* src = xc.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float* in = src + r * cols;
            float* o = dst + r * cols;
            float m = -std::numeric_limits<float>::infinity();
            for (int64_t c = 0; c < cols; ++c) m = in[c] > m ? in[c] : m;
            double sum = 0.0;
            for (int64_t c = 0; c < cols; ++c) {
                const float e = std::exp(in[c] - m);
                o[c] = e;
                sum += e;
            }
            const float inv = static_cast<float>(1.0 / sum);
            for (int64_t c = 0; c < cols; ++c) o[c] *= inv;
        }
    });
    return out;
}
"""

_ext = load_inline(
    name="kbv_honest_cpu_softmax",
    cpp_sources=_CPP,
    functions=["softmax_lastdim"],
    extra_cflags=["-O2"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ext.softmax_lastdim(x)
