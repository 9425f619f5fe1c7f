"""The CuTeDSL expert backend: where it cannot run, an explicit choice fails with the reason (real checks on
this machine, no mocks); the package imports without the DSL; the work-item table of the row-grouped GEMM
covers every row once; and on an H200 with the DSL, forward and gradients match a float64 reference as
closely as torch._grouped_mm does, and the FP8 backend within the bound its format allows
(trainer/experts/fp8.py; skipped elsewhere, with the reason). The FP8 quantizers run on the CPU for real."""

import importlib.util
import subprocess
import sys

import pytest
import torch

import trainer.experts as experts
from common.config import ModelConfig
from trainer.experts import BackendUnavailable, grouped_mm_experts, select_backend
from trainer.experts import cutedsl as cutedsl_module
from trainer.experts.cutedsl import cutedsl_experts, cutedsl_fp8_experts, cutedsl_unavailable, grouped
from trainer.experts.fp8 import (
    dequantize_blocks,
    dequantize_rows,
    dequantize_tokens_t,
    quantize_blocks,
    quantize_expert_weights,
    quantize_rows,
)
from trainer.experts.numerics import relative_errors
from trainer.model.moe import Experts

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


def test_auto_never_picks_cutedsl_yet_and_says_what_it_picked(caplog):
    with caplog.at_level("INFO", logger="trainer.experts"):
        picked = select_backend("auto", "cpu", torch.bfloat16)
    assert picked in ("grouped_mm", "reference")
    assert f"trainer.experts.backend = 'auto' picked {picked} on cpu torch.bfloat16" in caplog.text


def test_auto_in_bf16_takes_cutedsl_only_where_it_measured_faster(monkeypatch):
    """The choice `auto` makes on a CUDA GPU (trainer/experts/measured.py), from the shipped table: its real rows
    (cutedsl not faster on the H200, faster on the H100 at 128 experts), a GPU or shape it lacks, a row where
    cutedsl is faster, and a GPU it cannot run on."""
    from trainer.experts import measured

    assert measured.gpu_family("NVIDIA H200") == "H200" and measured.gpu_family("NVIDIA H100 80GB HBM3") == "H100"
    picked, why = measured.auto_bf16("NVIDIA H200", (2048, 768, 128, 8), None)
    assert picked == "grouped_mm" and "cutedsl measured 0.94x grouped_mm's speed there (not faster" in why
    picked, why = measured.auto_bf16("NVIDIA H100 80GB HBM3", (2048, 768, 128, 8), None)
    assert picked == "cutedsl" and "cutedsl measured 1.06x grouped_mm's speed there (faster" in why
    picked, why = measured.auto_bf16("NVIDIA H100 80GB HBM3", (1024, 512, 64, 6), None)
    assert picked == "grouped_mm" and "not measured on H100 at H1024 I512 E64 top-6" in why
    monkeypatch.setitem(measured.SPEEDUPS, ("H100", 4096, 1536, 64, 4), measured.Measured(1.2, "a test row"))
    picked, why = measured.auto_bf16("NVIDIA H100 80GB HBM3", (4096, 1536, 64, 4), None)
    assert picked == "cutedsl" and "1.20x" in why and "a test row" in why
    picked, why = measured.auto_bf16("NVIDIA H100 80GB HBM3", (4096, 1536, 64, 4), "no DSL installed")
    assert picked == "grouped_mm" and why == "cutedsl cannot run: no DSL installed"
    assert measured.auto_bf16("NVIDIA H200", None, None)[0] == "grouped_mm"


@pytest.mark.parametrize("shape", [(16, 131072), (6, 1001), (1, 5), (128, 12, 6), (128, 12, 16), (3, 2, 1)])
def test_scales_reach_tma_with_rows_of_whole_16_byte_units(shape):
    """The FP8 kernel's tma_scales reads the scales by TMA, whose strides must be multiples of 16 bytes: a scale
    tensor whose rows are not gets a copy with padded rows, of the same shape and values; one that is stays."""
    t = torch.randn(*shape)
    got = grouped._tma_rows(t)
    assert got.shape == t.shape and torch.equal(got, t)
    assert all(st * 4 % 16 == 0 for st in got.stride()[:-1]) and got.stride()[-1] == 1
    assert (got.data_ptr() == t.data_ptr()) == (shape[-1] % 4 == 0)


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


