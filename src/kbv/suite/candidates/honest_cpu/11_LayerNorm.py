"""Honest CPU candidate: LayerNorm over the last dimension in C++ (load_inline). Two passes per
row (mean, then the mean of squared deviations) in double precision, so rows with a large
offset do not cancel."""

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

torch::Tensor layer_norm_lastdim(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps) {
    TORCH_CHECK(x.device().is_cpu(), "layer_norm_lastdim: expected a CPU tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "layer_norm_lastdim: expected float32");
    const int64_t cols = x.size(-1);
    TORCH_CHECK(weight.numel() == cols && bias.numel() == cols, "layer_norm_lastdim: bad affine shape");
    auto xc = x.contiguous();
    auto w = weight.contiguous();
    auto b = bias.contiguous();
    auto out = torch::empty_like(xc);
    const int64_t rows = cols == 0 ? 0 : xc.numel() / cols;
    const float* src = xc.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* bp = b.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float* in = src + r * cols;
            float* o = dst + r * cols;
            double mean = 0.0;
            for (int64_t c = 0; c < cols; ++c) mean += in[c];
            mean /= static_cast<double>(cols);
            double var = 0.0;
            for (int64_t c = 0; c < cols; ++c) {
                const double d = in[c] - mean;
                var += d * d;
            }
            var /= static_cast<double>(cols);
            const double rstd = 1.0 / std::sqrt(var + eps);
            for (int64_t c = 0; c < cols; ++c) {
                o[c] = static_cast<float>((in[c] - mean) * rstd) * wp[c] + bp[c];
            }
        }
    });
    return out;
}
"""

_ext = load_inline(
    name="kbv_honest_cpu_layer_norm",
    cpp_sources=_CPP,
    functions=["layer_norm_lastdim"],
    extra_cflags=["-O2"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ext.layer_norm_lastdim(x, self.ln.weight.detach(), self.ln.bias.detach(), float(self.ln.eps))
