"""A CuTeDSL kernel for the FP8 input quantization of trainer/experts/fp8.py: `quantize_rows` (one fp32 scale
per row and 128 columns, k-block-major scales) in one pass over the tokens at memory bandwidth, bit for bit
what the torch function computes on a CUDA device. Each thread holds 8 contiguous elements (one 16-byte load),
16 threads one 128-column block of a row; they reduce the block's absolute maximum with butterfly shuffles,
then each converts its 8 values to e4m3 (one 8-byte store) and the first writes the block's scale.

The arithmetic is torch's on CUDA, op for op: scale = max(amax, 1e-12) * fp32(1/448) (torch divides a CUDA
tensor by a Python number as a product with the number's fp32 reciprocal) and q = e4m3(x / scale) with an
IEEE division, rounded to nearest even (the values are below 464 by construction, where saturating and
torch's conversion agree). A NaN in a block makes its scale and all its values NaN, as in torch.

`cutlass` is imported on first use, as in grouped.py, so that this module imports where the DSL is missing.
Left out: fusing the quantization into the producer of the tokens (the SwiGLU activation, the permutation)."""

import functools

import torch

from trainer.experts.cutedsl import grouped
from trainer.experts.fp8 import BLOCK, E4M3_MAX, TINY, quantize_rows

VEC = 8  # elements per thread: one 16-byte load of bf16
LANES = BLOCK // VEC  # threads per 128-column block
THREADS = 256
ROWS_PER_CTA = THREADS // LANES  # a CTA: 16 rows of one 128-column block


@functools.cache
def _launcher():
    """The @cute.jit launcher of the kernel, built on first use (the DSL's decorators need `cutlass`)."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute

    @cute.kernel
    def kernel(x: cute.Tensor, q: cute.Tensor, scale: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        rows_tile, kb, _ = cute.arch.block_idx()
        M, K = x.shape
        row = rows_tile * ROWS_PER_CTA + tidx // LANES
        lane = tidx % LANES
        chunk = kb * LANES + lane  # this thread's 8 columns
        live = row < M and chunk * VEC < K
        v = cute.make_rmem_tensor((VEC,), x.element_type)
        v.fill(0.0)
        if live:
            src = cute.zipped_divide(x, (1, VEC))[(0, None), (row, chunk)]
            cute.autovec_copy(cute.make_tensor(src.iterator.align(16), src.layout), v)
        xf = v.load().to(cutlass.Float32)
        # Every lane shuffles (an idle one with zeros), so that the full-warp masks hold. NaN-propagating maxima:
        # torch's amax and clamp keep a NaN.
        amax = cutlass.Float32(abs(xf).reduce(cute.ReductionOp.MAX, cutlass.Float32(0.0), 0))
        for i in cutlass.range_constexpr(LANES.bit_length() - 1):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=LANES >> (i + 1)), nan=True)
        s = cute.arch.fmax(amax, cutlass.Float32(TINY), nan=True) * cutlass.Float32(1.0 / E4M3_MAX)
        out = cute.make_rmem_tensor((VEC,), q.element_type)
        out.store((xf / s).to(q.element_type))
        if live:
            dst = cute.zipped_divide(q, (1, VEC))[(0, None), (row, chunk)]
            cute.autovec_copy(out, cute.make_tensor(dst.iterator.align(8), dst.layout))
            if lane == 0:
                scale[kb, row] = s

    @cute.jit
    def launch(x: cute.Tensor, q: cute.Tensor, scale: cute.Tensor, stream: cuda_driver.CUstream):
        M, K = x.shape
        grid = [(M + ROWS_PER_CTA - 1) // ROWS_PER_CTA, (K + BLOCK - 1) // BLOCK, 1]
        kernel(x, q, scale).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    return launch


_COMPILED: dict[tuple, object] = {}


def quantize_rows_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`trainer.experts.fp8.quantize_rows` on the GPU in one kernel: x [M, K] (bf16, fp16 or fp32; K a multiple
    of 8) -> (q [M, K] e4m3, scale [ceil(K/128), M] fp32), bit for bit torch's result on CUDA."""
    if x.dim() != 2 or x.shape[1] % VEC:
        raise ValueError(f"x must be [M, K] with K a multiple of {VEC} (16-byte rows), got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"quantize_rows_kernel takes bf16, fp16 or fp32 tokens, got {x.dtype}")
    M, K = x.shape
    q = grouped._output(M, K, device=x.device, dtype=torch.float8_e4m3fn)
    scale = grouped._output(-(-K // BLOCK), M, device=x.device, dtype=torch.float32)
    if M == 0:
        return q, scale
    x = grouped._aligned(x)
    # A one-row scale [kb, 1] has its stride-1 mode first: another layout, another compile.
    key = (x.dtype, grouped._unit_mode(scale))
    grouped.call(_COMPILED, key, _launcher(), (x, q, scale), compact=(0, 1))
    return q, scale


# A torch custom op, so that torch.compile keeps the kernel an opaque call (as grouped.py's GEMMs): Inductor
# never generates FP8 code itself (the Triton of torch 2.11 on the H200 failed to build a fused e4m3 cast).
# Its CPU kernel is the torch definition, for the host-side tests of the FP8 backend on machines without a GPU.
@torch.library.custom_op("slipstream::cutedsl_quantize_rows", mutates_args=(), device_types="cuda")
def quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_kernel as an op."""
    return quantize_rows_kernel(x)


@quantize_rows_op.register_kernel("cpu")
def _(x):
    return quantize_rows(x)


@quantize_rows_op.register_fake
def _(x):
    M, K = x.shape
    return x.new_empty(M, K, dtype=torch.float8_e4m3fn), x.new_empty(-(-K // BLOCK), M, dtype=torch.float32)