def _kernel_contract(grouping, config, a, b, c, offsets, item_expert, item_row, sfa=None, sfb=None):
    """What the kernel must do with the operands grouped.py hands it, in plain torch: `m` writes
    c[rows of e] = a[rows of e] @ b[:, :, e]^T item by item, `k` writes
    c[:, :, e] = a[:, rows of e] @ b[:, rows of e]^T; with scales (FP8), a and b stand for their e4m3 values
    times sfa (K/128, M) and sfb (N/128, K/128, E)."""
    ends = offsets.tolist()
    a, b = a.float(), b.float()
    if sfa is not None and grouping == "m":
        a = dequantize_rows(a[:, :, 0], sfa).unsqueeze(-1)
        b = dequantize_blocks(b.permute(2, 0, 1), sfb.permute(2, 0, 1)).permute(1, 2, 0)
    elif sfa is not None:  # the FP8 weight gradient: both operands [features, padded tokens], scales per block
        a = dequantize_tokens_t(a[:, :, 0], sfa).unsqueeze(-1)
        b = dequantize_tokens_t(b[:, :, 0], sfb).unsqueeze(-1)
    if grouping == "m":
        for e, r0 in zip(item_expert.tolist(), item_row.tolist(), strict=True):
            if e >= 0:
                r1 = min(r0 + config.tile_mn[0], ends[e])
                c[r0:r1, :, 0] = (a[r0:r1, :, 0] @ b[:, :, e].t()).to(c.dtype)
    else:
        for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
            c[:, :, e] = (a[:, start:end, 0] @ b[:, start:end, 0].t()).to(c.dtype)


@pytest.mark.parametrize("compiled", [False, True])
def test_host_side_matches_float64_when_the_kernel_keeps_its_contract(monkeypatch, compiled):
    """Everything but the kernel (work items, operand views, the autograd function, the custom ops, under
    torch.compile too) on the CPU, with the kernel replaced by its contract; unwritten outputs stay NaN."""
    monkeypatch.setattr(grouped, "_launch", _kernel_contract)
    monkeypatch.setattr(grouped, "POISON_OUTPUTS", True)
    fn = torch.compile(cutedsl_experts, backend="aot_eager") if compiled else cutedsl_experts
    errs = relative_errors(fn, [300, 0, 129, 64, 1, 511], 64, 32, seed=3, device=torch.device("cpu"))
    assert all(err < 5e-3 for err in errs.values()), errs


# The bound of trainer/experts/fp8.py: at most sqrt(6) x 3.6% from the six FP8 roundings on the deepest path.
FP8_BOUND = 0.10


def assert_wgrad_kernel_by_masters(monkeypatch, run, op: str) -> None:
    """On the CPU (the kernel replaced by its contract): `run`'s weight gradients over fp32 masters come from
    grouped.`op`, called twice with fp32 out; over bf16 weights it is not called; the gradients are in the masters'
    dtype either way."""
    monkeypatch.setattr(grouped, "_launch", _kernel_contract)
    real = getattr(grouped, op)
    out_dtypes: list[torch.dtype] = []
    monkeypatch.setattr(grouped, op, lambda *args: out_dtypes.append(args[-1]) or real(*args))
    x, gate_up, down, offsets = expert_inputs([300, 0, 129], 128, 64, seed=1, device="cpu")
    for masters, want in ((torch.float32, [torch.float32] * 2), (torch.bfloat16, [])):
        out_dtypes.clear()
        grads = output_and_grads(run, x, gate_up.to(masters), down.to(masters), offsets)
        assert out_dtypes == want, masters
        assert grads[2].dtype == grads[3].dtype == masters


