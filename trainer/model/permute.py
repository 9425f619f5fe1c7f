"""Token permutation of the MoE layer: `permute` copies each token's row to its k slots in expert order,
`combine` sums each token's k expert outputs weighted by the router. Both are autograd functions whose
backward is again a gather (no atomics, so results do not depend on scheduling). Two implementations:
`torch` (index_select; runs anywhere, the ground truth) and `triton` (CUDA only: one program per token
moves whole rows with 16-byte vector loads; inductor's gathers load one element per thread because it
cannot prove the gathered columns contiguous, and ran at 0.3-0.7 TB/s on the H200 against 4.2 TB/s for a
copy). `select_permute` resolves `auto | torch | triton`; an explicit choice that cannot run raises."""

from __future__ import annotations

import functools
import importlib.util

import torch

IMPLS = ("auto", "torch", "triton")


class PermuteUnavailable(RuntimeError):
    """An explicitly chosen permutation implementation cannot run on this device; the message says why."""


# Whether triton is installed (it ships with CUDA builds of torch); importing it is left to the first launch.
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _triton_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"the Triton permutation kernels run on CUDA devices only, not {device.type}"
    if not _HAS_TRITON:
        return "triton is not installed"
    return None


def select_permute(name: str, device: torch.device | str) -> str:
    """Resolve `auto | torch | triton` to an implementation that runs on `device`."""
    if name not in IMPLS:
        raise ValueError(f"unknown permutation implementation {name!r}; use one of {', '.join(IMPLS)}")
    reason = _triton_unavailable(torch.device(device))
    if name == "auto":
        return "triton" if reason is None else "torch"
    if name == "triton" and reason is not None:
        raise PermuteUnavailable(f"permute = 'triton' cannot run here: {reason}; use 'auto' or 'torch'")
    return name


# ---------------------------------------------------------------------------------------------- torch


