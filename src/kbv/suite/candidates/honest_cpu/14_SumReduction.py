"""Honest CPU candidate: sum over one dimension (keepdim) in C++ (load_inline), viewing the
input as (outer, reduced, inner) and accumulating in double."""

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

torch::Tensor sum_keepdim(torch::Tensor x, int64_t dim) {
    TORCH_CHECK(x.device().is_cpu(), "sum_keepdim: expected a CPU tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "sum_keepdim: expected float32");
    const int64_t nd = x.dim();
    if (dim < 0) dim += nd;
    TORCH_CHECK(dim >= 0 && dim < nd, "sum_keepdim: dim out of range");
    auto xc = x.contiguous();
    int64_t outer = 1, inner = 1;
    for (int64_t d = 0; d < dim; ++d) outer *= xc.size(d);
    for (int64_t d = dim + 1; d < nd; ++d) inner *= xc.size(d);
    const int64_t reduced = xc.size(dim);
    std::vector<int64_t> out_shape(xc.sizes().begin(), xc.sizes().end());
    out_shape[dim] = 1;
    auto out = torch::empty(out_shape, xc.options());
    const float* src = xc.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, outer, 1, [&](int64_t begin, int64_t end) {
        std::vector<double> acc(inner);
        for (int64_t o = begin; o < end; ++o) {
            std::fill(acc.begin(), acc.end(), 0.0);
            const float* base = src + o * reduced * inner;
            for (int64_t r = 0; r < reduced; ++r) {
                const float* row = base + r * inner;
                for (int64_t i = 0; i < inner; ++i) acc[i] += row[i];
            }
            for (int64_t i = 0; i < inner; ++i) dst[o * inner + i] = static_cast<float>(acc[i]);
        }
    });
    return out;
}
"""

_ext = load_inline(
    name="kbv_honest_cpu_sum_keepdim",
    cpp_sources=_CPP,
    functions=["sum_keepdim"],
    extra_cflags=["-O2"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ext.sum_keepdim(x, int(self.dim))
