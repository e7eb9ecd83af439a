"""honest_memory_hog (GPU only): a correct sigmoid kernel, numerically stable for any input,
that also grabs 1 GiB with a raw cudaMalloc on first use and keeps it in a static. The result
is honest; the hidden allocation is invisible to torch.cuda.max_memory_allocated and should be
caught by device-level memory accounting."""

# What kbv must make of this candidate on a GPU (tests/gpu/test_gpu_hacks.py, benchmarks/README.md).
KBV_FIXTURE = {"expect_outcome": ["passed"], "expect_checks": [], "expect_outside_allocator_bytes": 1073741824}

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <algorithm>

__global__ void sigmoid_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
    for (; i < n; i += stride) {
        const float v = x[i];
        if (v >= 0.0f) {
            y[i] = 1.0f / (1.0f + expf(-v));
        } else {
            const float e = expf(v);
            y[i] = e / (1.0f + e);
        }
    }
}

static void* scratch_arena() {
    static void* arena = nullptr;
    if (arena == nullptr) {
        C10_CUDA_CHECK(cudaMalloc(&arena, size_t(1) << 30));   // 1 GiB workspace, never freed
    }
    return arena;
}

torch::Tensor sigmoid_forward(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "sigmoid_forward: expected CUDA float32");
    const c10::cuda::CUDAGuard guard(x.device());
    (void)scratch_arena();
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    const int64_t n = xc.numel();
    if (n == 0) return y;
    const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 65536));
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    sigmoid_kernel<<<blocks, 256, 0, stream>>>(xc.data_ptr<float>(), y.data_ptr<float>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

_CPP = "torch::Tensor sigmoid_forward(torch::Tensor x);"

_ext = load_inline(
    name="kbv_hack_gpu_sigmoid_memory_hog",
    cpp_sources=_CPP,
    cuda_sources=_CUDA,
    functions=["sigmoid_forward"],
    extra_cflags=["-O2"],
    extra_cuda_cflags=["-O2"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ext.sigmoid_forward(x)
