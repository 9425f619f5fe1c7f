"""MoE token permutation: the torch and Triton implementations of permute / combine compute the same
function and gradients as plain gathers (Triton through its CPU interpreter where triton is installed),
and the implementation choice fails loudly where it cannot run."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainer.model.permute as P


def _routing(seed: int, T: int, k: int, E: int, H: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T * k,), generator=g)
    order = torch.argsort(ids, stable=True)
    sorted_pos = torch.empty_like(order)
    sorted_pos[order] = torch.arange(order.numel())
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    weights = torch.rand(T, k, generator=g, dtype=torch.float64)
    return x, weights, sorted_pos, order


def _naive(x, weights, sorted_pos, scale):
    """permute then combine, one slot at a time, with y = scale * rows (a stand-in for the experts)."""
    T, k = weights.shape
    rows = torch.zeros(T * k, x.shape[1], dtype=x.dtype)
    for t in range(T):
        for j in range(k):
            rows[sorted_pos[t * k + j]] = x[t]
    y = rows * scale
    out = torch.stack([sum(weights[t, j] * y[sorted_pos[t * k + j]] for j in range(k)) for t in range(T)])
    return rows, out


def test_torch_permute_and_combine_equal_a_per_slot_loop_with_gradients():
    x, weights, sorted_pos, order = _routing(0, T=9, k=3, E=4, H=5)
    scale = torch.randn(9 * 3, 1, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
    rows = P.permute(leaves[0], sorted_pos, order, 3, "torch")
    out = P.combine(rows * scale, leaves[1], sorted_pos, order, "torch")
    ref_leaves = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
    ref_rows, ref_out = _naive(ref_leaves[0], ref_leaves[1], sorted_pos, scale)
    torch.testing.assert_close(rows, ref_rows, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref_out, ref_leaves, g), strict=True):
        torch.testing.assert_close(a, b)


def test_auto_is_torch_off_cuda_and_an_explicit_triton_choice_says_why_not():
    assert P.select_permute("auto", "cpu") == "torch"
    assert P.select_permute("torch", "cpu") == "torch"
    with pytest.raises(P.PermuteUnavailable, match="CUDA devices only, not cpu"):
        P.select_permute("triton", "cpu")
    with pytest.raises(ValueError, match="unknown permutation implementation 'fast'"):
        P.select_permute("fast", "cpu")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_equal_the_torch_gathers_in_the_interpreter():
    """The three kernels, run on CPU tensors by Triton's interpreter (in a fresh process: the interpreter must
    be on before triton.language is imported), against index_select."""
    root = Path(__file__).resolve().parents[2]
    code = f"import sys; sys.path[:0] = [{str(root)!r}, {str(root / 'tests' / 'unit')!r}]; import test_permute; test_permute._check_kernels()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _check_kernels() -> None:
    """H not a power of two, so the column mask matters; outputs poisoned with NaN, so every row must be written."""
    scatter, gather_sum, combine_backward = P._kernels()
    T, k, H = 11, 3, 40
    x, weights, sorted_pos, order = _routing(1, T=T, k=k, E=5, H=H)
    x, weights = x.float(), weights.float()
    block = P._launch(H)[0]
    rows = torch.full((T * k, H), float("nan"))
    scatter[(T,)](x, sorted_pos, rows, H, K=k, BLOCK_H=block)
    torch.testing.assert_close(rows, x.index_select(0, order // k), rtol=0, atol=0)
    y = torch.randn(T * k, H)
    out = torch.full((T, H), float("nan"))
    gather_sum[(T,)](y, sorted_pos, weights, out, H, K=k, HAS_W=True, BLOCK_H=block)
    y_leaf, w_leaf = y.clone().requires_grad_(), weights.clone().requires_grad_()
    ref = (y_leaf.index_select(0, sorted_pos).view(T, k, H) * w_leaf.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out, ref)
    grad = torch.randn(T, H)
    gy, gw = torch.full_like(y, float("nan")), torch.full_like(weights, float("nan"))
    combine_backward[(T,)](grad, y, sorted_pos, weights, gy, gw, H, K=k, NEED_GW=True, BLOCK_H=block)
    ref_gy, ref_gw = torch.autograd.grad(ref, [y_leaf, w_leaf], grad)
    torch.testing.assert_close(gy, ref_gy)
    torch.testing.assert_close(gw, ref_gw)
    gx = torch.full((T, H), float("nan"))
    gather_sum[(T,)](gy, sorted_pos, sorted_pos, gx, H, K=k, HAS_W=False, BLOCK_H=block)
    torch.testing.assert_close(gx, gy.index_select(0, sorted_pos).view(T, k, H).sum(1))
