"""Honest CUDA candidate: LayerNorm over the last dimension, one block per row, two passes (mean,
then mean squared deviation) so large row offsets do not cancel; affine weight and bias."""

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <algorithm>

constexpr int kThreads = 256;

__device__ float block_sum(float v, float* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float r = lane < (kThreads / 32) ? shared[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) r += __shfl_xor_sync(0xffffffffu, r, off);
    __syncthreads();
    return r;
}

__global__ void layer_norm_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                  const float* __restrict__ b, float* __restrict__ y,
                                  int64_t rows, int64_t cols, float eps) {
    __shared__ float shared[kThreads / 32];
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* in = x + row * cols;
        float* out = y + row * cols;
        float s = 0.0f;
        for (int64_t c = threadIdx.x; c < cols; c += kThreads) s += in[c];
        const float mean = block_sum(s, shared) / static_cast<float>(cols);
        float sq = 0.0f;
        for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
            const float d = in[c] - mean;
            sq += d * d;
        }
        const float var = block_sum(sq, shared) / static_cast<float>(cols);
        const float rstd = rsqrtf(var + eps);
        for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
            out[c] = (in[c] - mean) * rstd * w[c] + b[c];
        }
    }
}

torch::Tensor layer_norm_lastdim(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps) {
    TORCH_CHECK(x.is_cuda() && weight.is_cuda() && bias.is_cuda(), "layer_norm_lastdim: expected CUDA tensors");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "layer_norm_lastdim: expected float32");
    const int64_t cols = x.size(-1);
    TORCH_CHECK(weight.numel() == cols && bias.numel() == cols, "layer_norm_lastdim: bad affine shape");
    const c10::cuda::CUDAGuard guard(x.device());
    auto xc = x.contiguous();
    auto w = weight.contiguous();
    auto b = bias.contiguous();
    auto y = torch::empty_like(xc);
    const int64_t rows = cols == 0 ? 0 : xc.numel() / cols;
    if (rows == 0) return y;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20));
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    layer_norm_kernel<<<blocks, kThreads, 0, stream>>>(
        xc.data_ptr<float>(), w.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(),
        rows, cols, static_cast<float>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

_CPP = "torch::Tensor layer_norm_lastdim(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps);"

_ext = load_inline(
    name="kbv_honest_cuda_layer_norm",
    cpp_sources=_CPP,
    cuda_sources=_CUDA,
    functions=["layer_norm_lastdim"],
    extra_cflags=["-O2"],
    extra_cuda_cflags=["-O2"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ext.layer_norm_lastdim(x, self.ln.weight.detach(), self.ln.bias.detach(), float(self.ln.eps))