class _PermuteTorch(torch.autograd.Function):
    """rows = x[order // k]; backward sums each token's k slot gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sorted_pos: torch.Tensor, order: torch.Tensor, k: int):
        ctx.save_for_backward(sorted_pos)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (sorted_pos,) = ctx.saved_tensors
        # sorted_pos[s] = where slot s (= token * k + choice) sits in expert order.
        g = grad.index_select(0, sorted_pos).view(-1, ctx.k, grad.shape[-1]).sum(1)
        return g, None, None, None


class _CombineTorch(torch.autograd.Function):
    """out[t] = sum_j weights[t, j] * y_sorted[sorted_pos[t*k + j]] in fp32, rounded once to y's dtype. It keeps
    y_sorted as it came (bf16 under autocast), as the Triton kernel does, not the fp32 products' operand autograd
    would keep; the backward gathers it again."""

    @staticmethod
    def forward(ctx, y_sorted: torch.Tensor, weights: torch.Tensor, sorted_pos: torch.Tensor, order: torch.Tensor):
        ctx.save_for_backward(y_sorted, weights, sorted_pos, order)
        T, k = weights.shape
        y = y_sorted.index_select(0, sorted_pos).view(T, k, -1)
        return (y.float() * weights.unsqueeze(-1)).sum(1).to(y_sorted.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y_sorted, weights, sorted_pos, order = ctx.saved_tensors
        T, k = weights.shape
        # autograd's own backward of the forward's expression, step by step: the products' dtype, the fp32 operand
        g = grad.to(torch.promote_types(torch.float32, weights.dtype)).unsqueeze(1)  # [T, 1, H]
        gy = (g * weights.unsqueeze(-1)).float().to(y_sorted.dtype).view(T * k, -1).index_select(0, order)
        gw = None
        if ctx.needs_input_grad[1]:
            y = y_sorted.index_select(0, sorted_pos).view(T, k, -1)
            gw = (g * y.float()).sum(-1).to(weights.dtype)
        return gy, gw, None, None


# --------------------------------------------------------------------------------------------- triton


@functools.cache
def _kernels():
    """The Triton kernels, compiled lazily so that importing this module never needs triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def scatter_rows(x_ptr, pos_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
        # out[pos[t*K + j]] = x[t]: the token's row is read once and written to its K slots.
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        row = tl.load(x_ptr + t * H + cols, mask=mask)
        for j in tl.static_range(K):
            dst = tl.load(pos_ptr + t * K + j).to(tl.int64)
            tl.store(out_ptr + dst * H + cols, row, mask=mask)

    @triton.jit
    def gather_sum(src_ptr, pos_ptr, w_ptr, out_ptr, H, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
        # out[t] = sum_j w[t*K + j] * src[pos[t*K + j]], accumulated in fp32, rounded once.
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        acc = tl.load(src_ptr + tl.load(pos_ptr + t * K).to(tl.int64) * H + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            acc = acc * tl.load(w_ptr + t * K)
        for j in tl.static_range(1, K):
            src = tl.load(pos_ptr + t * K + j).to(tl.int64)
            v = tl.load(src_ptr + src * H + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + t * K + j)
            acc += v
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def combine_backward(
        g_ptr, y_ptr, pos_ptr, w_ptr, gy_ptr, gw_ptr, H, K: tl.constexpr, NEED_GW: tl.constexpr, BLOCK_H: tl.constexpr
    ):
        # gy[pos[t*K + j]] = w[t*K + j] * g[t];  gw[t*K + j] = <g[t], y[pos[t*K + j]]> (fp32).
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        g = tl.load(g_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            s = tl.load(pos_ptr + t * K + j).to(tl.int64)
            w = tl.load(w_ptr + t * K + j)
            tl.store(gy_ptr + s * H + cols, (g * w).to(gy_ptr.dtype.element_ty), mask=mask)
            if NEED_GW:
                y = tl.load(y_ptr + s * H + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(gw_ptr + t * K + j, tl.sum(g * y, axis=0))

    return scatter_rows, gather_sum, combine_backward


def _launch(H: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps): one program per whole row, 8 bf16 elements (16 bytes) per thread."""
    import triton

    block = triton.next_power_of_2(H)
    return block, max(1, min(16, block // 256))


# Custom ops, so that torch.compile treats each kernel as one opaque call with a known output shape.
@torch.library.custom_op("slipstream::moe_scatter_rows", mutates_args=(), device_types="cuda")
def _scatter_rows(x: torch.Tensor, sorted_pos: torch.Tensor, k: int) -> torch.Tensor:
    T, H = x.shape
    out = x.new_empty(T * k, H)
    block, warps = _launch(H)
    _kernels()[0][(T,)](x, sorted_pos, out, H, K=k, BLOCK_H=block, num_warps=warps)
    return out


@_scatter_rows.register_fake
def _(x: torch.Tensor, sorted_pos: torch.Tensor, k: int) -> torch.Tensor:
    return x.new_empty(x.shape[0] * k, x.shape[1])


@torch.library.custom_op("slipstream::moe_gather_sum", mutates_args=(), device_types="cuda")
def _gather_sum(src: torch.Tensor, sorted_pos: torch.Tensor, weights: torch.Tensor | None, k: int) -> torch.Tensor:
    T, H = sorted_pos.shape[0] // k, src.shape[1]
    out = src.new_empty(T, H)
    block, warps = _launch(H)
    w = weights if weights is not None else sorted_pos  # never read when HAS_W is false
    _kernels()[1][(T,)](src, sorted_pos, w, out, H, K=k, HAS_W=weights is not None, BLOCK_H=block, num_warps=warps)
    return out


@_gather_sum.register_fake
def _(src: torch.Tensor, sorted_pos: torch.Tensor, weights: torch.Tensor | None, k: int) -> torch.Tensor:
    return src.new_empty(sorted_pos.shape[0] // k, src.shape[1])


@torch.library.custom_op("slipstream::moe_combine_backward", mutates_args=(), device_types="cuda")
def _combine_backward(
    grad: torch.Tensor, y_sorted: torch.Tensor, sorted_pos: torch.Tensor, weights: torch.Tensor, need_gw: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    T, k = weights.shape
    H = grad.shape[1]
    gy = y_sorted.new_empty(y_sorted.shape)
    gw = weights.new_empty(T, k)
    block, warps = _launch(H)
    _kernels()[2][(T,)](
        grad, y_sorted, sorted_pos, weights, gy, gw, H, K=k, NEED_GW=need_gw, BLOCK_H=block, num_warps=warps
    )
    return gy, gw


@_combine_backward.register_fake
def _(grad, y_sorted, sorted_pos, weights, need_gw):
    return y_sorted.new_empty(y_sorted.shape), weights.new_empty(weights.shape)


class _PermuteTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sorted_pos: torch.Tensor, k: int):
        ctx.save_for_backward(sorted_pos)
        ctx.k = k
        return _scatter_rows(x.contiguous(), sorted_pos, k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (sorted_pos,) = ctx.saved_tensors
        return _gather_sum(grad.contiguous(), sorted_pos, None, ctx.k), None, None


class _CombineTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted: torch.Tensor, weights: torch.Tensor, sorted_pos: torch.Tensor):
        y_sorted, weights = y_sorted.contiguous(), weights.contiguous()
        ctx.save_for_backward(y_sorted, weights, sorted_pos)
        return _gather_sum(y_sorted, sorted_pos, weights, weights.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y_sorted, weights, sorted_pos = ctx.saved_tensors
        gy, gw = _combine_backward(grad.contiguous(), y_sorted, sorted_pos, weights, ctx.needs_input_grad[1])
        return gy, (gw if ctx.needs_input_grad[1] else None), None


# ----------------------------------------------------------------------------------------------- api


def permute(x: torch.Tensor, sorted_pos: torch.Tensor, order: torch.Tensor, k: int, impl: str) -> torch.Tensor:
    """x [T, H] -> rows [T*k, H] in expert order: rows[sorted_pos[t*k + j]] = x[t]. `order` is the inverse
    permutation of `sorted_pos` (slots in expert order); `impl` is `torch` or `triton` (see select_permute)."""
    if impl == "triton":
        return _PermuteTriton.apply(x, sorted_pos, k)
    return _PermuteTorch.apply(x, sorted_pos, order, k)


def combine(
    y_sorted: torch.Tensor, weights: torch.Tensor, sorted_pos: torch.Tensor, order: torch.Tensor, impl: str
) -> torch.Tensor:
    """y_sorted [T*k, H] in expert order, weights [T, k] fp32 -> out [T, H] in y's dtype:
    out[t] = sum_j weights[t, j] * y_sorted[sorted_pos[t*k + j]], summed in fp32."""
    if impl == "triton":
        return _CombineTriton.apply(y_sorted, weights, sorted_pos)
    return _CombineTorch.apply(y_sorted, weights, sorted_pos, order)
