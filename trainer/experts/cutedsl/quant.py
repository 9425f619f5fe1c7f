"""CuTeDSL kernels for the FP8 quantization of trainer/experts/fp8.py, each bit for bit what the torch function
computes on a CUDA device:

- `quantize_rows_kernel` (the tokens: one fp32 scale per row and 128 columns, k-block-major scales) in one pass
  at memory bandwidth. Each thread holds 8 contiguous elements (one 16-byte load), 16 threads one 128-column
  block of a row; they reduce the block's absolute maximum with butterfly shuffles, then each converts its 8
  values to e4m3 (one 8-byte store) and the first writes the block's scale.
- `quantize_blocks_kernel` (the expert weights, once per optimizer step: one scale per 128x128 block) in one
  pass that also writes the transposed copy the dgrad GEMMs read. A CTA of 8 warps takes one block, 16 rows and
  4 columns a thread (each warp reads 32 consecutive elements of a row at a time), reduces its maximum through
  shuffles and shared memory, writes the e4m3 bytes and, through a transposed byte tile in shared memory, their
  transpose. torch's function makes a dozen passes over each chunk of 8 experts (12.3 ms for the 128-expert
  pack on an H100).
- `quantize_both_kernel` (a tensor the backward quantizes both ways: x, the activation, grad_y, grad_h) writes
  what quantize_rows_kernel writes and what trainer.experts.fp8.quantize_token_blocks computes (the weight
  gradient's operand: one scale per feature and 128-token block of one expert, tokens contiguous), reading the
  tensor once. A CTA of 512 threads takes 128 features of a padded 128-token block, each thread 4 tokens of 8
  features (16-byte loads): the feature maxima go through shuffles and shared memory; the row maxima through
  shuffles and the rows' e4m3 bytes straight out to q in 8-byte stores, while the other warps reach the barrier;
  the feature-scaled e4m3 bytes go through a swizzled transposed tile out to q_t in 16-byte stores. Every source row lies in exactly one padded block, so
  each row is quantized once. Its divisions take one reciprocal per scale and two residual steps per element
  (`quotient`), the bits of IEEE division without its per-element reciprocal, range check and slow-path branch;
  4 tokens a thread (64 registers) let 2 CTAs of 512 threads share an SM. On an H100 it went from 0.72 ms for x
  [131072, 2048] (8 tokens a thread, 256 threads, divisions) to 0.46 ms, 2.35 TB/s, against 0.29 ms for the
  row quantization alone. Two more kinds of it (`BOTH_KINDS`) quantize the SwiGLU's values, computed in fp32 in
  the same pass from their inputs, so that they are never written: the activation silu(gate) * up from h =
  gate|up (`swiglu_both_kernel`, the forward), and grad_h = (grad gate, grad up) from grad_act and h
  (`swiglu_grad_both_kernel`, the backward; the CTAs of a token block's gate and up features run side by side
  and share their reads of grad_act and h through L2).

The arithmetic is torch's on CUDA, op for op: scale = max(amax, 1e-12) * fp32(1/448) (torch divides a CUDA
tensor by a Python number as a product with the number's fp32 reciprocal) and q = e4m3(x / scale) with an
IEEE division, rounded to nearest even (the values are below 464 by construction, where saturating and
torch's conversion agree). A NaN in a block makes its scale and all its values NaN, as in torch.

`cutlass` is imported on first use, as in grouped.py, so that this module imports where the DSL is missing.
Left out: fusing the quantization into the permutation's gather."""

import functools

import torch

from trainer.experts.cutedsl import grouped
from trainer.experts.fp8 import (
    BLOCK,
    E4M3_MAX,
    TINY,
    quantize_expert_weights,
    quantize_rows,
    quantize_token_blocks,
    swiglu,
    swiglu_grad,
)

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


WARPS = 8  # a CTA of the block quantizer: 8 warps, one 128x128 block, 16 rows and 4 columns a thread