@pytest.mark.parametrize("run", [cutedsl_experts, cutedsl_fp8_experts])
def test_auto_weight_gradients_are_ours_for_fp32_masters_and_torchs_for_bf16(monkeypatch, run):
    """WGRAD "auto": fp32 masters get their gradients from our k-grouped kernel, written in fp32 (no cast of a
    bf16 result), bf16 weights from torch._grouped_mm."""
    monkeypatch.setattr(cutedsl_module, "WGRAD", "auto")
    monkeypatch.setattr(cutedsl_module, "FP8_WGRAD", "bf16")  # the FP8 backend's weight gradients by WGRAD
    assert_wgrad_kernel_by_masters(monkeypatch, run, "k_grouped_op")


def test_auto_fp8_weight_gradients_for_fp32_masters_and_bf16_ones_for_bf16_weights(monkeypatch):
    """FP8_WGRAD "auto": fp32 masters get FP8 weight gradients (the k-grouped scaled GEMM, written in fp32), bf16
    weights the bf16 ones (torch._grouped_mm, no cast)."""
    monkeypatch.setattr(cutedsl_module, "FP8_WGRAD", "auto")
    assert_wgrad_kernel_by_masters(monkeypatch, cutedsl_fp8_experts, "k_grouped_scaled_op")


@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_host_side_matches_float64_within_the_format_bound(monkeypatch, compiled):
    """The FP8 backend's host side on the CPU (quantizers, weight pack, autograd, custom ops, torch.compile), the
    kernel replaced by its contract on the dequantized operands; and it is measurably not the bf16 path."""
    monkeypatch.setattr(grouped, "_launch", _kernel_contract)
    monkeypatch.setattr(grouped, "POISON_OUTPUTS", True)
    fn = torch.compile(cutedsl_fp8_experts, backend="aot_eager") if compiled else cutedsl_fp8_experts
    errs = relative_errors(fn, [300, 0, 129, 64, 1, 511], 256, 128, seed=3, device=torch.device("cpu"))
    assert all(err < FP8_BOUND for err in errs.values()), errs
    assert errs["out"] > 5e-3, f"FP8 output as close as bf16 ({errs['out']:.1e}): the operands were not quantized"


@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_weight_gradients_host_side_matches_float64_within_the_format_bound(monkeypatch, compiled):
    """FP8_WGRAD = "fp8" on the CPU: the weight gradients from both operands quantized per feature and 128-token
    block (the two-way quantizer quantize_both_op, the padded token order, the fused SwiGLU quantizers, the
    custom ops, under torch.compile too), the kernel replaced by its contract; within the FP8 bound of float64,
    and not the bf16 weight gradients."""
    monkeypatch.setattr(grouped, "_launch", _kernel_contract)
    monkeypatch.setattr(grouped, "POISON_OUTPUTS", True)
    inputs = expert_inputs([300, 0, 129, 64, 1, 511], 256, 128, seed=3, device="cpu")
    monkeypatch.setattr(cutedsl_module, "FP8_WGRAD", "bf16")
    want = output_and_grads(cutedsl_fp8_experts, *inputs)
    monkeypatch.setattr(cutedsl_module, "FP8_WGRAD", "fp8")
    fn = torch.compile(cutedsl_fp8_experts, backend="aot_eager") if compiled else cutedsl_fp8_experts
    errs = relative_errors(fn, [300, 0, 129, 64, 1, 511], 256, 128, seed=3, device=torch.device("cpu"))
    assert all(err < FP8_BOUND for err in errs.values()), errs
    got = output_and_grads(fn, *inputs)
    # The output and grad x change only where the fused SwiGLU quantizers skip the bf16 rounding of the
    # activation and of grad_h: a value within that rounding (2^-9) of an e4m3 boundary (steps of 2^-3), about
    # one in 64, moves by a code, an eighth of itself, about 1/8 x sqrt(1/64) = 1.6% rms (1.3-1.4% measured),
    # against the FP8 error itself (5-7%).
    for name, a, b in (("out", got[0], want[0]), ("grad x", got[1], want[1])):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 3e-2, f"{name} {rel:.1e} from the bf16-wgrad path's"
    for name, a, b in (("gate_up", got[2], want[2]), ("down", got[3], want[3])):
        rel = ((a - b).norm() / b.norm()).item()
        assert 5e-3 < rel < FP8_BOUND, f"grad {name} {rel:.1e} from the bf16 weight gradients"
    # Unfused, the activation and grad_h are torch's bf16 ones quantized, as on the bf16-wgrad path: the output
    # and grad x are that path's, bit for bit, and the weight gradients are the fused path's within FP8 noise.
    monkeypatch.setattr(cutedsl_module, "SWIGLU_QUANT", "torch")
    unfused = output_and_grads(fn, *inputs)
    assert torch.equal(unfused[0], want[0]) and torch.equal(unfused[1], want[1]), "only the weight gradients change"
    for name, a, b in (("gate_up", unfused[2], got[2]), ("down", unfused[3], got[3])):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 3e-2, f"grad {name} {rel:.1e} from the fused SwiGLU's"
    monkeypatch.setattr(cutedsl_module, "SWIGLU_QUANT", "triton")
    with pytest.raises(ValueError, match=r"cutedsl.SWIGLU_QUANT = 'triton' is not one of \('fused', 'torch'\)"):
        output_and_grads(cutedsl_fp8_experts, *inputs)
    monkeypatch.setattr(cutedsl_module, "SWIGLU_QUANT", "fused")
    monkeypatch.setattr(cutedsl_module, "FP8_WGRAD", "int8")
    with pytest.raises(ValueError, match=r"cutedsl.FP8_WGRAD = 'int8' is not one of \('auto', 'bf16', 'fp8'\)"):
        output_and_grads(cutedsl_fp8_experts, *inputs)


