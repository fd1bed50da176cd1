"""The batch-1 FP8 weight stream in a CUDA kernel, against the shipped Triton kernel, one GPU.

`fp8_gemv_bounds_gpu.py` found no Triton kernel that streams Llama-3-8B's FP8 projections at one
row faster than 2.4 TB/s. This builds (torch's cpp_extension, the toolkit's nvcc) a plain CUDA
matrix-vector kernel: a warp takes R rows, each lane loads 16 weight bytes per row a step (one
128-bit load), converts them two at a time with the hardware's e4m3 -> half2 instruction and
accumulates in float32 against x held in shared memory; the warp's sum times the row's scale is
written in bfloat16. With PDL (programmatic dependent launch) a kernel starts while the one ahead
of it finishes, asks L2 for its weight rows (all, their first 512 bytes, or none), and only then
waits for it (x is its output). Timed inside CUDA graphs over weight copies that overflow L2 (TB/s of weight
read) per projection and R, then the four projections of 32 distinct layers in one graph: a
decode step's weights.

    python benchmarks/experiments/fp8_gemv_cuda_gpu.py    # results/fp8_gemv_cuda_gpu.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, graph_us, write_json  # noqa: E402

from spanserve.model import fp8, fp8_kernels  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = (1, 2, 4, 8)
PDL_MODES = {1: "no prefetch", 2: "rows prefetched to L2", 3: "first 512 bytes prefetched"}

CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

template <int R, int PDL>
__global__ void gemv_fp8_kernel(const uint8_t* __restrict__ W, const float* __restrict__ scale,
                                const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y, int N, int K) {
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);
  if (PDL) {
    // The weights do not depend on the kernel ahead: ask L2 for this warp's rows (all of them,
    // PDL 2, or their first 512 bytes, PDL 3; none, PDL 1) while it finishes, then wait for it
    // (x is its output) and let the kernel behind start likewise.
    const int r0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
    if (PDL > 1 && r0 < N)
      for (int r = 0; r < R; ++r)
        for (int k = (threadIdx.x & 31) * 16; k < (PDL == 2 ? K : 512); k += 512)
          asm volatile("prefetch.global.L2 [%0];" ::"l"(W + (size_t)(r0 + r) * K + k));
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
  for (int i = threadIdx.x * 8; i < K; i += blockDim.x * 8)
    *reinterpret_cast<uint4*>(xs + i) = *reinterpret_cast<const uint4*>(x + i);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  if (row0 >= N) return;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
#pragma unroll 2
  for (int k0 = lane * 16; k0 < K; k0 += 512) {
    uint4 w[R];
#pragma unroll
    for (int r = 0; r < R; ++r) w[r] = __ldg(reinterpret_cast<const uint4*>(W + (size_t)(row0 + r) * K + k0));
    float xf[16];
    const uint4 xa = *reinterpret_cast<const uint4*>(xs + k0);
    const uint4 xb = *reinterpret_cast<const uint4*>(xs + k0 + 8);
    const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&xa);
    const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&xb);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float2 a = __bfloat1622float2(pa[j]), b = __bfloat1622float2(pb[j]);
      xf[2 * j] = a.x; xf[2 * j + 1] = a.y; xf[8 + 2 * j] = b.x; xf[8 + 2 * j + 1] = b.y;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const __nv_fp8x2_storage_t* p = reinterpret_cast<const __nv_fp8x2_storage_t*>(&w[r]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(p[j], __NV_E4M3);
        float2 f = __half22float2(*reinterpret_cast<__half2*>(&hr));
        acc[r] = fmaf(f.x, xf[2 * j], acc[r]);
        acc[r] = fmaf(f.y, xf[2 * j + 1], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float v = acc[r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) y[row0 + r] = __float2bfloat16(v * scale[row0 + r]);
  }
}

template <int R>
void launch(int pdl, int blocks, size_t smem, cudaStream_t stream, const uint8_t* W, const float* sc,
            const __nv_bfloat16* x, __nv_bfloat16* y, int N, int K) {
  if (!pdl) {
    gemv_fp8_kernel<R, 0><<<blocks, 256, smem, stream>>>(W, sc, x, y, N, K);
    return;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (pdl == 1) cudaLaunchKernelEx(&cfg, gemv_fp8_kernel<R, 1>, W, sc, x, y, N, K);
  if (pdl == 2) cudaLaunchKernelEx(&cfg, gemv_fp8_kernel<R, 2>, W, sc, x, y, N, K);
  if (pdl == 3) cudaLaunchKernelEx(&cfg, gemv_fp8_kernel<R, 3>, W, sc, x, y, N, K);
}

void gemv_fp8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor y, int64_t rows, int64_t pdl) {
  const int N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 512 == 0 && N % rows == 0, "K a multiple of 512, N of rows");
  const int blocks = (N / rows + 7) / 8;
  const size_t smem = K * sizeof(__nv_bfloat16);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto Wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  auto xp = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  auto yp = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  auto sp = scale.data_ptr<float>();
  switch (rows) {
    case 1: launch<1>(pdl, blocks, smem, stream, Wp, sp, xp, yp, N, K); break;
    case 2: launch<2>(pdl, blocks, smem, stream, Wp, sp, xp, yp, N, K); break;
    case 4: launch<4>(pdl, blocks, smem, stream, Wp, sp, xp, yp, N, K); break;
    case 8: launch<8>(pdl, blocks, smem, stream, Wp, sp, xp, yp, N, K); break;
    default: TORCH_CHECK(false, "rows in 1, 2, 4, 8");
  }
}
"""