@functools.cache
def _blocks_launcher():
    """The @cute.jit launcher of the weight block quantizer, built on first use."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass.memory import SmemAllocator

    rows_per_thread = BLOCK // WARPS
    cols_per_thread = BLOCK // 32

    @cute.kernel
    def kernel(w: cute.Tensor, q: cute.Tensor, q_t: cute.Tensor, scale: cute.Tensor, scale_t: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        nb, kb, e = cute.arch.block_idx()
        _, N, K = w.shape
        warp = tidx // 32
        lane = tidx % 32
        n0 = nb * BLOCK
        k0 = kb * BLOCK
        smem = SmemAllocator()
        # The block's e4m3 bytes transposed (k, n), rows padded by 4 bytes against bank conflicts; the 8 warps'
        # maxima.
        tile = smem.allocate_tensor(cutlass.Uint8, cute.make_layout((BLOCK, BLOCK + 4), stride=(BLOCK + 4, 1)), 16)
        maxima = smem.allocate_tensor(cutlass.Float32, cute.make_layout(WARPS), 16)
        v = cute.make_rmem_tensor((rows_per_thread * cols_per_thread,), cutlass.Float32)
        v.fill(0.0)
        # Element (j, i) of this thread: row warp + 8 j, column lane + 32 i of the block (a warp reads 32
        # consecutive elements of a row at a time).
        for j in cutlass.range_constexpr(rows_per_thread):
            for i in cutlass.range_constexpr(cols_per_thread):
                r = n0 + warp + WARPS * j
                c = k0 + lane + 32 * i
                if r < N and c < K:
                    v[j * cols_per_thread + i] = cutlass.Float32(w[e, r, c])
        xf = v.load()
        amax = cutlass.Float32(abs(xf).reduce(cute.ReductionOp.MAX, cutlass.Float32(0.0), 0))
        for i in cutlass.range_constexpr(5):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=16 >> i), nan=True)
        if lane == 0:
            maxima[warp] = amax
        cute.arch.barrier()
        amax = maxima[0]
        for i in cutlass.range_constexpr(1, WARPS):
            amax = cute.arch.fmax(amax, maxima[i], nan=True)
        s = cute.arch.fmax(amax, cutlass.Float32(TINY), nan=True) * cutlass.Float32(1.0 / E4M3_MAX)
        out = cute.make_rmem_tensor((rows_per_thread * cols_per_thread,), q.element_type)
        out.store((xf / s).to(q.element_type))
        bits = cute.recast_tensor(out, cutlass.Uint8)
        q_bits = cute.recast_tensor(q, cutlass.Uint8)
        for j in cutlass.range_constexpr(rows_per_thread):
            for i in cutlass.range_constexpr(cols_per_thread):
                r = warp + WARPS * j
                c = lane + 32 * i
                tile[c, r] = bits[j * cols_per_thread + i]
                if n0 + r < N and k0 + c < K:
                    q_bits[e, n0 + r, k0 + c] = bits[j * cols_per_thread + i]
        cute.arch.barrier()
        # The transpose: consecutive threads write consecutive bytes of a row of q_t.
        qt_bits = cute.recast_tensor(q_t, cutlass.Uint8)
        for it in cutlass.range_constexpr(BLOCK * BLOCK // (WARPS * 32)):
            idx = tidx + it * WARPS * 32
            c = idx // BLOCK
            r = idx % BLOCK
            if k0 + c < K and n0 + r < N:
                qt_bits[e, k0 + c, n0 + r] = tile[c, r]
        if tidx == 0:
            scale[e, nb, kb] = s
            scale_t[e, kb, nb] = s

    @cute.jit
    def launch(
        w: cute.Tensor,
        q: cute.Tensor,
        q_t: cute.Tensor,
        scale: cute.Tensor,
        scale_t: cute.Tensor,
        stream: cuda_driver.CUstream,
    ):
        E, N, K = w.shape
        grid = [(N + BLOCK - 1) // BLOCK, (K + BLOCK - 1) // BLOCK, E]
        kernel(w, q, q_t, scale, scale_t).launch(grid=grid, block=[WARPS * 32, 1, 1], stream=stream)

    return launch


_COMPILED_BLOCKS: dict[tuple, object] = {}


def quantize_blocks_kernel(w: torch.Tensor, out: tuple[torch.Tensor, ...]) -> None:
    """`trainer.experts.fp8.quantize_blocks` of w [E, N, K] (fp32 or bf16) and its transpose, on the GPU in one
    pass: into out = (q [E, N, K], scale [E, N/128, K/128], q^T [E, K, N], scale^T [E, K/128, N/128]), bit for
    bit what the torch function computes (and the transposes of its result)."""
    if w.dim() != 3 or w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"w must be [E, N, K] fp32 or bf16, got {tuple(w.shape)} {w.dtype}")
    q, scale, q_t, scale_t = out
    if w.numel() == 0:
        return
    w = grouped._aligned(w)
    key = (w.dtype,)
    grouped.call(_COMPILED_BLOCKS, key, _blocks_launcher(), (w, q, q_t, scale, scale_t))


def quantize_expert_weights_fast(
    gate_up: torch.Tensor, down: torch.Tensor, out: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """`trainer.experts.fp8.quantize_expert_weights` (same pack, same bits) by quantize_blocks_kernel on a CUDA
    device: one pass over each weight instead of torch's dozen passes per chunk of 8 experts; elsewhere the torch
    function."""
    if not gate_up.is_cuda:
        return quantize_expert_weights(gate_up, down, out)
    if out is None:
        pack: list[torch.Tensor] = []
        for w in (gate_up, down):
            E, N, K = w.shape
            nb, kb = -(-N // BLOCK), -(-K // BLOCK)
            new = functools.partial(torch.empty, device=w.device)
            pack += [
                new(E, N, K, dtype=torch.float8_e4m3fn),
                new(E, nb, kb, dtype=torch.float32),
                new(E, K, N, dtype=torch.float8_e4m3fn),
                new(E, kb, nb, dtype=torch.float32),
            ]
        out = tuple(pack)
    for i, w in enumerate((gate_up, down)):
        quantize_blocks_kernel(w.detach(), out[4 * i : 4 * i + 4])
    return out


# A CTA of the two-way quantizer: one 128-feature block of one padded 128-token block, 512 threads, each 4
# consecutive tokens of 8 consecutive features (one 16-byte load per token of bf16, two of fp32). Within a warp,
# bits 0-3 of the thread index pick the feature lane (the 16 lanes of a token, whose row maximum is a butterfly
# over offsets 8 .. 1) and bit 4 the token group (the column maximum's one shuffle), so that a warp reads 2 token
# rows of 128 features at a time. A thread holds 32 values, so that a CTA fits in 64 registers a thread.
BOTH_THREADS = 512
BOTH_ROWS = 4  # tokens a thread: 4 e4m3 bytes, one 32-bit word of the transposed tile
BOTH_WARPS = BOTH_THREADS // 32
BOTH_CTAS = 2  # CTAs an SM


# What the two-way quantizer quantizes: "copy" its input x [R, F] itself; "swiglu" the activation silu(gate) * up
# of x = h = gate|up [R, 2F] (the forward's gate_up output); "swiglu_grad" grad_h = (the gate's, the up's gradient)
# [R, 2I] of x = grad_act [R, I] and x2 = h [R, 2I] (the backward's). The SwiGLU values are computed in fp32 and
# quantized as they are, never rounded to bf16 (trainer.experts.fp8.swiglu / swiglu_grad in torch).
BOTH_KINDS = ("copy", "swiglu", "swiglu_grad")

# How the SwiGLU kinds compute sigmoid(g) = 1 / (1 + e^-g): "ieee" by IEEE division, torch's arithmetic (the
# activation is torch's fp32 silu(gate) * up bit for bit); "rcp" by the hardware's approximate reciprocal and one
# Newton step, within an ulp of it, without the division's range check and slow-path branch an element, which
# make the fused kernels bound by arithmetic (1.5-1.8 TB/s against the copy kind's 2.3). "rcp" is an experiment
# until a GPU has timed it and run the fused kernels' test with it (bench/cutedsl_check.py --quant-only).
SIGMOID = "ieee"
SIGMOIDS = ("ieee", "rcp")


@functools.cache
def _both_launcher(kind: str = "copy", sigmoid_by: str = "ieee"):
    """The @cute.jit launcher of the two-way quantizer (quantize_rows and quantize_token_blocks in one pass over
    the tokens) of `kind` (BOTH_KINDS), its sigmoid by `sigmoid_by` (SIGMOIDS), built on first use."""
    if kind not in BOTH_KINDS:
        raise ValueError(f"the two-way quantizer's kind {kind!r} is not one of {BOTH_KINDS}")
    if sigmoid_by not in SIGMOIDS:
        raise ValueError(f"quant.SIGMOID = {sigmoid_by!r} is not one of {SIGMOIDS}")
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass.memory import SmemAllocator

    words = BLOCK // BOTH_ROWS  # 32-bit words (4 tokens of one feature) of a feature's 128 tokens
    store = 16 // BOTH_ROWS  # words of one 16-byte store of q_t
    stores = BLOCK // 16  # 16-byte stores of a feature's 128 tokens

    def quotient(x, s, y):
        """x / s rounded to nearest, the bits of IEEE division, from y = 1 / s (an IEEE division, once per scale):
        q0 = x y is within 1.5 units in the last place of x / s, one residual step (r = x - s q by an FMA, exact)
        brings it within one, and a second gives the correctly rounded quotient (Markstein's theorem; NVIDIA's
        division takes the same two steps after its reciprocal estimate, for each element: a MUFU reciprocal, a
        range check and a slow-path branch, which made this kernel's 64 divisions a thread cost more than its
        memory traffic). Where r0 is 0, q0 is exact (and keeps the sign of -0 / s, which the steps would turn to
        +0); where the steps give NaN, s is infinite or NaN, and q0 is what the division gives (x / inf = 0, NaN
        stays NaN). Residuals that underflow would need |x / s| below 1e-22, far below e4m3's smallest step."""
        q0 = x * y
        r0 = cute.math.fma(-s, q0, x)
        q1 = cute.math.fma(r0, y, q0)
        q2 = cute.math.fma(cute.math.fma(-s, q1, x), y, q1)
        q2 = cutlass.Float32(cutlass.select_(r0 == cutlass.Float32(0.0), q0, q2))
        return cutlass.Float32(cutlass.select_(cute.math.isnan(q2), q0, q2))

    def load(t, row, c, dst):
        """dst <- the 8 elements of chunk c (columns 8 c .. 8 c + 7) of row `row` of t, one 16-byte load."""
        src = cute.zipped_divide(t, (1, VEC))[(0, None), (row, c)]
        cute.autovec_copy(cute.make_tensor(src.iterator.align(16), src.layout), dst)

    def sigmoid(g):
        """1 / (1 + e^-g) of fp32 g; the exponential is libdevice's (as CUDA's expf). "ieee": an IEEE division,
        torch's silu_backward's arithmetic. "rcp": the hardware's reciprocal estimate (rcp.approx.ftz) and one
        Newton step; the denominator is at least 1, so the estimate is normal or, past 2^126 (g below -87), flushed
        to 0, where the step (inf x 0) would give NaN and is skipped."""
        d = cutlass.Float32(1.0) + cute.math.exp(-g)
        if sigmoid_by == "ieee":
            return cutlass.Float32(1.0) / d
        r0 = cute.arch.rcp_approx(d)
        r1 = cute.math.fma(r0, cute.math.fma(-d, r0, cutlass.Float32(1.0)), r0)
        return cutlass.Float32(cutlass.select_(r0 == cutlass.Float32(0.0), r0, r1))

    def silu(g):
        """g sigmoid(g): "ieee" as torch's silu, g / (1 + e^-g); "rcp" g times the sigmoid above."""
        if sigmoid_by == "ieee":
            return g / (cutlass.Float32(1.0) + cute.math.exp(-g))
        return g * sigmoid(g)

    @cute.kernel
    def kernel(
        x: cute.Tensor,
        x2: cute.Tensor,
        q: cute.Tensor,
        scale: cute.Tensor,
        q_t: cute.Tensor,
        scale_t: cute.Tensor,
        block_src: cute.Tensor,
        block_rows: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        kb, b, _ = cute.arch.block_idx()
        _, F = q.shape  # the quantized features: x's, the activation's (half h's), grad_h's (twice grad_act's)
        warp = tidx // 32
        lane = tidx % LANES  # this thread's features: 8 lane .. 8 lane + 7 of the block
        group = tidx // LANES  # its tokens: 4 group .. 4 group + 3 of the block
        half = group % 2  # which of the warp's two groups
        chunk = kb * LANES + lane
        live = chunk * VEC < F  # F is a multiple of 8: a thread's 8 features are all in or all out
        src = block_src[b]
        n = block_rows[b]
        smem = SmemAllocator()
        # The block's e4m3 bytes transposed, a feature's 128 tokens as 32 words of 4 tokens, word w of feature f
        # stored at w ^ (2 (f // 8)): a warp's stores (2 groups, 16 lanes) fall in 32 banks. The XOR keeps the
        # pairs of words (8 bytes) together but swaps the two halves of a 16-byte chunk where f // 8 is odd: the
        # reader of a chunk swaps them back. Then each warp's column maxima, the column scales and the row scales.
        tile = smem.allocate_tensor(cutlass.Uint32, cute.make_layout((BLOCK, words), stride=(words, 1)), 16)
        maxima = smem.allocate_tensor(cutlass.Float32, cute.make_layout((BOTH_WARPS, BLOCK), stride=(BLOCK, 1)), 16)
        col_scales = smem.allocate_tensor(cutlass.Float32, cute.make_layout(BLOCK), 16)
        row_scales = smem.allocate_tensor(cutlass.Float32, cute.make_layout(BLOCK), 16)
        # Padding tokens and features past F are zeros (the SwiGLU of zeros and its gradient are zeros too).
        xf = cute.make_rmem_tensor(cute.make_layout((BOTH_ROWS, VEC), stride=(VEC, 1)), cutlass.Float32)
        if cutlass.const_expr(kind == "copy"):
            v = cute.make_rmem_tensor(cute.make_layout((BOTH_ROWS, VEC), stride=(VEC, 1)), x.element_type)
            v.fill(0.0)
            for j in cutlass.range_constexpr(BOTH_ROWS):
                r = group * BOTH_ROWS + j
                if r < n and live:
                    load(x, src + r, chunk, v[j, None])
            xf.store(v.load().to(cutlass.Float32))
        elif cutlass.const_expr(kind == "swiglu"):
            # x = h [R, 2F]: this thread's gate chunk and the up chunk F / 8 chunks further.
            for j in cutlass.range_constexpr(BOTH_ROWS):
                r = group * BOTH_ROWS + j
                gate = cute.make_rmem_tensor((VEC,), x.element_type)
                up = cute.make_rmem_tensor((VEC,), x.element_type)
                gate.fill(0.0)
                up.fill(0.0)
                if r < n and live:
                    load(x, src + r, chunk, gate)
                    load(x, src + r, chunk + F // VEC, up)
                g = gate.load().to(cutlass.Float32)
                u = up.load().to(cutlass.Float32)
                for i in cutlass.range_constexpr(VEC):
                    xf[j, i] = silu(g[i]) * u[i]
        else:
            # x = grad_act [R, I], x2 = h [R, 2I]; grad_h's features 0 .. I-1 are the gate's gradient, I .. 2I-1
            # the up's: a thread's 8 features are one or the other (I is a multiple of 8), its column c of the
            # activation the same for both.
            inter = x.shape[1]
            on_gate = chunk * VEC < inter
            c = chunk - cutlass.Int32(cutlass.select_(on_gate, 0, inter // VEC))
            for j in cutlass.range_constexpr(BOTH_ROWS):
                r = group * BOTH_ROWS + j
                grad = cute.make_rmem_tensor((VEC,), x.element_type)
                gate = cute.make_rmem_tensor((VEC,), x2.element_type)
                up = cute.make_rmem_tensor((VEC,), x2.element_type)
                grad.fill(0.0)
                gate.fill(0.0)
                up.fill(0.0)
                if r < n and live:
                    load(x, src + r, c, grad)
                    load(x2, src + r, c, gate)
                    load(x2, src + r, c + inter // VEC, up)
                a = grad.load().to(cutlass.Float32)
                g = gate.load().to(cutlass.Float32)
                u = up.load().to(cutlass.Float32)
                for i in cutlass.range_constexpr(VEC):
                    sig = sigmoid(g[i])
                    # d/d gate = grad_act up sig (1 + gate (1 - sig)); d/d up = grad_act silu(gate) = grad_act gate sig
                    dgate = a[i] * u[i] * sig * (cutlass.Float32(1.0) + g[i] * (cutlass.Float32(1.0) - sig))
                    dup = a[i] * (g[i] * sig)
                    xf[j, i] = cutlass.Float32(cutlass.select_(on_gate, dgate, dup))
        # The columns first, so that the row work below covers the wait at the barrier: each feature's maximum
        # over the thread's 4 tokens and the warp's 2 groups (a shuffle); each group then writes 4 of the 8 maxima
        # (one 16-byte store), the other warps' reach them through shared memory. NaN-propagating maxima: torch's
        # amax and clamp keep a NaN.
        cm = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        for i in cutlass.range_constexpr(VEC):
            m = cutlass.Float32(0.0)
            for j in cutlass.range_constexpr(BOTH_ROWS):
                m = cute.arch.fmax(m, abs(xf[j, i]), nan=True)
            cm[i] = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=LANES), nan=True)
        mine = cute.make_rmem_tensor((VEC // 2,), cutlass.Float32)
        for i in cutlass.range_constexpr(VEC // 2):
            mine[i] = cutlass.Float32(cutlass.select_(half == 1, cm[VEC // 2 + i], cm[i]))
        held = cute.zipped_divide(maxima, (1, VEC // 2))[(0, None), (warp, lane * 2 + half)]
        cute.autovec_copy(mine, cute.make_tensor(held.iterator.align(16), held.layout))
        # The rows: each token's maximum over the thread's 8 features, then the 16 lanes (shuffles), its scale, its
        # e4m3 bytes straight out to q. Every lane shuffles, so that the full-warp masks hold.
        for j in cutlass.range_constexpr(BOTH_ROWS):
            m = cutlass.Float32(0.0)
            for i in cutlass.range_constexpr(VEC):
                m = cute.arch.fmax(m, abs(xf[j, i]), nan=True)
            for k in cutlass.range_constexpr(LANES.bit_length() - 1):
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=LANES >> (k + 1)), nan=True)
            s = cute.arch.fmax(m, cutlass.Float32(TINY), nan=True) * cutlass.Float32(1.0 / E4M3_MAX)
            y = cutlass.Float32(1.0) / s
            qr = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            for i in cutlass.range_constexpr(VEC):
                qr[i] = quotient(xf[j, i], s, y)
            out = cute.make_rmem_tensor((VEC,), q.element_type)
            out.store(qr.load().to(q.element_type))
            r = group * BOTH_ROWS + j
            if r < n and live:
                dst = cute.zipped_divide(q, (1, VEC))[(0, None), (src + r, chunk)]
                cute.autovec_copy(out, cute.make_tensor(dst.iterator.align(8), dst.layout))
            if lane == 0:
                row_scales[r] = s
        cute.arch.barrier()
        # A quarter of the threads finish the column scales, another quarter write the row scales (128 consecutive
        # floats).
        if tidx < BLOCK:
            amax = maxima[0, tidx]
            for w in cutlass.range_constexpr(1, BOTH_WARPS):
                amax = cute.arch.fmax(amax, maxima[w, tidx], nan=True)
            s = cute.arch.fmax(amax, cutlass.Float32(TINY), nan=True) * cutlass.Float32(1.0 / E4M3_MAX)
            col_scales[tidx] = s
            if kb * BLOCK + tidx < F:
                scale_t[b, kb * BLOCK + tidx] = s
        elif tidx < 2 * BLOCK:
            r = tidx - BLOCK
            if r < n:
                scale[kb, src + r] = row_scales[r]
        cute.arch.barrier()
        # Every token of the block, padding too (0 / s, NaN where s is), as torch: 4 tokens of a feature, a word.
        # The thread's 8 column scales come in two 16-byte loads.
        cs = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        mine_s = cute.zipped_divide(col_scales, (VEC,))[(None, lane)]
        cute.autovec_copy(cute.make_tensor(mine_s.iterator.align(16), mine_s.layout), cs)
        for i in cutlass.range_constexpr(VEC):
            y = cutlass.Float32(1.0) / cs[i]
            qc = cute.make_rmem_tensor((BOTH_ROWS,), cutlass.Float32)
            for j in cutlass.range_constexpr(BOTH_ROWS):
                qc[j] = quotient(xf[j, i], cs[i], y)
            out = cute.make_rmem_tensor((BOTH_ROWS,), q_t.element_type)
            out.store(qc.load().to(q_t.element_type))
            tile[lane * VEC + i, group ^ (lane * 2)] = cute.recast_tensor(out, cutlass.Uint32)[0]
        cute.arch.barrier()
        # Out to q_t: 16 consecutive tokens of a feature a thread (one 16-byte store), a feature's 128 tokens by 8
        # consecutive threads, which read its 8 chunks of the tile (a quarter-warp's 16-byte loads, 32 banks).
        qt_bytes = cute.zipped_divide(cute.recast_tensor(q_t, cutlass.Uint8), (1, 16))
        tile_stores = cute.zipped_divide(tile, (1, store))
        for it in cutlass.range_constexpr(BLOCK * stores // BOTH_THREADS):
            f = (tidx + it * BOTH_THREADS) // stores
            k = (tidx + it * BOTH_THREADS) % stores
            if kb * BLOCK + f < F:
                words_in = cute.make_rmem_tensor((store,), cutlass.Uint32)
                kept = tile_stores[(0, None), (f, k ^ (f // VEC // 2))]
                cute.autovec_copy(cute.make_tensor(kept.iterator.align(16), kept.layout), words_in)
                swap = f // VEC % 2 == 1
                chunk_out = cute.make_rmem_tensor((store,), cutlass.Uint32)
                for t in cutlass.range_constexpr(store):
                    chunk_out[t] = cutlass.Uint32(cutlass.select_(swap, words_in[t ^ 2], words_in[t]))
                dst = qt_bytes[(0, None), (kb * BLOCK + f, b * stores + k)]
                cute.autovec_copy(
                    cute.recast_tensor(chunk_out, cutlass.Uint8), cute.make_tensor(dst.iterator.align(16), dst.layout)
                )

    @cute.jit
    def launch(
        x: cute.Tensor,
        x2: cute.Tensor,
        q: cute.Tensor,
        scale: cute.Tensor,
        q_t: cute.Tensor,
        scale_t: cute.Tensor,
        block_src: cute.Tensor,
        block_rows: cute.Tensor,
        stream: cuda_driver.CUstream,
    ):
        _, F = q.shape
        grid = [(F + BLOCK - 1) // BLOCK, block_src.shape[0], 1]
        # 2 CTAs an SM (32 warps): at most 64 registers a thread, which its 32 values fit without spills (sm_90a);
        # the cap of 3 CTAs (40) spills them. Shared memory is 25 KB a CTA. The carveout (percent of the shared
        # memory, against L1, which these streaming loads do not reuse) is given so that the compile asks no device.
        kernel(x, x2, q, scale, q_t, scale_t, block_src, block_rows).launch(
            grid=grid,
            block=[BOTH_THREADS, 1, 1],
            stream=stream,
            min_blocks_per_mp=BOTH_CTAS,
            preferred_smem_carveout=50,
        )

    return launch


_COMPILED_BOTH: dict[tuple, object] = {}


def _quantize_both(
    kind: str, x: torch.Tensor, x2: torch.Tensor, F: int, block_src: torch.Tensor, block_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two-way quantizer of `kind` over inputs x, x2 (checked by the caller), F quantized features."""
    R = x.shape[0]
    P = block_src.shape[0] * BLOCK
    q = grouped._output(R, F, device=x.device, dtype=torch.float8_e4m3fn)
    scale = grouped._output(-(-F // BLOCK), R, device=x.device, dtype=torch.float32)
    q_t = grouped._output(F, P, device=x.device, dtype=torch.float8_e4m3fn)
    scale_t = grouped._output(P // BLOCK, F, device=x.device, dtype=torch.float32)
    if R and F:
        x, x2 = grouped._aligned(x), grouped._aligned(x2)
        # A one-row scale [kb, 1] has its stride-1 mode first: another layout, another compile.
        sigmoid = SIGMOID if kind != "copy" else "ieee"  # the copy kind has no sigmoid: one compile
        key = (kind, sigmoid, x.dtype, x2.dtype, grouped._unit_mode(scale))
        tensors = (x, x2, q, scale, q_t, scale_t, block_src, block_rows)
        grouped.call(_COMPILED_BOTH, key, _both_launcher(kind, sigmoid), tensors, compact=(0, 1, 2, 4, 5))
    elif F:  # no tokens: every block of q_t all zeros, as the torch function gives
        q_t.zero_()
        scale_t.fill_(TINY).mul_(1 / E4M3_MAX)
    return q, scale, q_t, scale_t


def _check_tokens(name: str, x: torch.Tensor, features: str) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} must be [R, {features}] bf16, fp16 or fp32, got {tuple(x.shape)} {x.dtype}")
    if x.shape[1] % VEC:
        raise ValueError(
            f"{name} must be [R, {features}] with {features} a multiple of {VEC} (16-byte rows; pad the features),"
            f" got {tuple(x.shape)}"
        )


def quantize_both_kernel(
    x: torch.Tensor, block_src: torch.Tensor, block_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(*quantize_rows(x), *quantize_token_blocks(x, block_src, block_rows))` of trainer.experts.fp8 on the GPU in
    one pass over x (bf16, fp16 or fp32 [R, F], F a multiple of 8), over the padded blocks of token_blocks: (q [R,
    F], scale [ceil(F/128), R], q_t [F, P], scale_t [P / 128, F]), bit for bit what the torch functions compute.
    The blocks come from the caller, once for all the tensors over the same rows: made here, their two dozen
    small torch ops cost more host time per call than the kernel takes on the GPU."""
    _check_tokens("x", x, "F")
    return _quantize_both("copy", x, x, x.shape[1], block_src, block_rows)


def swiglu_both_kernel(
    h: torch.Tensor, block_src: torch.Tensor, block_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_both_kernel of the activation silu(gate) * up of h = gate|up [R, 2I] (I a multiple of 8), computed
    in fp32 in the same pass: the activation is never written, in bf16 or otherwise. What
    `quantize_both(trainer.experts.fp8.swiglu(h))` computes, up to the last bit of the exponential."""
    _check_tokens("h", h, "2I")
    if h.shape[1] % (2 * VEC):
        raise ValueError(f"h must be gate|up [R, 2I] with I a multiple of {VEC}, got {tuple(h.shape)}")
    return _quantize_both("swiglu", h, h, h.shape[1] // 2, block_src, block_rows)


def swiglu_grad_both_kernel(
    grad_act: torch.Tensor, h: torch.Tensor, block_src: torch.Tensor, block_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_both_kernel of grad_h [R, 2I] = (grad gate, grad up), the SwiGLU's backward of grad_act [R, I]
    through h = gate|up [R, 2I], computed in fp32 in the same pass (grad_h is never written). What
    `quantize_both(trainer.experts.fp8.swiglu_grad(grad_act, h))` computes, up to the last bit of the
    exponential."""
    _check_tokens("grad_act", grad_act, "I")
    _check_tokens("h", h, "2I")
    R, inter = grad_act.shape
    if tuple(h.shape) != (R, 2 * inter):
        raise ValueError(
            f"h must be [R, 2I] = {(R, 2 * inter)} beside grad_act {tuple(grad_act.shape)}, got {tuple(h.shape)}"
        )
    return _quantize_both("swiglu_grad", grad_act, h, 2 * inter, block_src, block_rows)


def _both_fake(x: torch.Tensor, F: int, block_src: torch.Tensor) -> tuple[torch.Tensor, ...]:
    R = x.shape[0]
    P = block_src.shape[0] * BLOCK
    return (
        x.new_empty(R, F, dtype=torch.float8_e4m3fn),
        x.new_empty(-(-F // BLOCK), R, dtype=torch.float32),
        x.new_empty(F, P, dtype=torch.float8_e4m3fn),
        x.new_empty(P // BLOCK, F, dtype=torch.float32),
    )


def _both_reference(x: torch.Tensor, block_src: torch.Tensor, block_rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (*quantize_rows(x), *quantize_token_blocks(x, block_src, block_rows))


# The three as custom ops (opaque to torch.compile, as quantize_rows_op), their CPU kernels the torch functions.
@torch.library.custom_op("slipstream::cutedsl_quantize_both", mutates_args=(), device_types="cuda")
def quantize_both_op(
    x: torch.Tensor, block_src: torch.Tensor, block_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_both_kernel as an op."""
    return quantize_both_kernel(x, block_src, block_rows)


@quantize_both_op.register_kernel("cpu")
def _(x, block_src, block_rows):
    return _both_reference(x, block_src, block_rows)


@quantize_both_op.register_fake
def _(x, block_src, block_rows):
    return _both_fake(x, x.shape[1], block_src)


@torch.library.custom_op("slipstream::cutedsl_swiglu_both", mutates_args=(), device_types="cuda")
def swiglu_both_op(
    h: torch.Tensor, block_src: torch.Tensor, block_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """swiglu_both_kernel as an op."""
    return swiglu_both_kernel(h, block_src, block_rows)


@swiglu_both_op.register_kernel("cpu")
def _(h, block_src, block_rows):
    return _both_reference(swiglu(h), block_src, block_rows)


@swiglu_both_op.register_fake
def _(h, block_src, block_rows):
    return _both_fake(h, h.shape[1] // 2, block_src)


@torch.library.custom_op("slipstream::cutedsl_swiglu_grad_both", mutates_args=(), device_types="cuda")
def swiglu_grad_both_op(
    grad_act: torch.Tensor, h: torch.Tensor, block_src: torch.Tensor, block_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """swiglu_grad_both_kernel as an op."""
    return swiglu_grad_both_kernel(grad_act, h, block_src, block_rows)


@swiglu_grad_both_op.register_kernel("cpu")
def _(grad_act, h, block_src, block_rows):
    return _both_reference(swiglu_grad(grad_act, h), block_src, block_rows)


@swiglu_grad_both_op.register_fake
def _(grad_act, h, block_src, block_rows):
    return _both_fake(grad_act, 2 * grad_act.shape[1], block_src)