def test_the_padded_token_order_keeps_each_expert_in_whole_blocks_and_round_trips():
    """quantize_tokens_t: every expert's rows start at a multiple of 128 of the padded order, each block holds
    one expert's tokens (zeros after them), and dequantized back they are the tokens within half an e4m3 step."""
    from trainer.experts.fp8 import quantize_tokens_t, token_blocks

    counts = [300, 0, 129, 64, 1, 511, 0]
    x = torch.randn(sum(counts), 136) * torch.logspace(-3, 3, 136)
    offsets = torch.tensor(counts).cumsum(0).int()
    ends, src, n, P = token_blocks(offsets, x.shape[0])
    assert P == (-(-sum(counts) // 128) + len(counts)) * 128
    assert ends.tolist() == torch.tensor([-(-c // 128) * 128 for c in counts]).cumsum(0).tolist()
    q_t, scale, ends_q = quantize_tokens_t(x, offsets)
    assert q_t.shape == (136, P) and scale.shape == (P // 128, 136) and torch.equal(ends_q, ends)
    back = dequantize_tokens_t(q_t, scale)  # [F, P]
    rec = torch.zeros_like(x)
    for b in range(P // 128):
        rows = int(n[b])
        rec[int(src[b]) : int(src[b]) + rows] = back[:, b * 128 : b * 128 + rows].t()
        assert back[:, b * 128 + rows : (b + 1) * 128].eq(0).all(), "padding tokens are zeros"
    assert int(n.sum()) == sum(counts)
    assert ((rec - x).abs() <= x.abs() * 2**-4 + 2**-10 * x.abs().amax()).all()


def test_quantizers_round_trip_within_half_an_e4m3_step_and_keep_partial_blocks():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=g) * torch.logspace(-3, 3, 300)  # columns of very different sizes
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (37, 300) and s.shape == (3, 37)
    back = dequantize_rows(q, s)
    # Each element within half a unit in the last place (2^-4 relative), or, below e4m3's normal range
    # (2^-6 of the block maximum 448 * s), within half its subnormal step (2^-10 * s).
    step = torch.maximum(x.abs() * 2**-4, s.t().repeat_interleave(128, 1)[:, :300] * 2**-10)
    assert ((back - x).abs() <= step * 1.0001).all()
    assert (q.float().abs().amax(dim=1) == 448).all(), "each row's largest element lands on 448"
    w = torch.randn(3, 200, 130, generator=g)
    wq, ws = quantize_blocks(w, experts_per_chunk=2)
    assert ws.shape == (3, 2, 2)
    assert torch.allclose(ws[1, 1, 0], w[1, 128:, :128].abs().amax() / 448)
    assert ((dequantize_blocks(wq, ws) - w).abs() <= torch.maximum(w.abs() * 2**-4, ws.amax() * 2**-10)).all()
    zeros_q, zeros_s = quantize_rows(torch.zeros(2, 128))
    assert zeros_q.float().eq(0).all() and zeros_s.isfinite().all()


def test_the_experts_module_keeps_one_fp8_pack_per_step_and_the_transposes_agree(monkeypatch):
    """Experts with the cutedsl_fp8 backend on the CPU (kernel replaced by its contract): the pack appears after
    a forward asks for it, is rewritten in place by a refresh, and its transposed copies hold the same blocks."""
    monkeypatch.setattr(grouped, "_launch", _kernel_contract)
    cfg = ModelConfig(hidden_size=256, moe_intermediate_size=128, n_routed_experts=4)
    experts = Experts(cfg, "cutedsl_fp8")
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    x = torch.randn(40, 256).bfloat16()
    offsets = torch.tensor([10, 10, 30, 40], dtype=torch.int32)
    y0 = experts(x, offsets)
    assert experts._cast is None and experts._copy_dtype == torch.bfloat16  # quantized per call, copy asked for
    experts.refresh_weight_copy()
    pack = experts._cast
    assert len(pack) == 8 and pack[0].dtype == torch.float8_e4m3fn
    assert torch.equal(pack[2].float(), pack[0].transpose(1, 2).float()) and torch.equal(pack[3], pack[1].mT)
    assert torch.equal(experts(x, offsets), y0)
    with torch.no_grad():
        experts.down_proj.mul_(2)
    experts.refresh_weight_copy()
    assert experts._cast[4] is pack[4] and torch.allclose(experts(x, offsets).float(), 2 * y0.float(), rtol=0.02)
    fresh = quantize_expert_weights(experts.gate_up_proj, experts.down_proj)
    # Rewritten in place, every tensor holds the bits of a fresh pack (the dgrad transposes included).
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(experts._cast, fresh, strict=True))


def test_fp8_precision_runs_on_cutedsl_only_and_says_why_not_here():
    with pytest.raises(BackendUnavailable, match="fp8' runs on the cutedsl backend only"):
        select_backend("grouped_mm", "cpu", torch.bfloat16, precision="fp8")
    if GPU_REASON is not None:
        experts._why_not.cache_clear()
        with pytest.raises(BackendUnavailable, match="precision = 'fp8' cannot run here"):
            select_backend("auto", "cpu", torch.bfloat16, precision="fp8")
    with pytest.raises(ValueError, match="precision = 'fp16'"):
        select_backend("auto", "cpu", precision="fp16")


@needs_gpu
@pytest.mark.parametrize(
    "counts,H,inter",
    [
        ([300, 0, 129, 64, 1, 511], 256, 128),  # partial tiles, an empty expert, a one-row expert
        ([1024] * 8, 512, 384),  # full tiles only; N not a multiple of 256
        ([0, 2000, 0], 128, 64),  # one expert takes all; K shorter than one scale block
        ([700, 333], 2048, 768),  # the bench's H and I: 16 and 6 k-tiles
    ],
)
def test_cutedsl_fp8_matches_float64_within_the_format_bound(counts, H, inter):
    grouped.POISON_OUTPUTS = True
    try:
        errs = relative_errors(cutedsl_fp8_experts, counts, H, inter, seed=len(counts), device=torch.device("cuda"))
    finally:
        grouped.POISON_OUTPUTS = False
    assert all(err < FP8_BOUND for err in errs.values()), errs


@needs_gpu
def test_cutedsl_fp8_gemm_equals_its_dequantized_contract():
    """One FP8 GEMM against the same product of the dequantized operands in fp32: only accumulation order and
    the bf16 output rounding may differ (the scales must land on the right rows, columns and k-blocks)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    counts = [200, 0, 77, 300]
    offsets = torch.tensor(counts, device="cuda").cumsum(0).int()
    x = torch.randn(sum(counts), 384, device="cuda", generator=g) * torch.logspace(-2, 2, 384, device="cuda")
    w = torch.randn(4, 320, 384, device="cuda", generator=g) * torch.logspace(2, -2, 320, device="cuda")[:, None]
    (xq, xs), (wq, ws) = quantize_rows(x), quantize_blocks(w)
    items = grouped.work_items(offsets, x.shape[0], grouped.FP8_CONFIG.tile_mn[0])
    got = grouped.m_grouped_scaled(xq, xs, wq, ws, offsets, items).float()
    want = torch.empty_like(got)
    _kernel_contract(
        "m",
        grouped.FP8_CONFIG,
        xq.unsqueeze(-1),
        wq.permute(1, 2, 0),
        want.unsqueeze(-1),
        offsets,
        *items,
        xs,
        ws.permute(1, 2, 0),
    )
    assert ((got - want).norm() / want.norm()) < 5e-3


@needs_gpu
@pytest.mark.parametrize("config", ["module", "single CTAs"])
def test_cutedsl_fp8_weight_gradient_equals_its_dequantized_contract(config):
    """The FP8 weight-gradient GEMM (k_grouped_scaled) against the same products of its dequantized operands in
    fp32, per expert over its padded tokens: only the tensor cores' accumulation may differ (the row and column
    scales must land on the right features and token blocks; an empty expert gets zeros). Hopper's FP8 wgmma
    keeps about 14 bits while it sums a k-tile's 128 products (DeepSeek-V3 sec. 3.3.2, the reason for the
    promotion), so the bound is 1e-3 (measured on an H100: 1.2e-4), not fp32's; a scale on the wrong row, column
    or token block would be off by tens of percent."""
    from trainer.experts.fp8 import quantize_tokens_t

    g = torch.Generator(device="cuda").manual_seed(2)
    counts = [200, 0, 77, 300, 129]
    offsets = torch.tensor(counts, device="cuda").cumsum(0).int()
    a = torch.randn(sum(counts), 384, device="cuda", generator=g) * torch.logspace(-2, 2, 384, device="cuda")
    b = torch.randn(sum(counts), 256, device="cuda", generator=g)
    (a_t, sa, ends), (b_t, sb, _) = quantize_tokens_t(a, offsets), quantize_tokens_t(b, offsets)
    cfg = grouped.FP8_WGRAD_CONFIG if config == "module" else grouped.TileConfig((128, 128), 5, tma_scales=True)
    got = grouped.k_grouped_scaled(a_t, sa, b_t, sb, ends, torch.float32, cfg)
    want = torch.empty_like(got)
    _kernel_contract("k", cfg, a_t.unsqueeze(-1), b_t.unsqueeze(-1), want.permute(1, 2, 0), ends, ends, ends, sa, sb)
    assert got[1].eq(0).all(), "the empty expert's gradient is zeros"
    assert ((got - want).norm() / want.norm()) < 1e-3
    pairs = grouped.TileConfig((128, 128), 5, cluster_n=2, tma_scales=True)  # fp32 out as 8-byte pair stores
    assert torch.equal(got, grouped.k_grouped_scaled(a_t, sa, b_t, sb, ends, torch.float32, pairs)), (
        "the fp32 epilogue through shared memory writes the values of the pair stores"
    )


@needs_gpu
@pytest.mark.parametrize("counts,H,inter", [([300, 0, 129, 64, 1, 511], 256, 128), ([700, 333], 2048, 768)])
def test_cutedsl_fp8_weight_gradients_match_float64_within_the_format_bound(monkeypatch, counts, H, inter):
    """FP8_WGRAD = "fp8" on the GPU: the whole FP8 backend, weight gradients in FP8 too, within the bound."""
    monkeypatch.setattr(cutedsl_module, "FP8_WGRAD", "fp8")
    monkeypatch.setattr(grouped, "POISON_OUTPUTS", True)
    errs = relative_errors(cutedsl_fp8_experts, counts, H, inter, seed=len(counts), device=torch.device("cuda"))
    assert all(err < FP8_BOUND for err in errs.values()), errs


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
@pytest.mark.parametrize("wgrad", cutedsl_module.WGRADS)
def test_an_empty_expert_gets_zero_weight_gradients(monkeypatch, wgrad):
    monkeypatch.setattr(cutedsl_module, "WGRAD", wgrad)
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


def expert_inputs(counts: list[int], H: int, inter: int, seed: int, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """x [rows, H] bf16, gate_up [E, 2I, H], down [E, H, I] (fp32 masters) and the offsets of `counts`, on the GPU
    (or `device`)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(sum(counts), H, device=device, dtype=torch.bfloat16, generator=gen)
    gate_up = torch.randn(len(counts), 2 * inter, H, device=device, generator=gen) * 0.05
    down = torch.randn(len(counts), H, inter, device=device, generator=gen) * 0.05
    return x, gate_up, down, torch.tensor(counts, device=device).cumsum(0).int()


def output_and_grads(run, x, gate_up, down, offsets) -> list[torch.Tensor]:
    """y and the gradients of x, gate_up and down of `run` on fresh leaves, with dy = 1."""
    leaves = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    y = run(leaves[0], offsets, *leaves[1:])
    y.backward(torch.ones_like(y))
    return [y.detach(), *(t.grad for t in leaves)]


@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_both_launch_paths_compute_the_same_bits(monkeypatch, precision):
    """TVM-FFI (torch tensors handed to the compiled function, torch's current stream) and DLPack (cute tensors
    made per call, the stream passed explicitly) launch the same kernel: outputs and gradients are bitwise equal,
    also on a side stream, where a launch on the wrong stream would race with the side stream's producers."""
    x, gate_up, down, offsets = expert_inputs([300, 0, 517, 64], 256, 128, seed=3)
    run = cutedsl_experts if precision == "bf16" else cutedsl_fp8_experts

    def grads(launch: str) -> list[torch.Tensor]:
        monkeypatch.setattr(grouped, "LAUNCH", launch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = output_and_grads(run, x, gate_up, down, offsets)
        torch.cuda.current_stream().wait_stream(side)
        return got

    for a, b in zip(grads("tvm-ffi"), grads("dlpack"), strict=True):
        assert torch.equal(a, b)
    monkeypatch.setattr(grouped, "LAUNCH", "pointers")
    with pytest.raises(ValueError, match=r"grouped.LAUNCH = 'pointers' is not one of \('dlpack', 'tvm-ffi'\)"):
        run(x, offsets, gate_up, down)


# Schedules that move data differently but add the same products in the same order as the module's configs:
# other CTA counts (single CTAs, or clusters of two multicasting each A tile), the FP8 scales loaded by the
# consumers from global memory instead of brought by TMA with each stage, and the FP8 promotion overlapped with
# the next k-tile's wgmmas.
SCHEDULES = {
    "other CTA counts": {
        "M_CONFIG": grouped.TileConfig(),
        "K_CONFIG": grouped.TileConfig(cluster_n=2),
        "FP8_CONFIG": grouped.TileConfig((128, 128), 5, tma_scales=True),
    },
    "fp8 scales by global loads": {"FP8_CONFIG": grouped.TileConfig((128, 128), 5, cluster_n=2)},
    "fp8 overlap": {"FP8_CONFIG": grouped.TileConfig((128, 128), 5, overlap=True)},
    "fp8 overlap cluster2": {"FP8_CONFIG": grouped.TileConfig((128, 128), 5, cluster_n=2, overlap=True)},
}


@needs_gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    "counts,H,inter",
    [
        ([300, 0, 129, 64, 1, 511], 256, 128),  # partial tiles, an empty expert; odd and even n-tile counts
        ([1024] * 8, 512, 384),  # 3, 4 and 6 n-tiles of 128: a cluster runs where the count is even
        ([700, 333], 2048, 768),  # the bench's H and I: 16 and 6 k-tiles (even and odd for the overlap)
    ],
)
def test_schedules_compute_the_bits_of_the_default_one(monkeypatch, schedule, counts, H, inter):
    """Outputs and gradients of both precisions under each schedule equal, bit for bit, those of the module's
    configs: the schedules change which CTA loads what and when a partial is promoted, not what is added."""
    inputs = expert_inputs(counts, H, inter, seed=7)
    for run in (cutedsl_experts, cutedsl_fp8_experts):
        want = output_and_grads(run, *inputs)
        with monkeypatch.context() as m:
            for attr, config in SCHEDULES[schedule].items():
                m.setattr(grouped, attr, config)
            got = output_and_grads(run, *inputs)
        for name, a, b in zip(("y", "grad x", "grad gate_up", "grad down"), got, want, strict=True):
            assert torch.equal(a, b), f"{run.__name__} {name}: max diff {(a.float() - b.float()).abs().max():.3e}"


@needs_gpu
def test_the_fp32_epilogue_through_shared_memory_writes_the_pair_stores_values():
    """Our bf16 weight-gradient GEMM with its fp32 output staged through shared memory (smem_epilogue_fp32, 16-byte
    row segments, now K_CONFIG) against the 8-byte pair stores: the same accumulators, so the same bits, at
    partial tiles along both output sides (M 200, N 328), an empty expert and a 1-row one, odd k tails."""
    g = torch.Generator(device="cuda").manual_seed(4)
    counts = [300, 0, 517, 1, 64]
    offsets = torch.tensor(counts, device="cuda").cumsum(0).int()
    a = torch.randn(sum(counts), 200, device="cuda", generator=g).bfloat16()
    b = torch.randn(sum(counts), 328, device="cuda", generator=g).bfloat16()
    want = grouped.k_grouped(a, b, offsets, torch.float32, grouped.TileConfig())  # 8-byte pair stores
    staged = grouped.TileConfig(stages=3, smem_epilogue_fp32=True)
    assert torch.equal(grouped.k_grouped(a, b, offsets, torch.float32, staged), want)


@needs_gpu
@pytest.mark.parametrize("run", [cutedsl_experts, cutedsl_fp8_experts])
def test_both_weight_gradient_kernels_agree_within_bf16_rounding(monkeypatch, run):
    """torch._grouped_mm's wgrad (bf16 result, cast) and ours (fp32 straight from the accumulators): the same
    sums, so they differ by the bf16 rounding of torch's output only; the other gradients are the same bits."""
    x, gate_up, down, offsets = expert_inputs([300, 0, 517, 64], 256, 128, seed=5)
    monkeypatch.setattr(cutedsl_module, "FP8_WGRAD", "bf16")  # the FP8 backend's weight gradients by WGRAD

    def grads(wgrad: str) -> list[torch.Tensor]:
        monkeypatch.setattr(cutedsl_module, "WGRAD", wgrad)
        return output_and_grads(run, x, gate_up, down, offsets)[1:]

    (tx, tgu, td), (cx, cgu, cd) = grads("grouped_mm"), grads("cutedsl")
    assert torch.equal(tx, cx)
    for name, a, b in (("gate_up", tgu, cgu), ("down", td, cd)):
        assert a.dtype == b.dtype == torch.float32
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 4e-3, f"grad {name}: {rel:.2e}"
    monkeypatch.setattr(cutedsl_module, "WGRAD", "ours")
    with pytest.raises(ValueError, match=r"cutedsl.WGRAD = 'ours' is not one of \('auto', 'grouped_mm', 'cutedsl'\)"):
        run(x.clone().requires_grad_(), offsets, gate_up.clone().requires_grad_(), down).sum().backward()