def build():
    from torch.utils.cpp_extension import load_inline

    return load_inline("fp8_gemv_cuda", cpp_sources="void gemv_fp8(torch::Tensor x, torch::Tensor w, torch::Tensor "
                       "scale, torch::Tensor y, int64_t rows, int64_t pdl);", cuda_sources=CUDA, functions=["gemv_fp8"],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="fp8_gemv_cuda_gpu.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU and the CUDA toolkit's nvcc")
    t0 = time.perf_counter()
    ext = build()
    built_s = time.perf_counter() - t0
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)

    def cuda_gemv(x, w, rows, pdl=0):
        y = torch.empty(1, w.q.shape[0], dtype=torch.bfloat16, device=dev)
        ext.gemv_fp8(x, w.q, w.scale, y, rows, pdl)
        return y

    res, rows_out, best = {}, [], {}
    for name, (N, K) in SHAPES.items():
        n = max(2, min(32, int(1e9 // (N * K))))  # ~1 GB of weight copies
        wts = [fp8.quantize_weight(torch.randn(N, K, generator=gen, device=dev)) for _ in range(n)]
        xs = [torch.randn(1, K, generator=gen, device=dev).bfloat16() for _ in range(n)]
        ref = (xs[0].double() @ fp8.dequantize(wts[0], torch.float64).T)
        gb = N * K / 1e9
        e = {"shipped": gb / graph_us(lambda i: fp8_kernels.gemv(xs[i], wts[i].q, wts[i].scale), n) * 1e3}
        errs = {}
        for r in ROWS:
            errs[r] = ((cuda_gemv(xs[0], wts[0], r).double() - ref).norm() / ref.norm()).item()
            e[f"cuda, {r} rows a warp"] = gb / graph_us(lambda i, r=r: cuda_gemv(xs[i], wts[i], r), n) * 1e3
        for m, what in PDL_MODES.items():
            assert torch.equal(cuda_gemv(xs[0], wts[0], 1, m), cuda_gemv(xs[0], wts[0], 1))
            e[f"cuda + PDL, {what}"] = gb / graph_us(lambda i, m=m: cuda_gemv(xs[i], wts[i], 1, m), n) * 1e3
        best[name] = max(ROWS, key=lambda r: e[f"cuda, {r} rows a warp"])

        res[name] = {"tb_per_s": e, "rel_err": errs}
        rows_out.append([name, *(e.values()), max(errs.values())])
        print(name, {k: round(v, 2) for k, v in e.items()}, flush=True)
    cols = list(res["qkv"]["tb_per_s"])
    print(format_table(["W", *cols, "max rel err"], rows_out))
    layers = [{k: fp8.quantize_weight(torch.randn(N, K, generator=gen, device=dev)) for k, (N, K) in SHAPES.items()}
              for _ in range(32)]
    xk = {K: torch.randn(1, K, generator=gen, device=dev).bfloat16() for K in (4096, 14336)}
    step = {
        "shipped": graph_us(lambda i: [fp8_kernels.gemv(xk[K], layers[i][k].q, layers[i][k].scale)
                                       for k, (N, K) in SHAPES.items()], 32) * 32 / 1e3,
        "cuda, best rows": graph_us(lambda i: [cuda_gemv(xk[K], layers[i][k], best[k])
                                               for k, (N, K) in SHAPES.items()], 32) * 32 / 1e3,
    }
    for m, what in PDL_MODES.items():
        step[f"cuda + PDL, {what}, 1 row a warp"] = graph_us(
            lambda i, m=m: [cuda_gemv(xk[K], layers[i][k], 1, m) for k, (N, K) in SHAPES.items()], 32) * 32 / 1e3
    gb = 32 * sum(N * K for N, K in SHAPES.values()) / 1e9
    print(format_table(["32 layers' four projections", "ms", "TB/s"], [(k, v, gb / v) for k, v in step.items()]))
    path = write_json(args.out, {"benchmark": "fp8_gemv_cuda_gpu", "device": torch.cuda.get_device_name(0),
                                 "build_s": built_s, "shapes": res, "best_rows": best, "decode_projections_ms": step,
                                 "decode_projection_gb": gb})
    print(f"wrote {path.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
