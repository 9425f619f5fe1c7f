"""The CuTeDSL expert backend: where it cannot run, an explicit choice fails with the reason (real checks on
this machine, no mocks); the package imports without the DSL; the work-item table of the row-grouped GEMM
covers every row once; and on an H200 with the DSL, forward and gradients match a float64 reference as
closely as torch._grouped_mm does (skipped elsewhere, with the reason)."""

import importlib.util
import subprocess
import sys

import pytest
import torch

import trainer.experts as experts
from trainer.experts import BackendUnavailable, grouped_mm_experts, select_backend
from trainer.experts.cutedsl import cutedsl_experts, cutedsl_unavailable, grouped
from trainer.experts.numerics import relative_errors

DSL_INSTALLED = importlib.util.find_spec("cutlass") is not None
GPU_REASON = cutedsl_unavailable(torch.device("cuda"), torch.bfloat16) if torch.cuda.is_available() else "no CUDA GPU"
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"cutedsl cannot run here: {GPU_REASON}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_explicit_cutedsl_without_a_gpu_fails_naming_the_device():
    experts._why_not.cache_clear()
    with pytest.raises(BackendUnavailable, match=r"cutedsl.*Hopper GPUs.*not on cpu"):
        select_backend("cutedsl", "cpu", torch.bfloat16)


def test_missing_dsl_is_reported_with_the_extra_that_installs_it():
    from trainer.experts.cutedsl import _import_error

    reason = _import_error()
    if DSL_INSTALLED:
        assert reason is None
    else:
        assert "nvidia-cutlass-dsl is not importable" in reason and "`gpu` extra" in reason


def test_auto_never_picks_cutedsl_yet():
    assert select_backend("auto", "cpu", torch.bfloat16) in ("grouped_mm", "reference")


def test_the_backend_package_imports_without_loading_the_dsl():
    code = "import sys, trainer.experts; assert 'cutlass' not in sys.modules, 'cutlass imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("counts", [[5, 0, 300, 128, 1], [0, 0, 0, 7], [128, 128], [1000, 0, 37, 256, 255, 0]])
def test_work_items_cover_every_row_once_within_its_expert(counts):
    bm = 128
    offsets = torch.tensor(counts).cumsum(0).int()
    item_expert, item_row = grouped.work_items(offsets, sum(counts), bm)
    starts = offsets.long() - torch.tensor(counts)
    covered = torch.zeros(sum(counts), dtype=torch.int64)
    owner = torch.full((sum(counts),), -1)
    live = item_expert >= 0
    for e, r in zip(item_expert[live].tolist(), item_row[live].tolist(), strict=True):
        end = min(r + bm, int(offsets[e]))
        assert starts[e] <= r < end
        covered[r:end] += 1
        owner[r:end] = e
    assert covered.eq(1).all()
    assert owner.tolist() == [e for e, c in enumerate(counts) for _ in range(c)]
    assert not live[live.long().sum() :].any(), "idle items come after the live ones"


def _kernel_contract(grouping, config, a, b, c, offsets, item_expert, item_row):
    """What the kernel must do with the operands grouped.py hands it, in plain torch: `m` writes
    c[rows of e] = a[rows of e] @ b[:, :, e]^T item by item, `k` writes c[:, :, e] = a[:, rows of e] @ b[:, rows of e]^T."""
    ends = offsets.tolist()
    if grouping == "m":
        for e, r0 in zip(item_expert.tolist(), item_row.tolist(), strict=True):
            if e >= 0:
                r1 = min(r0 + config.tile_mn[0], ends[e])
                c[r0:r1, :, 0] = (a[r0:r1, :, 0].float() @ b[:, :, e].float().t()).to(c.dtype)
    else:
        for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
            c[:, :, e] = (a[:, start:end, 0].float() @ b[:, start:end, 0].float().t()).to(c.dtype)


@pytest.mark.parametrize("compiled", [False, True])
def test_host_side_matches_float64_when_the_kernel_keeps_its_contract(monkeypatch, compiled):
    """Everything but the kernel (work items, operand views, the autograd function, the custom ops, under
    torch.compile too) on the CPU, with the kernel replaced by its contract; unwritten outputs stay NaN."""
    monkeypatch.setattr(grouped, "_launch", _kernel_contract)
    monkeypatch.setattr(grouped, "POISON_OUTPUTS", True)
    fn = torch.compile(cutedsl_experts, backend="aot_eager") if compiled else cutedsl_experts
    errs = relative_errors(fn, [300, 0, 129, 64, 1, 511], 64, 32, seed=3, device=torch.device("cpu"))
    assert all(err < 5e-3 for err in errs.values()), errs


@needs_gpu
@pytest.mark.parametrize(
    "counts,H,inter",
    [
        ([300, 0, 129, 64, 1, 511], 256, 128),  # partial tiles, an empty expert, a one-row expert
        ([1024] * 8, 512, 384),  # full tiles only; N not a multiple of 256
        ([0, 2000, 0], 128, 64),  # one expert takes all; the wgrad has many k-tiles and a tail
    ],
)
def test_cutedsl_matches_float64_like_grouped_mm(counts, H, inter):
    grouped.POISON_OUTPUTS = True  # an element the kernel leaves unwritten stays NaN
    try:
        ours = relative_errors(cutedsl_experts, counts, H, inter, seed=len(counts), device=torch.device("cuda"))
    finally:
        grouped.POISON_OUTPUTS = False
    theirs = relative_errors(grouped_mm_experts, counts, H, inter, seed=len(counts), device=torch.device("cuda"))
    for name, err in ours.items():
        # bf16 operands and outputs: ~2e-3 is rounding; torch._grouped_mm lands there too.
        assert err < max(5e-3, 1.5 * theirs[name]), f"{name}: cutedsl {err:.2e}, torch._grouped_mm {theirs[name]:.2e}"


@needs_gpu
def test_an_empty_expert_gets_zero_weight_gradients():
    counts = [40, 0, 90]
    x = torch.randn(130, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate_up = torch.randn(3, 64, 64, device="cuda", requires_grad=True)
    down = torch.randn(3, 64, 32, device="cuda", requires_grad=True)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).int()
    grouped.POISON_OUTPUTS = True
    try:
        cutedsl_experts(x, offsets, gate_up, down).sum().backward()
    finally:
        grouped.POISON_OUTPUTS = False
    assert gate_up.grad[1].eq(0).all() and down.grad[1].eq(0).all()
    assert gate_up.grad[0].abs().sum() > 0 and down.grad[2].abs().sum() > 0
